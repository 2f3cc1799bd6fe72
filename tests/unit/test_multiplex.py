"""Unary calls multiplexed over one stream (shared/runtime/multiplex.py), over real gRPC on loopback and over the
node-local data plane's Unix socket (shared/runtime/local_plane.py, the tests marked BOTH): the caller keeps a unary
call's contract (response, status, trailers, deadline, cancellation, a broken peer), the server keeps its
interceptors (the SERVER span is the CLIENT span's child) and drains on stop. On the plane, a peer that sends
garbage, a cut message, an oversized one, a wrong token or an unknown method gets a status naming the problem
and its connection closed, and the server serves on; a caller that cannot reach an announced plane stays on
gRPC."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY

from academus.shared.runtime.errors import NOTHING_RAN, ResourceExhausted, abort_with, from_rpc_error
from academus.shared.runtime.local_plane import (
    HELLO_METHOD,
    STAGING_GRACE_S,
    STAGING_SUFFIX,
    TOKEN_KEY,
    FramingError,
    LocalEndpoint,
    LocalPlane,
    MessageBuffer,
    open_local,
    pack,
    remove_stale_sockets,
    socket_dir,
)
from academus.shared.runtime.multiplex import (
    CALLS_METHOD,
    FRAME_BATCHES_KEY,
    FRAME_BYTES_KEY,
    MAX_FRAME_BYTES,
    MAX_PUSHBACK_MS,
    MIN_PIECE_BYTES,
    WHOLE_PIECES,
    FrameContext,
    MultiplexChannel,
    MultiplexedMethod,
    MultiplexServicer,
    TransitFloor,
    _ServedStream,
    _Stream,
    piece_bytes,
    serve_multiplexed,
    unrun_reply,
)
from academus.shared.runtime.serving import Stubs
from academus.shared.runtime.tracing import ServerSpans
from academus.v1 import multiplex_pb2, multiplex_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, tensors_pb2

METHOD = "/t.Probe/Answer"


class Probe:
    """The handler: its behaviour is the request's text; it records what it saw."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.remaining: list[float | None] = []
        self.framed: list[bool] = []   # each call: as a frame of the stream, or a unary call of its own

    async def answer(self, payload: bytes, context) -> bytes:
        self.remaining.append(context.time_remaining())
        self.framed.append(isinstance(context, FrameContext))
        request = payload.rstrip(b" ")  # a large request is its behaviour padded with spaces
        if request.startswith(b"sleep:"):
            await asyncio.sleep(float(request[6:]))
        if request in (b"wait", b"hold"):  # until the caller leaves / until released
            self.entered.set()
            try:
                await (asyncio.sleep(30) if request == b"wait" else self.release.wait())
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request == b"refuse":
            await abort_with(context, ResourceExhausted("queue full (capacity 4)", pushback_ms=25))
        if request == b"fail":
            raise ValueError("a bug")
        if request == b"unsendable":   # a handler's bug: not bytes, so no reply can carry it
            return "text"
        if request.startswith(b"reply:"):  # a reply of that many bytes
            return bytes(range(256)) * (int(request[6:]) // 256)
        return b"ok:" + payload


@dataclass
class Mux:
    call: MultiplexedMethod
    probe: Probe
    servicer: MultiplexServicer
    server: grpc.aio.Server
    port: int
    server_spans: InMemorySpanExporter
    client_spans: InMemorySpanExporter
    plane: LocalPlane | None = None   # the server's node-local data plane, which the calls ride


BOTH = pytest.mark.parametrize("mux", ["grpc", "local"], indirect=True)   # the contract holds on either transport


@pytest.fixture
async def mux(request):
    """The Probe served as frames; with param "local", its calls ride the server's node-local data plane."""
    local = getattr(request, "param", "grpc") == "local"
    probe, server_spans, client_spans = Probe(), InMemorySpanExporter(), InMemorySpanExporter()
    server_provider, client_provider = TracerProvider(), TracerProvider()
    server_provider.add_span_processor(SimpleSpanProcessor(server_spans))
    client_provider.add_span_processor(SimpleSpanProcessor(client_spans))
    server = grpc.aio.server()
    servicer = serve_multiplexed(server, lambda s: s.add_registered_method_handlers(  # both ways, as every server
        "t.Probe", {"Answer": grpc.unary_unary_rpc_method_handler(probe.answer)}), [ServerSpans(server_provider)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    plane = LocalPlane(servicer, socket_dir(), "probe") if local else None
    if plane is not None:
        await plane.start()
    channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), client_provider,
                               local=open_local if local else None)
    mux = Mux(channel.unary_unary(METHOD), probe, servicer, server, port, server_spans, client_spans, plane)
    if local:
        await went_local(mux)
    yield mux
    await channel.close()
    await server.stop(None)
    if plane is not None:
        await plane.stop(0)


async def went_local(mux: Mux) -> None:
    """A first call learns the plane; then new calls ride it and the gRPC stream closes. What the warm-up
    left (its span, what the probe saw) is cleared."""
    assert await mux.call(b"warm", timeout=5) == b"ok:warm"
    for _ in range(200):
        if mux.call.channel.is_local and len(mux.servicer._streams) == 1:
            break
        await asyncio.sleep(0.01)
    assert mux.call.channel.is_local and len(mux.servicer._streams) == 1
    mux.probe.remaining.clear()
    mux.probe.framed.clear()
    mux.server_spans.clear()
    mux.client_spans.clear()


@BOTH
async def test_concurrent_calls_share_one_stream_and_answer_as_they_finish(mux):
    call, probe, servicer = mux.call, mux.probe, mux.servicer
    order: list[bytes] = []

    async def one(request: bytes) -> None:
        order.append(await call(request, timeout=5))

    await asyncio.gather(one(b"sleep:0.3"), one(b"sleep:0.0"), one(b"sleep:0.1"))
    assert order == [b"ok:sleep:0.0", b"ok:sleep:0.1", b"ok:sleep:0.3"]
    assert len(servicer._streams) == 1
    assert all(r is not None and 4.0 < r <= 5.0 for r in probe.remaining)  # the caller's deadline arrived


def batched(direction: str) -> float:
    return REGISTRY.get_sample_value("academus_multiplexed_batched_frames_total", {"direction": direction}) or 0.0


async def many(call, n: int, pad: int = 0) -> None:
    """n calls made in one turn of the loop, so their frames wait for the stream together; each answer is
    its own."""
    requests = [b"n%d" % i + b" " * pad for i in range(n)]
    answers = await asyncio.gather(*(call(r, timeout=5) for r in requests))
    assert answers == [b"ok:" + r for r in requests]


async def test_frames_and_replies_waiting_together_ride_one_message_each(mux):
    """On the gRPC stream, where a message costs the same whatever it holds (on the local plane a frame is
    written where it is sent)."""
    assert await mux.call(b"warm", timeout=5) == b"ok:warm"   # the server's headers say it reads batches
    assert mux.call.channel.stream().batches
    calls, replies = batched("calls"), batched("replies")
    await many(mux.call, 20)
    assert batched("calls") - calls == 20        # all twenty rode batches: they were queued in one turn
    assert batched("replies") - replies >= 2     # replies ready together went together too


@BOTH
async def test_a_message_of_frames_stays_within_the_frame_size(mux):
    """Three frames of 40 KiB: any two exceed a message's 64 KiB, so each goes alone, none is lost."""
    assert await mux.call(b"warm", timeout=5) == b"ok:warm"
    calls = batched("calls")
    await many(mux.call, 3, pad=40 * 1024)
    assert batched("calls") == calls


@pytest.mark.parametrize("side", ["caller", "server"])
async def test_a_peer_that_does_not_read_batches_gets_single_frames(side):
    """A caller that did not ask gets every reply alone; a server that did not announce (an earlier
    version sends no such header) is sent every frame alone, though the caller asked."""
    probe, server = Probe(), grpc.aio.server()
    serve_multiplexed(server, lambda s: s.add_registered_method_handlers(
        "t.Probe", {"Answer": grpc.unary_unary_rpc_method_handler(probe.answer)}), batches=side != "server")
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), batches=side != "caller")
    try:
        call = channel.unary_unary(METHOD)
        assert await call(b"warm", timeout=5) == b"ok:warm"
        assert not channel.stream().batches
        calls, replies = batched("calls"), batched("replies")
        await many(call, 20)
        assert (batched("calls"), batched("replies")) == (calls, replies)
    finally:
        await channel.close()
        await server.stop(None)


