"""Head-of-line blocking on a multiplexed stream: how long small calls wait behind one large request
(or, with `--replies`, behind one large reply; with `--streams`, behind a server stream's large message).

    python -m academus.loadgen.probes.frame_hol [--sizes-mib 0.25 1 4 16] [--repeats 5] [--replies | --streams]

A loopback server in a process of its own (its freed pages kept, as the services keep theirs) answers every call
with two bytes, served both ways (unary, and as frames of `academus.v1.Multiplex/Calls`, as every Academus server
is). For each size, a large request is sent and, while it travels, small calls one after another; the arms are:

- `unary`: every call its own HTTP/2 stream (ACADEMUS_HOP_STREAMS=false);
- `frames`: every call a frame of the one stream, however large (the stream before MAX_FRAME_BYTES);
- `mixed`: MultiplexChannel as the services use it: frames, and a request past MAX_FRAME_BYTES alone.

With `--replies` the large call is a small request answered with that many bytes: `frames` then gets every
reply whole, and `mixed` a reply past WHOLE_PIECES × MAX_FRAME_BYTES in pieces of MAX_FRAME_BYTES, the small
replies between them.
With `--streams` the large call is a server stream (InferStream's shape) of one large message then a small one:
`unary` gets it as a call of its own, `frames` as a frame whose message goes whole, and `mixed` as a frame whose
message comes in pieces.

Reported per arm and size: the small calls' median and worst latency while the large one was in flight,
and the large call's own time (medians over the repeats). The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import uvloop

from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.runtime.multiplex import MAX_FRAME_BYTES, MultiplexChannel, serve_multiplexed

SERVICE, NAME, STREAM = "t.Probe", "Answer", "Tell"
METHOD, STREAM_METHOD = f"/{SERVICE}/{NAME}", f"/{SERVICE}/{STREAM}"
LIMITS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
Call = Callable[[bytes], Awaitable[bytes]]


async def answer(request: bytes, context) -> bytes:
    return b"x" * int(request[6:]) if request.startswith(b"reply:") else b"ok"


async def tell(request: bytes, context) -> AsyncIterator[bytes]:
    yield b"x" * int(request)
    yield b"end"


async def serve(ports: multiprocessing.Queue) -> None:
    server = grpc.aio.server(options=LIMITS)
    handlers = {NAME: grpc.unary_unary_rpc_method_handler(answer), STREAM: grpc.unary_stream_rpc_method_handler(tell)}
    serve_multiplexed(server, lambda s: s.add_registered_method_handlers(SERVICE, handlers))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await server.wait_for_termination()


def run_server(ports: multiprocessing.Queue) -> None:
    keep_freed_pages()   # as every service does (ACADEMUS_KEEP_FREED_PAGES): a large reply's buffers are reused
    uvloop.run(serve(ports))


async def timed(call: Call, request: bytes) -> float:
    started = time.perf_counter()
    await call(request)
    return (time.perf_counter() - started) * 1e3


def drained(method) -> Call:
    """A server stream as a call: every message read."""
    async def call(request: bytes) -> bytes:
        return b"".join([m async for m in method(request)])
    return call


async def one_round(call: Call, large: bytes, large_call: Call | None = None) -> tuple[list[float], float]:
    """The small calls' latencies (ms) while `large` travelled (by `large_call`, else `call`), and the large call's."""
    big = asyncio.ensure_future(timed(large_call or call, large))
    await asyncio.sleep(0)  # the large request goes first
    small = [await timed(call, b"s")]
    while not big.done():  # one small call at a time, as a lightly loaded hop sees them
        small.append(await timed(call, b"s"))
    return small, await big


async def measure(port: int, sizes_mib: list[float], repeats: int, replies: bool = False,
                  streams: bool = False) -> dict:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=LIMITS) for _ in range(3)]
    plain = channels[0]
    whole, mixed = MultiplexChannel(channels[1], max_frame_bytes=1 << 40), MultiplexChannel(channels[2])
    arms: dict[str, tuple[Call, Call]] = {   # the small calls' method, the large call's
        arm: (channel.unary_unary(METHOD), drained(channel.unary_stream(STREAM_METHOD)))
        for arm, channel in (("unary", plain), ("frames", whole), ("mixed", mixed))}
    results: dict[str, dict] = {}
    try:
        for size in sizes_mib:
            n = int(size * (1 << 20))
            large = b"%d" % n if streams else b"reply:%d" % n if replies else b"x" * n
            for arm, (call, stream) in arms.items():
                for _ in range(20):  # the stream or the call path warm
                    await call(b"s")
                rounds = [await one_round(call, large, stream if streams else None) for _ in range(repeats)]
                results.setdefault(arm, {})[f"{size:g}MiB"] = {
                    "small_p50_ms": round(statistics.median(statistics.median(s) for s, _ in rounds), 3),
                    "small_max_ms": round(statistics.median(max(s) for s, _ in rounds), 3),
                    "large_ms": round(statistics.median(b for _, b in rounds), 2)}
    finally:
        for ch in channels:
            await ch.close()
    return {"max_frame_bytes": MAX_FRAME_BYTES, "repeats": repeats,
            "large": "stream message" if streams else "reply" if replies else "request", "arms": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.probes.frame_hol", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[0.25, 1, 4, 16])
    p.add_argument("--repeats", type=int, default=5)
    large = p.add_mutually_exclusive_group()
    large.add_argument("--replies", action="store_true", help="the large call is a large reply, not a large request")
    large.add_argument("--streams", action="store_true", help="the large call is a server stream's large message")
    args = p.parse_args(argv)
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=run_server, args=(ports,), daemon=True)
    server.start()
    try:
        print(json.dumps(uvloop.run(measure(ports.get(timeout=30), args.sizes_mib, args.repeats, args.replies,
                                              args.streams))))
    finally:
        server.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
