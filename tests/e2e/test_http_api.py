"""The HTTP/JSON API (`academus up --http-port`): TEI's /embed and /predict and OpenAI's /v1/embeddings answer what
the gRPC `Infer` answers, through the same mesh, keys and limits; bad input gets the status and the field."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from academus.client import Client
from academus.shared.cli.mesh import MeshState, down
from tests.e2e.conftest import metric, service, start_mesh

pytestmark = pytest.mark.e2e

TEXTS = ["Congratulations! You have won a free cruise, click here to claim your prize now!!!",
         "Hi Tom, the meeting moved to 3pm tomorrow, see you in room 204."]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("run")
    # a request limit of 64 · 2 · 4,000 · 4 bytes + 64 KiB (ACADEMUS_MAX_REQUEST_BYTES's default), uploads below it
    state = start_mesh(run_dir, http_port=0, env={"ACADEMUS_MODELS": "spam,minilm", "ACADEMUS_HTTP_MODEL": "minilm",
                                                   "ACADEMUS_MAX_INPUTS": "64",
                                                   "ACADEMUS_MAX_TEXT_CHARS": "4000",
                                                   "ACADEMUS_MAX_UPLOAD_BYTES": "65536"})
    yield state
    down(run_dir)


@pytest.fixture(scope="module")
def key(mesh: MeshState) -> str:
    from academus.shared.cli.mesh import ADMIN_KEY_FILE

    return (Path(mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()


def call(mesh: MeshState, path: str, body: Any = None, key: str | None = None, raw: bytes | None = None,
         headers: dict[str, str] | None = None, method: str | None = None) -> tuple[int, Any, dict[str, str]]:
    """Status, JSON answer (None when the body is not JSON) and headers of one HTTP request."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{mesh.http}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {}),
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            status, payload, got = answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as e:
        status, payload, got = e.code, e.read(), dict(e.headers)
    try:
        return status, json.loads(payload), got
    except ValueError:
        return status, None, got


def test_embed_answers_the_grpc_embeddings_at_unit_length(mesh, key):
    status, rows, headers = call(mesh, "/embed", {"inputs": TEXTS, "model": "minilm"}, key,
                                 headers={"x-request-id": "tei-1"})
    assert status == 200 and len(rows) == 2 and all(len(r) == 384 for r in rows)
    with Client(mesh.gateway, api_key=key) as client:
        predictions = client.infer("minilm", TEXTS).predictions
    served = [np.asarray(p.embedding) for p in predictions]
    told = {k.lower(): v for k, v in headers.items()}   # TEI's headers, in whole milliseconds
    assert told["x-request-id"] == "tei-1"
    assert int(told["x-compute-tokens"]) == sum(p.num_tokens for p in predictions)
    assert int(told["x-compute-characters"]) == sum(map(len, TEXTS))
    assert int(told["x-inference-time"]) <= int(told["x-total-time"]) == int(told["x-compute-time"])
    assert told["x-academus-policy"] == "fifo"   # the one deployment's, as gRPC's metadata.policy
    for row, grpc_row in zip(rows, served, strict=True):
        assert np.linalg.norm(row) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(row, grpc_row / np.linalg.norm(grpc_row), atol=1e-5)
    status, raw_rows, _ = call(mesh, "/embed", {"inputs": TEXTS[0], "model": "minilm", "normalize": False}, key)
    assert status == 200 and len(raw_rows) == 1
    np.testing.assert_allclose(raw_rows[0], served[0], atol=1e-5)   # as served


def test_a_request_names_the_policy_it_is_served_with_as_over_grpc(mesh, key):
    """`policy` in any inference route's body picks the deployment, as InferRequest.policy does."""
    status, rows, headers = call(mesh, "/embed", {"inputs": TEXTS, "model": "minilm", "policy": "fifo"}, key)
    assert status == 200 and len(rows) == 2 and headers["x-academus-policy"] == "fifo"
    status, answer, _ = call(mesh, "/v1/embeddings", {"input": TEXTS, "model": "minilm", "policy": "fifo"}, key)
    assert status == 200 and len(answer["data"]) == 2
    status, answer, _ = call(mesh, "/predict", {"inputs": TEXTS[0], "model": "spam", "policy": "batchy"}, key)
    assert (status, answer["error_type"]) == (400, "INVALID_ARGUMENT")
    assert "policy 'batchy' is not a policy; known: " in answer["error"]