@pytest.mark.parametrize("asks", [True, False])
async def test_replies_are_batched_only_for_a_caller_that_asks_in_its_calls_metadata(mux, asks):
    """A raw Calls stream sends one message of eight frames: the server reads them all, and its replies
    ride batches when the caller's metadata asked (FRAME_BATCHES_KEY), never when it did not."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}") as channel:
        calls = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                      response_deserializer=multiplex_pb2.ReplyFrame.FromString)(
            metadata=((FRAME_BATCHES_KEY, "1" if asks else "0"),))
        assert dict(await calls.initial_metadata()).get(FRAME_BATCHES_KEY) == "1"   # the server reads batches
        frames = [multiplex_pb2.CallFrame(id=i, method=METHOD, payload=b"b%d" % i) for i in range(1, 9)]
        await calls.write(multiplex_pb2.CallFrame(batch=frames))
        got: dict[int, bytes] = {}
        messages = []
        while len(got) < len(frames):
            message = await asyncio.wait_for(calls.read(), 5)
            messages.append(len(message.batch))
            for reply in message.batch or (message,):
                got[reply.id] = reply.payload
        assert got == {i: b"ok:b%d" % i for i in range(1, 9)}
        assert any(messages) if asks else not any(messages), messages
        calls.cancel()


async def test_batched_replies_keep_the_pieces_and_the_end_in_order(mux):
    """Small replies ready together share a message; one in pieces goes alone and the small ones behind it
    go between its pieces; the end waits for the last piece."""
    served = _ServedStream(mux.servicer, piece=4, batches=True, whole=4)   # (a caller asks for 16 KiB at least)
    for reply in (multiplex_pb2.ReplyFrame(id=1, payload=b"a"), multiplex_pb2.ReplyFrame(id=2, payload=b"b"),
                  multiplex_pb2.ReplyFrame(id=3, payload=b"abcdefghij"), multiplex_pb2.ReplyFrame(id=4, payload=b"c"),
                  None):
        served.replies.put_nowait(reply)
    sent = []
    while (message := await served.next_message()) is not None:
        sent.append([(r.id, r.payload, r.more) for r in message.batch] or (message.id, message.payload, message.more))
    assert sent == [[(1, b"a", False), (2, b"b", False)], (3, b"abcd", True), (4, b"c", False),
                    (3, b"efgh", True), (3, b"ij", False)]


async def test_a_refusal_keeps_its_code_details_and_pushback_trailer(mux):
    call = mux.call
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(b"refuse", timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    error = from_rpc_error(refused.value, "scheduler")
    assert isinstance(error, ResourceExhausted) and error.pushback_ms == 25 and "capacity 4" in error.message
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await call(b"fail", timeout=5)
    assert failed.value.code() == grpc.StatusCode.UNKNOWN and "ValueError: a bug" in failed.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as unsent:   # answered at once, not left to its timeout
        await call(b"unsendable", timeout=30)
    assert unsent.value.code() == grpc.StatusCode.UNKNOWN
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await call.channel.unary_unary("/t.Probe/Nothing", bytes, bytes)(b"x", timeout=5)
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert await call(b"after", timeout=5) == b"ok:after"  # the stream outlived the errors


@BOTH
async def test_a_large_request_rides_a_call_of_its_own_and_keeps_the_contract(mux):
    call, probe = mux.call, mux.probe
    pad = b" " * MAX_FRAME_BYTES    # past the limit: a frame this large would hold up the calls behind it
    assert await call(b"big" + pad, timeout=5) == b"ok:big" + pad
    assert await call(b"small", timeout=5) == b"ok:small"
    assert probe.framed == [False, True]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(b"refuse" + pad, timeout=5)
    error = from_rpc_error(refused.value, "worker")
    assert isinstance(error, ResourceExhausted) and error.pushback_ms == 25
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await call(b"wait" + pad, timeout=0.2)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(probe.cancelled.wait(), 5)
    assert probe.framed == [False, True, False, False]


async def test_a_large_reply_comes_in_pieces_and_a_reply_behind_it_goes_between_them(mux):
    large = 2 << 20                   # whole, it stays under gRPC's 4 MiB message limit
    expected = bytes(range(256)) * (large // 256)
    for piece, small_first in ((1024, True), (1 << 40, False)):   # pieces of 16 KiB (the least); every reply whole
        channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}"), max_frame_bytes=piece)
        call = channel.unary_unary(METHOD)
        try:
            assert await call(b"warm", timeout=5) == b"ok:warm"
            big = asyncio.ensure_future(call(b"reply:%d" % large, timeout=10))
            await asyncio.sleep(0)        # its frame is sent first
            assert await call(b"small", timeout=10) == b"ok:small"
            assert big.done() is not small_first, f"piece {piece}: the small reply waited behind the large"
            assert await big == expected
            assert await call(b"after", timeout=5) == b"ok:after"
        finally:
            await channel.close()


async def test_the_end_of_a_stream_waits_for_the_pieces_left_and_a_small_reply_cuts_in(mux):
    served = _ServedStream(mux.servicer, piece=4, whole=4)
    for reply in (multiplex_pb2.ReplyFrame(id=1, payload=b"abcdefghij"), multiplex_pb2.ReplyFrame(id=2, payload=b"s"),
                  None):
        served.replies.put_nowait(reply)
    sent = []
    while (frame := await served.next_reply()) is not None:
        sent.append((frame.id, frame.payload, frame.more))
    assert sent == [(1, b"abcd", True), (2, b"s", False), (1, b"efgh", True), (1, b"ij", False)]


async def test_a_calls_replies_behind_its_message_in_pieces_wait_for_its_last_piece(mux):
    """A stream's message in pieces: another call's reply cuts in between them, but the same call's next message
    and its status (the final reply) wait for its last piece, in order, whether queued or batched."""
    for batches in (False, True):
        served = _ServedStream(mux.servicer, piece=4, batches=batches, message_pieces=True, whole=4)
        for reply in (multiplex_pb2.ReplyFrame(id=1, payload=b"abcdefghij", partial=True),
                      multiplex_pb2.ReplyFrame(id=1, payload=b"m", partial=True),
                      multiplex_pb2.ReplyFrame(id=2, payload=b"s"), multiplex_pb2.ReplyFrame(id=1), None):
            served.replies.put_nowait(reply)
        sent = []
        while (message := await served.next_message()) is not None:
            sent.extend((r.id, r.payload, r.more, r.partial) for r in message.batch or (message,))
        assert sent == [(1, b"abcd", True, True), (2, b"s", False, False), (1, b"efgh", True, True),
                        (1, b"ij", False, True), (1, b"m", False, True), (1, b"", False, False)], batches


async def test_a_message_goes_whole_to_a_caller_that_does_not_join_its_pieces(mux):
    served = _ServedStream(mux.servicer, piece=4, whole=4)
    for reply in (multiplex_pb2.ReplyFrame(id=1, payload=b"abcdefghij", partial=True), multiplex_pb2.ReplyFrame(id=1),
                  None):
        served.replies.put_nowait(reply)
    sent = []
    while (frame := await served.next_reply()) is not None:
        sent.append((frame.id, frame.payload, frame.more, frame.partial))
    assert sent == [(1, b"abcdefghij", False, True), (1, b"", False, False)]


async def test_a_reply_of_a_few_pieces_goes_whole_and_a_larger_one_in_pieces(mux):
    """A piece costs the stream a message: up to WHOLE_PIECES pieces' bytes, a reply goes whole; past them, it
    comes in pieces of the caller's frame size."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}") as channel:
        calls = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                      response_deserializer=multiplex_pb2.ReplyFrame.FromString)(
            metadata=((FRAME_BYTES_KEY, str(MAX_FRAME_BYTES)),))
        whole = WHOLE_PIECES * MAX_FRAME_BYTES
        await calls.write(multiplex_pb2.CallFrame(id=1, method=METHOD, payload=b"reply:%d" % whole))
        reply = await asyncio.wait_for(calls.read(), 5)
        assert (reply.id, reply.code, reply.more, len(reply.payload)) == (1, 0, False, whole)
        await calls.write(multiplex_pb2.CallFrame(id=2, method=METHOD, payload=b"reply:%d" % (whole + 256)))
        pieces = [await asyncio.wait_for(calls.read(), 5) for _ in range(WHOLE_PIECES + 1)]
        assert [(r.id, r.more, len(r.payload)) for r in pieces] == [
            (2, True, MAX_FRAME_BYTES)] * WHOLE_PIECES + [(2, False, 256)]
        calls.cancel()


