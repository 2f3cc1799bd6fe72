"""Server streams (`InferStream`'s shape) over the multiplexed stream (shared/runtime/multiplex.py), on a real grpc.aio
server on loopback and on the node-local data plane's Unix socket: each message comes as it is written, before the
handler ends; a status after messages fails the call with its code, details and trailers; a caller that leaves (with
`cancel()` or by closing the iteration) or whose deadline passes cancels the handler; a request too large for a
frame, and a server that does not multiplex the method, get a server-streaming call of their own; a peer that dies
fails the call UNAVAILABLE."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import REGISTRY

from academus.shared.runtime.errors import ResourceExhausted, abort_with
from academus.shared.runtime.local_plane import LocalPlane, open_local, socket_dir
from academus.shared.runtime.multiplex import (
    CALLS_METHOD,
    FRAME_BYTES_KEY,
    MAX_FRAME_BYTES,
    FrameContext,
    MultiplexChannel,
    MultiplexedStreamMethod,
    serve_multiplexed,
)
from academus.v1 import multiplex_pb2

METHOD = "/t.Streams/Tell"
PLAIN = "/t.Plain/Tell"       # served as a call of its own only, as by a server of an earlier version
WAIT_S = 10.0   # only so that a broken test fails rather than hangs; nothing is timed against it
BOTH = pytest.mark.parametrize("streamed", ["grpc", "local"], indirect=True)


class Teller:
    """The handler: its behaviour is the request's first word; events let a test step it and observe it."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.cleaned_up = asyncio.Event()   # its generator's own clean-up ran (the caller left, or its deadline)
        self.framed: list[bool] = []

    async def tell(self, payload: bytes, context) -> AsyncIterator[bytes]:
        self.framed.append(isinstance(context, FrameContext))
        behaviour = payload.split(b" ")[0]
        try:
            yield b"first"
            if behaviour == b"gated":   # the second message once the test opens the gate
                self.entered.set()
                await self.gate.wait()
            if behaviour == b"refuse":
                await abort_with(context, ResourceExhausted("queue full (capacity 4)", pushback_ms=25))
            if behaviour == b"big":   # a message of the size its second word says, past a frame's
                yield big_message(int(payload.split(b" ")[1]))
            if behaviour == b"hold":
                self.entered.set()
                await asyncio.sleep(3600)
            yield b"second:" + payload[:16]
        finally:
            self.cleaned_up.set()


@dataclass
class Streamed:
    teller: Teller
    server: grpc.aio.Server
    port: int
    channel: MultiplexChannel
    tell: MultiplexedStreamMethod
    plane: LocalPlane | None


@pytest.fixture
async def streamed(request: pytest.FixtureRequest) -> AsyncIterator[Streamed]:
    """The Teller served as frames (and as a call of its own, under PLAIN, outside the Multiplex service)."""
    local = getattr(request, "param", "grpc") == "local"
    teller, server = Teller(), grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(teller.tell)
    servicer = serve_multiplexed(server, lambda s: s.add_registered_method_handlers("t.Streams", {"Tell": handler}))
    server.add_registered_method_handlers("t.Plain", {"Tell": handler})
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    plane = LocalPlane(servicer, socket_dir(), "streams") if local else None
    if plane is not None:
        await plane.start()
    channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), local=open_local if local else None)
    result = Streamed(teller, server, port, channel, channel.unary_stream(METHOD), plane)
    if local:
        await went_local(result)
    yield result
    await channel.close()
    await server.stop(None)
    if plane is not None:
        await plane.stop(0)


async def went_local(streamed: Streamed) -> None:
    assert await messages(streamed.tell(b"warm", timeout=WAIT_S)) == [b"first", b"second:warm"]
    for _ in range(500):
        if streamed.channel.is_local:
            break
        await asyncio.sleep(0.01)
    assert streamed.channel.is_local
    streamed.teller.__init__()   # what the warm-up left


