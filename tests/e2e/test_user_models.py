"""A user's models through the real mesh: `academus models add` on a running mesh, each model answered through
the gateway (its own tokenizer) on the packed and the padded paths, equal to transformers' own forward; a
refused directory registers nothing; `models remove` unserves the model. No restart anywhere."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from torch import nn

from academus.client import AcademusError, AsyncClient, Client
from academus.services.plot.core import PlotLookup
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshState, down
from academus.shared.models.adapters import AdapterWeights, encode_with_adapters
from academus.shared.models.model import TeacherEncoder, mean_pool, pad_batch
from academus.shared.models.plot import PlotStore
from academus.shared.models.plot.hierarchical import HierarchicalEncoder
from academus.shared.models.shard_io import FileSource
from academus.shared.models.shard_store import ShardStore
from academus.shared.models.student_shards import open_student_shards
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.user_models import add_model, open_model
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.catalogue import read_catalogue, write_entry
from academus.shared.training.plot_build import BuildOptions, build
from academus.shared.training.plot_models import register_embedding
from academus.shared.training.prepare import load_head_at
from academus.shared.training.student_artifacts import load_student_group
from academus.v1 import manage_pb2, manage_pb2_grpc
from tests.conftest import env, write_reviews
from tests.e2e.conftest import start_mesh
from tests.e2e.test_http_api import call as http_call
from tests.models import LABELS, permute_vocabulary, roberta_specials, tiny_model_dir

pytestmark = pytest.mark.e2e

TEXTS = ["the film was a quiet triumph", "dull, long and loud", "a cast that never once finds its footing",
         "worth the ticket"]
TOLERANCE = 1e-4
SERVED_WITHIN_S = 60


@pytest.fixture(scope="module")
def user_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshState]:
    """A mesh over its own catalogue (the bundled minilm only), with a packed and a padded deployment."""
    artifacts = tmp_path_factory.mktemp("artifacts")
    write_entry(artifacts, "minilm", read_catalogue(artifacts_dir())["minilm"])
    run_dir = tmp_path_factory.mktemp("run")
    state = start_mesh(run_dir, deployments=[Deployment("concat"), Deployment("padded")], artifacts=artifacts,
                       http_port=0)
    yield state
    down(run_dir)


@pytest.fixture(scope="module")
def client(user_mesh: MeshState) -> Iterator[Client]:
    key = (Path(user_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    with Client(user_mesh.gateway, api_key=key, timeout=30) as c:
        yield c


def academus(mesh: MeshState, *args: str | Path) -> subprocess.CompletedProcess:
    """The CLI on the mesh. A model that is only a test's set-up is added in process by `add_model`, which
    `models add` runs: a command's start costs about 7 s on 2 cores, mostly importing torch and transformers."""
    return subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", mesh.run_dir,
                           *map(str, args)], capture_output=True, text=True, timeout=120)


def wait_served(client: Client, name: str, served: bool = True) -> None:
    end = time.monotonic() + SERVED_WITHIN_S
    while ({m.name for m in client.list_models()} & {name}) != ({name} if served else set()):
        assert time.monotonic() < end, f"{name} not {'served' if served else 'gone'} within {SERVED_WITHIN_S}s"
        time.sleep(0.2)