async def test_a_caller_that_sends_no_frame_size_gets_every_reply_whole(mux):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}") as channel:
        calls = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                      response_deserializer=multiplex_pb2.ReplyFrame.FromString)()
        await calls.write(multiplex_pb2.CallFrame(id=7, method=METHOD, payload=b"reply:%d" % (4 * MAX_FRAME_BYTES)))
        reply = await asyncio.wait_for(calls.read(), 5)
        assert (reply.id, reply.code, reply.more, len(reply.payload)) == (7, 0, False, 4 * MAX_FRAME_BYTES)
        calls.cancel()


def test_a_caller_asks_for_pieces_of_at_least_16_kib():
    assert piece_bytes([(FRAME_BYTES_KEY, "1")]) == MIN_PIECE_BYTES == 16 * 1024
    assert piece_bytes([(FRAME_BYTES_KEY, str(1 << 20))]) == 1 << 20
    assert piece_bytes([]) == piece_bytes(None) == piece_bytes([(FRAME_BYTES_KEY, "0")]) == 0
    assert piece_bytes([(FRAME_BYTES_KEY, "-5")]) == piece_bytes([(FRAME_BYTES_KEY, b"65536")]) == 0


async def test_a_caller_that_leaves_during_a_replys_pieces_keeps_its_stream(mux):
    # pieces of 16 KiB (the least a caller may ask for); the requests are smaller, so they ride the stream
    channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}"), max_frame_bytes=MIN_PIECE_BYTES)
    call = channel.unary_unary(METHOD)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await call(b"reply:%d" % (32 << 20), timeout=0.02)   # 2048 pieces: it cannot all arrive in time
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await call(b"reply:%d" % (64 << 10), timeout=30) == bytes(range(256)) * 256   # in 4 pieces
        assert mux.probe.framed == [True, True]
        stream = channel.stream()
        for _ in range(300):          # the abandoned reply's pieces are dropped once its last one is in
            if not stream.pieces:
                break
            await asyncio.sleep(0.1)
        assert not stream.pieces and not stream.pending and stream.broken is None
    finally:
        await channel.close()


