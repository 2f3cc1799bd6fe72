"""Tenant models on the real request path (HMI): in-process gateway, scheduler, worker, resource
manager and adapter store over loopback gRPC, a real Redis and the real teacher. Tenants' texts share
batches on one base model; each row gets its own adapter and head, fetched from the store by the
worker; a tenant never reaches another's model; quotas answer RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest
import torch

from academus.client import AcademusError, AsyncClient
from academus.shared.models.adapters import encode_with_adapters
from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantModel, TenantRegistry
from academus.shared.training.onboarding import AdapterStoreClient
from tests.conftest import NO_WAIT_BOUND, env
from tests.unit.test_worker_adapters import trained_like

pytestmark = pytest.mark.integration
PREFIX = "tenants"
TEXTS = ["a warm, funny and wholly unexpected film", "a dull mess", "the plot never quite lands"]
LABELS = {"acme": ["neg", "pos"], "globex": ["billing", "tech", "other"]}


async def start(redis_url: str, tmp_path, **settings: str) -> list[RunningService]:
    from academus.services.adapter_store.server import build as adapter_store
    from academus.services.gateway.server import build as gateway
    from academus.services.resource_manager.server import build as resource_manager
    from academus.services.scheduler.server import build as scheduler
    from academus.services.worker.server import build as worker

    common = {"ACADEMUS_REDIS_URL": redis_url, "ACADEMUS_KEY_PREFIX": PREFIX, "ACADEMUS_PORT": "0",
              "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ARTIFACTS": str(artifacts_dir()),
              "ACADEMUS_ADAPTER_DIR": str(tmp_path / "adapters"), "ACADEMUS_WORKER_ID": "tenants-worker",
              "ACADEMUS_MODELS": "minilm", "ACADEMUS_GRACE_S": "5", "ACADEMUS_POLICY": "padded",
              "ACADEMUS_MAX_BATCH": "16", "ACADEMUS_MAX_DELAY_MS": "100", **NO_WAIT_BOUND, **settings}
    running = []
    with env(**common):
        for build in (resource_manager, adapter_store, worker, scheduler, gateway):
            running.append(RunningService(await build()))
            await running[-1].start()
    return running


@pytest.fixture(scope="module")
async def mesh(redis_server, tmp_path_factory):
    running = await start(redis_server.url, tmp_path_factory.mktemp("tenants"))
    redis = connect(redis_server.url)
    keys, registry = Keys(PREFIX), TenantRegistry(connect(redis_server.url), Keys(PREFIX))
    store = AdapterStoreClient(redis, keys)
    tenants = {}
    for seed, (tenant, labels) in enumerate(LABELS.items()):
        adapter = trained_like(seed + 10, labels)
        key = await registry.create_tenant(tenant, rate=1000, burst=1000)
        version = await store.put(tenant, "support", adapter.to_bytes(), {"base": "minilm"})
        await registry.register_model(tenant, TenantModel("support", "minilm", "support", version, labels))
        tenants[tenant] = (key, adapter)
    yield running[-1].address, tenants, registry
    await redis.aclose()
    for service in reversed(running):
        await service.stop()


def expected(adapters) -> np.ndarray:
    encoded = TeacherTokenizer(teacher_dir()).encode(TEXTS[: len(adapters)])
    ids, mask, types = pad_batch([e.input_ids for e in encoded])
    with torch.inference_mode():
        _, probs = encode_with_adapters(TeacherEncoder.load(), ids, mask, types, adapters)
    return probs.numpy()


async def test_each_tenant_gets_its_own_adapter_and_labels_in_shared_batches(mesh):
    gateway, tenants, _ = mesh
    clients = {t: AsyncClient(gateway, api_key=key) for t, (key, _) in tenants.items()}
    try:
        answers = await asyncio.gather(*(clients[t].infer("support", TEXTS) for t in tenants for _ in range(3)))
    finally:
        for client in clients.values():
            await client.close()
    for i, tenant in enumerate(t for t in tenants for _ in range(3)):
        adapter, labels = tenants[tenant][1], LABELS[tenant]
        served = np.array([[p.probs[label] for label in labels] for p in answers[i].predictions])
        assert served.shape == (3, len(labels)) and answers[i].model == "support"
        assert np.abs(served - expected([adapter] * 3)).max() < 1e-4
        assert [p.label for p in answers[i].predictions] == [labels[int(r.argmax())] for r in served]
    assert max(a.metadata.batch_size for a in answers) > 3   # texts of several requests shared a batch


async def test_another_tenants_model_is_not_found_exactly_like_an_unknown_one(mesh):
    gateway, _, registry = mesh
    await registry.create_tenant("initech", rate=1000, burst=1000)  # a tenant with no models
    outsider = await registry.create_tenant("umbrella", rate=1000, burst=1000)
    async with AsyncClient(gateway, api_key=outsider) as client:
        with pytest.raises(AcademusError) as theirs:
            await client.infer("support", TEXTS[:1])       # acme's and globex's model name
        with pytest.raises(AcademusError) as unknown:
            await client.infer("no-such-model", TEXTS[:1])
    assert theirs.value.status == grpc.StatusCode.NOT_FOUND
    assert str(theirs.value).replace("support", "X") == str(unknown.value).replace("no-such-model", "X")
    assert "acme" not in str(theirs.value) and "globex" not in str(theirs.value)


async def test_a_tenant_over_its_quota_is_refused_at_once_and_others_are_not(mesh):
    gateway, tenants, registry = mesh
    key = await registry.create_tenant("hooli", rate=0.01, burst=2)
    adapter = tenants["acme"][1]
    version = await AdapterStoreClient(registry.redis, registry.keys).put("hooli", "support", adapter.to_bytes(), {})
    await registry.register_model("hooli", TenantModel("support", "minilm", "support", version, LABELS["acme"]))
    async with AsyncClient(gateway, api_key=key) as client, \
            AsyncClient(gateway, api_key=tenants["globex"][0]) as other:
        for _ in range(2):
            await client.infer("support", TEXTS[:1])
        with pytest.raises(AcademusError) as over:
            await client.infer("support", TEXTS[:1])
        assert (await other.infer("support", TEXTS[:1])).predictions  # globex is not slowed or refused
    assert over.value.status == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in str(over.value)


async def test_a_tenant_model_whose_adapter_is_gone_fails_not_found_and_plain_requests_still_serve(mesh):
    gateway, _, registry = mesh
    key = await registry.create_tenant("vandelay", rate=1000, burst=1000)
    await registry.register_model("vandelay", TenantModel("support", "minilm", "support", 7, ["a", "b"]))
    async with AsyncClient(gateway, api_key=key) as client:
        with pytest.raises(AcademusError) as gone:
            await client.infer("support", TEXTS[:1])
        plain = await client.infer("minilm", TEXTS[:1])
    assert gone.value.status == grpc.StatusCode.NOT_FOUND
    assert len(plain.predictions[0].embedding) == 384


async def test_a_registered_adapter_is_in_host_memory_before_its_first_request(redis_server, tmp_path):
    """The worker's warmer loads a new tenant model into host memory (HMI §6.2): its first request is
    answered even with the adapter store gone, equal to applying the adapter directly."""
    settings = {"ACADEMUS_KEY_PREFIX": "warm", "ACADEMUS_WORKER_ID": "warm-worker", "ACADEMUS_ADAPTER_WARM_S": "0.2"}
    running = await start(redis_server.url, tmp_path, **settings)
    redis, keys = connect(redis_server.url), Keys("warm")
    try:
        registry, adapter = TenantRegistry(redis, keys), trained_like(30, LABELS["acme"])
        key = await registry.create_tenant("acme", rate=1000, burst=1000)
        version = await AdapterStoreClient(redis, keys).put("acme", "support", adapter.to_bytes(), {})
        await registry.register_model("acme", TenantModel("support", "minilm", "support", version, LABELS["acme"]))
        for _ in range(100):  # the worker's heartbeat publishes its host tier's figures
            cache = await redis.hget(keys.worker("warm-worker"), "adapter_cache")
            if cache and json.loads(cache).get("host_adapters") == 1:
                break
            await asyncio.sleep(0.1)
        await running.pop(1).stop()                                    # the adapter store is gone
        async with AsyncClient(running[-1].address, api_key=key) as client:
            answer = await client.infer("support", TEXTS)
        served = np.array([[p.probs[label] for label in LABELS["acme"]] for p in answer.predictions])
        assert np.abs(served - expected([adapter] * 3)).max() < 1e-4
        stats = json.loads(await redis.hget(keys.worker("warm-worker"), "adapter_cache"))
        assert stats["host_warmed"] == 1 and stats["host_misses"] == 0
    finally:
        await redis.aclose()
        for service in reversed(running):
            await service.stop()
