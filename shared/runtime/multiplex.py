"""Unary calls, and server streams, multiplexed over one bidirectional stream a peer (`academus.v1.Multiplex/Calls`).

A grpc.aio unary call opens and closes an HTTP/2 stream, and each end pays gRPC core's thread hand-offs
for it; a message on a stream that is already open costs about half of that, in latency and in CPU
(`python -m academus.loadgen.grpc_floor --streams`). The hops every request takes (gateway -> scheduler,
scheduler -> worker) therefore ride one stream a peer, each call a `CallFrame` answered by a
`ReplyFrame`. Both ends keep the unary call's contract, so the handlers, interceptors and callers are the
ones a unary call has:

- the caller gets the response or a `grpc.aio.AioRpcError` with the handler's code, details and
  trailers; DEADLINE_EXCEEDED at its timeout; UNAVAILABLE when the stream breaks (the peer died),
  for every call then pending;
- a caller that leaves (its task cancelled, or its timeout) sends a cancel frame: the handler's task is
  cancelled, as gRPC cancels a unary handler whose client went away;
- the handler sees a `FrameContext` (deadline, metadata, abort, trailers) wrapped by the service's own
  interceptors (metrics, the SERVER span), and the caller opens the CLIENT span and sends its context;
- a stopping server answers new frames UNAVAILABLE (the caller's retry goes elsewhere), lets running
  ones finish, then ends its streams.

A frame's deadline counts from when the caller made the call, as a unary call's does, not from when the
server got round to reading it. A server that falls behind leaves frames waiting in the stream's buffers
(HTTP/2 lets megabytes of small frames queue), and a frame read 4 s late with a 5 s timeout has 1 s left,
not 5: served as if just sent, every late frame would run in full for a caller that has given up, and
past a backlog of one timeout nothing would complete at all (what an H100's overloaded gateway did). So
the caller stamps each frame with its clock (`sent_s`), the server measures the wait against the least
(arrival - sent) seen on the stream lately (`TransitFloor`: the clocks' offset cancels out). A frame
whose deadline has passed by the time its handler could start is answered DEADLINE_EXCEEDED unrun, and
one that has waited half of its timeout RESOURCE_EXHAUSTED unrun (`unrun_reply`), before its payload is
parsed (`academus_multiplexed_unrun_total`). A caller whose call ended before its frame was written (the
writer waits on HTTP/2 flow control) does not send it at all.

A frame is written whole before the next one, so a large request (a PLOT-state batch is megabytes) would
hold up every small call behind it: a request past `max_frame_bytes` goes as a unary call of its own,
which HTTP/2 interleaves with the stream (`python -m academus.loadgen.probes.frame_hol`). A reply cannot leave
the stream (the server answers a frame with frames), so one past the caller's `max_frame_bytes`, which the
caller sends in the stream's metadata, comes in pieces of that size (`ReplyFrame.more`), and replies that
wait go between them (`frame_hol --replies`). A reply of up to WHOLE_PIECES pieces' bytes still goes whole: each
piece is a message, and a message's cost would outweigh what so few pieces spare the replies behind it. A caller
that sends no size gets every reply whole.

A server stream (the public InferStream) is a frame too: each message it writes goes as a partial reply, and its
status as the final reply, with no payload (`MultiplexedStreamCall`). A message past the bytes that go whole comes in
pieces too (`more` and `partial` both set) to a caller that joins them (MESSAGE_PIECES_KEY; one that does not gets them
whole). A call's replies keep their order whatever their sizes: one that comes behind a reply still going in pieces
waits for its last piece, so a stream's status never passes its last message.

A message costs gRPC about the same CPU whatever it holds: a frame and its reply took 189 us of CPU at
both ends on loopback here, 35 us a frame when eight shared each message (`python -m
academus.loadgen.probes.frame_batches`, docs/benchmarks/hops.md). So frames that wait for the
stream together (written while the last message was in flight, or queued in the same turn of the loop) go
as one message (`CallFrame.batch`), and so do replies ready together (`ReplyFrame.batch`: the answers to a
merged element): up to 64 frames whose payloads fit `max_frame_bytes` (64 KiB at most; the first frame goes
whatever its size). Batches form only when there is a queue to take them from, and cost a lone call
nothing. Both ends say they read batches (FRAME_BATCHES_KEY: the caller in its Calls metadata, the server
in its initial metadata), so a peer of an earlier version gets single frames.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from academus.shared.runtime.errors import NOTHING_RAN, PUSHBACK
from academus.shared.runtime.interceptors import UnaryBehavior, UnaryServerInterceptor, streamed_as_unary
from academus.v1 import multiplex_pb2, multiplex_pb2_grpc

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from prometheus_client import Counter

# The client SDK calls over this module with grpcio and protobuf alone (`academus[client]`): it then counts no
# metrics (only the serving side does), its calls carry no spans, and it logs nothing (only the node-local
# plane does, which a public client never opens).
try:
    from academus.shared.runtime.logs import log_event
    from academus.shared.runtime.metrics import MULTIPLEXED, MULTIPLEXED_BATCHED, MULTIPLEXED_UNRUN, REPLIES_IN_PIECES
    from academus.shared.runtime.tracing import client_tracer, end_client_span, start_client_span

    BATCHED_CALLS, BATCHED_REPLIES = MULTIPLEXED_BATCHED.labels("calls"), MULTIPLEXED_BATCHED.labels("replies")
except ModuleNotFoundError:
    MULTIPLEXED = MULTIPLEXED_UNRUN = REPLIES_IN_PIECES = BATCHED_CALLS = BATCHED_REPLIES = None

    def log_event(event: str, **fields: object) -> None:
        return None

    def client_tracer(provider: TracerProvider | None = None) -> None:
        return None

    def start_client_span(tracer: None, method: str) -> tuple[None, dict[str, str]]:
        return None, {}

    def end_client_span(span: None, code: grpc.StatusCode, details: str | None) -> None:
        return None

CALLS_METHOD = "/academus.v1.Multiplex/Calls"
SERVICE_NAME = "academus.v1.Multiplex"
CODES = {c.value[0]: c for c in grpc.StatusCode}
# Past this a request rides a unary call of its own: on loopback a frame holds the stream ~4 us a KiB
# (frame_hol), so 64 KiB holds it ~0.26 ms, about what a frame saves against a unary call (grpc_floor).
MAX_FRAME_BYTES = 64 * 1024
FRAME_BYTES_KEY = "academus-frame-bytes"   # Calls metadata: the caller's max_frame_bytes, the replies' piece size
# The smallest piece a caller may ask for (HTTP/2's default frame): the gateway serves Calls to the public, and
# a 1-byte piece would turn one reply into as many frames as it has bytes.
MIN_PIECE_BYTES = 16 * 1024
# A reply goes in pieces only past this many pieces' bytes. A piece costs the stream a message (~0.13 ms on loopback
# here), and behind a reply of a few pieces the calls waiting gain less than that: at 64 KiB pieces, a 0.19 MiB
# stream message (64 texts' 768-float embeddings) took 1.5-1.7x as long in three pieces as whole, and the small
# calls behind it waited no less (docs/benchmarks/hops.md).
WHOLE_PIECES = 4
# An overloaded server's refusal asks callers to hold off for its wait, at most this long. Short: the frames
# behind the refused one are as stale and are refused as fast as they are read, so there is room again long
# before that wait has passed. Up to 1 s, a caller honouring it (the gateway, a scheduler's) left the server
# idle after its backlog was gone: `stream_backlog --pushback-caps 1000,50` answered 2783 against 3621 in time.
MAX_PUSHBACK_MS = 50
# Calls one stream may have running at once (ACADEMUS_MAX_STREAM_CALLS's default): a public peer's frames cost the
# gateway a task each, and a stream is not a way round admission's bounds.
MAX_STREAM_CALLS = 4096
# Reply bytes one stream may hold unsent (ACADEMUS_MAX_STREAM_BACKLOG_BYTES's default): past it the server stops
# reading the stream's frames until its peer reads replies, so a peer that sends and never reads holds this much of the
# server's memory, not all it can ask for. Far above what a reading peer leaves waiting (a batch's answer is ~0.2 MiB).
MAX_STREAM_BACKLOG_BYTES = 64 * 1024 * 1024
# A shorter wait is jitter (a collection, a long turn of the loop), not a backlog: a call with a small budget
# left (a batch near its deadline) is not refused for it.
MIN_BACKLOG_S = 0.05
# Calls metadata (the caller) and initial metadata (the server): "1", this end reads batched frames.
FRAME_BATCHES_KEY = "academus-frame-batches"
# Calls metadata (the caller): "1", this end joins a partial reply (a server stream's message) sent in pieces.
MESSAGE_PIECES_KEY = "academus-message-pieces"
# Frame metadata (the caller): "1", send this call's early answers as partial replies (ReplyFrame.partial), which
# its handler sends with `FrameContext.send_partial` (exit ramps' results, Apparate). A plain unary call has no
# such channel: its caller gets the final answer only.
PARTIALS_KEY = "academus-partials"
# Initial metadata (the server): its node-local data plane, "<token>:<socket path>" (shared/runtime/local_plane.py).
LOCAL_KEY = "academus-local"
# Opens the announced plane with the stream's metadata, greeted, or raises (shared/runtime/local_plane.py's
# open_local); passed in, since the plane builds on this module's frames.
LocalOpener = Callable[[str, tuple[tuple[str, str], ...]], Awaitable[Any]]
MAX_BATCH_FRAMES = 64   # frames in one message, whatever their size
# A stream the server refused for who the caller is: its calls fail so too, not UNAVAILABLE, which callers retry
# on another peer (each would refuse the same caller).
CALLER_REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def rpc_error(code: grpc.StatusCode, details: str, trailers: Sequence[tuple[str, str]] = ()) -> grpc.aio.AioRpcError:
    """The error a unary call with this status raises, so callers keep their `except AioRpcError`."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