def test_the_root_serves_the_models_own_task_as_teis_does(mesh, key):
    """`POST /` (and SageMaker's `/invocations`) is /embed for an embedding model, /predict for a classifier; the
    model is the body's, else ACADEMUS_HTTP_MODEL's. `GET /` and `/ping` are the health check."""
    for path in ("/", "/invocations"):
        assert call(mesh, path, {"inputs": TEXTS}, key)[1] == call(mesh, "/embed", {"inputs": TEXTS}, key)[1]
        spam = {"inputs": TEXTS, "model": "spam"}
        assert call(mesh, path, spam, key)[1] == call(mesh, "/predict", spam, key)[1]
    status, answer, _ = call(mesh, "/", {"inputs": "x", "model": "nope"}, key)
    assert (status, answer["error_type"]) == (404, "NOT_FOUND") and "nope" in answer["error"]
    assert call(mesh, "/", {"inputs": "x"})[0] == 401
    assert call(mesh, "/", method="GET")[0] == call(mesh, "/ping", method="GET")[0] == 200


def test_hugging_faces_inference_client_embeds_through_the_root(mesh, key, monkeypatch):
    """The client TEI's users call it with (`InferenceClient(URL).feature_extraction`) posts to the root."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)   # offline, it refuses every URL
    client = InferenceClient(model=f"http://{mesh.http}", token=key)
    got = client.feature_extraction(TEXTS[0])
    assert got.shape == (1, 384)
    np.testing.assert_allclose(got[0], call(mesh, "/embed", {"inputs": TEXTS[0]}, key)[1][0], atol=1e-6)
    raw = client.feature_extraction(TEXTS, normalize=False, truncate=True)
    np.testing.assert_allclose(raw, call(mesh, "/embed", {"inputs": TEXTS, "normalize": False}, key)[1], atol=1e-6)


def test_predict_ranks_a_classifiers_labels_as_infer_does(mesh, key):
    status, one, _ = call(mesh, "/predict", {"inputs": TEXTS[0], "model": "spam"}, key)
    assert status == 200 and one[0]["label"] in ("ham", "spam")
    assert sorted(r["label"] for r in one) == ["ham", "spam"] and one[0]["score"] >= one[1]["score"]
    assert sum(r["score"] for r in one) == pytest.approx(1.0, abs=1e-4)
    status, both, _ = call(mesh, "/predict", {"inputs": [[t] for t in TEXTS], "model": "spam"}, key)
    assert status == 200 and len(both) == 2 and [r["label"] for r in both[0]] == [r["label"] for r in one]
    assert [r["score"] for r in both[0]] == pytest.approx([r["score"] for r in one], abs=1e-5)
    status, refused, _ = call(mesh, "/predict", {"inputs": TEXTS, "model": "spam"}, key)   # as in TEI: one pair
    assert status == 400 and "classifies single texts" in refused["error"]
    with Client(mesh.gateway, api_key=key) as client:
        labels = [p.label for p in client.infer("spam", TEXTS).predictions]
    assert [answer[0]["label"] for answer in both] == labels


def test_predict_scores_a_pair_on_an_embedding_model_as_infer_does(mesh, key):
    pair = ["A man is playing a guitar.", "Someone strums an acoustic guitar."]
    status, scored, _ = call(mesh, "/predict", {"inputs": [pair, [pair[0], "The market fell."]], "model": "minilm"},
                             key)
    with Client(mesh.gateway, api_key=key) as client:
        served = client.infer("minilm", [pair[0], pair[0]], pairs=[pair[1], "The market fell."]).predictions
    assert status == 200 and [s[0]["label"] for s in scored] == ["similarity", "similarity"]
    assert [s[0]["score"] for s in scored] == pytest.approx([p.score for p in served], abs=1e-5)
    assert scored[0][0]["score"] > scored[1][0]["score"]


def test_rerank_orders_texts_by_their_pair_score_as_infer_gives_it(mesh, key):
    query, texts = "A man is playing a guitar.", ["The market fell sharply.", "Someone strums an acoustic guitar.",
                                                  "A cat sleeps on the sofa."]
    status, order, _ = call(mesh, "/rerank", {"query": query, "texts": texts, "model": "minilm", "return_text": True},
                            key)
    with Client(mesh.gateway, api_key=key) as client:
        scores = [p.score for p in client.infer("minilm", [query] * 3, pairs=texts).predictions]
    assert status == 200 and order[0]["index"] == 1 and order[0]["text"] == texts[1]
    assert [o["index"] for o in order] == sorted(range(3), key=lambda i: -scores[i])
    assert [o["score"] for o in order] == pytest.approx(sorted(scores, reverse=True), abs=1e-5)
    status, refused, _ = call(mesh, "/rerank", {"query": query, "texts": texts, "model": "spam"}, key)
    assert status == 400 and "classifies single texts" in refused["error"]


def test_similarity_scores_each_sentence_against_the_source_as_infer_gives_it(mesh, key, monkeypatch):
    """TEI's /similarity, in the order sent; Hugging Face's `InferenceClient.sentence_similarity` posts the same body
    to the root."""
    import huggingface_hub
    from huggingface_hub import InferenceClient

    source, sentences = "A man is playing a guitar.", ["The market fell sharply.", "Someone strums an acoustic guitar."]
    body = {"inputs": {"source_sentence": source, "sentences": sentences}}
    status, scores, _ = call(mesh, "/similarity", body, key)
    with Client(mesh.gateway, api_key=key) as client:
        served = [p.score for p in client.infer("minilm", [source] * 2, pairs=sentences).predictions]
    assert status == 200 and scores == pytest.approx(served, abs=1e-5) and scores[1] > scores[0]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)   # offline, it refuses every URL
    hugging = InferenceClient(model=f"http://{mesh.http}", token=key).sentence_similarity(source, sentences)
    assert hugging == pytest.approx(served, abs=1e-5)
    status, refused, _ = call(mesh, "/similarity", {**body, "model": "spam"}, key)
    assert status == 400 and "classifies single texts" in refused["error"]


def test_openai_embeddings_and_models(mesh, key):
    status, answer, _ = call(mesh, "/v1/embeddings", {"input": TEXTS, "model": "minilm"}, key)
    assert status == 200 and answer["object"] == "list" and answer["model"] == "minilm"
    assert [d["index"] for d in answer["data"]] == [0, 1] and len(answer["data"][1]["embedding"]) == 384
    with Client(mesh.gateway, api_key=key) as client:
        served = client.infer("minilm", TEXTS).predictions
    assert answer["usage"]["prompt_tokens"] == sum(p.num_tokens for p in served) == answer["usage"]["total_tokens"]
    np.testing.assert_allclose(answer["data"][0]["embedding"], served[0].embedding, atol=1e-5)
    status, listed, _ = call(mesh, "/v1/models", key=key)
    assert status == 200 and {"minilm", "spam"} <= {m["id"] for m in listed["data"]}
    status, refused, _ = call(mesh, "/v1/embeddings", {"input": "x", "model": "minilm", "dimensions": 64}, key)
    assert status == 400 and "'dimensions' is 64; model 'minilm' gives 384" in refused["error"]["message"]
    assert refused["error"]["type"] == "INVALID_ARGUMENT"


def test_openais_own_client_embeds_and_lists_the_models(mesh, key):
    """`openai.OpenAI(base_url=...)`, as its users call it: it asks for base64 unless told `float`."""
    import openai

    client = openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key=key, max_retries=0)
    with Client(mesh.gateway, api_key=key) as grpc_client:
        served = [p.embedding for p in grpc_client.infer("minilm", TEXTS).predictions]
    for asked in ({}, {"encoding_format": "float"}):
        answer = client.embeddings.create(model="minilm", input=TEXTS, **asked)
        np.testing.assert_allclose([d.embedding for d in answer.data], served, atol=1e-5)
        assert answer.usage.prompt_tokens > 0 and answer.model == "minilm"
    assert {"minilm", "spam"} <= {m.id for m in client.models.list()}
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{mesh.http}/v1", api_key="not-a-key", max_retries=0).embeddings.create(
            model="minilm", input="x")


def test_tokenize_and_decode_use_the_models_own_tokenizer(mesh, key):
    """TEI's /tokenize and /decode: the ids, texts and offsets the model's tokenizer gives (the bundled teacher's for
    minilm and spam), untruncated; /info describes the model a request names, else ACADEMUS_HTTP_MODEL's."""
    from tokenizers import Tokenizer

    from academus.shared.models.teacher_files import teacher_dir

    library = Tokenizer.from_file(str(teacher_dir() / "tokenizer.json"))
    library.no_truncation()
    library.no_padding()
    long_text = "word " * 600   # past the model's 256 tokens: /embed refuses it untruncated, /tokenize counts it
    status, told, _ = call(mesh, "/tokenize", {"inputs": [TEXTS[0], long_text]}, key)
    assert status == 200 and len(told) == 2
    for text, tokens in zip([TEXTS[0], long_text], told, strict=True):
        expected = library.encode(text)
        assert [t["id"] for t in tokens] == expected.ids
        assert [t["special"] for t in tokens] == [bool(m) for m in expected.special_tokens_mask]
        for token in tokens:
            if not token["special"]:
                assert token["text"] == text[token["start"]:token["stop"]]
    assert len(told[1]) == 602 and told[0][0] == {"id": 101, "text": "[CLS]", "special": True, "start": None,
                                                   "stop": None}
    status, bare, _ = call(mesh, "/tokenize", {"inputs": "Hi there", "add_special_tokens": False, "model": "spam"},
                           key)
    assert status == 200 and [t["text"] for t in bare[0]] == ["Hi", "there"]
    status, texts, _ = call(mesh, "/decode", {"ids": [[t["id"] for t in told[0]], [7632]]}, key)
    assert status == 200 and texts == [library.decode(library.encode(TEXTS[0]).ids), "hi"]
    status, framed, _ = call(mesh, "/decode", {"ids": [101, 7632, 102], "skip_special_tokens": False}, key)
    assert status == 200 and framed == ["[CLS] hi [SEP]"]
    status, info, _ = call(mesh, "/info", key=key)
    assert status == 200 and (info["model_id"], info["model_type"], info["max_input_length"]) == (
        "minilm", {"embedding": {"dim": 384, "pooling": "mean", "normalized": True}}, 256)
    assert info["max_client_batch_size"] == 64 and info["max_input_characters"] == 4000
    status, spam, _ = call(mesh, "/info?model=spam", key=key)
    assert status == 200 and set(spam["model_type"]["classifier"]["label2id"]) == {"ham", "spam"}
    assert call(mesh, "/info")[0] == 401