@BOTH
async def test_the_deadline_answers_deadline_exceeded_and_stops_the_handler(mux):
    call, probe, servicer = mux.call, mux.probe, mux.servicer
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await call(b"wait", timeout=0.2)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(probe.cancelled.wait(), 5)
    (served,) = servicer._streams
    assert not served.running


def unrun(code: str) -> float:
    return REGISTRY.get_sample_value("academus_multiplexed_unrun_total", {"method": METHOD, "code": code}) or 0.0


async def test_a_frames_wait_on_its_way_counts_against_its_timeout_whatever_the_callers_clock(mux):
    """Frames stamped on a clock 12345 s off the server's: the first sets the stream's floor; one sent
    10 s before it is past its 5 s timeout, one sent 3 s before has waited more than half of it (both
    answered unrun), one sent 1 s before is served with about 4 s left."""
    probe, base = mux.probe, 12345.0
    expired_before, behind_before = unrun("DEADLINE_EXCEEDED"), unrun("RESOURCE_EXHAUSTED")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}") as channel:
        calls = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                      response_deserializer=multiplex_pb2.ReplyFrame.FromString)()
        await calls.write(multiplex_pb2.CallFrame(id=1, method=METHOD, payload=b"first", timeout_s=5, sent_s=base))
        assert (await asyncio.wait_for(calls.read(), 5)).payload == b"ok:first"
        for call_id, ago in ((2, 10.0), (3, 3.0), (4, 1.0)):
            await calls.write(multiplex_pb2.CallFrame(id=call_id, method=METHOD, payload=b"sent %gs ago" % ago,
                                                      timeout_s=5, sent_s=base - ago))
        replies = {r.id: r for r in [await asyncio.wait_for(calls.read(), 5) for _ in range(3)]}
        calls.cancel()
    assert replies[2].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "nothing ran" in replies[2].details
    behind = replies[3]
    trailers = {t.key: t.value for t in behind.trailers}
    assert behind.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "waited 3" in behind.details
    assert trailers[NOTHING_RAN] == "true" and int(trailers["grpc-retry-pushback-ms"]) == MAX_PUSHBACK_MS  # 3 s, capped
    assert replies[4].code == 0 and replies[4].payload == b"ok:sent 1s ago"
    assert len(probe.remaining) == 2 and 3.5 < probe.remaining[1] <= 4.0   # the unrun two never reached it
    assert unrun("DEADLINE_EXCEEDED") == expired_before + 1 and unrun("RESOURCE_EXHAUSTED") == behind_before + 1


async def test_a_short_wait_is_jitter_not_a_backlog():
    """Half of a small budget is not a backlog: a call with 0.05 s left that waited 0.03 s still runs."""
    now = asyncio.get_running_loop().time()
    small = multiplex_pb2.CallFrame(id=1, timeout_s=0.05)
    assert unrun_reply(small, FrameContext(small, started=now - 0.03)) is None
    large = multiplex_pb2.CallFrame(id=2, timeout_s=0.5)
    refused = unrun_reply(large, FrameContext(large, started=now - 0.3))
    assert refused is not None and refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    untimed = multiplex_pb2.CallFrame(id=3)
    assert unrun_reply(untimed, FrameContext(untimed, started=now - 100)) is None   # no deadline: never refused


def test_the_transit_floor_cancels_the_clocks_offset_and_is_taken_afresh_after_its_window():
    floor = TransitFloor(window_s=10)
    assert floor.waited(0.0, 5.0) == 0.0                        # unstamped: counted from its arrival
    assert floor.waited(1000.0, 5.0) == 0.0                     # the first sets the floor (offset -995 s)
    assert floor.waited(1000.0, 5.5) == pytest.approx(0.5)      # sent together, it came 0.5 s later
    assert floor.waited(1001.0, 5.6) == 0.0                     # a faster way through lowers the floor
    assert floor.waited(1001.0, 6.6) == pytest.approx(1.0)
    assert floor.waited(1001.0, 16.0) == 0.0                    # 10 s without a new floor: taken afresh