# ---------------------------------------------------------------- caller side


class _Stream:
    """One open Calls stream: its pending calls by id, the task that writes the frames (callers never
    await a write, so a caller cancelled mid-write cannot leave the call half-written) and the task that
    reads the replies. On the node-local plane (a `call` that is `direct`) neither task exists: a frame is
    written where it is sent and a reply handled where it is read, two task switches a call fewer."""

    def __init__(self, call: grpc.aio.StreamStreamCall, batches: bool = False,
                 batch_bytes: int = MAX_FRAME_BYTES,
                 on_metadata: Callable[[_Stream, dict], None] | None = None) -> None:
        """`batches`: the caller asked for batches; they go out once the server has announced it reads them.
        `on_metadata`: told the server's initial metadata (its node-local endpoint, shared/runtime/local_plane.py)."""
        self.call = call
        self.on_metadata = on_metadata
        self.retired = False   # new calls go elsewhere: closed once its pending calls have answered
        self.pending: dict[int, asyncio.Future] = {}
        self.pieces: dict[int, list[bytes]] = {}   # the pieces so far of replies that come in pieces
        self.partials: dict[int, Callable[[bytes], None]] = {}   # calls that take early answers: their handlers
        self.unsent: set[int] = set()              # calls whose frame waits in the outbox
        self.broken: grpc.aio.AioRpcError | None = None
        self.outbox: asyncio.Queue[multiplex_pb2.CallFrame] = asyncio.Queue()
        self.held: multiplex_pb2.CallFrame | None = None   # taken from the outbox, too big for the last batch
        self.batches = False                       # the server reads batches: its initial metadata said so
        self.batches_asked = batches
        self.batch_bytes = batch_bytes
        self.direct = getattr(call, "direct", False)
        self.writer = self.reader = self.announced = None
        if self.direct:
            call.attach(self._receive, self._break)
            return
        self.writer = asyncio.ensure_future(self._write())
        self.reader = asyncio.ensure_future(self._read())
        self.announced = asyncio.ensure_future(self._learn_batches()) if batches or on_metadata else None

    def send(self, frame: multiplex_pb2.CallFrame, reply: asyncio.Future) -> None:
        if self.broken is not None:
            raise self.broken
        self.pending[frame.id] = reply
        if self.direct:
            self.call.write_now(frame)
            return
        self.unsent.add(frame.id)
        self.outbox.put_nowait(frame)

    def forget(self, call_id: int) -> None:
        """The caller left call `call_id`: no reply is awaited; a frame not written yet never is, and the
        handler of one that was is told to stop."""
        self.partials.pop(call_id, None)
        if self.pending.pop(call_id, None) is None or self.broken is not None:
            return
        if self.retired and not self.pending:
            self._break("retired: calls ride the node-local data plane")
            return
        if call_id in self.unsent:
            self.unsent.discard(call_id)   # the writer skips it
        elif self.direct:
            self.call.write_now(multiplex_pb2.CallFrame(id=call_id, cancel=True))
        else:
            self.outbox.put_nowait(multiplex_pb2.CallFrame(id=call_id, cancel=True))

    async def _learn_batches(self) -> None:
        try:
            metadata = dict(await self.call.initial_metadata() or ())
        except Exception:  # the stream failed before the server's headers: the reader says so
            return
        self.batches = self.batches_asked and metadata.get(FRAME_BATCHES_KEY) == "1"
        if self.on_metadata is not None:
            self.on_metadata(self, metadata)

    def retire(self) -> None:
        """New calls go to another stream; this one closes once its pending calls have answered."""
        self.retired = True
        if not self.pending:
            self._break("retired: calls ride the node-local data plane")

    async def _write(self) -> None:
        try:
            while True:
                frames = self._take(self.held if self.held is not None else await self.outbox.get())
                if len(frames) > 1:
                    await self.call.write(multiplex_pb2.CallFrame(batch=frames))
                elif frames:
                    await self.call.write(frames[0])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream ended under us: the peer is gone or stopping
            self._break(f"multiplexed stream to the peer broke on write: {type(e).__name__}: {e}")

    def _take(self, frame: multiplex_pb2.CallFrame) -> list[multiplex_pb2.CallFrame]:
        """`frame`, and once the server reads batches every frame queued behind it whose payloads fit one
        message of `batch_bytes` (the first goes whatever its size); the frames of callers that left are
        skipped (never sent). A frame taken is committed: if its caller leaves while the message waits on
        flow control, a cancel frame follows it, as for a frame being written."""
        self.held, frames, size = None, [], 0
        while True:
            if frame.cancel or frame.id in self.unsent:
                if frames and size + len(frame.payload) > self.batch_bytes:
                    self.held = frame   # the next message's first
                    return frames
                self.unsent.discard(frame.id)
                frames.append(frame)
                size += len(frame.payload)
            if not self.batches or self.outbox.empty() or len(frames) >= MAX_BATCH_FRAMES:
                return frames
            frame = self.outbox.get_nowait()

    async def _read(self) -> None:
        try:
            async for message in self.call:
                for reply in message.batch or (message,):
                    self._receive(reply)
            self._break("the peer ended the multiplexed stream (stopping)")
        except grpc.aio.AioRpcError as e:
            code = e.code() if e.code() in CALLER_REFUSED else grpc.StatusCode.UNAVAILABLE
            self._break(f"multiplexed stream to the peer failed: {e.code().name}: {e.details()}", code)
        except asyncio.CancelledError:
            self._break("multiplexed stream closed by the caller")
            raise

    def _receive(self, reply: multiplex_pb2.ReplyFrame) -> None:
        if reply.more:   # a call's replies come in order, so its pieces so far are of this one reply
            self.pieces.setdefault(reply.id, []).append(reply.payload)
            return
        if reply.id in self.pieces:
            reply.payload = b"".join([*self.pieces.pop(reply.id), reply.payload])
        if reply.partial:
            take = self.partials.get(reply.id)
            if take is not None:
                try:
                    take(reply.payload)
                except Exception as e:  # the caller's handler: its failure must not stop the replies' reader
                    log_event("partial_reply_failed", error=repr(e))
            return
        self.partials.pop(reply.id, None)
        future = self.pending.pop(reply.id, None)
        if future is not None and not future.done():
            future.set_result(reply)
        if self.retired and not self.pending:
            self._break("retired: calls ride the node-local data plane")

    def _break(self, details: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """Every pending call fails UNAVAILABLE, as unary calls to a peer that died do (or `code`: the peer
        refused the caller); the next call opens a new stream."""
        if self.broken is None:
            self.broken = rpc_error(code, details)
            self.call.cancel()
            for task in (self.writer, self.announced):
                if task is not None:
                    task.cancel()
        pending, self.pending, self.pieces, self.partials = self.pending, {}, {}, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self.broken)


