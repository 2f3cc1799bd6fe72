"""The node-local data plane: the Multiplex layer's frames (`CallFrame` / `ReplyFrame`, shared/runtime/multiplex.py)
over a Unix domain socket, read and written by asyncio protocols on the service's uvloop.

A grpc.aio message costs each end gRPC core's thread hand-offs and its HTTP/2 framing (~190 us of CPU a
message on loopback here); a length-prefixed message on a Unix socket costs a system call or two. So the hops
between processes of one node (gateway -> scheduler, scheduler -> worker) ride this plane, with the same
protobuf messages, the same handlers, interceptors, deadlines, cancellation, batching and drain as the gRPC
stream; only the transport differs.

Discovery needs no configuration: a server with a plane announces its socket in the initial metadata of its
gRPC Calls stream (LOCAL_KEY: path and a random token). A caller that may go local (`MultiplexChannel(local=
open_local)`) connects to that path; the token in its hello proves it reached the same server, not a socket of the
same name in another container's file system. Once connected, new calls take the socket; calls already on the
gRPC stream finish there. A peer on another node announces a path the caller cannot reach (or one of its own
file system that refuses the token), so its calls stay on gRPC. A broken socket fails its pending calls
UNAVAILABLE, as a broken stream does, and the next call opens a gRPC stream, which announces the socket anew.

Wire: each message is a 4-byte little-endian length and that many bytes of one protobuf message. The caller
sends CallFrames, the first a hello (id 0, method HELLO_METHOD, the Calls metadata and the token); the server
answers the hello with ReplyFrame id 0 (its announcement as trailers), then ReplyFrames. A message the server
cannot take (longer than MAX_MESSAGE_BYTES, not a CallFrame, cut short by the peer's end of writing, a bad
token, an unknown method) is answered with a status naming the problem, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from academus.shared.runtime.logs import log_event
from academus.shared.runtime.metrics import LOCAL_PLANE_CONNECTIONS, LOCAL_PLANE_REFUSED
from academus.shared.runtime.multiplex import (
    BATCHED_CALLS,
    CODES,
    FRAME_BATCHES_KEY,
    MultiplexServicer,
    _ServedStream,
    joins_message_pieces,
    piece_bytes,
    reply_status,
    rpc_error,
)
from academus.v1 import multiplex_pb2

HEADER = struct.Struct("<I")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024   # gRPC's limit on the mesh's channels (shared/runtime/serving.py)
HELLO_METHOD = "academus.local/hello"
TOKEN_KEY = "academus-local-token"
HELLO_TIMEOUT_S = 2.0
STAGING_SUFFIX = ".binding"   # a socket being bound, before it listens (`listening_socket`)
STAGING_GRACE_S = 60.0        # a staging socket older than this was left by a service killed while binding


class FramingError(ValueError):
    """The byte stream is not length-prefixed messages within the limit."""


@dataclass(frozen=True)
class LocalEndpoint:
    """Where a server's plane listens and the token that proves a connection reached it."""

    path: str
    token: str

    def announce(self) -> str:
        return f"{self.token}:{self.path}"

    @classmethod
    def parse(cls, announced: str) -> LocalEndpoint | None:
        token, _, path = announced.partition(":")
        return cls(path, token) if token and path.startswith("/") else None


def socket_dir(configured: str = "") -> Path:
    """The configured folder, else one a user in the system's temporary folder (a socket's path must stay
    under ~108 bytes, which a checkout's run directory can exceed)."""
    return Path(configured) if configured else Path(tempfile.gettempdir()) / f"academus-{os.getuid()}"


