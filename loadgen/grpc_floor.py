"""The transport floor on this machine: bare grpc.aio (uvloop) chains of 1-3 loopback hops with
no Academus code, the leaf answering a 384-float matrix after `--work-ms` spent in a thread (as a
worker's model would), or with `--spin` busy on its own loop (no thread, no timer: what a hop costs after
the chain sat idle that long). Compare with `academus.loadgen.overhead` to see what the mesh itself adds.
With `--streams` each hop's calls ride one multiplexed stream (shared/runtime/multiplex.py), as the mesh's do.

    python -m academus.loadgen.grpc_floor [--requests 1500] [--work-ms 0 10] [--spin] [--streams]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import uvloop

from academus.loadgen.runner import closed_callers
from academus.loadgen.stats import summary
from academus.shared.cli.redis_server import free_port
from academus.shared.runtime.multiplex import over_streams, serve_multiplexed
from academus.v1 import tensors_pb2, worker_pb2, worker_pb2_grpc

REPLY = tensors_pb2.ModelOutput(values=tensors_pb2.Matrix(values=[0.1] * 384, rows=1, dim=384))


def spin(seconds: float) -> None:
    """Busy for `seconds` on this thread, the GIL held: a handler's CPU, holding its event loop."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Leaf(worker_pb2_grpc.WorkerServicer):
    def __init__(self, work_s: float, spin: bool = False) -> None:
        self.work_s, self.spin = work_s, spin

    async def Run(self, request, context):
        if self.work_s and self.spin:
            spin(self.work_s)
        elif self.work_s:
            await asyncio.get_running_loop().run_in_executor(None, time.sleep, self.work_s)
        return REPLY


class Forward(worker_pb2_grpc.WorkerServicer):
    def __init__(self, target: str, streams: bool) -> None:
        self.target, self.streams = target, streams
        self.stub: worker_pb2_grpc.WorkerStub | None = None

    async def Run(self, request, context):
        if self.stub is None:  # the channel must belong to the serving loop
            self.stub = worker_pb2_grpc.WorkerStub(over_streams(grpc.aio.insecure_channel(self.target), self.streams))
        return await self.stub.Run(request, timeout=5)


async def serve(port: int, servicer: worker_pb2_grpc.WorkerServicer) -> None:
    """The servicer as unary calls and as frames of the Multiplex service, as the mesh's servers are."""
    server = grpc.aio.server()
    serve_multiplexed(server, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


REQUEST = worker_pb2.RunRequest(model="m", tokens=tensors_pb2.TokenBatch(input_ids=list(range(16)), lengths=[16]))
WARMUP = 100


async def sequential(call: Callable[[], Awaitable[object]], requests: int, warmup: int = WARMUP) -> dict:
    """Latency (ms) of `requests` calls made one after the other, after `warmup` more (connections, caches)."""
    times = []
    for _ in range(warmup + requests):
        start = time.perf_counter()
        await call()
        times.append((time.perf_counter() - start) * 1e3)
    return summary(times[warmup:])


async def closed_loop(call: Callable[[], Awaitable[object]], callers: int, duration_s: float) -> dict:
    """Capacity: `callers` closed loops for `duration_s`, each calling again once answered."""
    times: list[float] = []

    async def send(_: int) -> None:
        start = time.perf_counter()
        await call()
        times.append((time.perf_counter() - start) * 1e3)

    elapsed = await closed_callers(callers, duration_s, send)
    return {"callers": callers, "throughput_rps": round(len(times) / elapsed, 1), "latency_ms": summary(times)}


async def figures(call: Callable[[], Awaitable[object]], requests: int, callers: int = 0,
                  duration_s: float = 0.0) -> dict:
    """Sequential latency, and with `callers` the capacity of that many closed loops."""
    out = {"latency_ms": await sequential(call, requests)}
    if callers:
        out["capacity"] = await closed_loop(call, callers, duration_s)
    return out


async def measure(port: int, requests: int, streams: bool, callers: int = 0, duration_s: float = 0.0) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(over_streams(channel, streams))
        await channel.channel_ready()
        return await figures(lambda: stub.Run(REQUEST, timeout=5), requests, callers, duration_s)


@contextlib.contextmanager
def running_chain(hops: int, work_ms: float = 0.0, spin: bool = False, streams: bool = False) -> Iterator[int]:
    """The chain's processes, the leaf last; yields the first hop's port, stops them on leaving."""
    ports = [free_port() for _ in range(hops)]
    me = [sys.executable, "-m", "academus.loadgen.grpc_floor"]
    procs = [subprocess.Popen([*me, "--serve-leaf", str(ports[-1]), "--work-ms", str(work_ms),
                               *(["--spin"] if spin else [])])]
    procs += [subprocess.Popen([*me, "--serve-forward", str(ports[i]), str(ports[i + 1]),
                                *(["--streams"] if streams else [])]) for i in range(hops - 1)]
    try:
        time.sleep(2.0)
        yield ports[0]
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def chain(hops: int, work_ms: float, requests: int, spin: bool = False, streams: bool = False, callers: int = 0,
          duration_s: float = 0.0) -> dict:
    """{"latency_ms": sequential}, and with `callers` {"capacity": that many closed loops'} (see `figures`)."""
    with running_chain(hops, work_ms, spin, streams) as port:
        return uvloop.run(measure(port, requests, streams, callers, duration_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--work-ms", type=float, nargs="+", default=[0.0, 10.0])
    p.add_argument("--spin", action="store_true", help="the leaf's work is a busy loop on its own event loop")
    p.add_argument("--streams", action="store_true", help="every hop's calls ride one multiplexed stream")
    p.add_argument("--serve-leaf", type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve-forward", type=int, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_leaf:
        uvloop.run(serve(args.serve_leaf, Leaf(args.work_ms[0] / 1e3, args.spin)))
        return 0
    if args.serve_forward:
        uvloop.run(serve(args.serve_forward[0], Forward(f"127.0.0.1:{args.serve_forward[1]}", args.streams)))
        return 0
    rows = [{"hops": h, "work_ms": w, "spin": args.spin, "streams": args.streams}
            | chain(h, w, args.requests, args.spin, args.streams)
            for w in args.work_ms for h in (1, 3)]
    for row in rows:
        row["overhead_p50_ms"] = round(row["latency_ms"]["p50"] - row["work_ms"], 3)
    print(json.dumps({"results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