class MultiplexChannel:
    """Stands in for a grpc.aio.Channel to a generated stub: `WorkerStub(MultiplexChannel(channel))`
    gives a stub whose unary methods ride one stream of `channel`, reopened after it breaks."""

    def __init__(self, channel: grpc.aio.Channel, tracer_provider: TracerProvider | None = None,
                 max_frame_bytes: int = MAX_FRAME_BYTES, batches: bool = True,
                 local: LocalOpener | None = None, metadata: Sequence[tuple[str, str]] = ()) -> None:
        """`local`: opens the server's node-local data plane when it announces one, which new calls then take
        if this process reaches it (shared/runtime/local_plane.py's open_local); None for the public API,
        whose callers are not the mesh's. `metadata`: sent with each stream it opens (the mesh's token)."""
        self.channel = channel
        self.metadata = tuple(metadata)
        self.max_frame_bytes = max_frame_bytes
        self.batches = batches   # frames waiting together go as one message, replies likewise (off: the ablation)
        self.local = local
        self._going_local: asyncio.Task | None = None
        self._unreachable: set[str] = set()   # endpoints that could not be reached: their calls stay on gRPC
        self.tracer = client_tracer(tracer_provider)  # None: tracing off, or no provider given or set
        self._calls = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                            response_deserializer=multiplex_pb2.ReplyFrame.FromString)
        self._stream: _Stream | None = None
        self._ids = itertools.count(1)

    def unary_unary(self, method: str, request_serializer: Callable | None = None,
                    response_deserializer: Callable | None = None,
                    _registered_method: bool = False) -> MultiplexedMethod:
        serialize, deserialize = request_serializer or _same, response_deserializer or _same
        # a request too large for a frame goes as this call, through the channel's own interceptors
        alone = self.channel.unary_unary(method, response_deserializer=deserialize)
        return MultiplexedMethod(self, method, serialize, deserialize, alone)

    def unary_stream(self, method: str, request_serializer: Callable | None = None,
                     response_deserializer: Callable | None = None,
                     _registered_method: bool = False) -> MultiplexedStreamMethod:
        """A server-streaming method (InferStream): its messages ride the stream as partial replies."""
        serialize, deserialize = request_serializer or _same, response_deserializer or _same
        alone = self.channel.unary_stream(method, response_deserializer=deserialize)
        return MultiplexedStreamMethod(self, method, serialize, deserialize, alone)

    def send_frame(self, method: str, payload: bytes, timeout: float | None, metadata: Sequence[tuple[str, str]],
                   on_partial: Callable[[bytes], None] | None = None) -> tuple[_Stream, int, asyncio.Future]:
        """One call's frame, sent on the stream new calls take: that stream, the call's id and the future its final
        reply settles; `on_partial` takes the payload of each partial reply before it."""
        stream = self.stream()
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        if on_partial is not None:
            stream.partials[call_id] = on_partial
        stream.send(multiplex_pb2.CallFrame(
            id=call_id, method=method, payload=payload, timeout_s=timeout or 0.0, sent_s=loop.time(),
            metadata=[multiplex_pb2.MetadataEntry(key=k, value=v) for k, v in metadata]), reply)
        return stream, call_id, reply

    def stream(self) -> _Stream:
        """The stream new calls take: the node-local one once connected, else (again after it broke) gRPC's."""
        if self._stream is None or self._stream.broken is not None:
            self._stream = _Stream(self._calls(metadata=self._metadata()), self.batches, self._batch_bytes(),
                                   self._offered if self.local else None)
        return self._stream

    @property
    def is_local(self) -> bool:
        """New calls ride the node-local data plane."""
        return self._stream is not None and self._stream.broken is None and not isinstance(
            self._stream.call, grpc.aio.Call)

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return ((FRAME_BYTES_KEY, str(self.max_frame_bytes)), (FRAME_BATCHES_KEY, "1" if self.batches else "0"),
                (MESSAGE_PIECES_KEY, "1"), *self.metadata)

    def _batch_bytes(self) -> int:
        return min(self.max_frame_bytes, MAX_FRAME_BYTES)

    def _offered(self, stream: _Stream, metadata: dict) -> None:
        announced = metadata.get(LOCAL_KEY, "")
        if announced and announced not in self._unreachable and self._going_local is None:
            self._going_local = asyncio.ensure_future(self._go_local(stream, announced))

    async def _go_local(self, stream: _Stream, announced: str) -> None:
        """Connects to the announced plane; once greeted, new calls take it and `stream` retires."""
        assert self.local is not None
        try:
            call = await self.local(announced, self._metadata())
        except (OSError, ValueError, TimeoutError, grpc.aio.AioRpcError) as e:   # another node's, or refused
            self._unreachable.add(announced)
            log_event("local_plane_unreachable", endpoint=announced, error=repr(e))
            return
        finally:
            self._going_local = None
        if self._stream is not stream or stream.broken is not None:
            call.cancel()   # the stream broke meanwhile: the next one announces the plane again
            return
        self._stream = _Stream(call, self.batches, self._batch_bytes())
        stream.retire()

    async def close(self) -> None:
        if self._going_local is not None:
            self._going_local.cancel()
        if self._stream is not None:
            self._stream.call.cancel()
        await self.channel.close()