def big_message(size: int) -> bytes:
    return bytes(range(256)) * (size // 256)


async def messages(call) -> list[bytes]:
    return [m async for m in call]


def served_as_frames(method: str) -> float:
    return REGISTRY.get_sample_value("academus_multiplexed_calls_total", {"method": method}) or 0.0


def sent_in_pieces(method: str) -> float:
    return REGISTRY.get_sample_value("academus_multiplexed_replies_in_pieces_total", {"method": method}) or 0.0


@BOTH
async def test_each_message_comes_as_written_before_the_handler_ends(streamed: Streamed) -> None:
    before = served_as_frames(METHOD)
    stream = streamed.tell(b"gated", timeout=WAIT_S).__aiter__()
    assert await asyncio.wait_for(stream.__anext__(), WAIT_S) == b"first"   # the handler still waits on its gate
    assert streamed.teller.entered.is_set() and not streamed.teller.cleaned_up.is_set()
    streamed.teller.gate.set()
    assert [m async for m in stream] == [b"second:gated"]
    assert streamed.teller.framed == [True] and served_as_frames(METHOD) == before + 1


@BOTH
async def test_a_status_after_messages_fails_the_call_with_its_code_and_trailers(streamed: Streamed) -> None:
    got: list[bytes] = []
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for message in streamed.tell(b"refuse", timeout=WAIT_S):
            got.append(message)
    assert got == [b"first"]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue full (capacity 4)" in refused.value.details()
    assert dict(refused.value.trailing_metadata())["grpc-retry-pushback-ms"] == "25"


@BOTH
async def test_a_caller_that_leaves_cancels_the_handler_and_the_stream_serves_on(streamed: Streamed) -> None:
    call = streamed.tell(b"hold", timeout=WAIT_S)
    async for _ in call:
        break
    await asyncio.wait_for(streamed.teller.entered.wait(), WAIT_S)
    call.cancel()
    await asyncio.wait_for(streamed.teller.cleaned_up.wait(), WAIT_S)
    assert await messages(streamed.tell(b"again", timeout=WAIT_S)) == [b"first", b"second:again"]
    assert streamed.teller.framed == [True, True]


@BOTH
async def test_leaving_the_iteration_without_cancel_stops_the_handler(streamed: Streamed) -> None:
    messages_of = streamed.tell(b"hold", timeout=WAIT_S).__aiter__()
    assert await messages_of.__anext__() == b"first"
    await asyncio.wait_for(streamed.teller.entered.wait(), WAIT_S)
    await messages_of.aclose()   # what leaving an `async for` comes to once the iterator is let go
    await asyncio.wait_for(streamed.teller.cleaned_up.wait(), WAIT_S)


async def test_a_call_cancelled_before_its_iteration_sends_nothing(streamed: Streamed) -> None:
    call = streamed.tell(b"never", timeout=WAIT_S)
    call.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as cancelled:
        await messages(call)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED and streamed.teller.framed == []


@BOTH
async def test_the_deadline_answers_deadline_exceeded_and_stops_the_handler(streamed: Streamed) -> None:
    got: list[bytes] = []
    with pytest.raises(grpc.aio.AioRpcError) as late:
        async for message in streamed.tell(b"hold", timeout=0.3):
            got.append(message)
    assert got == [b"first"] and late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(streamed.teller.cleaned_up.wait(), WAIT_S)


async def test_a_request_too_large_for_a_frame_is_a_call_of_its_own(streamed: Streamed) -> None:
    large = b"large " + b" " * streamed.channel.max_frame_bytes
    assert await messages(streamed.tell(large, timeout=WAIT_S)) == [b"first", b"second:" + large[:16]]
    assert streamed.teller.framed == [False]


async def test_a_server_that_does_not_multiplex_the_method_is_called_on_its_own(streamed: Streamed) -> None:
    plain = streamed.channel.unary_stream(PLAIN)
    assert await messages(plain(b"old", timeout=WAIT_S)) == [b"first", b"second:old"]
    assert streamed.teller.framed == [False]


async def test_a_peer_that_dies_fails_the_call_unavailable(streamed: Streamed) -> None:
    call = streamed.tell(b"hold", timeout=WAIT_S)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        async for _ in call:
            await asyncio.wait_for(streamed.teller.entered.wait(), WAIT_S)
            await streamed.server.stop(None)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE


@BOTH
async def test_a_message_past_a_frame_comes_in_pieces_joined_in_order(streamed: Streamed) -> None:
    """A message of 1 MiB goes as pieces of the caller's frame size (not whole, holding up the stream's other
    replies), and comes out whole, between the stream's messages before and after it."""
    size = 1 << 20
    before = sent_in_pieces(METHOD)
    got = await messages(streamed.tell(b"big %d" % size, timeout=WAIT_S))
    assert got == [b"first", big_message(size), b"second:big %d" % size]
    assert sent_in_pieces(METHOD) == before + 1 and streamed.teller.framed == [True]


async def test_a_caller_that_does_not_join_message_pieces_gets_each_message_whole(streamed: Streamed) -> None:
    """A caller of an earlier version (a frame size in its metadata, no MESSAGE_PIECES_KEY): every message whole."""
    size = 4 * MAX_FRAME_BYTES
    async with grpc.aio.insecure_channel(f"127.0.0.1:{streamed.port}") as channel:
        calls = channel.stream_stream(CALLS_METHOD, request_serializer=multiplex_pb2.CallFrame.SerializeToString,
                                      response_deserializer=multiplex_pb2.ReplyFrame.FromString)(
            metadata=((FRAME_BYTES_KEY, str(MAX_FRAME_BYTES)),))
        await calls.write(multiplex_pb2.CallFrame(id=3, method=METHOD, payload=b"big %d" % size))
        replies = [await asyncio.wait_for(calls.read(), WAIT_S) for _ in range(4)]
        calls.cancel()
    assert [(r.id, r.partial, r.more, r.code) for r in replies] == [(3, True, False, 0)] * 3 + [(3, False, False, 0)]
    assert [r.payload for r in replies] == [b"first", big_message(size), b"second:big %d" % size, b""]