def remove_stale_sockets(folder: Path, now: float | None = None) -> list[Path]:
    """Unlinks the sockets in `folder` that no process listens on: what a killed service left (its `stop`
    never ran). A socket is judged by connecting, not by the pid in its name: the folder may be shared by
    containers whose pids this process cannot see. A socket still being bound (`listening_socket`) is not
    judged until it is older than STAGING_GRACE_S: only a service killed while binding leaves one that old."""
    now = time.time() if now is None else now
    removed = [path for path in folder.glob(f"*.sock{STAGING_SUFFIX}") if _unlink_older(path, now - STAGING_GRACE_S)]
    for path in folder.glob("*.sock"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        except OSError:
            pass   # not ours to judge (permissions, not a socket)
        finally:
            probe.close()
    return removed


def _unlink_older(path: Path, before: float) -> bool:
    with contextlib.suppress(FileNotFoundError):
        if path.lstat().st_mtime < before:
            path.unlink()
            return True
    return False


def listening_socket(path: str) -> socket.socket:
    """A Unix socket listening at `path`, where it appears only once it listens and only its user may connect.
    Bound at `path` itself, it would lie there bound but not yet listening for a moment, and a service starting
    beside this one would judge it stale (`remove_stale_sockets`) and unlink it: so it is bound under a staging
    name the sweep leaves alone, then renamed (atomic within the folder)."""
    staging = path + STAGING_SUFFIX
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(staging)
        os.chmod(staging, 0o600)   # before it listens: the node's other users cannot call in
        listener.listen()   # the server's own backlog is set when it starts serving
        os.rename(staging, path)
    except BaseException:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
        raise
    listener.setblocking(False)
    return listener


def pack(message: bytes) -> bytes:
    return HEADER.pack(len(message)) + message


class MessageBuffer:
    """Cuts the bytes received into whole messages; refuses a length past `limit` before reading it."""

    def __init__(self, limit: int = MAX_MESSAGE_BYTES) -> None:
        self.limit = limit
        self.data = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.data += data
        messages, offset, end = [], 0, len(self.data)
        while end - offset >= HEADER.size:
            (size,) = HEADER.unpack_from(self.data, offset)
            if size > self.limit:
                raise FramingError(f"message of {size} bytes exceeds the local plane's limit of {self.limit} bytes")
            if end - offset - HEADER.size < size:
                break
            start = offset + HEADER.size
            messages.append(bytes(self.data[start : start + size]))
            offset = start + size
        del self.data[:offset]
        return messages

    def partial(self) -> str:
        """What an unfinished message lacks, '' when none is."""
        if not self.data:
            return ""
        if len(self.data) < HEADER.size:
            return f"{len(self.data)} bytes of a {HEADER.size}-byte length prefix"
        (size,) = HEADER.unpack_from(self.data, 0)
        return f"{len(self.data) - HEADER.size} of its {size} bytes"


# ---------------------------------------------------------------- server side


class LocalPlane:
    """A service's listener: each connection is served as one Calls stream of `servicer`."""

    def __init__(self, servicer: MultiplexServicer, folder: Path, name: str) -> None:
        self.servicer = servicer
        self.endpoint = LocalEndpoint(str(folder / f"{name}-{os.getpid()}-{secrets.token_hex(4)}.sock"),
                                      secrets.token_hex(16))
        self.connections: set[_ServedConnection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> LocalEndpoint:
        folder = Path(self.endpoint.path).parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        remove_stale_sockets(folder)
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: _ServedConnection(self), sock=listening_socket(self.endpoint.path))
        self.servicer.local_endpoint = self.endpoint.announce()
        return self.endpoint

    async def stop(self, grace_s: float) -> int:
        """Accepts no more; waits up to `grace_s` for the connections to end (the servicer drains them), then
        cuts the rest. Returns how many it cut."""
        if self._server is not None:
            self._server.close()
        closed = [c.closed for c in self.connections]
        if closed:
            await asyncio.wait(closed, timeout=grace_s)
        cut = list(self.connections)
        for connection in cut:
            connection.transport.abort()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.endpoint.path)
        return len(cut)


