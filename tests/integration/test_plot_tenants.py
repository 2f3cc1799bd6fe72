"""Tenant adapters on HMI's hierarchical base `minilm-plot` (§3.2.2, §5.2): PLOT lookups stand in for the
lower layers, each tenant's adapter runs in the shared upper layers, and a tenant model's domain overlay
is searched before the root. A real table the teacher builds from real reviews, the real training code,
the worker's runner, and the whole path over loopback gRPC with a real Redis and adapter store."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import numpy as np
import pytest
import torch

from academus.client import AcademusError, AsyncClient
from academus.services.worker.adapters import TenantBatch
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models.adapters import BatchedAdapters, install_adapters
from academus.shared.models.plot import PlotStore
from academus.shared.models.plot.hierarchical import padded_lookup
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.errors import InvalidArgument
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantModel, TenantRegistry
from academus.shared.training.adapters import plot_lower_states, train_adapter, upper_pooled
from academus.shared.training.data import load_task
from academus.shared.training.onboarding import AdapterStoreClient, create_tenant_model
from academus.shared.training.plot_build import BuildOptions, build
from academus.shared.training.plot_models import register_embedding
from academus.shared.training.prepare import subsample
from tests.conftest import all_cores, env, torch_threads, write_reviews
from tests.integration.test_tenant_serving import start

pytestmark = pytest.mark.integration
K = 3
PREFIX = "plot-tenants"


@pytest.fixture(scope="module")
def reviews() -> dict[str, list]:
    """Rotten Tomatoes snippets: the tenants' labelled data, and a held-out set for the domain overlay."""
    task = load_task("sentiment")
    train = subsample(task.train, 400)
    return {"texts": [e.text for e in train], "labels": [task.labels[e.label] for e in train],
            "domain": [e.text for e in subsample(task.validation, 60)]}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, teacher, reviews):
    """The prepared catalogue plus a K=3 table of the training reviews (root) and an overlay `critics` of
    other reviews, registered as minilm-plot by the real command's code."""
    root = tmp_path_factory.mktemp("plot-tenant-artifacts")
    shutil.copy(artifacts_dir() / "models.json", root / "models.json")
    shutil.copytree(artifacts_dir() / "heads", root / "heads")
    table = root / "plot" / "minilm-k3"
    layers = SplitBert(teacher.body, K)
    with torch_threads(all_cores()):     # nothing else runs yet
        build(reviews["texts"], table, BuildOptions(lower_layers=K, unigrams="corpus"), layers=layers)
        build(reviews["domain"], table, BuildOptions(lower_layers=K, domain="critics", top_percent=100),
              layers=layers)
    assert register_embedding(root, table) == "minilm-plot"
    return root


@pytest.fixture(scope="module")
def store(artifacts) -> PlotStore:
    return PlotStore.open(artifacts / "plot" / "minilm-k3", lower_layers=K)


@pytest.fixture(scope="module")
def trained(teacher, store, reviews):
    with torch_threads(all_cores()):
        return train_adapter(reviews["texts"], reviews["labels"], base="minilm-plot", epochs=5,
                             validation_fraction=0.3, encoder=teacher, plot_store=store, progress=False)


def encode(texts: list[str]) -> list:
    return TeacherTokenizer(teacher_dir()).encode(texts, truncate=True)


def training_path_probs(teacher, store, adapter, texts: list[str], domains: list[str]) -> torch.Tensor:
    """What training computes: looked-up states (row by row, each in its domain), the upper layers with
    the adapter hooked in, the tenant's head."""
    rows = []
    for text, domain in zip(texts, domains, strict=True):
        states = plot_lower_states(store, teacher.body, encode([text]), K, domain)
        stack = BatchedAdapters([adapter], batched=False)
        with torch.no_grad(), install_adapters(teacher.body).active(stack):
            rows.append(stack.probabilities(upper_pooled(teacher.body, states, K)))
    return torch.cat(rows)


def test_an_adapter_trains_on_plot_lookups_and_beats_the_untrained_one(trained):
    adapter, summary = trained
    before, after = summary["untrained_validation"], summary["validation"]
    assert (summary["base"], adapter.base, summary["counts"]) == ("minilm-plot", "minilm-plot",
                                                                   {"train": 280, "validation": 120})
    assert after["accuracy"] >= before["accuracy"] + 0.05 and after["f1"] >= before["f1"] + 0.1, summary


def test_the_worker_serves_exactly_what_was_trained_each_row_in_its_domain(artifacts, teacher, store, trained,
                                                                           reviews):
    adapter, _ = trained
    runner = ModelRunner(artifacts, ["minilm-plot"])
    texts = [reviews["domain"][0], reviews["texts"][0], reviews["domain"][1], "an utterly new zebra sentence"]
    domains = ["critics", "", "", "critics"]
    seqs = [e.input_ids for e in encode(texts)]
    batch = TenantBatch([adapter] * 4, [], domains=tuple(domains))
    served = runner.run(Batch("minilm-plot", OUTPUT_PROBS, [t for s in seqs for t in s], [len(s) for s in seqs]),
                        tenants=batch).values
    expected = training_path_probs(teacher, store, adapter, texts, domains)
    assert np.abs(served - expected.numpy()).max() < 1e-5
    # the overlay matters: the same critics' text looked up in the root alone backs off and answers otherwise
    root_only = training_path_probs(teacher, store, adapter, texts[:1], [""])
    assert np.abs(served[0] - root_only.numpy()[0]).max() > 1e-4
    with pytest.raises(InvalidArgument, match="no PLOT overlay for domain 'nope'"):
        runner.run(Batch("minilm-plot", OUTPUT_PROBS, seqs[0], [len(seqs[0])]),
                   tenants=TenantBatch([adapter], [], domains=("nope",)))