class HeldCall:
    """A Calls stream whose writes wait for `gate` (HTTP/2 flow control from a peer that is behind)."""

    def __init__(self, batches: bool = False) -> None:
        self.gate = asyncio.Event()
        self.written: list[multiplex_pb2.CallFrame] = []
        self.batches = batches   # the headers of a server that reads batches

    async def initial_metadata(self):
        return ((FRAME_BATCHES_KEY, "1"),) if self.batches else ()

    async def write(self, frame: multiplex_pb2.CallFrame) -> None:
        await self.gate.wait()
        self.written.append(frame)

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.Event().wait()   # no replies

    def cancel(self) -> bool:
        return True


async def test_a_frame_whose_caller_left_before_it_was_written_is_never_sent(mux):
    channel, held = mux.call.channel, HeldCall()
    stream = channel._stream = _Stream(held)
    call = mux.call
    first = asyncio.ensure_future(call(b"first", timeout=5))     # the writer takes it and waits on the gate
    await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await call(b"gave up", timeout=0.05)                      # its frame still in the outbox
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    third = asyncio.ensure_future(call(b"third", timeout=5))
    await asyncio.sleep(0.01)
    first.cancel()                                                # its frame is being written: a cancel follows
    held.gate.set()
    for _ in range(100):
        if len(held.written) == 3:
            break
        await asyncio.sleep(0.01)
    assert [(f.id, f.payload, f.cancel) for f in held.written] == [
        (1, b"first", False), (3, b"third", False), (1, b"", True)]
    assert all(f.sent_s > 0 for f in held.written if not f.cancel)   # stamped with the caller's clock
    third.cancel()
    stream.writer.cancel()
    stream.reader.cancel()
    channel._stream = None


async def test_a_message_takes_at_most_64_frames_never_one_whose_caller_left_and_carries_cancels(mux):
    """While a write waits on flow control, 70 calls and one whose caller leaves queue up: the next
    message takes 64 frames, the one after the other 6 and the cancel of the call being written, and the
    frame of the caller that left is never sent."""
    channel, held = mux.call.channel, HeldCall(batches=True)
    stream = channel._stream = _Stream(held, batches=True)
    call = mux.call
    await asyncio.sleep(0.01)                                     # the server's headers are read
    assert stream.batches
    first = asyncio.ensure_future(call(b"first", timeout=5))     # alone: the writer takes it, waits on the gate
    await asyncio.sleep(0.01)
    many = [asyncio.ensure_future(call(b"m%d" % i, timeout=5)) for i in range(70)]
    with pytest.raises(grpc.aio.AioRpcError):
        await call(b"gave up", timeout=0.05)
    first.cancel()                                                # being written: a cancel frame follows
    await asyncio.sleep(0.01)
    held.gate.set()
    for _ in range(100):
        if len(held.written) == 3:
            break
        await asyncio.sleep(0.01)
    alone, full, rest = held.written
    assert (alone.id, alone.payload, len(alone.batch)) == (1, b"first", 0)
    assert [f.payload for f in full.batch] == [b"m%d" % i for i in range(64)]
    assert [(f.payload, f.cancel) for f in rest.batch] == [(b"m%d" % i, False) for i in range(64, 70)] + [
        (b"", True)] and rest.batch[-1].id == 1
    for task in many:
        task.cancel()
    stream.writer.cancel()
    stream.reader.cancel()
    channel._stream = None