@dataclass(frozen=True)
class MultiplexedMethod:
    """A unary method of a stub, called as a generated stub's: `await stub.Run(request, timeout=...)`."""

    channel: MultiplexChannel
    method: str
    serialize: Callable[[object], bytes]
    deserialize: Callable[[bytes], object]
    alone: grpc.aio.UnaryUnaryMultiCallable   # the same method as a unary call of its own (bytes in)

    async def __call__(self, request, timeout: float | None = None, metadata: Sequence[tuple[str, str]] = (),
                       on_partial: Callable[[Any], None] | None = None):
        """`on_partial`: called with each early answer the handler sends before its response (a request too large
        for a frame rides a unary call of its own, which has none)."""
        payload = self.serialize(request)
        if len(payload) > self.channel.max_frame_bytes:
            return await self.alone(payload, timeout=timeout, metadata=metadata or None)
        span, carrier = start_client_span(self.channel.tracer, self.method)
        if on_partial is not None:
            metadata = [*metadata, (PARTIALS_KEY, "1")]
        try:
            reply = await self._call(payload, timeout, [*metadata, *carrier.items()], on_partial)
        except grpc.aio.AioRpcError as e:
            end_client_span(span, e.code(), e.details())
            raise
        except asyncio.CancelledError:
            end_client_span(span, grpc.StatusCode.CANCELLED, "cancelled by the caller")
            raise
        end_client_span(span, grpc.StatusCode.OK, None)
        return reply

    async def _call(self, payload: bytes, timeout: float | None, metadata: list[tuple[str, str]],
                    on_partial: Callable[[Any], None] | None = None):
        stream, call_id, future = self.channel.send_frame(
            self.method, payload, timeout, metadata,
            None if on_partial is None else lambda payload: on_partial(self.deserialize(payload)))
        try:
            async with asyncio.timeout(timeout):
                reply = await future
        except TimeoutError:
            stream.forget(call_id)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            stream.forget(call_id)
            raise
        return self.deserialize(reply_payload(reply))


