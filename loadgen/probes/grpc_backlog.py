"""What gRPC itself answers when a Python server's event loop cannot take calls as fast as they come.

    python -m academus.loadgen.probes.grpc_backlog [--calls 3000] [--hold 1.0] [--pending-limit N] [--streams]

One grpc.aio server whose handler holds each call for --hold seconds, one client sending --calls calls
at once on one channel. Calls that reach the server before its loop has asked for them wait in
grpc-core's pending queue; past `grpc.server.max_pending_requests` (default 1000) grpc-core starts to
refuse them at random, hard at `..._hard_limit` (default 3000), and a refused call ends CANCELLED
(message "CANCELLED") long before its deadline, and before any handler, interceptor or metric of the
server has seen it. This is what the H200 bursts showed at the gateway (docs/benchmarks/students.md,
2026-11-26). --pending-limit sets
both limits. With --streams the calls are frames of one multiplexed stream (shared/runtime/multiplex.py, as
`AsyncClient(streams=True)` sends them): one call for grpc-core, so its pending queue never fills. The last
line printed is the JSON summary: codes, messages, median time to a refusal.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

import grpc

from academus.loadgen.stats import percentile
from academus.shared.runtime.multiplex import over_streams, serve_multiplexed

METHOD = "/academus.backlog.Hold/Call"


def server_options(pending_limit: int | None) -> list[tuple[str, int]]:
    if pending_limit is None:
        return []
    return [("grpc.server.max_pending_requests", pending_limit),
            ("grpc.server.max_pending_requests_hard_limit", pending_limit)]


async def measure(calls: int, hold_s: float, pending_limit: int | None = None, streams: bool = False) -> dict:
    async def hold(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await asyncio.sleep(hold_s)
        return request

    server = grpc.aio.server(options=server_options(pending_limit))
    serve_multiplexed(server, lambda s: s.add_registered_method_handlers(
        "academus.backlog.Hold", {"Call": grpc.unary_unary_rpc_method_handler(hold)}))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes: collections.Counter[str] = collections.Counter()
    messages: collections.Counter[str] = collections.Counter()
    refused_after: list[float] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = over_streams(channel, streams).unary_unary(METHOD)

            async def one() -> None:
                sent = time.perf_counter()
                try:
                    await call(b"x", timeout=hold_s + 30)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1
                    messages[f"{e.code().name}: {e.details()}"] += 1
                    refused_after.append((time.perf_counter() - sent) * 1e3)

            await asyncio.gather(*(one() for _ in range(calls)))
    finally:
        await server.stop(0)
    return {"calls": calls, "hold_s": hold_s, "pending_limit": pending_limit, "streams": streams, "codes": dict(codes),
            "messages": dict(messages),
            "refused_p50_ms": round(percentile(refused_after, 50), 3) if refused_after else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="academus.loadgen.probes.grpc_backlog", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--hold", type=float, default=1.0, help="seconds the handler holds each call")
    p.add_argument("--pending-limit", type=int, default=None, help="both of grpc-core's pending-call limits")
    p.add_argument("--streams", action="store_true", help="the calls ride one multiplexed stream")
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.calls, args.hold, args.pending_limit, args.streams))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