def test_an_overlay_built_after_the_store_opened_is_loaded_on_first_use(artifacts, teacher, reviews):
    table = artifacts / "plot" / "minilm-k3"
    opened = PlotStore.open(table, lower_layers=K)
    texts = reviews["domain"][10:20]
    build(texts, table, BuildOptions(lower_layers=K, domain="late", top_percent=100),
          layers=SplitBert(teacher.body, K))
    seqs = [e.input_ids for e in encode(texts[:3])]
    ids, lengths = np.concatenate(seqs), [len(s) for s in seqs]
    late, _ = padded_lookup(opened, ids, lengths, ["late", "", "late"])
    fresh, _ = padded_lookup(PlotStore.open(table, lower_layers=K), ids, lengths, ["late", "", "late"])
    for row, (seq, domain) in enumerate(zip(seqs, ["late", "", "late"], strict=True)):  # row by row, alone
        alone, _ = padded_lookup(opened, np.array(seq), [len(seq)], [domain])
        assert torch.equal(late[row, : len(seq)], alone[0])
    assert "late" in opened.domains and torch.equal(late, fresh)


@pytest.fixture(scope="module")
async def mesh(redis_server, tmp_path_factory, artifacts):
    running = await start(redis_server.url, tmp_path_factory.mktemp("plot-tenants"), ACADEMUS_KEY_PREFIX=PREFIX,
                          ACADEMUS_ARTIFACTS=str(artifacts), ACADEMUS_MODELS="minilm,minilm-plot",
                          ACADEMUS_WORKER_ID="plot-tenants-worker")
    redis = connect(redis_server.url)
    yield running[-1].address, redis, TenantRegistry(redis, Keys(PREFIX))
    await redis.aclose()
    for service in reversed(running):
        await service.stop()


async def test_tenants_on_minilm_plot_share_batches_each_with_its_domain(mesh, teacher, store, trained, reviews):
    gateway, redis, registry = mesh
    adapter, _ = trained
    labels = list(adapter.labels)
    keys = {}
    for tenant, domain in (("acme", "critics"), ("globex", "")):
        keys[tenant] = await registry.create_tenant(tenant, rate=1000, burst=1000)
        version = await AdapterStoreClient(redis, registry.keys).put(tenant, "reviews", adapter.to_bytes(),
                                                                     {"base": "minilm-plot"})
        await registry.register_model(tenant, TenantModel("reviews", "minilm-plot", "reviews", version, labels,
                                                          domain=domain))
    texts = reviews["domain"][:3]
    clients = {t: AsyncClient(gateway, api_key=k) for t, k in keys.items()}
    try:
        answers = await asyncio.gather(*(clients[t].infer("reviews", texts) for t in keys for _ in range(3)))
    finally:
        for client in clients.values():
            await client.close()
    for i, domain in enumerate(d for d in ("critics", "") for _ in range(3)):
        served = np.array([[p.probs[label] for label in labels] for p in answers[i].predictions])
        expected = training_path_probs(teacher, store, adapter, texts, [domain] * 3).numpy()
        assert np.abs(served - expected).max() < 1e-4, domain
        assert [p.label for p in answers[i].predictions] == [labels[int(r.argmax())] for r in served]
    assert max(a.metadata.batch_size for a in answers) > 3   # texts of several requests shared a batch


async def test_tenants_create_trains_on_minilm_plot_and_the_key_serves_it(mesh, artifacts, reviews, tmp_path):
    gateway, redis, registry = mesh
    data = write_reviews(tmp_path / "reviews.jsonl", list(zip(reviews["texts"][:80], reviews["labels"][:80],
                                                                strict=True)))
    with env(ACADEMUS_ARTIFACTS=str(artifacts)):   # the catalogue the CLI's training reads the table from
        with pytest.raises(InvalidArgument, match="no PLOT overlay for domain 'nope'"):
            await create_tenant_model(redis, registry.keys, "initech", "minilm-plot", data, epochs=1,
                                      progress=False, domain="nope")
        created = await create_tenant_model(redis, registry.keys, "initech", "minilm-plot", data, epochs=2,
                                            progress=False, domain="critics")
    assert "initech" in await registry.tenants()
    model = await registry.model("initech", "initech")
    assert (created["base"], model.base, model.domain) == ("minilm-plot", "minilm-plot", "critics")
    async with AsyncClient(gateway, api_key=created["key"]) as client:
        answer = await client.infer("initech", reviews["domain"][:2])
        with pytest.raises(AcademusError) as other:
            await client.infer("reviews", reviews["domain"][:1])   # acme's and globex's model name
    assert [p.label in created["labels"] for p in answer.predictions] == [True, True]
    assert other.value.status == grpc.StatusCode.NOT_FOUND
