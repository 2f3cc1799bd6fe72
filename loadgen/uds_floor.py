"""The node-local transport floor: a chain of loopback hops over Unix domain sockets, each end an asyncio
Protocol on uvloop, no gRPC and no Academus serving code: what the local data plane (shared/runtime/local_plane.py)
could cost at best, as `academus.loadgen.grpc_floor` is gRPC's. Messages are framed as the plane frames them
(a 4-byte little-endian length, then one protobuf message): a `CallFrame` (its id, so that many callers
share a connection, and the serialized RunRequest) or a `ReplyFrame`; the leaf answers at once with
grpc_floor's 384-float ModelOutput. A forwarding hop sends each call on to the next hop over one connection,
from the reading callback (no task a call).

    python -m academus.loadgen.uds_floor [--hops 3] [--requests 1500] [--callers 64] [--duration 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import uvloop

from academus.loadgen.grpc_floor import REPLY, REQUEST, figures
from academus.shared.runtime.local_plane import MessageBuffer, pack
from academus.v1 import multiplex_pb2

REPLY_BYTES = REPLY.SerializeToString()
REQUEST_BYTES = REQUEST.SerializeToString()
START_TIMEOUT_S = 20.0   # the chain's processes start together: each imports protobuf and uvloop first


class Framed(asyncio.Protocol):
    """One connection's bytes, cut into messages each handed to `on_message(self, message)`."""

    def __init__(self, on_message: Callable[[Framed, bytes], None]) -> None:
        self.on_message = on_message
        self.buffer = MessageBuffer()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        for message in self.buffer.feed(data):
            self.on_message(self, message)

    def send(self, message: bytes) -> None:
        self.transport.write(pack(message))


class Upstream:
    """The caller's end of a connection to the next hop: calls by id, each reply handed to its callback."""

    def __init__(self) -> None:
        self.pending: dict[int, Callable[[bytes], None]] = {}
        self.ids = itertools.count(1)
        self.connection: Framed | None = None

    async def connect(self, path: str, timeout_s: float = START_TIMEOUT_S) -> Upstream:
        """Retries until the hop listens (the chain's processes start together)."""
        end = time.monotonic() + timeout_s
        while True:
            try:
                _, self.connection = await asyncio.get_running_loop().create_unix_connection(
                    lambda: Framed(self._reply), path)
                return self
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.05)

    def _reply(self, _: Framed, message: bytes) -> None:
        reply = multiplex_pb2.ReplyFrame.FromString(message)
        self.pending.pop(reply.id)(reply.payload)

    def send(self, payload: bytes, on_reply: Callable[[bytes], None]) -> None:
        call_id = next(self.ids)
        self.pending[call_id] = on_reply
        self.connection.send(multiplex_pb2.CallFrame(id=call_id, payload=payload).SerializeToString())

    async def call(self, payload: bytes) -> bytes:
        reply = asyncio.get_running_loop().create_future()
        self.send(payload, reply.set_result)
        return await reply


def answer(connection: Framed, call_id: int, payload: bytes) -> None:
    connection.send(multiplex_pb2.ReplyFrame(id=call_id, payload=payload).SerializeToString())


async def serve(path: str, next_path: str | None) -> None:
    """A hop at `path`: the leaf (no next hop) answers each call; a forward calls the next hop first."""
    upstream = await Upstream().connect(next_path) if next_path else None

    def on_call(connection: Framed, message: bytes) -> None:
        frame = multiplex_pb2.CallFrame.FromString(message)
        if upstream is None:
            answer(connection, frame.id, REPLY_BYTES)
        else:
            upstream.send(frame.payload, lambda payload: answer(connection, frame.id, payload))

    server = await asyncio.get_running_loop().create_unix_server(lambda: Framed(on_call), path)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def running_chain(hops: int) -> Iterator[str]:
    """The chain's processes, started together; yields the first hop's socket path, stops them on leaving."""
    folder = Path(tempfile.mkdtemp(prefix="uds-floor-"))   # a socket path must stay under ~108 bytes
    paths = [str(folder / f"hop-{i}.sock") for i in range(hops)]
    me = [sys.executable, "-m", "academus.loadgen.uds_floor", "--serve"]
    procs = [subprocess.Popen([*me, path, *([paths[i + 1]] if i + 1 < hops else [])]) for i, path in enumerate(paths)]
    try:
        yield paths[0]
    finally:
        for p in procs:
            p.terminate()
            p.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def measure(path: str, requests: int, callers: int = 0, duration_s: float = 0.0) -> dict:
    """Sequential latency, and with `callers` the capacity of that many closed loops on one connection."""
    upstream = await Upstream().connect(path)
    try:
        return await figures(lambda: upstream.call(REQUEST_BYTES), requests, callers, duration_s)
    finally:
        upstream.connection.transport.close()


def chain(hops: int, requests: int, callers: int = 0, duration_s: float = 0.0) -> dict:
    with running_chain(hops) as path:
        return uvloop.run(measure(path, requests, callers, duration_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.uds_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hops", type=int, default=3)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--callers", type=int, default=64, help="closed loops of the capacity run; 0: none")
    p.add_argument("--duration", type=float, default=5.0, help="seconds of the capacity run")
    p.add_argument("--serve", nargs="+", metavar=("PATH", "NEXT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        uvloop.run(serve(args.serve[0], args.serve[1] if len(args.serve) > 1 else None))
        return 0
    print(json.dumps({"hops": args.hops} | chain(args.hops, args.requests, args.callers, args.duration)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
