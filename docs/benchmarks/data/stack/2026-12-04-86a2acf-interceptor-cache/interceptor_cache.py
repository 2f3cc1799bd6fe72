"""The gRPC server interceptors' cost a call, one bare grpc.aio unary hop, three arms:

- none: no interceptor;
- per-call: the project's interceptors (metrics, SERVER spans at the default 1 % ratio) building each method's
  wrapper on every call, as before the wrapper was kept;
- kept: the same interceptors, the wrapper built once a method.

    python interceptor_cache.py ROUNDS CALLS OUT.json

Each arm serves from a fresh process; the arms' order alternates between rounds. The sync client sends CALLS
sequential 64-byte calls with an unsampled trace context (as the gateway's hops carry); p50 of the wall time a
call and the server's CPU a call (from /proc).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ARMS = ("none", "per-call", "kept")
UNSAMPLED = (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-00"),)


def serve(arm: str, port_file: str) -> None:
    from academus.shared.runtime.interceptors import UnaryServerInterceptor
    from academus.shared.runtime.metrics import MetricsInterceptor
    from academus.shared.runtime.tracing import server_interceptors, setup_tracing

    if arm == "per-call":
        async def per_call(self, continuation, details):
            handler = await continuation(details)
            return handler if handler is None else self._wrapped_handler(handler, details.method)
        UnaryServerInterceptor.intercept_service = per_call

    async def main() -> None:
        interceptors = [] if arm == "none" else [MetricsInterceptor("gateway"),
                                                 *server_interceptors(setup_tracing("gateway"), 0.01)]
        server = grpc.aio.server(interceptors=interceptors)

        async def noop(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return request

        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "b.S", {"M": grpc.unary_unary_rpc_method_handler(noop)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        with open(port_file + ".tmp", "w") as f:
            f.write(str(port))
        os.rename(port_file + ".tmp", port_file)
        await server.wait_for_termination()

    asyncio.run(main())


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(arm: str, calls: int) -> dict:
    port_file = f"/tmp/interceptor_cache.{os.getpid()}.{arm}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", arm, port_file])
    try:
        while not os.path.exists(port_file):
            time.sleep(0.05)
        with grpc.insecure_channel(f"127.0.0.1:{Path(port_file).read_text()}") as channel:
            call = channel.unary_unary("/b.S/M")
            for _ in range(300):
                call(b"x" * 64, metadata=UNSAMPLED)
            walls = []
            before = cpu_s(server.pid)
            for _ in range(calls):
                start = time.perf_counter()
                call(b"x" * 64, metadata=UNSAMPLED)
                walls.append(time.perf_counter() - start)
            server_cpu = cpu_s(server.pid) - before
        return {"p50_ms": statistics.median(walls) * 1e3, "server_cpu_ms": server_cpu / calls * 1e3}
    finally:
        server.kill()
        server.wait()
        os.remove(port_file)


def main() -> None:
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3])
        return
    rounds, calls, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    runs = []
    for r in range(rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            runs.append({"round": r, "arm": arm, **one_run(arm, calls)})
            print(json.dumps(runs[-1]), flush=True)
    with open(out, "w") as f:
        json.dump({"rounds": rounds, "calls": calls, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