@dataclass(frozen=True)
class MultiplexedStreamMethod:
    """A server-streaming method of a stub, called as a generated stub's: `stub.InferStream(request, timeout=...)`
    gives a call to iterate (`async for`) and `cancel()`. Each message comes as a partial reply, and the call's
    status as its final reply, whose payload is empty. A request too large for a frame, and a server that does
    not multiplex the method (an earlier version's), get a server-streaming call of their own."""

    channel: MultiplexChannel
    method: str
    serialize: Callable[[object], bytes]
    deserialize: Callable[[bytes], object]
    alone: grpc.aio.UnaryStreamMultiCallable   # the same method as a call of its own (bytes in)

    def __call__(self, request, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> MultiplexedStreamCall:
        return MultiplexedStreamCall(self, self.serialize(request), timeout, tuple(metadata or ()))


class MultiplexedStreamCall:
    """One server stream's call: the frame goes out on the first iteration; `cancel()` (or leaving the
    iteration) tells the server's handler to stop, as gRPC cancels a stream whose client went away."""

    def __init__(self, method: MultiplexedStreamMethod, payload: bytes, timeout: float | None,
                 metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.payload = payload
        self.timeout = timeout
        self.metadata = metadata
        self._forget: Callable[[], None] | None = None
        self._alone: grpc.aio.UnaryStreamCall | None = None
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._messages()

    def cancel(self) -> bool:
        self._cancelled = True
        if self._alone is not None:
            return self._alone.cancel()
        if self._forget is not None:
            self._forget()
        return True

    async def _messages(self) -> AsyncIterator[Any]:
        if self._cancelled:
            raise rpc_error(grpc.StatusCode.CANCELLED, "cancelled by the caller")
        if len(self.payload) > self.method.channel.max_frame_bytes:
            async for message in self._call_alone():
                yield message
            return
        span, carrier = start_client_span(self.method.channel.tracer, self.method.method)
        code, details = grpc.StatusCode.OK, None
        try:
            async for message in self._framed_else_alone([*self.metadata, *carrier.items()]):
                yield message
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details()
            raise
        except (asyncio.CancelledError, GeneratorExit):   # the caller left: its handler stops now, not at collection
            code, details = grpc.StatusCode.CANCELLED, "cancelled by the caller"
            self.cancel()
            raise
        finally:
            end_client_span(span, code, details)

    async def _framed_else_alone(self, metadata: list[tuple[str, str]]) -> AsyncIterator[Any]:
        """The call as a frame; as a call of its own where the server answers, before any message, that it does not
        multiplex the method (an earlier version's)."""
        received = 0
        try:
            async for message in self._framed(metadata):
                received += 1
                yield message
            return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED or received or "multiplexed" not in (e.details() or ""):
                raise
        async for message in self._call_alone():
            yield message

    async def _call_alone(self) -> AsyncIterator[Any]:
        self._alone = self.method.alone(self.payload, timeout=self.timeout, metadata=self.metadata or None)
        async for message in self._alone:
            yield message

    async def _framed(self, metadata: list[tuple[str, str]]) -> AsyncIterator[Any]:
        """Its messages come as partial replies (the server sends a stream's whatever the metadata says), its status
        as the final reply (`end`)."""
        messages: asyncio.Queue[bytes | None] = asyncio.Queue()
        stream, call_id, end = self.method.channel.send_frame(self.method.method, self.payload, self.timeout,
                                                              metadata, messages.put_nowait)
        end.add_done_callback(lambda _: messages.put_nowait(None))   # after the messages before it
        self._forget = lambda: stream.forget(call_id)
        deadline = asyncio.get_running_loop().time() + self.timeout if self.timeout else None
        try:
            while True:
                try:   # the deadline's scope holds no yield: it cancels this wait, never the caller's code
                    async with asyncio.timeout_at(deadline):
                        payload = await messages.get()
                except TimeoutError:
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
                if payload is None:
                    break
                yield self.method.deserialize(payload)
        finally:
            stream.forget(call_id)   # the caller left or the deadline passed; nothing once the call has ended
        reply_payload(end.result())   # the status; a broken stream's UNAVAILABLE


# ---------------------------------------------------------------- server side


class FrameContext:
    """What the project's handlers and interceptors ask of a grpc.aio.ServicerContext, for one frame."""

    def __init__(self, frame: multiplex_pb2.CallFrame, started: float,
                 partial: Callable[[object], None] | None = None, peer: str = "") -> None:
        """`started`: when the caller made the call, on this loop's clock. `partial`: sends an early answer,
        where the caller asked for them. `peer`: the stream's, as grpc names it."""
        self.send_partial = partial
        self._peer = peer
        self._deadline = started + frame.timeout_s if frame.timeout_s > 0 else None
        self._metadata = tuple((m.key, m.value) for m in frame.metadata)
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None
        self.trailers: tuple[tuple[str, str], ...] = ()

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self._code, self._details = code, details
        if trailing_metadata:
            self.trailers = tuple(trailing_metadata)
        raise grpc.aio.AbortError(details)

    def set_trailing_metadata(self, trailing_metadata) -> None:
        self.trailers = tuple(trailing_metadata)

    async def write(self, message: object) -> None:
        """A server stream's message (`streamed_as_unary` writes each), sent as a partial reply."""
        if self.send_partial is not None:
            self.send_partial(message)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details


@dataclass(frozen=True)
class UnaryMethod:
    """A unary handler the Multiplex service serves frames of."""

    behavior: UnaryBehavior
    deserialize: Callable[[bytes], object]
    serialize: Callable[[object], bytes]
    served: Counter | None = None   # its academus_multiplexed_calls_total child, resolved once
    streams: bool = False   # a server stream's, in unary form: its messages go as partial replies, then its status


class MultiplexServicer(multiplex_pb2_grpc.MultiplexServicer):
    """Serves each frame of a Calls stream with the unary method it names, wrapped by the same
    interceptors the server puts around its unary calls; replies go back in the order they finish."""

    def __init__(self, methods: dict[str, UnaryMethod], interceptors: Sequence[UnaryServerInterceptor] = (),
                 batches: bool = True, max_calls: int = MAX_STREAM_CALLS,
                 max_backlog_bytes: int = MAX_STREAM_BACKLOG_BYTES) -> None:
        self.methods = {name: UnaryMethod(wrapped(m.behavior, name, interceptors), m.deserialize, m.serialize,
                                          MULTIPLEXED.labels(name), m.streams) for name, m in methods.items()}
        self.batches = batches   # reads batched frames, and batches replies for a caller that reads them
        self.max_calls = max_calls   # running at once on one stream: a peer cannot pile up tasks without bound
        self.max_backlog_bytes = max_backlog_bytes   # unsent replies one stream holds before its frames wait unread
        self.draining = False
        self.local_endpoint = ""  # the node-local data plane's announcement (shared/runtime/local_plane.py); "": none
        self._streams: set[_ServedStream] = set()

    async def Calls(self, request_iterator, context: grpc.aio.ServicerContext):
        metadata = context.invocation_metadata()
        batches = self.batches and dict(metadata or ()).get(FRAME_BATCHES_KEY) == "1"
        served = _ServedStream(self, piece_bytes(metadata), batches, peer=context.peer(),
                               message_pieces=joins_message_pieces(metadata))
        self._streams.add(served)   # before any await: a drain meanwhile must reach it
        reader: asyncio.Future | None = None
        try:
            announced = (((FRAME_BATCHES_KEY, "1"),) if self.batches else ()) + (
                ((LOCAL_KEY, self.local_endpoint),) if self.local_endpoint else ())
            if announced:
                await context.send_initial_metadata(announced)
            reader = asyncio.ensure_future(served.read(request_iterator))
            while (reply := await served.next_message()) is not None:
                yield reply
        finally:
            self._streams.discard(served)
            if reader is not None:
                reader.cancel()
            served.cancel_all()

    def drain(self) -> None:
        """Stopping: frames from now on are answered UNAVAILABLE; each stream ends once its running
        calls have answered."""
        self.draining = True
        for served in list(self._streams):
            served.end_when_idle()


def unrun_reply(frame: multiplex_pb2.CallFrame, context: FrameContext) -> multiplex_pb2.ReplyFrame | None:
    """The answer to a frame not worth running, else None: past its deadline, DEADLINE_EXCEEDED (its
    caller has given up); or it waited at least half of its timeout, and MIN_BACKLOG_S, before its handler
    could start, RESOURCE_EXHAUSTED: this server is behind, and what is left must cover the handler and
    the reply's way back through the same backlog (served, such frames came back late:
    `loadgen/probes/stream_backlog.py`)."""
    remaining = context.time_remaining()
    if remaining is None:
        return None
    waited = frame.timeout_s - remaining
    if remaining <= 0:
        return reply_status(frame.id, grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"Deadline Exceeded: the call waited past its {frame.timeout_s:g} s timeout before "
                            f"this server could start it; nothing ran")
    if waited < max(remaining, MIN_BACKLOG_S):
        return None
    return reply_status(frame.id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"overloaded: the call waited {waited * 1e3:.0f} ms of its {frame.timeout_s:g} s timeout "
                        f"before this server could start it; nothing ran",
                        [(PUSHBACK, str(min(round(waited * 1e3), MAX_PUSHBACK_MS))),
                         (NOTHING_RAN, "true")])


class TransitFloor:
    """How long a frame waited between its caller and this server, from the caller's stamp: (arrival -
    sent) minus the least such difference over the last `window_s`. The clocks' offset is in both, so it
    cancels out; what is left is the wait beyond the fastest frame's. The floor is taken afresh after
    `window_s` so the clocks' drift (ppm) cannot add up over a long-lived stream; a backlog that lasts
    longer than that is then measured from its own level, which can only under-count a wait."""

    def __init__(self, window_s: float = 300.0) -> None:
        self.window_s = window_s
        self.floor: float | None = None
        self.since = 0.0

    def waited(self, sent_s: float, now: float) -> float:
        if sent_s <= 0:   # an unstamped caller: its frames count from their arrival
            return 0.0
        difference = now - sent_s
        if self.floor is None or difference <= self.floor or now - self.since > self.window_s:
            self.floor, self.since = difference, now
        return difference - self.floor


class _ServedStream:
    """One client's Calls stream on the server: its running calls by id and the replies to send."""

    def __init__(self, servicer: MultiplexServicer, piece: int = 0, batches: bool = False,
                 send_now: Callable[[multiplex_pb2.ReplyFrame], bool] | None = None, peer: str = "",
                 message_pieces: bool = False, whole: int | None = None) -> None:
        """`piece`: the caller's frame size, 0 for replies whole; `whole`: the largest payload that still goes
        whole (WHOLE_PIECES pieces unless given). `send_now`: sends a whole reply on the spot if it can (the
        node-local plane), else the reply waits for `next_message`. `peer`: the client, for its frames' handlers
        (grpc's form, `ipv4:host:port`). `message_pieces`: the client joins partial replies sent in pieces."""
        self.servicer = servicer
        self.peer = peer
        self.send_now = send_now
        self.running: dict[int, asyncio.Task] = {}
        self.closing = False   # half-closed by the client, or the server drains: end once idle
        self.replies: asyncio.Queue[multiplex_pb2.ReplyFrame | None] = asyncio.Queue()
        self.held: deque[multiplex_pb2.ReplyFrame | None] = deque()  # taken from `replies`, not batched
        self.piece = piece     # 0: replies go whole
        self.whole = piece * WHOLE_PIECES if whole is None else whole
        # large replies still to send: the reply, its payload (read once: each read of a bytes field copies it), offset
        self.rest: deque[tuple[multiplex_pb2.ReplyFrame, bytes, int]] = deque()
        # the calls whose reply goes in pieces now, and their replies that came behind it, in order
        self.behind: dict[int, deque[multiplex_pb2.ReplyFrame]] = {}
        self.message_pieces = message_pieces
        self.backlog = 0   # payload bytes of the replies queued and not yet handed to the transport
        self.sizes: dict[int, int] = {}   # each queued reply's payload length, read once, by the reply's id()
        self.room = asyncio.Event()   # clear while the backlog is past the servicer's bound: frames wait unread
        self.room.set()
        self.transit = TransitFloor()
        self.batches = batches  # the caller reads batched replies
        self.batch_bytes = min(piece, MAX_FRAME_BYTES) if piece else MAX_FRAME_BYTES   # payload bytes a message

    async def next_message(self) -> multiplex_pb2.ReplyFrame | None:
        """The next message to send, None to end: the next reply (or piece), and when the caller reads
        batches the whole replies ready behind it that fit one message of `batch_bytes`."""
        reply = await self.next_reply()
        if reply is None or reply.more:
            return reply
        size = self.handed(reply)
        if not self.batches:
            return reply
        batch = [reply]
        while not self.held and self.replies.qsize() and len(batch) < MAX_BATCH_FRAMES:
            ready = self.replies.get_nowait()
            if (ready is None or self.in_pieces(ready) or ready.id in self.behind
                    or size + self.payload_size(ready) > self.batch_bytes):
                self.held.append(ready)   # the end, a reply in pieces or behind one, or the next message's first
                break
            batch.append(ready)
            size += self.handed(ready)
        if len(batch) == 1:
            return reply
        BATCHED_REPLIES.inc(len(batch))
        return multiplex_pb2.ReplyFrame(batch=batch)

    async def next_reply(self) -> multiplex_pb2.ReplyFrame | None:
        """The next frame to send, None to end: a waiting reply before the next piece of a large one, and
        the large ones' pieces in turn, so no reply waits behind more than one piece of another call's. A reply
        of a call whose earlier reply is in pieces waits for its last piece."""
        while True:
            if self.rest and not self.held and self.replies.empty():
                return self._next_piece()
            reply = self.held.popleft() if self.held else await self.replies.get()
            if reply is None:
                if not self.rest:
                    return None
                self.replies.put_nowait(None)   # the end goes behind the pieces left
                return self._next_piece()
            if reply.id in self.behind:
                self.behind[reply.id].append(reply)
            elif self.in_pieces(reply):
                self.behind[reply.id] = deque()
                self.rest.append((reply, reply.payload, 0))
                return self._next_piece()
            else:
                return reply

    def in_pieces(self, reply: multiplex_pb2.ReplyFrame, size: int | None = None) -> bool:
        """Past the bytes that go whole; a partial reply (a stream's message, an early answer) only to a caller
        that joins its pieces. `size`: its payload's length, where the caller has read it."""
        return self.piece > 0 and self.whole < (self.payload_size(reply) if size is None else size) and (
            self.message_pieces or not reply.partial)

    def payload_size(self, reply: multiplex_pb2.ReplyFrame) -> int:
        """Its payload's length as read where it was queued (each read of a bytes field copies it); read now for a
        piece, or for a reply put in the queue by hand."""
        size = self.sizes.get(id(reply))
        return len(reply.payload) if size is None else size

    def _next_piece(self) -> multiplex_pb2.ReplyFrame:
        reply, payload, offset = self.rest.popleft()
        end = offset + self.piece
        more = end < len(payload)
        if more:
            self.rest.append((reply, payload, end))
        else:   # the call's replies that waited for this one go next, in order
            self.held.extendleft(reversed(self.behind.pop(reply.id)))
            self.handed(reply)
        return multiplex_pb2.ReplyFrame(id=reply.id, payload=payload[offset:end], more=more, partial=reply.partial)

    def queue(self, reply: multiplex_pb2.ReplyFrame, size: int | None = None) -> None:
        """A reply to send once those ahead of it have gone, counted in the backlog by its payload's length `size`
        (read here where the caller has not; ByteSize would serialize it, which costs as much as sending it)."""
        size = self.sizes[id(reply)] = len(reply.payload) if size is None else size
        self.backlog += size
        if self.backlog > self.servicer.max_backlog_bytes:
            self.room.clear()
        self.replies.put_nowait(reply)

    def handed(self, reply: multiplex_pb2.ReplyFrame) -> int:
        """A queued reply went to the transport, whole or its last piece: out of the backlog. Its payload's length."""
        size = self.sizes.pop(id(reply), None)
        if size is None:   # a piece, or a reply put in the queue by hand
            return len(reply.payload)
        self.backlog -= size
        if self.backlog <= self.servicer.max_backlog_bytes:
            self.room.set()
        return size

    async def read(self, request_iterator) -> None:
        try:
            async for message in request_iterator:
                if message.batch:
                    BATCHED_CALLS.inc(len(message.batch))
                for frame in message.batch or (message,):
                    self.receive(frame)
                await self.room.wait()   # a peer that does not read its replies is not read either
        except grpc.aio.AioRpcError:  # the client went away: its running calls are cancelled below
            pass
        except Exception as e:  # a message that is not a CallFrame: as the local plane does, refuse and close
            self.refuse_stream(f"a message of this stream is not an academus.v1.CallFrame ({type(e).__name__}: {e}); "
                               f"the stream is closed and its running calls cancelled")
            return
        self.end_when_idle()  # the client half-closed: answer what runs, then end

    def refuse_stream(self, details: str) -> None:
        """Answers the peer with a status on call id 0, cancels what it was running and ends the stream."""
        self.cancel_all()
        self.queue(reply_status(0, grpc.StatusCode.INVALID_ARGUMENT, details))
        self.closing = True
        self.replies.put_nowait(None)

    def receive(self, frame: multiplex_pb2.CallFrame) -> None:
        if frame.cancel:
            task = self.running.pop(frame.id, None)
            if task is not None:
                task.cancel()
        elif self.servicer.draining:
            self.queue(reply_status(frame.id, grpc.StatusCode.UNAVAILABLE,
                                                 "the server is stopping; nothing ran"))
        elif (refusal := self.refusal(frame)) is not None:
            MULTIPLEXED_UNRUN.labels(frame.method, CODES[refusal.code].name).inc()
            self.emit(refusal)
        else:
            now = asyncio.get_running_loop().time()
            started = now - self.transit.waited(frame.sent_s, now)
            self.running[frame.id] = asyncio.ensure_future(self.serve(frame, started))

    def refusal(self, frame: multiplex_pb2.CallFrame) -> multiplex_pb2.ReplyFrame | None:
        """A frame the stream's contract does not allow, answered unrun: an id already running (its replies
        could not be told apart), or one call past the stream's limit of running calls."""
        if frame.id in self.running:
            return reply_status(frame.id, grpc.StatusCode.INVALID_ARGUMENT,
                                f"call id {frame.id} is already running on this stream: a running call's id must "
                                f"be unique; nothing ran")
        if len(self.running) >= self.servicer.max_calls:
            return reply_status(frame.id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(self.running)} calls are running on this stream, its limit "
                                f"(ACADEMUS_MAX_STREAM_CALLS={self.servicer.max_calls}); nothing ran",
                                [(PUSHBACK, str(MAX_PUSHBACK_MS)), (NOTHING_RAN, "true")])
        return None

    async def serve(self, frame: multiplex_pb2.CallFrame, started: float) -> None:
        try:
            self.send(await self.answer(frame, started), frame.method)
        except asyncio.CancelledError:
            pass  # the caller left: nobody waits for an answer
        finally:
            self.running.pop(frame.id, None)
            if self.closing and not self.running:
                self.replies.put_nowait(None)

    def send(self, reply: multiplex_pb2.ReplyFrame, method: str) -> None:
        """A reply of a call of `method`: queued for its pieces where it goes in pieces, else emitted. Its payload is
        read once, here."""
        size = len(reply.payload)
        if self.in_pieces(reply, size):
            REPLIES_IN_PIECES.labels(method).inc()
            self.queue(reply, size)
        else:
            self.emit(reply, size)

    def emit(self, reply: multiplex_pb2.ReplyFrame, size: int | None = None) -> None:
        """A whole reply, written on the spot where it can be and nothing waits ahead of it (replies of one call
        keep their order: early answers before the final one), else queued."""
        if self.send_now is None or self.held or self.rest or not self.replies.empty() or not self.send_now(reply):
            self.queue(reply, size)

    async def answer(self, frame: multiplex_pb2.CallFrame, started: float) -> multiplex_pb2.ReplyFrame:
        method = self.servicer.methods.get(frame.method)
        if method is None:
            return reply_status(frame.id, grpc.StatusCode.UNIMPLEMENTED,
                                f"method {frame.method!r} is not multiplexed here")
        partial = None
        if method.streams or any(m.key == PARTIALS_KEY and m.value == "1" for m in frame.metadata):
            def partial(message: object) -> None:
                if frame.id in self.running:   # not after the call ended (or its caller left)
                    self.send(multiplex_pb2.ReplyFrame(id=frame.id, payload=method.serialize(message), partial=True),
                              frame.method)
        context = FrameContext(frame, started, partial, self.peer)
        unrun = unrun_reply(frame, context)
        if unrun is not None:
            MULTIPLEXED_UNRUN.labels(frame.method, CODES[unrun.code].name).inc()
            return unrun
        try:
            request = method.deserialize(frame.payload)
        except Exception as e:  # garbage, cut short, bad UTF-8: the caller's fault, nothing ran
            return reply_status(frame.id, grpc.StatusCode.INVALID_ARGUMENT, unparsable(method.deserialize, e))
        method.served.inc()
        try:
            response = await method.behavior(request, context)
            if method.streams:   # its messages went as partial replies: this is its status
                return multiplex_pb2.ReplyFrame(id=frame.id)
            # inside: a response that cannot be sent is answered as a handler's error, never dropped
            return multiplex_pb2.ReplyFrame(id=frame.id, payload=method.serialize(response))
        except grpc.aio.AbortError:
            return reply_status(frame.id, context.code() or grpc.StatusCode.UNKNOWN, context.details() or "",
                                context.trailers)
        except Exception as e:  # what grpc answers for a handler's unmapped exception
            return reply_status(frame.id, grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}")

    def end_when_idle(self) -> None:
        self.closing = True
        if not self.running:
            self.replies.put_nowait(None)

    def cancel_all(self) -> None:
        for task in self.running.values():
            task.cancel()
        self.running.clear()


class MethodCapture:
    """Stands in for the server to a service's `add_servicers`: registers everything with `server` as
    before, and keeps the unary and server-streaming handlers by full method name, for the Multiplex service
    to serve."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server
        self.methods: dict[str, UnaryMethod] = {}

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.server.add_registered_method_handlers(service, {name: parsed_inside(h) for name, h in handlers.items()})
        for name, handler in handlers.items():
            parse, serialize = handler.request_deserializer or _same, handler.response_serializer or _same
            if handler.unary_unary is not None:  # no (de)serializer: bytes as they are, as grpc takes it
                self.methods[f"/{service}/{name}"] = UnaryMethod(handler.unary_unary, parse, serialize)
            elif handler.unary_stream is not None:
                self.methods[f"/{service}/{name}"] = UnaryMethod(
                    streamed_as_unary(handler.unary_stream), parse, serialize, streams=True)

    def __getattr__(self, name: str):  # add_generic_rpc_handlers and the rest go to the server
        return getattr(self.server, name)


def parsed_inside(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A unary handler that parses its request itself: grpc answers a request it cannot parse UNKNOWN, which
    says the server failed; a peer that sent garbage, a message cut short or bad UTF-8 is told INVALID_ARGUMENT."""
    parse, behavior = handler.request_deserializer, handler.unary_unary
    if behavior is None or parse is None:
        return handler

    async def checked(payload: bytes, context: grpc.aio.ServicerContext) -> object:
        try:
            request = parse(payload)
        except Exception as e:  # DecodeError, or what a hand-written deserializer raises
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, unparsable(parse, e))
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(checked, response_serializer=handler.response_serializer)


