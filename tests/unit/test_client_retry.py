"""The SDK retries UNAVAILABLE (nothing ran) and a server's CANCELLED within the deadline, on a multiplexed
stream as the channel's retry policy does for a unary call, and, asked to (`retry_overload`), an overloaded
server's RESOURCE_EXHAUSTED after its pushback hint, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc
import pytest

from academus.client import AcademusError, AsyncClient, Client
from academus.client.types import retry_wait
from academus.shared.runtime.errors import PUSHBACK
from academus.shared.runtime.multiplex import serve_multiplexed
from academus.v1 import inference_pb2 as pb
from academus.v1 import inference_pb2_grpc

UNAVAILABLE, EXHAUSTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_retry_wait_follows_the_channels_policy():
    widest = lambda low, high: high   # noqa: E731 - the backoff's bound, not a random draw
    assert retry_wait(UNAVAILABLE, 0, 5.0, draw=widest) == pytest.approx(0.05)
    assert retry_wait(UNAVAILABLE, 1, 5.0, draw=widest) == pytest.approx(0.1)
    assert retry_wait(UNAVAILABLE, 2, 5.0, draw=widest) is None           # three attempts in all
    assert retry_wait(grpc.StatusCode.RESOURCE_EXHAUSTED, 0, 5.0) is None   # only what says nothing ran
    assert retry_wait(UNAVAILABLE, 0, 5.0, pushback_ms=30) == pytest.approx(0.03)
    assert retry_wait(UNAVAILABLE, 0, 5.0, pushback_ms=-1) is None         # the server says: do not retry
    assert retry_wait(UNAVAILABLE, 0, 0.02, pushback_ms=30) is None        # past the deadline


def test_an_overload_is_retried_only_when_asked_and_only_after_its_pushback():
    assert retry_wait(EXHAUSTED, 0, 5.0, pushback_ms=30, overload=True) == pytest.approx(0.03)
    assert retry_wait(EXHAUSTED, 0, 5.0, pushback_ms=30) is None               # opt-in
    assert retry_wait(EXHAUSTED, 0, 5.0, overload=True) is None               # no hint: e.g. a message too large
    assert retry_wait(EXHAUSTED, 0, 5.0, pushback_ms=-1, overload=True) is None
    assert retry_wait(EXHAUSTED, 0, 0.02, pushback_ms=30, overload=True) is None   # past the deadline
    assert retry_wait(EXHAUSTED, 2, 5.0, pushback_ms=30, overload=True) is None    # three attempts in all


class Flaky(inference_pb2_grpc.InferenceServicer):
    """`code` for the first `failures` calls (with a pushback hint of `pushback_ms` when given), then an answer."""

    def __init__(self, failures: int, code: grpc.StatusCode = UNAVAILABLE, pushback_ms: int | None = None) -> None:
        self.failures, self.code, self.pushback_ms, self.calls = failures, code, pushback_ms, 0

    async def Infer(self, request, context):
        await self._fail_first(context)
        return pb.InferResponse(model=request.model)

    async def ListModels(self, request, context):
        await self._fail_first(context)
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="spam", kind="classification", labels=["ham", "spam"])])

    async def _fail_first(self, context) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            if self.pushback_ms is not None:
                context.set_trailing_metadata(((PUSHBACK, str(self.pushback_ms)),))
            await context.abort(self.code, "the scheduler is gone; nothing ran" if self.code == UNAVAILABLE
                                else "every scheduler serving the model has a full queue")


@pytest.fixture
async def flaky():
    servers: list[grpc.aio.Server] = []

    async def serve(failures: int, code: grpc.StatusCode = UNAVAILABLE,
                    pushback_ms: int | None = None) -> tuple[Flaky, str]:
        servicer = Flaky(failures, code, pushback_ms)
        server = grpc.aio.server()
        serve_multiplexed(server, lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(servicer, s))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return servicer, f"127.0.0.1:{port}"

    yield serve
    for server in servers:
        await server.stop(None)


@pytest.mark.parametrize("streams", [False, True])
async def test_unavailable_is_retried_within_the_deadline_on_a_stream_as_on_a_unary_call(flaky, streams):
    servicer, target = await flaky(failures=2)
    async with AsyncClient(target, api_key="k", timeout=5.0, streams=streams) as client:
        assert (await client.infer("spam", ["hi"])).model == "spam"
    assert servicer.calls == 3
    servicer, target = await flaky(failures=5)
    async with AsyncClient(target, api_key="k", timeout=5.0, streams=streams) as client:
        with pytest.raises(AcademusError) as refused:
            await client.infer("spam", ["hi"])
    assert refused.value.code == "UNAVAILABLE" and servicer.calls == 3


@pytest.mark.parametrize("streams", [False, True])
async def test_a_servers_cancelled_is_retried_as_a_stopping_grpc_server_sends_it_for_calls_not_started(flaky, streams):
    servicer, target = await flaky(failures=2, code=grpc.StatusCode.CANCELLED)
    async with AsyncClient(target, api_key="k", timeout=5.0, streams=streams) as client:
        assert (await client.infer("spam", ["hi"])).model == "spam"
    assert servicer.calls == 3
    assert retry_wait(grpc.StatusCode.CANCELLED, 2, 5.0) is None   # three attempts in all, as for UNAVAILABLE


@pytest.mark.parametrize("streams", [False, True])
async def test_an_overload_with_a_pushback_is_retried_after_it_when_asked(flaky, streams):
    servicer, target = await flaky(failures=3, code=EXHAUSTED, pushback_ms=20)
    async with AsyncClient(target, api_key="k", timeout=5.0, streams=streams) as client:
        with pytest.raises(AcademusError) as refused:   # off by default
            await client.infer("spam", ["hi"])
    assert refused.value.code == "RESOURCE_EXHAUSTED" and servicer.calls == 1
    async with AsyncClient(target, api_key="k", timeout=5.0, streams=streams, retry_overload=True) as client:
        assert (await client.infer("spam", ["hi"])).model == "spam"   # refused twice more, then answered
        assert [m.name for m in await client.list_models()] == ["spam"]
    assert servicer.calls == 5


@pytest.mark.parametrize("pushback_ms", [None, 60_000])
async def test_an_overload_without_a_pushback_or_past_the_deadline_is_refused_at_once(flaky, pushback_ms):
    """Not DEADLINE_EXCEEDED after sitting out the deadline, as the channel's own retry policy would answer."""
    servicer, target = await flaky(failures=5, code=EXHAUSTED, pushback_ms=pushback_ms)
    async with AsyncClient(target, api_key="k", timeout=5.0, retry_overload=True) as client:
        with pytest.raises(AcademusError) as refused:
            await client.infer("spam", ["hi"])
    assert refused.value.code == "RESOURCE_EXHAUSTED" and servicer.calls == 1


