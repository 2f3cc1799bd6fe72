"""Partial replies (early answers) over the multiplexed hop (shared/runtime/multiplex.py), on real grpc.aio servers on
loopback and on the node-local data plane's Unix socket (shared/runtime/local_plane.py): a caller that passes
`on_partial` gets each early answer its handler sends with `context.send_partial`, in order, before the call's
result; they interleave with other calls' replies on the same stream; a caller that passes none leaves the handler
no `send_partial`; a caller that leaves cancels the handler and gets no more of its early answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest

from academus.shared.runtime.local_plane import LocalPlane, open_local, socket_dir
from academus.shared.runtime.multiplex import (
    FrameContext,
    MultiplexChannel,
    MultiplexedMethod,
    MultiplexServicer,
    call_with_partials,
    serve_multiplexed,
)
from academus.v1 import tensors_pb2, worker_pb2, worker_pb2_grpc

WAIT_S = 10.0   # only so that a broken test fails rather than hangs; nothing is timed against it
BOTH = pytest.mark.parametrize("served", ["grpc", "local"], indirect=True)   # either transport


def early(row: int, layer: int) -> tensors_pb2.ModelOutput:
    """An early answer: row `row` of the batch, released at exit layer `layer`."""
    return tensors_pb2.ModelOutput(rows=[row], exit_layer=layer, labels=[f"early-{row}"])


def final(name: str) -> tensors_pb2.ModelOutput:
    return tensors_pb2.ModelOutput(labels=[f"final-{name}"])


def summary(outputs: list[tensors_pb2.ModelOutput]) -> list[tuple[list[int], int]]:
    return [(list(o.rows), o.exit_layer) for o in outputs]


class Worker(worker_pb2_grpc.WorkerServicer):
    """The handler: its behaviour is the request's batch_id; events let a test step it and observe it."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()          # "slow": sends its second early answer once set
        self.entered = asyncio.Event()       # "hold": sent its first early answer, now waits
        self.cancelled = asyncio.Event()     # "hold": its task was cancelled
        self.late_sent = asyncio.Event()     # "hold": tried an early answer after its cancellation
        self.contexts: list[tuple[str, bool, bool]] = []   # (behaviour, a frame's context, send_partial is None)

    async def Run(self, request: worker_pb2.RunRequest, context) -> tensors_pb2.ModelOutput:
        behaviour = request.batch_id
        send = getattr(context, "send_partial", None)   # a plain unary call's context has none at all
        self.contexts.append((behaviour, isinstance(context, FrameContext), send is None))
        if behaviour == "probe":   # says whether it could send early answers
            return tensors_pb2.ModelOutput(labels=["none" if send is None else "partials"])
        if behaviour == "two":
            send(early(0, 2))
            send(early(1, 4))
            return final("two")
        if behaviour == "slow":
            send(early(0, 2))
            await self.gate.wait()
            send(early(1, 4))
            send(early(2, 6))
            return final("slow")
        if behaviour == "big":   # early answers before a final too large for one piece
            send(tensors_pb2.ModelOutput(rows=[0], exit_layer=2, labels=["e" * 40_000]))   # larger than a piece
            send(early(1, 4))
            return tensors_pb2.ModelOutput(labels=["x" * 200_000])
        if behaviour == "hold":
            send(early(0, 2))
            self.entered.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                send(early(1, 4))   # too late: the caller left
                self.late_sent.set()
                self.cancelled.set()
                raise
        return final(behaviour)