def each_text(directory: Path) -> list[torch.Tensor]:
    """Each text's ids alone ([1, T]), tokenized by the model's own tokenizer.json."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_padding()
    return [torch.tensor([encoding.ids]) for encoding in tokenizer.encode_batch(TEXTS)]


def reference(model: nn.Module, directory: Path, classifier: bool) -> torch.Tensor:
    """transformers' forward on each text alone."""
    rows = []
    with torch.no_grad():
        for ids in each_text(directory):
            mask = torch.ones_like(ids)
            if classifier:
                rows.append(torch.softmax(model(input_ids=ids, attention_mask=mask).logits, dim=-1)[0])
            else:
                pooled = mean_pool(model(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
                rows.append(nn.functional.normalize(pooled, dim=1)[0])
    return torch.stack(rows)


def word_reviews(path: Path) -> Path:
    """80 labelled lines a tiny random model can learn: the label is in the words."""
    words = {"pos": ["great", "lovely", "superb"], "neg": ["awful", "dull", "boring"]}
    return write_reviews(path, ((f"{a} film, {b} cast {i}", label) for i in range(40)
                                for label, (a, b) in ((k, (v[i % 3], v[(i + 1) % 3])) for k, v in words.items())))


def served(client: Client, name: str, policy: str, classifier: bool) -> torch.Tensor:
    result = client.infer(name, TEXTS, policy=policy)
    if classifier:
        return torch.tensor([[p.probs[label] for label in LABELS] for p in result.predictions])
    return torch.tensor([p.embedding for p in result.predictions])


@pytest.mark.parametrize("family,classifier", [("roberta", True), ("mpnet", False), ("bert", True)])
def test_a_model_added_to_a_running_mesh_answers_as_transformers_does(user_mesh: MeshState, client: Client,
                                                                     tmp_path: Path, family: str,
                                                                     classifier: bool) -> None:
    name = f"tiny-{family}"
    model = tiny_model_dir(family, classifier, tmp_path / name)
    added = academus(user_mesh, "models", "add", name, "--from", tmp_path / name)
    assert added.returncode == 0, added.stderr
    wait_served(client, name)
    info = next(m for m in client.list_models() if m.name == name)
    assert (info.kind, info.dim, info.layers, info.labels) == (
        "classification" if classifier else "embedding", 36, 3, LABELS if classifier else [])
    assert (info.pooling, info.normalized) == (("", False) if classifier else ("mean", True))   # as `reference`
    status = json.loads(academus(user_mesh, "status", "--json").stdout)
    row = next(m for m in status["models"] if m["name"] == name)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert (row["architecture"], row["layers"], row["workers"]) == (model.config.architectures[0], 3, 1)
    assert weights * 0.9 <= row["memory_bytes"] <= weights * 1.1   # as loaded: a BERT head's pooler, buffers
    assert (row.get("pooling"), row.get("normalized")) == ((None, None) if classifier else ("mean", True))
    if not classifier:   # the table an operator reads says it too
        line = next(r for r in academus(user_mesh, "status").stdout.splitlines() if r.startswith(f"model {name} "))
        assert line.endswith("pooling mean, normalized"), line
    expected = reference(model, tmp_path / name, classifier)
    for policy in ("concat", "padded"):   # packed (ConcatBatching) and padded batches
        got = served(client, name, policy, classifier)
        assert (got - expected).abs().max().item() <= TOLERANCE, policy


def pair_reference(model: nn.Module, directory: Path, queries: list[str], texts: list[str],
                   limit: int | None = None) -> list[float]:
    """transformers' forward on each pair alone, framed by the model's own tokenizer.json (truncated longest first
    to `limit` tokens): its one label's sigmoid."""
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.no_padding()
    if limit:
        tokenizer.enable_truncation(max_length=limit)
    scores = []
    with torch.no_grad():
        for query, text in zip(queries, texts, strict=True):
            encoding = tokenizer.encode(query, text)
            ids, types = torch.tensor([encoding.ids]), torch.tensor([encoding.type_ids])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types).logits
            scores.append(torch.sigmoid(logits)[0, 0].item())
    return scores


def test_a_pair_classifier_scores_each_text_with_its_pair_as_transformers_does(user_mesh: MeshState,
                                                                               client: Client,
                                                                               tmp_path: Path) -> None:
    """`models add --pairs`: a cross-encoder (a BERT reranker of one label) reads a query and a text together. gRPC's
    score and TEI's /rerank give its sigmoid as transformers computes it, packed and padded; a text alone is refused."""
    model = tiny_model_dir("bert", True, tmp_path / "rr", labels=["relevance"])
    added = academus(user_mesh, "models", "add", "rr", "--from", tmp_path / "rr", "--pairs")
    assert added.returncode == 0, added.stderr
    wait_served(client, "rr")
    info = next(m for m in client.list_models() if m.name == "rr")
    assert (info.kind, info.labels, info.pairs) == ("classification", ["relevance"], True)
    query = "which film is worth the ticket"
    expected = pair_reference(model, tmp_path / "rr", [query] * len(TEXTS), TEXTS)
    for policy in ("concat", "padded"):
        result = client.infer("rr", [query] * len(TEXTS), pairs=TEXTS, policy=policy)
        assert [p.label for p in result.predictions] == ["relevance"] * len(TEXTS)
        assert [p.score for p in result.predictions] == pytest.approx(expected, abs=TOLERANCE), policy
    # documents past the gateway's cut (16 characters a token of the limit): after a short query (cut to their
    # start) and after a long one (both cut where the pair's budget is even, else both tokenized whole)
    limit = read_catalogue(user_mesh.artifacts)["rr"]["max_tokens"]
    documents = [" ".join(TEXTS) * 8, "worth the ticket " * 60, "dull " * 400]
    queries = [query, query, " ".join(TEXTS) * 9]
    assert min(map(len, documents + queries[2:])) > 16 * limit
    truncated = client.infer("rr", queries, pairs=documents)
    assert all(p.truncated for p in truncated.predictions)
    assert [p.score for p in truncated.predictions] == pytest.approx(
        pair_reference(model, tmp_path / "rr", queries, documents, limit), abs=TOLERANCE)
    key = (Path(user_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    status, ranked, _ = http_call(user_mesh, "/rerank", {"query": query, "texts": TEXTS, "model": "rr"}, key)
    assert status == 200, ranked
    assert [r["index"] for r in ranked] == sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    assert [r["score"] for r in ranked] == pytest.approx(sorted(expected, reverse=True), abs=TOLERANCE)
    with pytest.raises(AcademusError) as alone:
        client.infer("rr", ["a text without its pair"])
    assert alone.value.code == "INVALID_ARGUMENT"
    assert "inputs[0].text_pair is empty: model 'rr' classifies text pairs" in alone.value.details
    refused = academus(user_mesh, "distill", "--model", "rr", "--quick")
    assert refused.returncode != 0 and "(a cross-encoder, `models add --pairs`): students learn from single texts" \
        in refused.stderr
    # the load generator's pairs: the query before each review, over gRPC and to TEI's /rerank
    for gateway in ((), ("--gateway", f"http://{user_mesh.http}/rerank")):
        load = academus(user_mesh, "loadgen", "run", "--model", "rr", "--query", query, "--schedule", "poisson:8",
                        "--duration", "2", "--texts", "task:sentiment", "--out", tmp_path / "load", *gateway)
        assert load.returncode == 0, load.stderr[-2000:]
        run = json.loads(load.stdout.strip().splitlines()[-1])["runs"][0]
        assert run["completed"] == run["sent"] > 5 and not run["errors"] and run["accuracy"] is None, run


def test_a_text_over_the_models_own_limit_is_refused_naming_it(user_mesh: MeshState, client: Client) -> None:
    limit = read_catalogue(user_mesh.artifacts)["tiny-roberta"]["max_tokens"]   # 48 positions, numbered from 2
    assert limit == 46
    with pytest.raises(AcademusError) as refused:
        client.infer("tiny-roberta", ["word " * 60], truncate=False)
    assert refused.value.code == "INVALID_ARGUMENT"
    assert f"the limit is {limit} tokens" in refused.value.details
    assert client.infer("tiny-roberta", ["word " * 60]).predictions[0].truncated   # cut at its own limit


def test_a_refused_directory_registers_nothing(user_mesh: MeshState, client: Client, tmp_path: Path) -> None:
    tiny_model_dir("bert", False, tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").unlink()
    before = read_catalogue(user_mesh.artifacts)
    refused = academus(user_mesh, "models", "add", "broken", "--from", tmp_path / "broken")
    assert refused.returncode == 2
    assert f"{tmp_path / 'broken'} has no weights" in refused.stderr
    assert read_catalogue(user_mesh.artifacts) == before
    assert not (Path(user_mesh.artifacts) / "models" / "broken").exists()
    assert "broken" not in {m.name for m in client.list_models()}


def test_a_removed_model_is_no_longer_served(user_mesh: MeshState, client: Client, tmp_path: Path) -> None:
    model = tiny_model_dir("bert", False, tmp_path / "gone")
    add_model(Path(user_mesh.artifacts), "gone", tmp_path / "gone")
    wait_served(client, "gone")
    assert len(client.infer("gone", TEXTS[:1]).predictions[0].embedding) == model.config.hidden_size
    bundled = academus(user_mesh, "models", "remove", "minilm")
    assert bundled.returncode == 2 and "not removed here" in bundled.stderr
    removed = academus(user_mesh, "models", "remove", "gone")
    assert removed.returncode == 0, removed.stderr
    wait_served(client, "gone", served=False)
    with pytest.raises(AcademusError) as gone:
        client.infer("gone", TEXTS[:1])
    assert gone.value.code == "NOT_FOUND"
    assert not (Path(user_mesh.artifacts) / "models" / "gone").exists()
    assert client.infer("minilm", TEXTS[:1]).predictions[0].embedding   # the others serve on


def test_a_head_trained_on_a_users_model_serves_on_its_encoder(user_mesh: MeshState, client: Client,
                                                               tmp_path: Path) -> None:
    model = tiny_model_dir("mpnet", False, tmp_path / "base")
    add_model(Path(user_mesh.artifacts), "head-base", tmp_path / "base")
    data = word_reviews(tmp_path / "reviews.jsonl")
    trained = academus(user_mesh, "heads", "train", "--model", "head-base", "--data", data, "--name", "reviews")
    assert trained.returncode == 0, trained.stderr
    wait_served(client, "reviews")
    head = load_head_at(Path(user_mesh.artifacts) / "heads" / "reviews")
    with torch.no_grad():
        expected = torch.softmax(head(reference(model, tmp_path / "base", classifier=False)), dim=-1)
    result = client.infer("reviews", TEXTS, policy="concat")
    got = torch.tensor([[p.probs[label] for label in head.labels] for p in result.predictions])
    assert (got - expected).abs().max().item() <= TOLERANCE
    refused = academus(user_mesh, "models", "remove", "head-base")
    assert refused.returncode == 2 and "carries the heads reviews" in refused.stderr
    assert academus(user_mesh, "models", "remove", "reviews").returncode == 0
    wait_served(client, "reviews", served=False)
    assert not (Path(user_mesh.artifacts) / "heads" / "reviews").exists()
    assert client.infer("head-base", TEXTS[:1]).predictions[0].embedding   # its encoder serves on


def test_students_distilled_from_a_users_model_serve_with_its_tokenizer(user_mesh: MeshState, client: Client,
                                                                        tmp_path: Path) -> None:
    """MPNet students (relative-position bias, positions from 2) of a head on a user's MPNet, distilled --quick,
    served through the mesh equal to the group's own forward on the model's tokenization."""
    tiny_model_dir("mpnet", False, tmp_path / "deep", intermediate_size=54)   # shards split the FFN evenly
    add_model(Path(user_mesh.artifacts), "deep", tmp_path / "deep")
    steps = [("heads", "train", "--model", "deep", "--task", "sentiment"),
             ("distill", "--model", "deep-sentiment", "--quick")]
    for step in steps:
        done = academus(user_mesh, *step)
        assert done.returncode == 0, done.stderr[-2000:]
    wait_served(client, "deep-sentiment-students")
    info = next(m for m in client.list_models() if m.name == "deep-sentiment-students")
    assert (info.architecture, info.layers, info.labels) == ("MPNetModel", 2, ["rotten", "fresh"])
    group = load_student_group(Path(user_mesh.artifacts), "deep-sentiment", teacher="deep-sentiment",
                               task="sentiment")
    tokenizer = Tokenizer.from_file(str(tmp_path / "deep" / "tokenizer.json"))
    tokenizer.no_padding()
    with torch.no_grad():
        seqs = [e.ids for e in tokenizer.encode_batch(TEXTS)]
        expected = torch.softmax(group.head(group(*pad_batch(seqs))), dim=-1)
    for policy in ("concat", "padded"):
        result = client.infer("deep-sentiment-students", TEXTS, policy=policy)
        got = torch.tensor([[p.probs[label] for label in group.labels] for p in result.predictions])
        assert (got - expected).abs().max().item() <= TOLERANCE, policy
    refused = academus(user_mesh, "models", "remove", "deep-sentiment")
    assert refused.returncode == 2 and "teacher of the student groups deep-sentiment-2l, deep-sentiment-students" \
        in refused.stderr
    # its students cut into shards (STI): at full precision each equals the group's own MPNet student
    built = academus(user_mesh, "shard", "build", "--model", "deep-sentiment-students", "--quick")
    assert built.returncode == 0, built.stderr[-2000:]
    shards = open_student_shards(Path(user_mesh.artifacts), read_catalogue(user_mesh.artifacts)[
        "deep-sentiment-students"])
    assert shards.min_bits in shards.store.versions and shards.store.manifest.extra["relative_attention"]
    with torch.no_grad():
        ids, mask, types = pad_batch(seqs)
        hidden, mask4d = group.prepare_inputs(ids, mask, types)
        for m, student in enumerate(group.students):
            elastic = shards.load(m, 32, FileSource())
            for got, want in zip(elastic(hidden, mask4d, mask), student(hidden, mask4d, mask), strict=True):
                assert (got - want).abs().max().item() <= 1e-5


def test_a_users_model_served_from_its_shards_answers_as_its_encoder(user_mesh: MeshState, client: Client,
                                                                    tmp_path: Path) -> None:
    """STI on a user's RoBERTa (its own vocabulary numbering, positions from 2): `shard build --model` on the running
    mesh; with time enough the answer is transformers' own forward under the head fitted for the whole model."""
    model = tiny_model_dir("roberta", False, tmp_path / "cut", seed=8, intermediate_size=54)
    roberta_specials(tmp_path / "cut")
    permute_vocabulary(tmp_path / "cut")
    add_model(Path(user_mesh.artifacts), "cut", tmp_path / "cut")
    built = academus(user_mesh, "shard", "build", "--model", "cut", "--tasks", "sentiment", "--quick")
    assert built.returncode == 0, built.stderr[-2000:]
    wait_served(client, "cut-sentiment-sti")
    head = ShardStore(Path(user_mesh.artifacts) / "shards" / "cut").heads("sentiment")[(3, 3)]
    with torch.no_grad():
        expected = torch.softmax(head(reference(model, tmp_path / "cut", classifier=False)), dim=-1)
    result = client.infer("cut-sentiment-sti", TEXTS)
    assert (result.metadata.shards.layers, result.metadata.shards.mean_bits) == (3, 32)
    got = torch.tensor([[p.probs[label] for label in head.labels] for p in result.predictions])
    assert (got - expected).abs().max().item() <= TOLERANCE
    refused = academus(user_mesh, "models", "remove", "cut")
    assert refused.returncode == 2 and "cut into the shards of cut-sentiment-sti" in refused.stderr


def test_a_users_classifier_served_from_its_shards_answers_as_the_classifier(user_mesh: MeshState, client: Client,
                                                                            tmp_path: Path) -> None:
    """STI on a user's MPNet sequence classifier (its own head: dense, tanh and projection on `<s>`): `shard build
    --model` on the running mesh serves `<model>-sti`, whose answer with time enough is transformers' own."""
    model = tiny_model_dir("mpnet", True, tmp_path / "verdict", seed=9, intermediate_size=54)
    roberta_specials(tmp_path / "verdict")
    add_model(Path(user_mesh.artifacts), "verdict", tmp_path / "verdict")
    built = academus(user_mesh, "shard", "build", "--model", "verdict", "--quick")
    assert built.returncode == 0, built.stderr[-2000:]
    wait_served(client, "verdict-sti")
    info = next(m for m in client.list_models() if m.name == "verdict-sti")
    assert (info.kind, info.labels, info.architecture) == ("classification", LABELS, "MPNetForSequenceClassification")
    result = client.infer("verdict-sti", TEXTS)
    assert (result.metadata.shards.layers, result.metadata.shards.mean_bits) == (3, 32)
    got = torch.tensor([[p.probs[label] for label in LABELS] for p in result.predictions])
    assert (got - reference(model, tmp_path / "verdict", classifier=True)).abs().max().item() <= TOLERANCE


def test_a_plot_table_on_a_users_model_serves_its_upper_layers(user_mesh: MeshState, client: Client,
                                                              tmp_path: Path) -> None:
    """`academus plot build --model` on a running mesh: a RoBERTa-framed model's table, served as `<model>-plot`
    through the gateway (the model's tokenizer) equal to the hierarchical model on the same table; the model is not
    removed from under it."""
    tiny_model_dir("roberta", False, tmp_path / "lower")
    roberta_specials(tmp_path / "lower")
    add_model(Path(user_mesh.artifacts), "lower", tmp_path / "lower")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS[:2]) + "\n")
    built = academus(user_mesh, "plot", "build", "--model", "lower", "--corpus", corpus, "--lower-layers", "2",
                     "--unigrams", "corpus")
    assert built.returncode == 0, built.stderr[-2000:]
    assert json.loads(built.stdout.splitlines()[-1])["registered"] == "lower-plot"
    wait_served(client, "lower-plot")
    info = next(m for m in client.list_models() if m.name == "lower-plot")
    assert (info.kind, info.dim) == ("embedding", 36)
    artifacts = Path(user_mesh.artifacts)
    store = PlotStore.open(artifacts / "plot" / "lower-k2", model="lower", lower_layers=2)
    hierarchical = HierarchicalEncoder(store, open_model(artifacts / "models" / "lower")[0])
    expected = hierarchical.pool([ids[0].tolist() for ids in each_text(tmp_path / "lower")])
    for policy in ("concat", "padded"):   # a packing plan runs padded for a PLOT model
        got = served(client, "lower-plot", policy, classifier=False)
        assert (got - expected).abs().max().item() <= 1e-5, policy
    refused = academus(user_mesh, "models", "remove", "lower")
    assert refused.returncode == 2 and "base of the PLOT models lower-plot" in refused.stderr
    assert academus(user_mesh, "models", "remove", "lower-plot").returncode == 0
    wait_served(client, "lower-plot", served=False)
    assert academus(user_mesh, "models", "remove", "lower").returncode == 0


def adapted(directory: Path, adapter_file: Path) -> tuple[list[str], torch.Tensor]:
    """(labels, probabilities) of the tenant's adapter and head on the user's model, each text alone, in process."""
    adapter = AdapterWeights.from_bytes(adapter_file.read_bytes())
    encoder = open_model(directory)[0]
    with torch.no_grad():
        rows = [encode_with_adapters(encoder, ids, torch.ones_like(ids), None, [adapter])[1][0]
                for ids in each_text(directory)]
    return adapter.labels, torch.stack(rows)


def wait_job(manage: manage_pb2_grpc.ManageStub, key: str, job_id: str) -> manage_pb2.Job:
    end = time.monotonic() + 180
    while time.monotonic() < end:
        job = manage.GetJob(manage_pb2.GetJobRequest(id=job_id), metadata=(("x-api-key", key),), timeout=5)
        if job.status in (manage_pb2.JOB_STATUS_SUCCEEDED, manage_pb2.JOB_STATUS_FAILED):
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not done within 180 s")


def test_tenant_models_on_a_users_model_serve_their_adapters_and_hold_it(user_mesh: MeshState, client: Client,
                                                                         tmp_path: Path) -> None:
    """Tenant adapters on a user's MPNet (3 layers, 36 wide): one trained by `academus tenants create`, one by the
    trainer through the Manage API; each served through the mesh equal to its adapter on the model in process. The
    model is not removed while a tenant's model sits on it, and is once the tenant is gone."""
    tiny_model_dir("mpnet", False, tmp_path / "base")
    permute_vocabulary(tmp_path / "base")   # its own tokenizer: the teacher's would give other ids
    add_model(Path(user_mesh.artifacts), "tenant-base", tmp_path / "base")
    wait_served(client, "tenant-base")
    data = word_reviews(tmp_path / "reviews.jsonl")
    created = academus(user_mesh, "tenants", "create", "acme", "--base", "tenant-base", "--data", data, "--epochs", "3")
    assert created.returncode == 0, created.stderr[-2000:]
    acme = json.loads(created.stdout.splitlines()[-1])
    assert (acme["base"], acme["labels"]) == ("tenant-base", ["neg", "pos"])

    with grpc.insecure_channel(user_mesh.gateway) as channel:
        manage = manage_pb2_grpc.ManageStub(channel)
        request = manage_pb2.CreateTenantModelRequest(name="memos", base="tenant-base", data=data.read_bytes())
        job = manage.CreateTenantModel(request, metadata=(("x-api-key", acme["key"]),), timeout=10)
        done = wait_job(manage, acme["key"], job.id)
    assert done.status == manage_pb2.JOB_STATUS_SUCCEEDED, done.message
    memos = json.loads(done.result_json)

    adapters = Path(user_mesh.artifacts) / "adapters" / "acme"
    with Client(user_mesh.gateway, api_key=acme["key"], timeout=30) as tenant:
        for name, version in (("acme", acme["version"]), ("memos", memos["version"])):
            labels, expected = adapted(Path(user_mesh.artifacts) / "models" / "tenant-base",
                                       adapters / name / f"v{version}.safetensors")
            result = tenant.infer(name, TEXTS)
            got = torch.tensor([[p.probs[label] for label in labels] for p in result.predictions])
            assert (got - expected).abs().max().item() <= TOLERANCE, name

    refused = academus(user_mesh, "models", "remove", "tenant-base")
    assert refused.returncode == 2 and "is the base of tenant models of acme" in refused.stderr
    assert academus(user_mesh, "tenants", "delete", "acme").returncode == 0
    removed = academus(user_mesh, "models", "remove", "tenant-base")
    assert removed.returncode == 0, removed.stderr
    wait_served(client, "tenant-base", served=False)


def test_each_plot_table_gets_its_plot_service_and_both_models_are_prefetched(tmp_path: Path) -> None:
    """`academus up` over the teacher's table and one on a user's model starts a plot service for each; requests
    waiting for a padded batch are looked up in the service holding their model's table (HMI §6.1), and the
    answers equal the hierarchical model on the wire's fp16 states."""
    artifacts = tmp_path / "artifacts"
    write_entry(artifacts, "minilm", read_catalogue(artifacts_dir())["minilm"])
    tiny_model_dir("roberta", False, tmp_path / "upper")
    roberta_specials(tmp_path / "upper")
    add_model(artifacts, "upper", tmp_path / "upper")
    with env(ACADEMUS_ARTIFACTS=str(artifacts)):
        for model, k in (("minilm", 1), ("upper", 2)):
            table = artifacts / "plot" / f"{model}-k{k}"
            build(TEXTS, table, BuildOptions(model=model, lower_layers=k, unigrams="corpus"))
            register_embedding(artifacts, table)
    run_dir = tmp_path / "run"
    mesh = start_mesh(run_dir, deployments=[Deployment("padded")], artifacts=artifacts,
                      env={"ACADEMUS_MAX_BATCH": "64", "ACADEMUS_MAX_DELAY_MS": "300"})
    try:
        status = json.loads(academus(mesh, "status", "--json").stdout)
        plots = {s["name"]: s["health"] for s in status["services"] if s["name"].startswith("plot")}
        assert plots == {"plot": "SERVING", "plot-1": "SERVING"}
        key = (run_dir / ADMIN_KEY_FILE).read_text().strip()

        async def infer_each(model: str) -> list:
            async with AsyncClient(mesh.gateway, api_key=key, timeout=30) as client:
                return await asyncio.gather(*(client.infer(model, [t]) for t in TEXTS))

        for model, k, tokenizer_dir in (("minilm", 1, teacher_dir()), ("upper", 2, tmp_path / "upper")):
            # a lookup still running when its batch is sent is dropped, and the worker looks up itself; a loaded
            # `make test` once saw a first round miss (cause not traced), so the check is on a second round
            asyncio.run(infer_each(f"{model}-plot"))
            answers = asyncio.run(infer_each(f"{model}-plot"))
            assert all(a.metadata.plot_prefetched for a in answers), model
            store = PlotStore.open(artifacts / "plot" / f"{model}-k{k}", model=model, lower_layers=k)
            encoder = (open_model(artifacts / "models" / model)[0] if model == "upper"
                       else TeacherEncoder.load())
            tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
            tokenizer.no_padding()
            seqs = [e.ids for e in tokenizer.encode_batch(TEXTS)]
            lookup = PlotLookup(store, max_tokens=1024).lookup(np.concatenate(seqs), np.array([len(s) for s in seqs]))
            wire = lookup.states.astype(np.float16).astype(np.float32)   # the Lookup RPC's states
            expected = HierarchicalEncoder(store, encoder).pool_states(wire, lookup.lengths)
            got = torch.tensor([a.predictions[0].embedding for a in answers])
            assert (got - expected).abs().max().item() <= 1e-5, model
    finally:
        down(run_dir)
