"""A call the gateway sends again (its scheduler answered UNAVAILABLE after releasing early answers) runs its texts
anew: the client still gets one early result a text, the first released, then the final one. The real gateway
(build()) on a grpc.aio server with a real Redis, and two schedulers on real gRPC servers over loopback whose
Schedule replies are scripted: the first call releases text 0 then fails as a scheduler that is gone; the call sent
again releases texts 0 and 1 at another layer, then answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from academus.client import AsyncClient
from academus.shared.models.work_wire import matrix_to_pb
from academus.shared.runtime.multiplex import serve_multiplexed
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService
from academus.shared.state.catalogue import CLASSIFICATION, ModelSpec
from academus.shared.state.keys import Keys
from academus.v1 import scheduler_pb2_grpc, tensors_pb2
from tests.conftest import env

pytestmark = pytest.mark.integration
PREFIX, KEY, MODEL = "resent", "resent-key", "spam"
LABELS = ["ham", "spam"]
FIRST_LAYER, AGAIN_LAYER = 2, 4   # the layers that release text 0 on the first call, and texts 0 and 1 on the second


def output(rows: list[int], probs: list[list[float]], layer: int = 0) -> tensors_pb2.ModelOutput:
    return tensors_pb2.ModelOutput(rows=rows, exit_layer=layer, labels=LABELS,
                                   values=matrix_to_pb(np.array(probs, np.float32)))


class ScriptedSchedulers(scheduler_pb2_grpc.SchedulerServicer):
    """Both schedulers' Schedule, by the order of the calls they take between them: the first releases text 0, then
    fails UNAVAILABLE (nothing to answer with); the next releases texts 0 and 1 at another layer, then answers."""

    def __init__(self) -> None:
        self.calls = 0

    async def Schedule(self, request, context):
        self.calls += 1
        texts = len(request.tokens.lengths)
        if self.calls % 2 == 1:
            context.send_partial(output([0], [[0.9, 0.1]], FIRST_LAYER))
            await asyncio.sleep(0.05)   # the early answer leaves first, as a scheduler's would before it died
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: the scheduler is gone")
        context.send_partial(output([0, 1], [[0.2, 0.8], [0.3, 0.7]], AGAIN_LAYER))
        return output([], [[0.1, 0.9]] * texts)


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[tuple[str, ScriptedSchedulers]]:
    scripted, servers = ScriptedSchedulers(), []
    redis, keys = connect(redis_url), Keys(PREFIX)
    await redis.hset(keys.api_key(KEY), mapping={"tenant": "resent", "role": "tenant"})
    await redis.hset(keys.models(), MODEL, ModelSpec(MODEL, CLASSIFICATION, LABELS).to_json())
    for k in range(2):
        server = grpc.aio.server()
        serve_multiplexed(server, lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(scripted, s))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        await redis.sadd(keys.schedulers(), f"scripted.{k}")
        await redis.hset(keys.scheduler(f"scripted.{k}"), mapping={"address": f"127.0.0.1:{port}",
                                                                    "policy": "padded", "models": MODEL})
    from academus.services.gateway.server import build

    with env(ACADEMUS_REDIS_URL=redis_url, ACADEMUS_KEY_PREFIX=PREFIX, ACADEMUS_PORT="0",
             ACADEMUS_METRICS_PORT="-1", ACADEMUS_SCHEDULER_HANG_S="0"):
        service = RunningService(await build())
        await service.start()
    yield service.address, scripted
    await service.stop()
    for server in servers:
        await server.stop(None)
    await redis.aclose()


async def test_a_stream_sent_again_releases_each_text_once_the_first_release_kept(gateway) -> None:
    address, scripted = gateway
    async with AsyncClient(address, api_key=KEY, timeout=10.0) as client:
        events = [e async for e in client.infer_stream(MODEL, ["first mail", "second mail"])]
    assert scripted.calls == 2   # sent again after the first scheduler's UNAVAILABLE
    early = [(p.input_index, p.exit_layer, p.label) for e in events for p in e.predictions if not p.final]
    assert early == [(0, FIRST_LAYER, "ham"), (1, AGAIN_LAYER, "spam")]
    assert [(p.input_index, p.final) for p in events[-1].predictions] == [(0, True), (1, True)]


async def test_a_unary_early_exit_sent_again_answers_each_text_with_its_first_release(gateway) -> None:
    address, scripted = gateway
    async with AsyncClient(address, api_key=KEY, timeout=10.0) as client:
        response = await client.infer(MODEL, ["first mail", "second mail"], early_exit=True)
    assert scripted.calls == 2
    assert [(p.input_index, p.exit_layer, p.label) for p in response.predictions] == [
        (0, FIRST_LAYER, "ham"), (1, AGAIN_LAYER, "spam")]