class _ServedConnection(asyncio.Protocol):
    """One caller's connection: its hello, then its frames into a `_ServedStream`, the replies back. Replies
    are written as they are ready (`send_now`); while the socket's buffer is full they wait in the stream's
    queue for `reply`, which writes them once it drains."""

    def __init__(self, plane: LocalPlane) -> None:
        self.transport: asyncio.Transport | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.plane = plane
        self.buffer = MessageBuffer()
        self.served: _ServedStream | None = None
        self.replier: asyncio.Task | None = None
        self.resumer: asyncio.Task | None = None   # reading paused while the replies' backlog is past its bound
        self.closing = False   # refused: frames from now on are answered UNAVAILABLE
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.plane.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.buffer.feed(data)
        except FramingError as e:
            self.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return
        for raw in messages:
            try:
                frame = multiplex_pb2.CallFrame.FromString(raw)
            except DecodeError:
                self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                            f"a message of {len(raw)} bytes is not an academus.v1.CallFrame")
                return
            if self.served is None:
                if not self.hello(frame):
                    return
            else:
                self.receive(frame)
        if self.served is not None and not self.served.room.is_set() and self.resumer is None:
            self.transport.pause_reading()   # a caller that does not read its replies is not read either
            self.resumer = asyncio.ensure_future(self.resume_when_room())

    async def resume_when_room(self) -> None:
        await self.served.room.wait()
        self.resumer = None
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def hello(self, frame: multiplex_pb2.CallFrame) -> bool:
        metadata = {m.key: m.value for m in frame.metadata}
        if frame.method != HELLO_METHOD or not secrets.compare_digest(metadata.get(TOKEN_KEY, ""),
                                                                       self.plane.endpoint.token):
            self.refuse(grpc.StatusCode.UNAUTHENTICATED,
                        f"the first message must be a {HELLO_METHOD} frame carrying this server's token")
            return False
        servicer = self.plane.servicer
        batches = servicer.batches and metadata.get(FRAME_BATCHES_KEY) == "1"
        self.served = _ServedStream(servicer, piece_bytes(tuple(metadata.items())), batches, self.send_now,
                                    peer="unix:local-plane", message_pieces=joins_message_pieces(metadata.items()))
        servicer._streams.add(self.served)
        LOCAL_PLANE_CONNECTIONS.inc()
        if servicer.draining:
            self.served.end_when_idle()
        announced = [multiplex_pb2.MetadataEntry(key=FRAME_BATCHES_KEY, value="1" if servicer.batches else "0")]
        self.transport.write(pack(multiplex_pb2.ReplyFrame(id=0, trailers=announced).SerializeToString()))
        self.replier = asyncio.ensure_future(self.reply())
        return True

    def receive(self, frame: multiplex_pb2.CallFrame) -> None:
        if frame.batch:
            BATCHED_CALLS.inc(len(frame.batch))
        for one in frame.batch or (frame,):
            if self.closing and not one.cancel:
                self.served.queue(reply_status(one.id, grpc.StatusCode.UNAVAILABLE,
                                               "this connection is closing; nothing ran"))
            elif not one.cancel and one.method not in self.plane.servicer.methods:
                self.served.queue(reply_status(
                    one.id, grpc.StatusCode.UNIMPLEMENTED,
                    f"method {one.method!r} is not served here; the connection is closed once its calls answer"))
                self.closing = True
                self.served.end_when_idle()
            else:
                self.served.receive(one)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def send_now(self, reply: multiplex_pb2.ReplyFrame) -> bool:
        """A reply written on the spot, unless the socket's buffer is full (then `reply` sends it)."""
        if not self.writable.is_set() or self.transport.is_closing():
            return False
        self.transport.write(pack(reply.SerializeToString()))
        return True

    async def reply(self) -> None:
        try:
            while (message := await self.served.next_message()) is not None:
                self.transport.write(pack(message.SerializeToString()))
                await self.writable.wait()
        finally:
            self.transport.close()

    def eof_received(self) -> bool:
        """The caller ended its writing: a message cut short is refused, else what runs is answered."""
        if cut := self.buffer.partial():
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, f"the connection ended inside a message: {cut}")
        elif self.served is not None:
            self.served.end_when_idle()
        else:
            self.transport.close()
        return True   # keep the transport open for the replies

    def refuse(self, code: grpc.StatusCode, details: str) -> None:
        """A status for the whole connection (ReplyFrame id 0), then the connection is closed: the calls
        it was running are cancelled, as a broken gRPC stream's are."""
        log_event("local_plane_refused", logging.WARNING, code=code.name, details=details)
        LOCAL_PLANE_REFUSED.labels(code.name).inc()
        self.transport.write(pack(reply_status(0, code, details).SerializeToString()))
        self.transport.close()
        self._end()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()
        self._end()

    def _end(self) -> None:
        if self.served is not None and self.served in self.plane.servicer._streams:
            self.served.cancel_all()
            self.plane.servicer._streams.discard(self.served)
            LOCAL_PLANE_CONNECTIONS.dec()
        for task in (self.replier, self.resumer):
            if task is not None:
                task.cancel()
        self.plane.connections.discard(self)
        if not self.closed.done():
            self.closed.set_result(None)