@BOTH
async def test_a_caller_that_leaves_cancels_the_handler(mux):
    call, probe = mux.call, mux.probe
    caller = asyncio.ensure_future(call(b"wait", timeout=30))
    await asyncio.wait_for(probe.entered.wait(), 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(probe.cancelled.wait(), 5)


@BOTH
async def test_the_server_span_is_the_client_spans_child(mux):
    call, server_spans, client_spans = mux.call, mux.server_spans, mux.client_spans
    await call(b"traced", timeout=5)
    (client,) = client_spans.get_finished_spans()
    (served,) = server_spans.get_finished_spans()
    assert client.kind == SpanKind.CLIENT and served.kind == SpanKind.SERVER and served.name == METHOD
    assert served.parent.span_id == client.context.span_id
    assert client.attributes["rpc.grpc.status_code"] == served.attributes["rpc.grpc.status_code"] == 0


@BOTH
async def test_a_peer_that_dies_fails_pending_calls_unavailable_and_a_new_stream_serves_its_successor(mux):
    call, probe, servicer, port = mux.call, mux.probe, mux.servicer, mux.port
    pending = asyncio.ensure_future(call(b"wait", timeout=30))
    await asyncio.wait_for(probe.entered.wait(), 5)
    await mux.server.stop(None)  # no grace: the stream is cut, as when the process is killed
    if mux.plane is not None:
        await mux.plane.stop(0)  # its socket too: the successor is reached over gRPC, where it announces none
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await pending
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(b"again", timeout=2)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    successor = grpc.aio.server()
    multiplex_pb2_grpc.add_MultiplexServicer_to_server(servicer, successor)
    successor.add_insecure_port(f"127.0.0.1:{port}")
    await successor.start()
    try:
        for _ in range(100):  # the channel reconnects after its back-off
            try:
                assert await call(b"back", timeout=2) == b"ok:back"
                break
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("no call reached the successor")
    finally:
        await successor.stop(None)


@BOTH
async def test_draining_refuses_new_frames_and_finishes_running_ones(mux):
    call, probe, servicer = mux.call, mux.probe, mux.servicer
    running = asyncio.ensure_future(call(b"hold", timeout=10))
    await asyncio.wait_for(probe.entered.wait(), 5)
    servicer.drain()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(b"late", timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "stopping" in refused.value.details()
    probe.release.set()
    assert await running == b"ok:hold"
    for _ in range(100):  # the stream ends once its last call answered
        if not servicer._streams:
            break
        await asyncio.sleep(0.01)
    assert not servicer._streams


class Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def Schedule(self, request, context):
        return tensors_pb2.ModelOutput(labels=[request.model])


async def test_a_generated_stub_rides_the_stream_of_a_captured_servicer():
    """What the services do: `add_servicers` through serve_multiplexed (MethodCapture), callers through
    Stubs(multiplexed)."""
    server = grpc.aio.server()
    multiplex = serve_multiplexed(server, lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(Scheduler(), s))
    assert list(multiplex.methods) == ["/academus.v1.Scheduler/Schedule"]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stub = Stubs(scheduler_pb2_grpc.SchedulerStub, multiplexed=True)(f"127.0.0.1:{port}")
    direct = Stubs(scheduler_pb2_grpc.SchedulerStub)(f"127.0.0.1:{port}")
    try:
        request = scheduler_pb2.ScheduleRequest(model="sentiment")
        assert list((await stub.Schedule(request, timeout=5)).labels) == ["sentiment"]
        assert list((await direct.Schedule(request, timeout=5)).labels) == ["sentiment"]  # still served unary
    finally:
        await server.stop(None)


# ---------------------------------------------------------------- the node-local data plane's own faults


def test_messages_are_cut_whole_across_reads_and_an_oversized_length_is_refused_unread():
    buffer = MessageBuffer(limit=10)
    stream = pack(b"abc") + pack(b"") + pack(b"0123456789")
    assert buffer.feed(stream[:5]) == [] and buffer.partial() == "1 of its 3 bytes"
    assert buffer.feed(stream[5:]) == [b"abc", b"", b"0123456789"] and buffer.partial() == ""
    assert buffer.feed(b"\x02") == [] and buffer.partial() == "1 bytes of a 4-byte length prefix"
    with pytest.raises(FramingError, match="11 bytes exceeds the local plane's limit of 10 bytes"):
        MessageBuffer(limit=10).feed(pack(b"x" * 11)[:4])


def test_an_announcement_names_a_socket_path_and_a_token():
    endpoint = LocalEndpoint("/tmp/a/worker-1.sock", "f00d")
    assert LocalEndpoint.parse(endpoint.announce()) == endpoint
    assert LocalEndpoint.parse("f00d:relative.sock") is None and LocalEndpoint.parse("") is None


def hello(token: str) -> bytes:
    entries = [multiplex_pb2.MetadataEntry(key=TOKEN_KEY, value=token),
               multiplex_pb2.MetadataEntry(key=FRAME_BATCHES_KEY, value="1")]
    return pack(multiplex_pb2.CallFrame(method=HELLO_METHOD, metadata=entries).SerializeToString())


def frame(call_id: int, method: str = METHOD, payload: bytes = b"x") -> bytes:
    return pack(multiplex_pb2.CallFrame(id=call_id, method=method, payload=payload, timeout_s=5).SerializeToString())


async def exchange(endpoint: LocalEndpoint, sent: bytes, end_writing: bool = False) -> list[multiplex_pb2.ReplyFrame]:
    """A raw peer: sends `sent`, (ends its writing,) and reads every reply until the server closes."""
    reader, writer = await asyncio.open_unix_connection(endpoint.path)
    writer.write(sent)
    if end_writing:
        writer.write_eof()
    data = await asyncio.wait_for(reader.read(), 5)   # to EOF: the server closed the connection
    writer.close()
    return [multiplex_pb2.ReplyFrame.FromString(m) for m in MessageBuffer().feed(data)]


def endpoint_of(mux) -> LocalEndpoint:
    return mux.plane.endpoint


@pytest.mark.parametrize("mux", ["local"], indirect=True)
@pytest.mark.parametrize(("case", "code", "named"), [
    ("garbage", grpc.StatusCode.INVALID_ARGUMENT, "is not an academus.v1.CallFrame"),
    ("truncated", grpc.StatusCode.INVALID_ARGUMENT, "ended inside a message: 2 of its"),
    ("oversized", grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the local plane's limit of 67108864 bytes"),
    ("bad token", grpc.StatusCode.UNAUTHENTICATED, "carrying this server's token"),
])
async def test_a_bad_peer_gets_a_status_naming_the_problem_and_its_connection_closed(mux, case, code, named):
    endpoint = endpoint_of(mux)
    good = hello(endpoint.token)
    sent = {"garbage": good + pack(b"\xff\xff\xff\xff\xff"),
            "truncated": good + frame(7)[:6],
            "oversized": good + (100 * 1024 * 1024).to_bytes(4, "little"),
            "bad token": hello("not-the-token") + frame(1)}[case]
    replies = await exchange(endpoint, sent, end_writing=case == "truncated")
    refusal = replies[-1]
    assert (refusal.id, refusal.code) == (0, code.value[0]) and named in refusal.details
    assert not [r for r in replies if r.id]    # nothing of the bad peer's ran
    assert await mux.call(b"still", timeout=5) == b"ok:still"   # the server serves on
    assert mux.call.channel.is_local


@pytest.mark.parametrize("mux", ["local"], indirect=True)
async def test_an_unknown_method_is_answered_unimplemented_and_the_connection_closes_once_its_calls_answer(mux):
    endpoint = endpoint_of(mux)
    sent = hello(endpoint.token) + frame(1, payload=b"sleep:0.2") + frame(2, method="/t.Probe/Nothing") + frame(3)
    replies = {r.id: r for message in await exchange(endpoint, sent) for r in (*message.batch, message) if r.id}
    assert replies[1].code == 0 and replies[1].payload == b"ok:sleep:0.2"   # accepted before: answered
    assert replies[2].code == grpc.StatusCode.UNIMPLEMENTED.value[0] and "'/t.Probe/Nothing'" in replies[2].details
    assert replies[3].code == grpc.StatusCode.UNAVAILABLE.value[0] and "nothing ran" in replies[3].details


@pytest.mark.parametrize("mux", ["grpc"], indirect=True)
async def test_a_plane_the_caller_cannot_reach_leaves_its_calls_on_grpc(mux):
    """What a caller on another node sees: a path that is not there (or not its peer's)."""
    mux.servicer.local_endpoint = LocalEndpoint("/nonexistent/academus/worker.sock", "f00d").announce()
    channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}"), local=open_local)
    try:
        call = channel.unary_unary(METHOD)
        for i in range(5):
            assert await call(b"%d" % i, timeout=5) == b"ok:%d" % i
            await asyncio.sleep(0.02)
        assert not channel.is_local and channel._unreachable == {mux.servicer.local_endpoint}
    finally:
        await channel.close()


def test_a_socket_no_process_listens_on_is_removed_and_one_listened_on_stays(tmp_path):
    """What a killed service leaves behind goes; a socket someone listens on stays, whatever its name."""
    import socket

    stale, live = tmp_path / "worker-999999-dead.sock", tmp_path / "scheduler-1-alive.sock"
    for path in (stale, live):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        if path == live:
            s.listen()
            listening = s
        else:
            s.close()   # the file stays, with no listener: what kill -9 leaves
    try:
        assert remove_stale_sockets(tmp_path) == [stale]
        assert not stale.exists() and live.exists()
        assert remove_stale_sockets(tmp_path) == []
    finally:
        listening.close()


async def test_a_plane_starting_beside_a_sweep_is_listening_whenever_its_socket_can_be_seen(tmp_path, monkeypatch):
    """Two services of a node start at once: one sweeps the folder (`remove_stale_sockets`) at the worst moment of
    the other's start, bound and about to listen. The starting plane's socket survives, answers, and only its user
    may connect."""
    import socket
    import stat

    real_listen = socket.socket.listen

    def swept_then_listen(sock: socket.socket, *args: int) -> None:
        if sock.family == socket.AF_UNIX:
            remove_stale_sockets(tmp_path)   # the service starting beside this one
        real_listen(sock, *args)

    monkeypatch.setattr(socket.socket, "listen", swept_then_listen)
    plane = LocalPlane(serve_multiplexed(grpc.aio.server(), lambda s: None, []), tmp_path, "worker")
    endpoint = await plane.start()
    try:
        path = Path(endpoint.path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and list(tmp_path.iterdir()) == [path]
        _, writer = await asyncio.open_unix_connection(endpoint.path)
        writer.close()
        await writer.wait_closed()
    finally:
        await plane.stop(0)
    assert not path.exists()


def test_a_staging_socket_is_removed_only_once_older_than_a_bind_can_take(tmp_path):
    """A socket still being bound is left to its service; one as old as STAGING_GRACE_S was left by a service
    killed while binding."""
    import os
    import time

    fresh, left = tmp_path / f"worker-1-a.sock{STAGING_SUFFIX}", tmp_path / f"worker-2-b.sock{STAGING_SUFFIX}"
    fresh.touch()
    left.touch()
    old = time.time() - STAGING_GRACE_S - 1
    os.utime(left, (old, old))
    assert remove_stale_sockets(tmp_path) == [left]
    assert fresh.exists() and not left.exists()
    assert remove_stale_sockets(tmp_path, now=time.time() + STAGING_GRACE_S + 1) == [fresh]


async def raw_calls(mux: Mux, frames: list[multiplex_pb2.CallFrame], replies: int) -> list[multiplex_pb2.ReplyFrame]:
    """A peer that writes its own frames on the mux's transport (a gRPC Calls stream, or a local-plane connection
    after its hello) and reads `replies` replies; the probe's held calls are released after the frames are in."""
    got: list[multiplex_pb2.ReplyFrame] = []
    if mux.plane is None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}")
        call = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                     response_deserializer=multiplex_pb2.ReplyFrame.FromString)()
        for f in frames:
            await call.write(f)
        await asyncio.sleep(0.1)
        mux.probe.release.set()
        while len(got) < replies:
            message = await asyncio.wait_for(call.read(), 5)
            got.extend(message.batch or (message,))
        await call.done_writing()
        await channel.close()
        return got
    reader, writer = await asyncio.open_unix_connection(mux.plane.endpoint.path)
    writer.write(hello(mux.plane.endpoint.token) + b"".join(pack(f.SerializeToString()) for f in frames))
    await asyncio.sleep(0.1)
    mux.probe.release.set()
    buffer = MessageBuffer()
    while len(got) < replies:
        for data in buffer.feed(await asyncio.wait_for(reader.read(65536), 5)):
            message = multiplex_pb2.ReplyFrame.FromString(data)
            got.extend(r for r in (*message.batch, message) if r.id)
    writer.close()
    return got


def call_frame(call_id: int, payload: bytes) -> multiplex_pb2.CallFrame:
    return multiplex_pb2.CallFrame(id=call_id, method=METHOD, payload=payload, timeout_s=5)


class SilentPeer:
    """A peer that writes frames on the mux's transport (a gRPC Calls stream, or a local-plane connection after its
    hello) and reads replies only when asked."""

    def __init__(self, mux: Mux) -> None:
        self.mux, self.channel, self.call, self.reader, self.writer = mux, None, None, None, None
        self.buffer, self.got = MessageBuffer(), []

    async def send(self, frames: list[multiplex_pb2.CallFrame]) -> None:
        if self.mux.plane is None:
            self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.mux.port}")
            self.call = self.channel.stream_stream(CALLS_METHOD,
                                                   request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                                   response_deserializer=multiplex_pb2.ReplyFrame.FromString)()
            for f in frames:
                await self.call.write(f)
            return
        self.reader, self.writer = await asyncio.open_unix_connection(self.mux.plane.endpoint.path)
        self.writer.write(hello(self.mux.plane.endpoint.token))
        for f in frames:   # one at a time, as a gRPC stream's messages come: the plane reads what came together
            self.writer.write(pack(f.SerializeToString()))
            await asyncio.sleep(0.005)

    async def read(self, replies: int) -> list[multiplex_pb2.ReplyFrame]:
        while len(self.got) < replies:
            if self.call is not None:
                message = await asyncio.wait_for(self.call.read(), 10)
                self.got.extend(message.batch or (message,))
                continue
            for data in self.buffer.feed(await asyncio.wait_for(self.reader.read(1 << 20), 10)):
                message = multiplex_pb2.ReplyFrame.FromString(data)
                self.got.extend(r for r in (*message.batch, message) if r.id)
        return self.got

    async def close(self) -> None:
        if self.channel is not None:
            self.call.cancel()
            await self.channel.close()
        else:
            self.writer.close()