async def test_the_blocking_client_retries_an_overload_when_asked(flaky):
    servicer, target = await flaky(failures=2, code=EXHAUSTED, pushback_ms=20)

    def calls() -> tuple[str, list[str]]:   # in a thread: the server runs on this test's loop
        with Client(target, api_key="k", timeout=5.0, retry_overload=True) as client:
            return client.infer("spam", ["hi"]).model, [m.labels for m in client.list_models()]

    assert await asyncio.to_thread(calls) == ("spam", [["ham", "spam"]])
    assert servicer.calls == 4
    servicer, target = await flaky(failures=1, code=EXHAUSTED, pushback_ms=20)
    with Client(target, api_key="k", timeout=5.0) as client, pytest.raises(AcademusError) as refused:
        await asyncio.to_thread(client.infer, "spam", ["hi"])
    assert refused.value.code == "RESOURCE_EXHAUSTED" and servicer.calls == 1


async def test_a_served_client_rides_out_a_gateway_restart_and_a_new_one_fails_at_once():
    """A supervised gateway is back on its port a second or two after it died: a client it has answered waits
    for it within the deadline (the next call succeeds), where one that never reached it is told at once."""
    servicer = Flaky(failures=0)

    async def start(port: int = 0) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, bound

    server, port = await start()
    target = f"127.0.0.1:{port}"
    async with AsyncClient(target, api_key="k", timeout=10.0) as client:
        def blocking() -> str:
            with Client(target, api_key="k", timeout=10.0) as sync_client:
                sync_client.infer("spam", ["hi"])
                restart.wait()                                   # the server is down now
                return sync_client.infer("spam", ["again"]).model

        restart = threading.Event()
        sync_answer = asyncio.create_task(asyncio.to_thread(blocking))
        assert (await client.infer("spam", ["hi"])).model == "spam"
        while servicer.calls < 2:
            await asyncio.sleep(0.01)
        await server.stop(None)
        restart.set()
        answer = asyncio.create_task(client.infer("spam", ["again"]))
        await asyncio.sleep(0.5)                                  # down for half a second, as a restart is
        assert not answer.done()
        server, _ = await start(port)
        assert (await answer).model == "spam" and await sync_answer == "spam"
    await server.stop(None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"   # nothing listens there
    async with AsyncClient(closed, api_key="k", timeout=10.0) as fresh:
        with pytest.raises(AcademusError) as refused:
            await fresh.infer("spam", ["hi"])
    assert refused.value.code == "UNAVAILABLE"
