"""Every service's real build() on in-process grpc.aio servers (port 0) with a real Redis and the
real model: the request path and admission control without subprocesses."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from academus.client import AcademusError, AsyncClient
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService, ServiceSpec
from academus.shared.state.keys import Keys
from academus.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import NO_WAIT_BOUND, env

pytestmark = pytest.mark.integration
KEY = "integration-key"
LONG = ["a sentence that keeps the only worker busy for a good while " * 30] * 48



async def start_services(redis_url: str, prefix: str, second_scheduler: dict[str, str] | None = None,
                         **settings: str) -> list[RunningService]:
    """Resource manager, worker, scheduler (and a second scheduler with `second_scheduler`'s settings
    when given), gateway last; the gateway is the last service of the list."""
    from academus.services.gateway.server import build as gateway
    from academus.services.resource_manager.server import build as resource_manager
    from academus.services.scheduler.server import build as scheduler
    from academus.services.worker.server import build as worker

    async def second() -> ServiceSpec:
        with env(**second_scheduler):
            return await scheduler()

    redis = connect(redis_url)
    await redis.hset(Keys(prefix).api_key(KEY), mapping={"tenant": "it", "role": "tenant"})
    await redis.aclose()
    running = []
    common = {"ACADEMUS_REDIS_URL": redis_url, "ACADEMUS_KEY_PREFIX": prefix, "ACADEMUS_PORT": "0",
              "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ARTIFACTS": str(artifacts_dir()),
              "ACADEMUS_WORKER_ID": f"{prefix}-worker", "ACADEMUS_MODELS": "spam", "ACADEMUS_GRACE_S": "5",
              **NO_WAIT_BOUND, **settings}
    with env(**common):
        for build in (resource_manager, worker, scheduler, *([second] if second_scheduler else []), gateway):
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


@pytest.fixture(scope="module")
async def two_deployments(redis_server):
    """Two deployments of spam on one worker: fifo, and padded holding one request for 5 s (queue of 1)."""
    running = await start_services(redis_server.url, "it-two", {"ACADEMUS_POLICY": "padded",
                                   "ACADEMUS_MAX_DELAY_MS": "5000", "ACADEMUS_MAX_BATCH": "8"},
                                   ACADEMUS_QUEUE_CAPACITY="1")
    yield running[-1].address, redis_server.url
    for service in reversed(running):
        await service.stop()


async def test_a_full_deployment_passes_its_requests_to_another_and_costs_no_quota(two_deployments):
    from academus.shared.state.tenants import TenantRegistry

    address, redis_url = two_deployments
    redis = connect(redis_url)
    tenant_key = await TenantRegistry(redis, Keys("it-two")).create_tenant("one-token", rate=0.01, burst=1)
    async with AsyncClient(address, api_key=KEY, timeout=60) as client, \
            AsyncClient(address, api_key=tenant_key, timeout=60) as tenant:
        held = asyncio.create_task(client.infer("spam", ["waits 5 s for its batch"], policy="padded"))
        await asyncio.sleep(0.3)
        # The padded queue is full: a request sent there is refused and goes to the fifo deployment.
        spread = [await client.infer("spam", ["lunch at noon?"]) for _ in range(4)]
        assert {r.metadata.policy for r in spread} == {"fifo"}
        # Both full (fifo: one running, one waiting): refused, and the tenant's one token goes back.
        running = asyncio.create_task(client.infer("spam", LONG, policy="fifo"))
        await asyncio.sleep(0.3)
        queued = asyncio.create_task(client.infer("spam", ["waits in the fifo queue"], policy="fifo"))
        await asyncio.sleep(0.3)
        with pytest.raises(AcademusError, match=r"RESOURCE_EXHAUSTED.*(queue is full|full queue)"):
            await tenant.infer("spam", ["no room anywhere"])
        assert len((await running).predictions) == 48 and len((await queued).predictions) == 1
        assert (await tenant.infer("spam", ["the token given back pays for this"])).predictions
        with pytest.raises(AcademusError, match="over its rate limit"):
            await tenant.infer("spam", ["and this one has none"])
        assert (await held).metadata.policy == "padded"
    await redis.aclose()


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