@dataclass
class Served:
    worker: Worker
    servicer: MultiplexServicer
    server: grpc.aio.Server
    port: int
    channel: MultiplexChannel
    stub: worker_pb2_grpc.WorkerStub
    plane: LocalPlane | None = None
    extra: list[MultiplexChannel] = field(default_factory=list)   # channels a test opened, closed after it

    @property
    def run(self) -> MultiplexedMethod:
        return self.stub.Run

    def another_channel(self, **kwargs: object) -> MultiplexChannel:
        channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{self.port}"), **kwargs)
        self.extra.append(channel)
        return channel


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    """The Worker served as frames on loopback; with param "local", the calls ride its node-local data plane."""
    local = getattr(request, "param", "grpc") == "local"
    worker, server = Worker(), grpc.aio.server()
    servicer = serve_multiplexed(server, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(worker, s))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    plane = LocalPlane(servicer, socket_dir(), "partials") if local else None
    if plane is not None:
        await plane.start()
    channel = MultiplexChannel(grpc.aio.insecure_channel(f"127.0.0.1:{port}"), local=open_local if local else None)
    served = Served(worker, servicer, server, port, channel, worker_pb2_grpc.WorkerStub(channel), plane)
    assert isinstance(served.run, MultiplexedMethod)
    if local:
        await went_local(served)
    yield served
    for other in served.extra:
        await other.close()
    await channel.close()
    await server.stop(None)
    if plane is not None:
        await plane.stop(0)


async def went_local(served: Served, method: MultiplexedMethod | None = None, streams: int = 1) -> None:
    """A first call learns the plane; new calls then ride it and the gRPC stream closes (`streams`: the server's
    streams then, one a channel)."""
    method = method or served.run
    assert await method(worker_pb2.RunRequest(batch_id="warm"), timeout=WAIT_S) == final("warm")
    for _ in range(500):
        if method.channel.is_local and len(served.servicer._streams) == streams:
            break
        await asyncio.sleep(0.01)
    assert method.channel.is_local and len(served.servicer._streams) == streams
    served.worker.contexts.clear()


def recorder(log: list[tuple[str, object]], name: str, then: Callable[[], None] | None = None
             ) -> Callable[[tensors_pb2.ModelOutput], None]:
    """An on_partial that appends ("<name>:partial", its answer) to `log` (and calls `then`)."""
    def take(message: tensors_pb2.ModelOutput) -> None:
        log.append((f"{name}:partial", message))
        if then is not None:
            then()
    return take


async def call(served: Served, log: list[tuple[str, object]], behaviour: str, partials: bool = True,
               then: Callable[[], None] | None = None, method: MultiplexedMethod | None = None) -> None:
    """One call; its early answers and then its result go to `log`, so `log` shows what came before what."""
    on_partial = recorder(log, behaviour, then) if partials else None
    response = await (method or served.run)(worker_pb2.RunRequest(batch_id=behaviour), timeout=WAIT_S,
                                            on_partial=on_partial)
    log.append((f"{behaviour}:final", response))


@BOTH
async def test_early_answers_arrive_in_order_before_the_result(served: Served) -> None:
    log: list[tuple[str, object]] = []
    await call(served, log, "two")
    assert [what for what, _ in log] == ["two:partial", "two:partial", "two:final"]
    assert summary([m for what, m in log if what == "two:partial"]) == [([0], 2), ([1], 4)]
    assert log[-1][1] == final("two")
    assert served.worker.contexts == [("two", True, False)]


@BOTH
async def test_early_answers_interleave_with_other_calls_replies_on_one_stream(served: Served) -> None:
    log: list[tuple[str, object]] = []
    first = asyncio.Event()
    slow = asyncio.ensure_future(call(served, log, "slow", then=first.set))
    try:
        await asyncio.wait_for(first.wait(), WAIT_S)   # its first early answer came; it waits on the gate
        await asyncio.wait_for(asyncio.gather(call(served, log, "a"), call(served, log, "two"),
                                              call(served, log, "b", partials=False)), WAIT_S)
        assert not slow.done()                         # the others finished while it was pending
        served.worker.gate.set()
        await asyncio.wait_for(slow, WAIT_S)
    finally:
        slow.cancel()
    slow_log = [(what, m) for what, m in log if what.startswith("slow:")]
    assert [what for what, _ in slow_log] == ["slow:partial"] * 3 + ["slow:final"]
    assert summary([m for _, m in slow_log[:3]]) == [([0], 2), ([1], 4), ([2], 6)]
    assert slow_log[-1][1] == final("slow")
    finished = [what for what, _ in log if what.endswith(":final")]
    assert sorted(finished[:3]) == ["a:final", "b:final", "two:final"] and finished[3] == "slow:final"
    assert log[0][0] == "slow:partial"             # its first early answer came before any other reply
    two = [what for what, _ in log if what.startswith("two:")]
    assert two == ["two:partial", "two:partial", "two:final"]
    assert len(served.servicer._streams) == 1      # all rode one stream


