"""The Manage API's AddModel and RemoveModel over loopback gRPC: the real builds of the gateway, the trainer and
the request path in process, a real Redis, a catalogue of the test's own. The admin adds a user's model from a
directory, the job succeeds, the worker follows the catalogue and the model answers Infer; a refused directory
fails its job naming the file; a tenant key is refused; RemoveModel unserves the model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import CHANNEL_OPTIONS
from academus.shared.state.catalogue import read_catalogue, write_entry
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantRegistry
from academus.v1 import inference_pb2, inference_pb2_grpc, manage_pb2, manage_pb2_grpc
from tests.integration.test_manage_service import auth, start_services, wait_job
from tests.models import tiny_model_dir

pytestmark = pytest.mark.integration
PREFIX = "manage-models"


@pytest.fixture(scope="module")
async def mesh(redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("manage-models")
    artifacts = tmp / "artifacts"
    write_entry(artifacts, "minilm", read_catalogue(artifacts_dir())["minilm"])
    settings = {"ACADEMUS_REDIS_URL": redis_server.url, "ACADEMUS_KEY_PREFIX": PREFIX, "ACADEMUS_PORT": "0",
                "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ARTIFACTS": str(artifacts), "ACADEMUS_GRACE_S": "5",
                "ACADEMUS_ADAPTER_DIR": str(tmp / "adapters"), "ACADEMUS_UPLOADS_DIR": str(tmp / "uploads"),
                "ACADEMUS_WORKER_ID": "manage-models-worker", "ACADEMUS_POLICY": "padded", "ACADEMUS_POLL_S": "0.1",
                "ACADEMUS_CATALOGUE_POLL_S": "0.2"}
    running = await start_services(settings)
    redis = connect(redis_server.url)
    admin = "acd_admin_for_manage_models_tests"
    await redis.hset(Keys(PREFIX).api_key(admin), mapping={"tenant": "admin", "role": "admin"})
    tenant = await TenantRegistry(redis, Keys(PREFIX)).create_tenant("acme")
    async with grpc.aio.insecure_channel(running[-1].address, options=CHANNEL_OPTIONS) as channel:
        yield (manage_pb2_grpc.ManageStub(channel), inference_pb2_grpc.InferenceStub(channel),
               {"admin": admin, "acme": tenant}, artifacts)
    await redis.aclose()
    for service in reversed(running):
        await service.stop()


async def served(inference, key: str, name: str, present: bool = True, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        listed = await inference.ListModels(inference_pb2.ListModelsRequest(), metadata=auth(key), timeout=5)
        if (name in {m.name for m in listed.models}) == present:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{name} {'not served' if present else 'still served'} after {timeout_s}s")


async def test_an_admin_adds_a_model_through_the_api_and_it_serves(mesh, tmp_path: Path) -> None:
    manage, inference, keys, artifacts = mesh
    tiny_model_dir("roberta", True, tmp_path / "clf")
    job = await manage.AddModel(manage_pb2.AddModelRequest(name="api-roberta", source=str(tmp_path / "clf")),
                                metadata=auth(keys["admin"]), timeout=10)
    assert (job.kind, job.target, job.status) == ("model", "api-roberta", manage_pb2.JOB_STATUS_QUEUED)
    done = await wait_job(manage, keys["admin"], job.id)
    assert done.status == manage_pb2.JOB_STATUS_SUCCEEDED, done.message
    assert read_catalogue(artifacts)["api-roberta"]["architecture"] == "RobertaForSequenceClassification"
    await served(inference, keys["acme"], "api-roberta")
    reply = await inference.Infer(inference_pb2.InferRequest(model="api-roberta", inputs=[
        inference_pb2.TextInput(text="a quiet triumph")]), metadata=auth(keys["acme"]), timeout=30)
    assert list(reply.labels) == ["neg", "neu", "pos"] and len(reply.predictions[0].probs) == 3

    removed = await wait_job(manage, keys["admin"], (await manage.RemoveModel(
        manage_pb2.RemoveModelRequest(name="api-roberta"), metadata=auth(keys["admin"]), timeout=10)).id)
    assert removed.status == manage_pb2.JOB_STATUS_SUCCEEDED, removed.message
    await served(inference, keys["acme"], "api-roberta", present=False)
    assert "api-roberta" not in read_catalogue(artifacts)


async def test_a_refused_directory_fails_its_job_naming_the_file(mesh, tmp_path: Path) -> None:
    manage, _, keys, artifacts = mesh
    tiny_model_dir("bert", False, tmp_path / "no-tokenizer")
    (tmp_path / "no-tokenizer" / "tokenizer.json").unlink()
    job = await manage.AddModel(manage_pb2.AddModelRequest(name="broken", source=str(tmp_path / "no-tokenizer")),
                                metadata=auth(keys["admin"]), timeout=10)
    done = await wait_job(manage, keys["admin"], job.id)
    assert done.status == manage_pb2.JOB_STATUS_FAILED
    assert f"{tmp_path / 'no-tokenizer'} has no tokenizer" in done.message
    assert "broken" not in read_catalogue(artifacts) and not (artifacts / "models" / "broken").exists()
    bundled = await wait_job(manage, keys["admin"], (await manage.RemoveModel(
        manage_pb2.RemoveModelRequest(name="minilm"), metadata=auth(keys["admin"]), timeout=10)).id)
    assert bundled.status == manage_pb2.JOB_STATUS_FAILED and "not removed here" in bundled.message


@pytest.mark.parametrize("request_, key, code, says", [
    (manage_pb2.AddModelRequest(name="x", source="/models/x"), "acme", grpc.StatusCode.PERMISSION_DENIED, "admin"),
    (manage_pb2.AddModelRequest(name="Bad Name", source="/m"), "admin", grpc.StatusCode.INVALID_ARGUMENT, "name="),
    (manage_pb2.AddModelRequest(name="x", source="models/x"), "admin", grpc.StatusCode.INVALID_ARGUMENT,
     "source='models/x' must be an absolute path"),
    (manage_pb2.AddModelRequest(name="x", source="/m", task="rank"), "admin", grpc.StatusCode.INVALID_ARGUMENT,
     "task='rank'"),
    (manage_pb2.AddModelRequest(name="x", source="/m", pooling="max"), "admin", grpc.StatusCode.INVALID_ARGUMENT,
     "pooling='max'"),
    (manage_pb2.RemoveModelRequest(name="x"), "acme", grpc.StatusCode.PERMISSION_DENIED, "admin"),
])
async def test_bad_model_requests_are_refused_at_the_edge(mesh, request_, key, code, says) -> None:
    manage, _, keys, _ = mesh
    call = manage.AddModel if isinstance(request_, manage_pb2.AddModelRequest) else manage.RemoveModel
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(request_, metadata=auth(keys[key]), timeout=10)
    assert refused.value.code() == code and says in refused.value.details()