def unparsable(parse: Callable[[bytes], object], error: Exception) -> str:
    """Names the message a request failed to parse as, and why."""
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    expected = descriptor.full_name if descriptor is not None else "this method's request message"
    return f"the request is not a valid {expected}: {error}"


def piece_bytes(metadata: Sequence[tuple[str, str | bytes]] | None) -> int:
    """The caller's frame size from its Calls metadata, at least MIN_PIECE_BYTES; 0 (replies whole) when it
    sent none."""
    value = dict(metadata or ()).get(FRAME_BYTES_KEY, "")
    if not (isinstance(value, str) and value.isdigit() and int(value)):
        return 0
    return max(int(value), MIN_PIECE_BYTES)


def joins_message_pieces(metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """The caller's Calls metadata says it joins a partial reply sent in pieces (an earlier version's does not)."""
    return dict(metadata or ()).get(MESSAGE_PIECES_KEY) == "1"


def reply_payload(reply: multiplex_pb2.ReplyFrame) -> bytes:
    """A final reply's payload, or the AioRpcError its status raises (code, details, trailers), as a unary call's."""
    if reply.code:
        raise rpc_error(CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.details,
                        [(t.key, t.value) for t in reply.trailers])
    return reply.payload


def reply_status(call_id: int, code: grpc.StatusCode, details: str,
                 trailers: Sequence[tuple[str, str]] = ()) -> multiplex_pb2.ReplyFrame:
    return multiplex_pb2.ReplyFrame(id=call_id, code=code.value[0], details=details,
                                    trailers=[multiplex_pb2.MetadataEntry(key=k, value=v) for k, v in trailers])


def serve_multiplexed(server: grpc.aio.Server, add_servicers: Callable[[object], None],
                      interceptors: Sequence[UnaryServerInterceptor] = (), batches: bool = True,
                      max_calls: int = MAX_STREAM_CALLS,
                      max_backlog_bytes: int = MAX_STREAM_BACKLOG_BYTES) -> MultiplexServicer:
    """Registers `add_servicers`' servicers with `server` as ever, and the Multiplex service that serves
    their unary methods as frames, inside the same interceptors."""
    capture = MethodCapture(server)
    add_servicers(capture)
    multiplex = MultiplexServicer(capture.methods, interceptors, batches, max_calls, max_backlog_bytes)
    multiplex_pb2_grpc.add_MultiplexServicer_to_server(multiplex, server)
    return multiplex


def over_streams(channel: grpc.aio.Channel, streams: bool, batches: bool = True, local: LocalOpener | None = None,
                 metadata: Sequence[tuple[str, str]] = ()) -> grpc.aio.Channel | MultiplexChannel:
    """What a generated stub is given: the channel, or its multiplexed stand-in when `streams` (going to the
    peer's node-local data plane through `local` when it has one this process reaches; each stream opened with
    `metadata`)."""
    return MultiplexChannel(channel, batches=batches, local=local, metadata=metadata) if streams else channel


def wrapped(behavior: UnaryBehavior, method: str, interceptors: Sequence[UnaryServerInterceptor]) -> UnaryBehavior:
    """`behavior` inside `interceptors`, the first outermost, as grpc applies a server's interceptors."""
    for interceptor in reversed(interceptors):
        behavior = interceptor.wrap(behavior, method)
    return behavior


def _same(payload: bytes) -> bytes:
    return payload


async def call_with_partials(method: Any, request: object, timeout: float | None,
                             on_partial: Callable[[Any], None] | None) -> Any:
    """`method(request)`, its early answers to `on_partial` where it rides a multiplexed stream (a plain unary
    stub has no channel for them: its caller gets the final answer only)."""
    if on_partial is not None and isinstance(method, MultiplexedMethod):
        return await method(request, timeout=timeout, on_partial=on_partial)
    return await method(request, timeout=timeout)