@BOTH
async def test_a_caller_without_on_partial_leaves_the_handler_no_send_partial(served: Served) -> None:
    plain = await served.run(worker_pb2.RunRequest(batch_id="probe"), timeout=WAIT_S)
    assert list(plain.labels) == ["none"]
    asked: list[tensors_pb2.ModelOutput] = []
    with_partials = await served.run(worker_pb2.RunRequest(batch_id="probe"), timeout=WAIT_S, on_partial=asked.append)
    assert list(with_partials.labels) == ["partials"] and asked == []   # it sent none, though it could
    assert served.worker.contexts == [("probe", True, True), ("probe", True, False)]
    assert await served.run(worker_pb2.RunRequest(batch_id="c"), timeout=WAIT_S) == final("c")   # as before


async def test_call_with_partials_takes_them_over_a_stream_and_a_plain_stub_gets_the_result_only(
        served: Served) -> None:
    got: list[tensors_pb2.ModelOutput] = []
    request = worker_pb2.RunRequest(batch_id="two")
    assert await call_with_partials(served.run, request, WAIT_S, got.append) == final("two")
    assert summary(got) == [([0], 2), ([1], 4)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        plain = worker_pb2_grpc.WorkerStub(channel)
        unary: list[tensors_pb2.ModelOutput] = []
        probe = await call_with_partials(plain.Run, worker_pb2.RunRequest(batch_id="probe"), WAIT_S, unary.append)
        assert list(probe.labels) == ["none"] and unary == []
    assert served.worker.contexts[-1] == ("probe", False, True)   # a unary call's own context: no send_partial
    assert await call_with_partials(served.run, worker_pb2.RunRequest(batch_id="probe"), WAIT_S, None) == (
        tensors_pb2.ModelOutput(labels=["none"]))


@BOTH
async def test_a_caller_that_leaves_cancels_the_handler_and_gets_no_more_early_answers(served: Served) -> None:
    log: list[tuple[str, object]] = []
    first = asyncio.Event()
    caller = asyncio.ensure_future(call(served, log, "hold", then=first.set))
    try:
        await asyncio.wait_for(first.wait(), WAIT_S)
        await asyncio.wait_for(served.worker.entered.wait(), WAIT_S)
    finally:
        caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(served.worker.cancelled.wait(), WAIT_S)
    assert served.worker.late_sent.is_set()   # the handler tried another early answer as it was cancelled
    # replies of one stream keep their order: once a later call's result is back, anything sent before it has come
    after: list[tuple[str, object]] = []
    await call(served, after, "two")
    assert [what for what, _ in after] == ["two:partial", "two:partial", "two:final"]
    assert [what for what, _ in log] == ["hold:partial"]   # the first early answer only; no result
    assert summary([log[0][1]]) == [([0], 2)]
    assert served.run.channel.stream().partials == {} and served.run.channel.stream().pending == {}


@BOTH
async def test_early_answers_come_before_a_result_sent_in_pieces(served: Served) -> None:
    """A caller with a small frame size gets a large result in pieces: the early answers (whole, though one is
    larger than a piece) still come first, and the pieces make the result whole."""
    channel = served.another_channel(max_frame_bytes=16 * 1024, local=open_local if served.plane else None)
    method = worker_pb2_grpc.WorkerStub(channel).Run
    if served.plane is not None:
        await went_local(served, method, streams=2)
    log: list[tuple[str, object]] = []
    await call(served, log, "big", method=method)
    assert [what for what, _ in log] == ["big:partial", "big:partial", "big:final"]
    assert summary([m for what, m in log if what == "big:partial"]) == [([0], 2), ([1], 4)]
    assert list(log[0][1].labels) == ["e" * 40_000]
    assert list(log[-1][1].labels) == ["x" * 200_000]