def test_loadgen_drives_the_http_port_as_it_drives_grpc(mesh, key, tmp_path):
    """`academus loadgen --gateway http://...`: TEI's root (the model's own task) and OpenAI's route, every request
    answered, a classifier's answers scored; refusals recorded under their gRPC code; a policy asked for, served."""
    import subprocess
    import sys

    def loadgen(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", mesh.run_dir, "loadgen", "run",
                               "--schedule", "poisson:10", "--duration", "2", "--texts", "task:spam",
                               "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=120)

    short = ("--length-dist", "normal,mean=20,var=16,min=4,max=60")   # OpenAI's route truncates nothing
    for gateway, model, extra in ((f"http://{mesh.http}", "spam", ()),
                                  (f"http://{mesh.http}/v1/embeddings", "minilm", short)):
        done = loadgen("--gateway", gateway, "--key", key, "--model", model, *extra)
        assert done.returncode == 0, done.stderr
        run = json.loads(done.stdout.splitlines()[-1])["runs"][0]
        assert run["completed"] == run["sent"] > 5 and not run["errors"], run
        assert (run["accuracy"] is not None and run["accuracy"] > 0.5) if model == "spam" else run["accuracy"] is None
    refused = loadgen("--gateway", f"http://{mesh.http}", "--key", "not-a-key", "--model", "spam")
    run = json.loads(refused.stdout.splitlines()[-1])["runs"][0]
    assert run["completed"] == 0 and run["errors"] == {"UNAUTHENTICATED": run["sent"]}, run
    with_policy = loadgen("--gateway", f"http://{mesh.http}", "--key", key, "--model", "spam", "--policy", "fifo")
    assert with_policy.returncode == 0, with_policy.stderr
    run = json.loads(with_policy.stdout.splitlines()[-1])["runs"][0]
    assert run["completed"] == run["sent"] > 5 and run["served_by"] == {"fifo": run["sent"]}, run


def test_health_and_the_requests_counted(mesh, key):
    assert call(mesh, "/health")[0] == 200
    before = metric(service(mesh, "gateway").metrics_port, "academus_http_requests_total", route="/embed",
                    status="200")
    call(mesh, "/embed", {"inputs": "counted", "model": "minilm"}, key)
    after = metric(service(mesh, "gateway").metrics_port, "academus_http_requests_total", route="/embed",
                   status="200")
    assert after == before + 1


def test_an_http_request_is_one_trace_across_the_hops(mesh, key):
    """A request carrying a sampled W3C `traceparent` gets the gateway's SERVER span as the child of the caller's, and
    the scheduler's and the worker's spans in the same trace; one carrying an unsampled context makes no span."""
    from academus.shared.runtime.tracing import read_traces

    sampled, unsampled = "4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737"
    caller = "00f067aa0ba902b7"
    for trace_id, flags in ((sampled, "01"), (unsampled, "00")):
        status, _, _ = call(mesh, "/embed", {"inputs": "traced", "model": "minilm"}, key,
                            headers={"traceparent": f"00-{trace_id}-{caller}-{flags}"})
        assert status == 200
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        traces = read_traces([Path(mesh.run_dir) / "traces.jsonl"])
        spans = traces.get(sampled, [])
        if {"academus-gateway", "academus-scheduler", "academus-worker"} <= {s["service"] for s in spans}:
            break
        time.sleep(0.3)
    else:
        raise AssertionError(f"no complete trace for the HTTP request: {[(s['service'], s['name']) for s in spans]}")
    edge = next(s for s in spans if s["name"] == "POST /embed")
    assert (edge["kind"], edge["service"], edge["parent_id"]) == ("SERVER", "academus-gateway", caller)
    assert edge["attributes"]["http.response.status_code"] == 200 and edge["attributes"]["http.route"] == "/embed"
    assert not traces.get(unsampled)


@pytest.mark.parametrize(("path", "body", "key_as", "status", "code", "says"), [
    ("/embed", {"inputs": "x", "model": "minilm"}, None, 401, "UNAUTHENTICATED", "API key"),
    ("/embed", {"inputs": "x", "model": "minilm"}, "wrong", 401, "UNAUTHENTICATED", "API key"),
    ("/embed", {"inputs": []}, None, 401, "UNAUTHENTICATED", "API key"),   # credentials first, as gRPC checks them
    ("/v1/embeddings", {"input": "x", "encoding_format": "base64"}, "wrong", 401, "UNAUTHENTICATED", "API key"),
    ("/predict", {"inputs": "x"}, "admin", 400, "INVALID_ARGUMENT", "embedding model"),   # the default, minilm
    ("/embed", {"inputs": [], "model": "minilm"}, "admin", 400, "INVALID_ARGUMENT", "field 'inputs' must be"),
    ("/embed", {"inputs": ["a", 3], "model": "minilm"}, "admin", 400, "INVALID_ARGUMENT", "field 'inputs' must be"),
    ("/embed", {"inputs": "x", "model": "minilm", "truncate": "yes"}, "admin", 400, "INVALID_ARGUMENT",
     "field 'truncate' must be bool, not str"),
    ("/embed", {"inputs": "x", "model": "nope"}, "admin", 404, "NOT_FOUND", "nope"),
    ("/embed", {"inputs": ["x"] * 65, "model": "minilm"}, "admin", 400, "INVALID_ARGUMENT", "64"),
    ("/embed", {"inputs": "word " * 600, "model": "minilm"}, "admin", 400, "INVALID_ARGUMENT", "token"),
    ("/embed", ["x"], "admin", 400, "INVALID_ARGUMENT", "the body must be a JSON object, not list"),
    ("/predict", {"inputs": "x", "model": "minilm"}, "admin", 400, "INVALID_ARGUMENT", "embedding model"),
    ("/predict", {"inputs": "x", "model": "spam", "raw_scores": True}, "admin", 400, "INVALID_ARGUMENT",
     "'raw_scores'"),
    ("/rerank", {"texts": ["a"], "model": "minilm"}, "admin", 400, "INVALID_ARGUMENT", "field 'query' is required"),
    ("/rerank", {"query": "q", "texts": [], "model": "minilm"}, "admin", 400, "INVALID_ARGUMENT",
     "field 'texts' must be"),
    ("/v1/embeddings", {"input": "x", "model": "minilm", "encoding_format": "binary"}, "admin", 400,
     "INVALID_ARGUMENT", "'encoding_format' must be 'float' or 'base64'"),
    ("/similarity", {"inputs": "x"}, "admin", 400, "INVALID_ARGUMENT", "field 'inputs' must be dict, not str"),
    ("/similarity", {"inputs": {"sentences": ["a"]}}, "admin", 400, "INVALID_ARGUMENT",
     "field 'source_sentence' is required"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, "admin", 400, "INVALID_ARGUMENT",
     "field 'sentences' must be"),
    ("/tokenize", {"inputs": "x"}, "wrong", 401, "UNAUTHENTICATED", "API key"),
    ("/tokenize", {"inputs": ["x"] * 65}, "admin", 400, "INVALID_ARGUMENT", "64"),
    ("/tokenize", {"inputs": "x" * 4001}, "admin", 400, "INVALID_ARGUMENT", "inputs[0] has 4001 characters"),
    ("/tokenize", {"inputs": "x", "model": "nope"}, "admin", 404, "NOT_FOUND", "nope"),
    ("/decode", {"ids": [101, 30522]}, "admin", 400, "INVALID_ARGUMENT", "ids[0][1] is 30522"),
    ("/decode", {"ids": [[-1]]}, "admin", 400, "INVALID_ARGUMENT", "ids[0][0] is -1"),
    ("/decode", {"ids": [[1] * 4097] * 32}, "admin", 400, "INVALID_ARGUMENT",
     "ids hold 131104 ids; a request holds at most 131072"),
    ("/tokenize", {"inputs": ["a." * 2000] * 64}, "admin", 400, "INVALID_ARGUMENT",
     "inputs: the first 34 texts hold 136068 tokens; an answer holds at most 131072"),
    ("/decode", {"ids": [[1]] * 65}, "admin", 400, "INVALID_ARGUMENT", "the limit is 64"),
    ("/decode", {"ids": "101"}, "admin", 400, "INVALID_ARGUMENT", "field 'ids' must be"),
])
def test_bad_input_gets_the_status_and_names_the_field(mesh, key, path, body, key_as, status, code, says):
    got, answer, _ = call(mesh, path, body, {"admin": key, "wrong": "not-a-key"}.get(key_as))
    message = answer["error"]["message"] if path.startswith("/v1") else answer["error"]
    kind = answer["error"]["type"] if path.startswith("/v1") else answer["error_type"]
    assert (got, kind) == (status, code) and says in message, answer


def test_a_timeout_header_is_the_requests_deadline(mesh, key):
    """`x-timeout-ms` is the deadline gRPC callers set: a batch that cannot finish within 50 ms is answered 504
    DEADLINE_EXCEEDED at once, not after the default 30 s; a bad value is 400 naming the header."""
    texts = [f"{i} " + "every layer of this batch takes a while on a small CPU " * 40 for i in range(64)]
    start = time.monotonic()
    status, answer, _ = call(mesh, "/embed", {"inputs": texts, "model": "minilm", "truncate": True}, key,
                             headers={"x-timeout-ms": "50"})
    assert (status, answer["error_type"]) == (504, "DEADLINE_EXCEEDED") and time.monotonic() - start < 5
    status, answer, _ = call(mesh, "/embed", {"inputs": "x", "model": "minilm"}, key, headers={"x-timeout-ms": "-1"})
    assert status == 400 and "'x-timeout-ms'" in answer["error"]
    status, _, _ = call(mesh, "/embed", {"inputs": "x", "model": "minilm"}, key, headers={"x-timeout-ms": "5000"})
    assert status == 200


def test_what_is_not_json_or_too_large_is_refused_unread(mesh, key):
    status, answer, _ = call(mesh, "/embed", raw=b'{"inputs": ', key=key)
    assert status == 400 and answer["error"].startswith("the body is not JSON")
    status, answer, _ = call(mesh, "/embed", raw=b"x" * (4000 * 64 * 2 * 4 + 65 * 1024), key=key)
    assert status == 413 and answer["error_type"] == "RESOURCE_EXHAUSTED"   # the gRPC port's limit and code
    assert f"the request limit of {4000 * 64 * 2 * 4 + 64 * 1024} bytes" in answer["error"]
    status, answer, _ = call(mesh, "/embed", {"inputs": "x", "model": "minilm"}, headers={"x-api-key": key})
    assert status == 200
    assert call(mesh, "/embed", method="GET")[0] == 405


def test_a_client_that_leaves_stops_the_forward_pass_downstream(mesh, key):
    """The HTTP connection closed while the worker computes: the handler is cancelled, and with it the scheduler's
    and the worker's calls; the worker stops the batch between layers rather than finishing it for nobody."""
    import socket

    worker = service(mesh, "worker-0")
    texts = [f"{i} " + "every layer of this batch takes a while on a small CPU " * 40 for i in range(64)]
    batches = metric(worker.metrics_port, "academus_worker_batches_total", model="minilm")
    abandoned = metric(worker.metrics_port, "academus_worker_abandoned_total")
    body = json.dumps({"inputs": texts, "model": "minilm", "truncate": True}).encode()
    host, port = mesh.http.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as client:
        client.sendall(f"POST /embed HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        end = time.monotonic() + 30
        while metric(worker.metrics_port, "academus_rpc_in_flight", service="worker", method="Run") < 1:
            assert time.monotonic() < end, "the batch never reached the worker"
            time.sleep(0.02)
    end = time.monotonic() + 20
    while metric(worker.metrics_port, "academus_worker_abandoned_total") == abandoned and time.monotonic() < end:
        time.sleep(0.1)
    assert metric(worker.metrics_port, "academus_worker_abandoned_total") == abandoned + 1
    assert metric(worker.metrics_port, "academus_worker_batches_total", model="minilm") == batches


def test_requests_in_flight_when_the_gateway_is_told_to_stop_are_answered(mesh, key):
    """SIGTERM (the module's last test: the mesh is not supervised, so the gateway stays gone): the HTTP port closes
    only once the gRPC side drained, and every request it took is answered, not cut. 24 requests of 8 texts of 256
    tokens queue up seconds of work; the gateway is told to stop while they wait."""
    import os
    import signal
    from concurrent.futures import ThreadPoolExecutor

    long = [" ".join(["a fairly long sentence about nothing in particular"] * 40)] * 8

    def send() -> tuple[float, int, int]:
        status, rows, _ = call(mesh, "/embed", {"inputs": long, "model": "minilm", "truncate": True}, key)
        return time.monotonic(), status, len(rows) if status == 200 else 0

    with ThreadPoolExecutor(24) as pool:
        sent = [pool.submit(send) for _ in range(24)]
        time.sleep(0.3)
        os.kill(service(mesh, "gateway").pid, signal.SIGTERM)
        killed = time.monotonic()
        answers = [s.result(timeout=60) for s in sent]
    assert [(status, rows) for _, status, rows in answers] == [(200, 8)] * 24
    assert sum(at > killed for at, _, _ in answers) >= 12, "most were answered before the SIGTERM: nothing drained"
