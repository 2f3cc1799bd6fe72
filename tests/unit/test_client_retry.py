"""The SDK retries UNAVAILABLE (nothing ran) within the deadline, on a multiplexed stream as the channel's
retry policy does for a unary call, over real gRPC on loopback."""

from __future__ import annotations

import grpc
import pytest

from academus.client import AcademusError, AsyncClient
from academus.client.types import retry_wait
from academus.shared.runtime.multiplex import serve_multiplexed
from academus.v1 import inference_pb2 as pb
from academus.v1 import inference_pb2_grpc

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def test_the_retry_wait_follows_the_channels_policy():
    widest = lambda low, high: high   # noqa: E731 - the backoff's bound, not a random draw
    assert retry_wait(UNAVAILABLE, 0, 5.0, draw=widest) == pytest.approx(0.05)
    assert retry_wait(UNAVAILABLE, 1, 5.0, draw=widest) == pytest.approx(0.1)
    assert retry_wait(UNAVAILABLE, 2, 5.0, draw=widest) is None           # three attempts in all
    assert retry_wait(grpc.StatusCode.RESOURCE_EXHAUSTED, 0, 5.0) is None   # only what says nothing ran
    assert retry_wait(UNAVAILABLE, 0, 5.0, pushback_ms=30) == pytest.approx(0.03)
    assert retry_wait(UNAVAILABLE, 0, 5.0, pushback_ms=-1) is None         # the server says: do not retry
    assert retry_wait(UNAVAILABLE, 0, 0.02, pushback_ms=30) is None        # past the deadline


class Flaky(inference_pb2_grpc.InferenceServicer):
    """UNAVAILABLE for the first `failures` calls, then an answer."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    async def Infer(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            await context.abort(UNAVAILABLE, "the scheduler is gone; nothing ran")
        return pb.InferResponse(model=request.model)


@pytest.fixture
async def flaky():
    servers: list[grpc.aio.Server] = []

    async def serve(failures: int) -> tuple[Flaky, str]:
        servicer = Flaky(failures)
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
