"""The Manage API end to end over loopback gRPC: the real builds of the gateway, the trainer, the adapter
store and the request path (resource manager, worker, scheduler) in process, a real Redis and the real
teacher. A tenant uploads ~200 labelled sentiment reviews, the trainer trains the adapter, the model turns
ready and answers Infer; an admin uploads a domain corpus and the trainer builds its PLOT overlay into a
small root table. Errors reach the wire with their status codes."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import pytest

from academus.shared.models.model import TeacherEncoder
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.plot.store import PlotStore
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import CHANNEL_OPTIONS, RunningService
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantRegistry
from academus.shared.training.data import load_task
from academus.shared.training.plot_build import BuildOptions, build
from academus.v1 import inference_pb2, inference_pb2_grpc, manage_pb2, manage_pb2_grpc
from tests.conftest import NO_WAIT_BOUND, env

pytestmark = pytest.mark.integration
PREFIX = "manage"
K = 2
ROOT_CORPUS = ["the court ruled on the contract", "the cat sat on the mat", "markets fell sharply today"]
DOMAIN_CORPUS = [f"the court ruled that clause {i} of the contract is void" for i in range(30)]


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    """A tiny K=2 root table (corpus unigrams only): overlays extend it."""
    out = tmp_path_factory.mktemp("plot") / "minilm-k2"
    build(ROOT_CORPUS, out, BuildOptions(lower_layers=K, unigrams="corpus"),
          layers=SplitBert(TeacherEncoder.load().body, K))
    return out


async def start_services(settings: dict[str, str]) -> list[RunningService]:
    """The request path, the adapter store, the trainer and the gateway (last), built and started in process."""
    from academus.services.adapter_store.server import build as adapter_store
    from academus.services.gateway.server import build as gateway
    from academus.services.resource_manager.server import build as resource_manager
    from academus.services.scheduler.server import build as scheduler
    from academus.services.trainer.server import build as trainer
    from academus.services.worker.server import build as worker

    running = []
    with env(**settings):
        for factory in (resource_manager, adapter_store, worker, scheduler, trainer, gateway):
            running.append(RunningService(await factory()))
            await running[-1].start()
    return running


@pytest.fixture(scope="module")
async def mesh(redis_server, tmp_path_factory, table):
    tmp = tmp_path_factory.mktemp("manage")
    settings = {"ACADEMUS_REDIS_URL": redis_server.url, "ACADEMUS_KEY_PREFIX": PREFIX, "ACADEMUS_PORT": "0",
                "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ARTIFACTS": str(artifacts_dir()), "ACADEMUS_GRACE_S": "5",
                "ACADEMUS_ADAPTER_DIR": str(tmp / "adapters"), "ACADEMUS_UPLOADS_DIR": str(tmp / "uploads"),
                "ACADEMUS_PLOT_DIR": str(table), "ACADEMUS_WORKER_ID": "manage-worker", "ACADEMUS_MODELS": "minilm",
                "ACADEMUS_POLICY": "padded", "ACADEMUS_ADAPTER_EPOCHS": "3", "ACADEMUS_POLL_S": "0.1",
                "ACADEMUS_MIN_CORPUS_LINES": "20", **NO_WAIT_BOUND}
    running = await start_services(settings)
    redis = connect(redis_server.url)
    admin = "acd_admin_for_manage_tests"
    await redis.hset(Keys(PREFIX).api_key(admin), mapping={"tenant": "admin", "role": "admin"})
    registry = TenantRegistry(redis, Keys(PREFIX))
    keys = {t: await registry.create_tenant(t) for t in ("acme", "globex")}
    async with grpc.aio.insecure_channel(running[-1].address, options=CHANNEL_OPTIONS) as channel:
        yield manage_pb2_grpc.ManageStub(channel), inference_pb2_grpc.InferenceStub(channel), keys | {"admin": admin}
    await redis.aclose()
    for service in reversed(running):
        await service.stop()


def auth(key: str) -> tuple[tuple[str, str]]:
    return (("x-api-key", key),)


def sentiment(n: int) -> bytes:
    task = load_task("sentiment")
    rows = [{"text": e.text, "label": task.labels[e.label]} for e in task.train[:n]]
    return "\n".join(json.dumps(r) for r in rows).encode()


async def wait_job(stub, key: str, job_id: str, timeout_s: float = 180.0) -> manage_pb2.Job:
    end, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < end:
        job = await stub.GetJob(manage_pb2.GetJobRequest(id=job_id), metadata=auth(key), timeout=5)
        seen.append(job.progress)
        if job.status in (manage_pb2.JOB_STATUS_SUCCEEDED, manage_pb2.JOB_STATUS_FAILED):
            assert seen == sorted(seen), f"progress went backwards: {seen}"
            return job
        await asyncio.sleep(0.2)
    raise AssertionError(f"job {job_id} not done after {timeout_s}s (progress {seen[-1]})")


async def test_a_tenant_trains_its_model_through_the_api_and_serves_it(mesh):
    manage, inference, keys = mesh
    job = await manage.CreateTenantModel(manage_pb2.CreateTenantModelRequest(
        name="reviews", base="minilm", data=sentiment(200)), metadata=auth(keys["acme"]), timeout=10)
    assert (job.kind, job.target, job.status) == ("adapter", "reviews", manage_pb2.JOB_STATUS_QUEUED)
    [listed] = (await manage.ListTenantModels(manage_pb2.ListTenantModelsRequest(), metadata=auth(keys["acme"]),
                                              timeout=5)).models
    assert listed.status in ("training", "ready") and listed.job_id == job.id

    done = await wait_job(manage, keys["acme"], job.id)
    assert done.status == manage_pb2.JOB_STATUS_SUCCEEDED, done.message
    result = json.loads(done.result_json)
    assert done.progress == pytest.approx(1.0) and result["version"] >= 1 and result["validation"]["accuracy"] > 0.5
    [model] = (await manage.ListTenantModels(manage_pb2.ListTenantModelsRequest(), metadata=auth(keys["acme"]),
                                             timeout=5)).models
    assert (model.status, model.version, sorted(model.labels)) == ("ready", result["version"], ["fresh", "rotten"])

    reply = await inference.Infer(inference_pb2.InferRequest(model="reviews", inputs=[
        inference_pb2.TextInput(text="a warm, funny and wholly delightful film")]),
        metadata=auth(keys["acme"]), timeout=30)
    assert reply.predictions[0].label in ("fresh", "rotten") and len(reply.predictions[0].probs) == 2

    # globex sees none of it: not the model, not the job, not a way to serve it.
    other = auth(keys["globex"])
    assert not (await manage.ListTenantModels(manage_pb2.ListTenantModelsRequest(), metadata=other, timeout=5)).models
    for call in (manage.GetJob(manage_pb2.GetJobRequest(id=job.id), metadata=other, timeout=5),
                 manage.DeleteTenantModel(manage_pb2.DeleteTenantModelRequest(name="reviews"), metadata=other,
                                          timeout=5),
                 inference.Infer(inference_pb2.InferRequest(model="reviews", inputs=[
                     inference_pb2.TextInput(text="hello")]), metadata=other, timeout=10)):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND

    await manage.DeleteTenantModel(manage_pb2.DeleteTenantModelRequest(name="reviews"), metadata=auth(keys["acme"]),
                                   timeout=10)
    assert not (await manage.ListTenantModels(manage_pb2.ListTenantModelsRequest(), metadata=auth(keys["acme"]),
                                              timeout=5)).models


async def test_an_admin_builds_a_domain_overlay_through_the_api(mesh, table):
    manage, _, keys = mesh
    request = manage_pb2.CreateDomainRequest(name="legal", corpus="\n".join(DOMAIN_CORPUS).encode(), top_percent=50)
    job = await manage.CreateDomain(request, metadata=auth(keys["admin"]), timeout=10)
    done = await wait_job(manage, keys["admin"], job.id)
    assert done.status == manage_pb2.JOB_STATUS_SUCCEEDED, done.message
    assert json.loads(done.result_json)["version"] == "legal"
    [domain] = (await manage.ListDomains(manage_pb2.ListDomainsRequest(), metadata=auth(keys["acme"]),
                                         timeout=5)).domains
    assert (domain.name, domain.status, domain.lines, domain.top_percent) == ("legal", "ready", 30, 50)
    assert "legal" in PlotStore.open(table, lower_layers=K).domains

    # A tenant model on the domain holds it: its adapter was trained on the overlay's states.
    model = manage_pb2.CreateTenantModelRequest(name="contracts", base="minilm-plot", domain="legal",
                                                data=sentiment(20))
    trained = await manage.CreateTenantModel(model, metadata=auth(keys["acme"]), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as held:
        await manage.DeleteDomain(manage_pb2.DeleteDomainRequest(name="legal"), metadata=auth(keys["admin"]),
                                  timeout=5)
    assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "used by 1 tenant model(s) (acme/contracts); delete them first" in held.value.details()
    await manage.DeleteTenantModel(manage_pb2.DeleteTenantModelRequest(name="contracts"),
                                   metadata=auth(keys["acme"]), timeout=10)
    await wait_job(manage, keys["acme"], trained.id)   # the trainer is done with it, whichever way

    await manage.DeleteDomain(manage_pb2.DeleteDomainRequest(name="legal"), metadata=auth(keys["admin"]), timeout=5)
    assert not (table / "domains" / "legal").exists()


@pytest.mark.parametrize(("call", "who", "code", "message"), [
    ("CreateDomain", "acme", grpc.StatusCode.PERMISSION_DENIED, "only the admin key"),
    ("CreateTenantModel", "admin", grpc.StatusCode.PERMISSION_DENIED, "tenant's API key"),
    ("CreateTenantModel", "nobody", grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
    ("BadUtf8", "acme", grpc.StatusCode.INVALID_ARGUMENT, "data:2: not valid UTF-8"),
    ("UnknownBase", "acme", grpc.StatusCode.INVALID_ARGUMENT, "base='bert-large' is not a base"),
    ("GetJob", "acme", grpc.StatusCode.NOT_FOUND, "job 'missing' not found"),
])
async def test_errors_reach_the_wire_with_their_codes(mesh, call, who, code, message):
    manage, _, keys = mesh
    good = sentiment(20)
    requests = {
        "CreateDomain": (manage.CreateDomain, manage_pb2.CreateDomainRequest(name="d", corpus=b"x\n" * 30)),
        "CreateTenantModel": (manage.CreateTenantModel, manage_pb2.CreateTenantModelRequest(
            name="m", base="minilm", data=good)),
        "BadUtf8": (manage.CreateTenantModel, manage_pb2.CreateTenantModelRequest(
            name="m", base="minilm", data=good.split(b"\n")[0] + b"\n\xff\xfe" + good)),
        "UnknownBase": (manage.CreateTenantModel, manage_pb2.CreateTenantModelRequest(
            name="m", base="bert-large", data=good)),
        "GetJob": (manage.GetJob, manage_pb2.GetJobRequest(id="missing")),
    }
    method, request = requests[call]
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await method(request, metadata=auth(keys.get(who, "acd_nobody_x")), timeout=10)
    assert raised.value.code() == code and message in raised.value.details()

