"""Every service's real build() on in-process grpc.aio servers (port 0) with a real Redis and the
real model: the request path and admission control without subprocesses."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from academus.client import AcademusError, AsyncClient
from academus.shared.config import artifacts_dir
from academus.shared.keys import Keys
from academus.shared.redis_conn import connect
from academus.shared.serving import RunningService
from academus.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import env

pytestmark = pytest.mark.integration
KEY = "integration-key"
LONG = ["a sentence that keeps the only worker busy for a good while " * 30] * 48



async def start_services(redis_url: str, prefix: str, **settings: str) -> list[RunningService]:
    from academus.services.gateway.server import build as gateway
    from academus.services.resource_manager.server import build as resource_manager
    from academus.services.scheduler.server import build as scheduler
    from academus.services.worker.server import build as worker

    redis = connect(redis_url)
    await redis.hset(Keys(prefix).api_key(KEY), mapping={"tenant": "it", "role": "tenant"})
    await redis.aclose()
    running = []
    common = {"ACADEMUS_REDIS_URL": redis_url, "ACADEMUS_KEY_PREFIX": prefix, "ACADEMUS_PORT": "0",
              "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ARTIFACTS": str(artifacts_dir()),
              "ACADEMUS_WORKER_ID": f"{prefix}-worker", "ACADEMUS_MODELS": "spam", "ACADEMUS_GRACE_S": "5",
              **settings}
    with env(**common):
        for build in (resource_manager, worker, scheduler, gateway):
            service = RunningService(await build())
            await service.start()
            running.append(service)
    return running


@pytest.fixture(scope="module")
async def mesh(redis_server):
    running = await start_services(redis_server.url, "it-fifo", ACADEMUS_QUEUE_CAPACITY="1")
    yield running[-1].address
    for service in reversed(running):
        await service.stop()


@pytest.fixture(scope="module")
async def padded_mesh(redis_server):
    running = await start_services(redis_server.url, "it-padded", ACADEMUS_POLICY="padded",
                                   ACADEMUS_MAX_BATCH="8", ACADEMUS_MAX_DELAY_MS="200")
    yield running[-1].address
    for service in reversed(running):
        await service.stop()


async def test_request_path_in_process(mesh):
    async with AsyncClient(mesh, api_key=KEY) as client:
        result = await client.infer("spam", ["WIN a FREE iPhone, click now!!!", "lunch at noon?"])
    assert [p.label for p in result.predictions] == ["spam", "ham"]
    assert result.metadata.worker_id == "it-fifo-worker" and result.metadata.attempts == 1


async def test_full_queue_is_refused_at_once_with_pushback(mesh):
    async with AsyncClient(mesh, api_key=KEY, timeout=60) as client:
        running = asyncio.create_task(client.infer("spam", LONG))
        await asyncio.sleep(0.3)
        queued = asyncio.create_task(client.infer("spam", ["waits in the one queue slot"]))
        await asyncio.sleep(0.3)
        async with grpc.aio.insecure_channel(mesh) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Infer(
                inference_pb2.InferRequest(model="spam", inputs=[inference_pb2.TextInput(text="one too many")]),
                timeout=5, metadata=(("x-api-key", KEY),))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            trailing = dict(await call.trailing_metadata())
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in info.value.details() and int(trailing["grpc-retry-pushback-ms"]) > 0
        assert len((await running).predictions) == 48 and len((await queued).predictions) == 1


async def test_wrong_key_in_process(mesh):
    async with AsyncClient(mesh, api_key="nope") as client:
        with pytest.raises(AcademusError, match="UNAUTHENTICATED"):
            await client.infer("spam", ["hi"])


async def test_padded_policy_merges_concurrent_requests_and_splits_answers(padded_mesh):
    texts = ["URGENT: claim your FREE prize money now!!!", "Are we still on for lunch tomorrow?"] * 3
    async with AsyncClient(padded_mesh, api_key=KEY) as client:
        results = await asyncio.gather(*(client.infer("spam", [t]) for t in texts))
    assert [r.predictions[0].label for r in results] == ["spam", "ham"] * 3
    assert {r.metadata.policy for r in results} == {"padded"}
    assert max(r.metadata.batch_size for r in results) > 1  # merged into one worker call
    alone = await AsyncClient(padded_mesh, api_key=KEY).infer("spam", [texts[0]])
    assert alone.predictions[0].probs == pytest.approx(results[0].predictions[0].probs, abs=1e-4)
