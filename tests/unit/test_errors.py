"""The error contract over real gRPC on loopback: a ServingError's code, pushback hint and `nothing_ran`
reach the caller through `abort_with`, and `from_rpc_error` rebuilds the same error on the other side."""

from __future__ import annotations

import grpc
import pytest

from academus.shared.runtime.errors import (
    DeadlineExceeded,
    ResourceExhausted,
    ServingError,
    Unavailable,
    Unreachable,
    abort_with,
    from_rpc_error,
)
from academus.v1 import tensors_pb2, worker_pb2, worker_pb2_grpc


class Refuses(worker_pb2_grpc.WorkerServicer):
    def __init__(self, error: ServingError) -> None:
        self.error = error

    async def Run(self, request, context):
        await abort_with(context, self.error)


@pytest.mark.parametrize("sent", [
    DeadlineExceeded("the deadline cannot be met: about 900 ms of queued work ahead", nothing_ran=True),
    DeadlineExceeded("deadline passed before layer 3"),
    ResourceExhausted("scheduler queue is full (1 requests waiting)", pushback_ms=50),
    Unavailable("no live worker serves model 'm'"),   # a live handler's answer: not Unreachable
])
async def test_an_error_crosses_a_hop_whole(sent):
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(Refuses(sent), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = worker_pb2.RunRequest(model="m", tokens=tensors_pb2.TokenBatch(input_ids=[1], lengths=[1]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await worker_pb2_grpc.WorkerStub(channel).Run(request, timeout=5)
    finally:
        await server.stop(None)
    got = from_rpc_error(info.value, "worker")
    assert type(got) is type(sent) and got.message == sent.message
    assert (got.pushback_ms, got.nothing_ran) == (sent.pushback_ms, sent.nothing_ran)


async def test_a_peer_that_cannot_be_reached_is_unreachable_not_a_handlers_unavailable():
    """A restarting peer refuses connections: UNAVAILABLE no handler chose, which a caller may wait out."""
    from academus.shared.cli.redis_server import free_port

    async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:   # nothing listens there
        request = worker_pb2.RunRequest(model="m", tokens=tensors_pb2.TokenBatch(input_ids=[1], lengths=[1]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await worker_pb2_grpc.WorkerStub(channel).Run(request, timeout=5)
    assert type(from_rpc_error(info.value, "worker")) is Unreachable