@BOTH
async def test_a_peer_that_does_not_read_its_replies_is_not_read_either(mux):
    """Past the stream's bound on unsent reply bytes the server stops reading its frames, so a peer that sends and
    never reads holds a bounded share of the server's memory; once it reads, every frame it sent is answered."""
    bound, size, calls = 1 << 20, 256 << 10, 64
    mux.servicer.max_backlog_bytes = bound
    before = len(mux.probe.framed)
    peer = SilentPeer(mux)
    try:
        await peer.send([call_frame(i, b"reply:%d" % size) for i in range(1, calls + 1)])
        served = None
        for _ in range(500):
            served = next((s for s in mux.servicer._streams if not s.room.is_set()), None)
            if served is not None:
                break
            await asyncio.sleep(0.01)
        assert served is not None, "no stream's backlog passed its bound"
        await asyncio.sleep(0.3)   # what it would read meanwhile, it does not
        assert len(mux.probe.framed) - before < calls and not served.room.is_set()
        replies = await peer.read(calls)
    finally:
        await peer.close()
    assert sorted(r.id for r in replies) == list(range(1, calls + 1))
    assert all(r.code == 0 and len(r.payload) == size for r in replies)
    assert served.backlog == 0 and served.room.is_set()


@BOTH
async def test_a_second_frame_with_a_running_calls_id_is_refused_and_the_first_runs_on(mux):
    replies = await raw_calls(mux, [call_frame(1, b"hold"), call_frame(1, b"again"), call_frame(2, b"x")], 3)
    refused = [r for r in replies if r.code]
    assert [(r.id, r.code) for r in refused] == [(1, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert "call id 1 is already running" in refused[0].details and "nothing ran" in refused[0].details
    assert sorted(r.payload for r in replies if not r.code) == [b"ok:hold", b"ok:x"]   # not b"ok:again"
    assert await mux.call(b"still", timeout=5) == b"ok:still"


@BOTH
async def test_a_frame_past_the_streams_limit_of_running_calls_is_refused_unrun(mux):
    mux.servicer.max_calls = 2
    replies = await raw_calls(mux, [call_frame(1, b"hold"), call_frame(2, b"hold"), call_frame(3, b"x")], 3)
    by_id = {r.id: r for r in replies}
    assert by_id[3].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "2 calls are running on this stream, its limit (ACADEMUS_MAX_STREAM_CALLS=2)" in by_id[3].details
    assert {(t.key, t.value) for t in by_id[3].trailers} >= {(NOTHING_RAN, "true")}
    assert by_id[1].payload == by_id[2].payload == b"ok:hold"        # the calls within the limit ran
    assert await mux.call(b"after", timeout=5) == b"ok:after"        # room again once they answered


@pytest.mark.parametrize("mux", ["grpc"], indirect=True)
async def test_a_message_that_is_not_a_frame_ends_the_grpc_stream_with_a_status_and_cancels_its_calls(mux):
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{mux.port}")
    call = channel.stream_stream(CALLS_METHOD)()   # raw bytes, so that the peer can send what is not a frame
    await call.write(call_frame(1, b"wait").SerializeToString())
    await asyncio.wait_for(mux.probe.entered.wait(), 5)
    await call.write(b"\xff\xff")
    replies = [multiplex_pb2.ReplyFrame.FromString(raw) async for raw in call]   # ends: no deadline needed
    assert [(r.id, r.code) for r in replies] == [(0, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert "is not an academus.v1.CallFrame" in replies[0].details
    await asyncio.wait_for(mux.probe.cancelled.wait(), 5)   # the running call was cancelled
    await channel.close()
    assert await mux.call(b"still", timeout=5) == b"ok:still"


@pytest.mark.parametrize("mux", ["local"], indirect=True)
async def test_a_stopping_plane_cuts_the_connections_left_after_its_grace_and_says_how_many(mux):
    """Nothing drained the servicer, so the caller's idle connection outlives the grace: it is cut, and counted
    (the service logs it in its `stopped` event). A second stop has nothing left to cut."""
    assert await mux.plane.stop(0.05) == 1
    for _ in range(10):   # the cut connection leaves the plane's set when the loop reports it lost
        await asyncio.sleep(0)
    assert not mux.plane.connections and await mux.plane.stop(0) == 0