# ---------------------------------------------------------------- caller side


class LocalCall(asyncio.Protocol):
    """A Calls stream over the plane, to the multiplex layer's `_Stream` what grpc's StreamStreamCall is,
    but `direct`: frames are written on the spot (`write_now`) and each reply goes to the stream's handler as
    it is read (`attach`); a failure breaks the stream with UNAVAILABLE, as a broken gRPC stream does.
    Frames are not held back for the socket's buffer: a caller's frames are bounded by its calls in flight."""

    direct = True

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = MessageBuffer()
        self.metadata = asyncio.get_running_loop().create_future()
        self.failure: grpc.aio.AioRpcError | None = None
        self.on_reply: Callable[[multiplex_pb2.ReplyFrame], None] | None = None
        self.on_failure: Callable[[str], None] | None = None

    @classmethod
    async def open(cls, endpoint: LocalEndpoint, metadata: tuple[tuple[str, str], ...]) -> LocalCall:
        """Connected and greeted; raises OSError when the socket cannot be reached, AioRpcError when the
        server refuses the hello."""
        call = cls()
        await asyncio.get_running_loop().create_unix_connection(lambda: call, endpoint.path)
        entries = [multiplex_pb2.MetadataEntry(key=k, value=v) for k, v in (*metadata, (TOKEN_KEY, endpoint.token))]
        call.transport.write(pack(multiplex_pb2.CallFrame(method=HELLO_METHOD, metadata=entries).SerializeToString()))
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                await asyncio.shield(call.metadata)
        except BaseException:
            call.cancel()
            raise
        return call

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def attach(self, on_reply: Callable[[multiplex_pb2.ReplyFrame], None], on_failure: Callable[[str], None]) -> None:
        self.on_reply, self.on_failure = on_reply, on_failure

    def write_now(self, frame: multiplex_pb2.CallFrame) -> None:
        if self.failure is None:
            self.transport.write(pack(frame.SerializeToString()))

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.buffer.feed(data)
            for raw in messages:
                self.receive(multiplex_pb2.ReplyFrame.FromString(raw))
        except (FramingError, DecodeError) as e:
            self.fail(f"the local plane's server sent what is not a ReplyFrame: {e}")
            self.transport.abort()

    def receive(self, reply: multiplex_pb2.ReplyFrame) -> None:
        if reply.id or reply.batch:
            for one in reply.batch or (reply,):
                self.on_reply(one)
        elif reply.code:   # the server refused the connection
            code = CODES.get(reply.code, grpc.StatusCode.UNKNOWN).name
            self.fail(f"the local plane's server closed the connection: {code}: {reply.details}")
        elif not self.metadata.done():
            self.metadata.set_result(tuple((t.key, t.value) for t in reply.trailers))

    def cancel(self) -> bool:
        if self.transport is not None:
            self.transport.abort()
        self.fail("the local connection was closed by the caller")
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(f"the peer closed the local connection{f': {exc}' if exc else ''}")

    def fail(self, details: str) -> None:
        if self.failure is not None:
            return
        self.failure = rpc_error(grpc.StatusCode.UNAVAILABLE, details)
        if not self.metadata.done():
            self.metadata.set_exception(self.failure)
            self.metadata.exception()   # retrieved: a failed hello is reported by `open`, not by asyncio
        if self.on_failure is not None:
            self.on_failure(details)


async def open_local(announced: str, metadata: tuple[tuple[str, str], ...]) -> LocalCall:
    """A MultiplexChannel's LocalOpener: the announced plane, connected and greeted; raises ValueError for
    an announcement it cannot read, OSError or AioRpcError as LocalCall.open does."""
    endpoint = LocalEndpoint.parse(announced)
    if endpoint is None:
        raise ValueError(f"not an endpoint: {announced!r}")
    return await LocalCall.open(endpoint, metadata)
