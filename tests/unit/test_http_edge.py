"""The HTTP/JSON edge's parts without a mesh: JSON to the core's call, and the core's errors to HTTP statuses.
The routes end to end: tests/e2e/test_http_api.py."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from academus.services.gateway.core import EMBED, LABEL, Answer, InferCall
from academus.services.gateway.http import HttpApi, embed_call, error_response, predict_call
from academus.shared.runtime.config import GatewayConfig
from academus.shared.runtime.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec


@pytest.mark.parametrize(("extra", "says"), [
    ({"prompt_name": "query"}, "'prompt_name' is not served"),
    ({"truncation_direction": "left"}, "'truncation_direction' must be 'right'"),
    ({"truncation_direction": 3}, "'truncation_direction' must be str, not int"),
])
def test_embed_refuses_teis_options_that_would_change_the_embeddings(extra, says):
    with pytest.raises(InvalidArgument, match=says):
        embed_call({"inputs": "a", **extra}, "minilm")
    assert embed_call({"inputs": "a", "truncation_direction": "Right", "prompt_name": None}, "minilm").normalize


def test_embed_takes_teis_defaults():
    call = embed_call({"inputs": "a"}, "minilm")
    assert (call.call.texts, call.call.model, call.call.output, call.call.truncate, call.normalize) == (
        ["a"], "minilm", EMBED, False, True)
    named = embed_call({"inputs": ["a", "b"], "model": "other", "truncate": True, "normalize": False}, "minilm")
    assert (named.call.model, named.call.truncate, named.normalize) == ("other", True, False)


@pytest.mark.parametrize(("inputs", "texts", "pairs", "single", "output"), [
    ("a", ["a"], [""], True, LABEL),
    (["a", "b"], ["a"], ["b"], True, ""),                           # TEI: two strings are one pair
    ([["a"], ["b"]], ["a", "b"], ["", ""], False, LABEL),
    (["a", "b", "c"], ["a", "b", "c"], ["", "", ""], False, LABEL),
    ([["a", "b"], "c"], ["a", "c"], ["b", ""], False, ""),
])
def test_predict_reads_teis_inputs(inputs, texts, pairs, single, output):
    call = predict_call({"inputs": inputs, "model": "m"}, "")
    assert (list(call.call.texts), list(call.call.pairs), call.single, call.call.output) == (texts, pairs, single,
                                                                                              output)


@pytest.mark.parametrize(("body", "says"), [
    ({"inputs": "a"}, "field 'model' is required"),
    ({"inputs": [], "model": "m"}, "field 'inputs' must be"),
    ({"inputs": [["a", "b", "c"]], "model": "m"}, "field 'inputs' must be"),
    ({"inputs": "a", "model": "m", "raw_scores": True}, "'raw_scores' cannot be true"),
    ({"inputs": "a", "model": "m", "truncate": 1}, "field 'truncate' must be bool, not int"),
])
def test_predict_names_the_field_it_refuses(body, says):
    with pytest.raises(InvalidArgument, match=says):
        predict_call(body, "")


def test_rerank_pairs_the_query_with_every_text():
    from academus.services.gateway.http import rerank_call

    call = rerank_call({"query": "q", "texts": ["a", "b"]}, "minilm")
    assert (list(call.call.texts), list(call.call.pairs), call.call.model, call.call.truncate) == (
        ["q", "q"], ["a", "b"], "minilm", False)
    with pytest.raises(InvalidArgument, match="field 'query' must be str, not int"):
        rerank_call({"query": 3, "texts": ["a"]}, "m")


def test_the_routes_shape_the_cores_answer_as_tei_and_openai_do():
    from academus.services.gateway.core import Answer
    from academus.services.gateway.http import embeddings, openai_answer, predictions, ranked, similarities

    probs = Answer("spam", ["ham", "spam"], np.array([[0.75, 0.25], [0.125, 0.875]], np.float32), [3, 4])
    assert predictions(probs, single=False) == [[{"label": "ham", "score": 0.75}, {"label": "spam", "score": 0.25}],
                                                [{"label": "spam", "score": 0.875}, {"label": "ham", "score": 0.125}]]
    pairs = Answer("minilm", [], np.zeros((0, 2), np.float32), [5, 6], [0.25, 0.75])
    assert predictions(pairs, single=True) == [{"label": "similarity", "score": 0.25}]
    assert ranked(pairs, {"texts": ["a", "b"], "return_text": True}) == [{"index": 1, "score": 0.75, "text": "b"},
                                                                         {"index": 0, "score": 0.25, "text": "a"}]
    # a classifier of pairs (a reranker of one label): each pair's last label's probability, as gRPC's score
    relevance = Answer("rr", ["relevance"], np.array([[0.25], [0.875], [0.5]], np.float32), [5, 6, 7])
    assert [r["index"] for r in ranked(relevance, {"texts": ["a", "b", "c"]})] == [1, 2, 0]
    assert similarities(relevance, {}, None) == [0.25, 0.875, 0.5]
    rows = Answer("minilm", [], np.array([[3.0, 4.0], [0.0, 0.0]], np.float32), [2, 3])
    np.testing.assert_allclose(embeddings(rows, normalize=True), [[0.6, 0.8], [0.0, 0.0]])   # a zero row stays zero
    openai = json.loads(orjson.dumps(openai_answer(rows, {"dimensions": 2}), option=orjson.OPT_SERIALIZE_NUMPY))
    assert [d["embedding"] for d in openai["data"]] == [[3.0, 4.0], [0.0, 0.0]]
    assert openai["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    with pytest.raises(InvalidArgument, match="'dimensions' is 3; model 'minilm' gives 2"):
        openai_answer(rows, {"dimensions": 3})


@pytest.mark.parametrize(("error", "status", "retry_after"), [
    (ResourceExhausted("tenant 'a' is over its quota", pushback_ms=1500), 429, "2"),
    (ResourceExhausted("full", pushback_ms=20), 429, "1"),            # at least a second
    (InvalidArgument("bad"), 400, None),
    (PermissionDenied("no"), 403, None),
    (Unavailable("gone"), 503, None),
    (DeadlineExceeded("late"), 504, None),
])
def test_an_error_keeps_its_meaning_and_its_retry_hint(error, status, retry_after):
    tei, openai = error_response(error, openai=False), error_response(error, openai=True)
    assert tei.status == openai.status == status
    assert tei.headers.get("Retry-After") == retry_after
    assert json.loads(tei.body) == {"error": error.message, "error_type": error.code.name}
    assert json.loads(openai.body) == {"error": {"message": error.message, "type": error.code.name, "code": status}}


def test_openai_base64_is_each_embeddings_little_endian_float32_bytes():
    import base64

    from academus.services.gateway.http import openai_answer, openai_call

    answer = Answer("m", [], np.array([[1.5, -2.0, 0.1], [0.0, 3.25, 7.0]], np.float32), [3, 4])
    body = {"input": ["a", "b"], "model": "m", "encoding_format": "base64"}
    assert openai_call(body, "").call.output == EMBED
    encoded = openai_answer(answer, body)
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in encoded["data"]]
    np.testing.assert_array_equal(decoded, answer.rows)
    assert encoded["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    with pytest.raises(InvalidArgument, match="'encoding_format' must be 'float' or 'base64'"):
        openai_call({**body, "encoding_format": "binary"}, "")


async def any_key(*_args) -> None:
    return None


async def unknown_models(*_args):
    raise AssertionError("no route here asks for a model's spec")


async def test_a_caller_without_a_valid_key_is_refused_before_its_body_is_read():
    """Over a real loopback socket: 401 whatever the body (not JSON, no model, too large), as gRPC checks a call's
    credentials before its fields; the key and the peer reach the check, and nothing reaches the core."""
    from aiohttp.test_utils import TestClient, TestServer

    checked: list[tuple[str | None, str]] = []

    async def refuse_keys(api_key, peer):
        checked.append((api_key, peer))
        raise Unauthenticated("invalid API key")

    async def unused(*_args):
        raise AssertionError("no request reaches the core")

    config = GatewayConfig()
    api = HttpApi(config, unused, unused, lambda: True, refuse_keys, unused, unused, unused)
    async with TestClient(TestServer(api.app())) as client:
        for body in (b'{"inputs": ', b'{"inputs": "x"}', b"x" * (config.request_limit + 1)):
            answer = await client.post("/embed", data=body, headers={"x-api-key": "k"})
            assert answer.status == 401, await answer.text()
            assert await answer.json() == {"error": "invalid API key", "error_type": "UNAUTHENTICATED"}
        openai = await client.post("/v1/embeddings", data=b"[]")
        assert openai.status == 401 and (await openai.json())["error"]["type"] == "UNAUTHENTICATED"
    assert [k for k, _ in checked] == ["k", "k", "k", None]
    assert all(peer == "ipv4:127.0.0.1:0" for _, peer in checked), checked


async def test_the_root_serves_the_models_own_task_as_tei_does():
    """`POST /` and SageMaker's `/invocations`: /embed's request and answer for an embedding model, /predict's for a
    classifier (Hugging Face's InferenceClient posts to the root); `GET /` and `/ping` are the health check."""
    from aiohttp.test_utils import TestClient, TestServer

    specs = {"emb": ModelSpec("emb", EMBEDDING, dim=2), "cls": ModelSpec("cls", CLASSIFICATION, ["no", "yes"])}
    calls: list[InferCall] = []
    policies: list[str] = []

    async def answer(_key, call: InferCall, _id, _s, _peer, policy: str) -> Answer:
        calls.append(call)
        policies.append(policy)
        if call.model == "emb":
            return Answer("emb", [], np.array([[3.0, 4.0]] * len(call.texts), np.float32), [2] * len(call.texts),
                          tokenize_ms=0.4, queue_ms=2.7, compute_ms=11.9, policy=policy or "concat")
        return Answer("cls", ["no", "yes"], np.array([[0.25, 0.75]] * len(call.texts), np.float32), [2])

    async def describe(_key, name: str, _peer) -> ModelSpec:
        return specs[name]

    api = HttpApi(GatewayConfig(http_model="emb"), answer, unused_models, lambda: True, any_key, describe,
                  no_tokenizer, no_tokenizer)
    async with TestClient(TestServer(api.app())) as client:
        embedded = await client.post("/", json={"inputs": ["a", "bc"], "policy": "student"},
                                     headers={"x-request-id": "r-1"})
        assert embedded.status == 200 and await embedded.json() == [[0.6, 0.8], [0.6, 0.8]]   # TEI normalizes
        told = {k.lower(): v for k, v in embedded.headers.items() if k.lower().startswith("x-")}   # TEI's, whole ms
        assert int(told.pop("x-compute-time")) >= 0 and int(told.pop("x-total-time")) >= 0
        assert told == {"x-request-id": "r-1", "x-compute-characters": "3", "x-compute-tokens": "4",
                        "x-tokenization-time": "0", "x-queue-time": "2", "x-inference-time": "11",
                        "x-academus-policy": "student"}
        refused = await client.post("/embed", json={"inputs": "a", "policy": 3})
        assert refused.status == 400 and "field 'policy' must be str, not int" in (await refused.json())["error"]
        raw = await client.post("/invocations", json={"inputs": "a", "normalize": False})
        assert await raw.json() == [[3.0, 4.0]]
        predicted = await client.post("/", json={"inputs": "a", "model": "cls", "parameters": {}})
        assert await predicted.json() == [{"label": "yes", "score": 0.75}, {"label": "no", "score": 0.25}]
        for path in ("/", "/ping"):
            assert (await client.get(path)).status == 200
    assert [(c.model, c.output, c.truncate) for c in calls] == [("emb", EMBED, False), ("emb", EMBED, False),
                                                                  ("cls", LABEL, False)]
    assert policies == ["student", "", ""]


async def test_early_exit_reaches_the_core_and_each_inputs_releasing_layer_comes_back_as_a_header():
    """`"early_exit": true` is gRPC's `InferRequest.early_exit` on every inference route; the layers that released the
    inputs' results come back in `x-academus-exit-layers`, in order, and only where they were asked for."""
    from aiohttp.test_utils import TestClient, TestServer

    calls: list[InferCall] = []

    async def answer(_key, call: InferCall, *_args) -> Answer:
        calls.append(call)
        rows = np.array([[0.25, 0.75], [0.5, 0.5]][: len(call.texts)], np.float32)
        return Answer("cls", ["no", "yes"], rows, [2] * len(call.texts),
                      exit_layers=[2, 0][: len(call.texts)] if call.early_exit else None)

    async def describe(_key, _name: str, _peer) -> ModelSpec:
        return ModelSpec("cls", CLASSIFICATION, ["no", "yes"])

    api = HttpApi(GatewayConfig(http_model="cls"), answer, unused_models, lambda: True, any_key, describe,
                  no_tokenizer, no_tokenizer)
    async with TestClient(TestServer(api.app())) as client:
        early = await client.post("/predict", json={"inputs": [["a"], ["b"]], "early_exit": True})   # two texts
        assert early.status == 200 and early.headers["x-academus-exit-layers"] == "2,0"
        assert (await early.json())[0] == [{"label": "yes", "score": 0.75}, {"label": "no", "score": 0.25}]
        single = await client.post("/", json={"inputs": "a", "early_exit": True})
        assert single.headers["x-academus-exit-layers"] == "2"
        exact = await client.post("/predict", json={"inputs": "a"})
        assert exact.status == 200 and "x-academus-exit-layers" not in exact.headers
        refused = await client.post("/predict", json={"inputs": "a", "early_exit": "yes"})
        assert refused.status == 400 and "field 'early_exit' must be bool, not str" in (await refused.json())["error"]
    assert [c.early_exit for c in calls] == [True, True, False]


async def test_a_streamed_predict_sends_each_exit_event_then_the_final_answer_as_server_sent_events():
    """`"stream": true` on /predict is gRPC's InferStream: an event a released set of inputs, then every input's final
    result; a refusal at admission is a status of its own, one after the stream started its last event."""
    from aiohttp.test_utils import TestClient, TestServer

    def answer_of(rows: list[list[float]], indices: list[int] | None, layer: int) -> Answer:
        return Answer("cls", ["no", "yes"], np.array(rows, np.float32), [2] * len(rows),
                      exit_layers=None if indices is None else [layer] * len(rows), indices=indices)

    async def stream(_key, call: InferCall, *_args):
        if call.model == "refused":
            raise ResourceExhausted("tenant 't' is over its quota of 10 requests a second")
        yield answer_of([[0.25, 0.75]], [1], 2)
        if call.model == "fails":
            raise DeadlineExceeded("the deadline passed before the full model answered")
        yield answer_of([[0.5, 0.5], [0.125, 0.875]], None, 0)

    async def describe(_key, name: str, _peer) -> ModelSpec:
        return ModelSpec(name, CLASSIFICATION, ["no", "yes"])

    api = HttpApi(GatewayConfig(http_model="cls"), unused_models, unused_models, lambda: True, any_key, describe,
                  no_tokenizer, no_tokenizer, stream)
    async with TestClient(TestServer(api.app())) as client:
        streamed = await client.post("/predict", json={"inputs": [["a"], ["b"]], "stream": True})
        assert streamed.status == 200 and streamed.headers["Content-Type"] == "text/event-stream"
        events = [json.loads(chunk.removeprefix("data: ")) for chunk in (await streamed.text()).split("\n\n") if chunk]
        early = {"index": 1, "scores": [{"label": "yes", "score": 0.75}, {"label": "no", "score": 0.25}]}
        final = [{"index": 0, "scores": [{"label": "no", "score": 0.5}, {"label": "yes", "score": 0.5}]},
                 {"index": 1, "scores": [{"label": "yes", "score": 0.875}, {"label": "no", "score": 0.125}]}]
        assert events == [{"final": False, "exit_layer": 2, "predictions": [early]},
                          {"final": True, "exit_layer": 0, "predictions": final}]
        refused = await client.post("/", json={"inputs": "a", "model": "refused", "stream": True})
        assert refused.status == 429 and "over its quota" in (await refused.json())["error"]
        failed = await client.post("/predict", json={"inputs": "a", "model": "fails", "stream": True})
        *_, last = (await failed.text()).strip().split("\n\n")
        assert failed.status == 200 and last.startswith("event: error\ndata: ")
        assert json.loads(last.split("data: ", 1)[1]) == {
            "error": "the deadline passed before the full model answered", "error_type": "DEADLINE_EXCEEDED"}
        embed = await client.post("/embed", json={"inputs": "a", "stream": True})
        assert embed.status == 400 and "field 'stream' is served by /predict only" in (await embed.json())["error"]


async def unused_models(*_args):
    raise AssertionError("no route here lists the models")


async def no_tokenizer(*_args):
    raise AssertionError("no route here tokenizes")


async def test_a_refusal_downstream_reaches_the_client_as_429_with_retry_after():
    """Over a real loopback socket: an answer the core refuses for want of room."""
    from aiohttp.test_utils import TestClient, TestServer

    async def refuse(*_args):
        raise ResourceExhausted("every scheduler serving model 'm' has a full queue; retry in 250 ms", pushback_ms=250)

    async def no_models(*_args):
        return []

    api = HttpApi(GatewayConfig(), refuse, no_models, lambda: False, any_key, unknown_models,
                  no_tokenizer, no_tokenizer)
    async with TestClient(TestServer(api.app())) as client:
        answer = await client.post("/embed", json={"inputs": "a", "model": "m"})
        assert answer.status == 429 and answer.headers["Retry-After"] == "1"
        assert (await answer.json())["error_type"] == "RESOURCE_EXHAUSTED"
        health = await client.get("/health")
        assert health.status == 503   # no scheduler serves: a load balancer should look elsewhere
    serving = HttpApi(GatewayConfig(), refuse, no_models, lambda: True, any_key, unknown_models,
                      no_tokenizer, no_tokenizer)
    async with TestClient(TestServer(serving.app())) as client:
        assert (await client.get("/health")).status == 200
        serving.stopping = True   # SIGTERM: the gateway drains
        stopping = await client.get("/health")
        assert stopping.status == 503 and (await stopping.json()) == {"status": "stopping"}


async def test_the_server_binds_the_port_the_os_chose_and_stops():
    """ACADEMUS_HTTP_PORT=0: the port is the OS's choice, which the server reports; stopped, it takes nothing more."""
    import aiohttp

    from academus.services.gateway.http import HttpServer

    async def unused(*_args):
        raise AssertionError("no request reaches the core")

    config = GatewayConfig(http_port=0, grace_s=1.0)
    server = HttpServer(HttpApi(config, unused, unused, lambda: True, unused, unused, unused, unused), config)
    port = await server.start()
    assert port > 0
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/health") as answer:
            assert answer.status == 200
        await server.stop()
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://127.0.0.1:{port}/health")


@pytest.mark.parametrize(("value", "seconds"), [(None, 30.0), ("250", 0.25), ("1.5", 0.0015)])
def test_the_timeout_header_gives_the_deadline(value, seconds):
    from aiohttp.test_utils import make_mocked_request

    from academus.services.gateway.http import timeout_s

    request = make_mocked_request("POST", "/embed", headers={"x-timeout-ms": value} if value else {})
    assert timeout_s(request, 30.0) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["0", "-5", "soon", "nan", "inf"])
def test_a_timeout_header_that_is_no_time_is_refused_naming_it(value):
    from aiohttp.test_utils import make_mocked_request

    from academus.services.gateway.http import timeout_s

    with pytest.raises(InvalidArgument, match="header 'x-timeout-ms'"):
        timeout_s(make_mocked_request("POST", "/embed", headers={"x-timeout-ms": value}), 30.0)


def test_tokenize_and_decode_take_teis_bodies():
    from academus.services.gateway.http import decode_args, tokenize_args

    assert tokenize_args({"inputs": "a b"}, "minilm") == ("minilm", ["a b"], True)
    assert tokenize_args({"inputs": ["a", "b"], "add_special_tokens": False, "model": "m"}, "") == (
        "m", ["a", "b"], False)
    assert decode_args({"ids": [101, 7]}, "minilm") == ("minilm", [[101, 7]], True)
    assert decode_args({"ids": [[1], [2, 3]], "skip_special_tokens": False}, "minilm") == (
        "minilm", [[1], [2, 3]], False)


@pytest.mark.parametrize(("parse", "body", "says"), [
    ("tokenize", {"inputs": []}, "'inputs' must be a string or a non-empty list of strings"),
    ("tokenize", {"inputs": "a", "add_special_tokens": "yes"}, "'add_special_tokens' must be bool, not str"),
    ("tokenize", {"inputs": "a", "prompt_name": "query"}, "'prompt_name' is not served"),
    ("tokenize", {"inputs": "a", "model": ""}, "'model' is required"),
    ("decode", {"ids": []}, "'ids' must be a non-empty list of token ids"),
    ("decode", {"ids": [[1], []]}, "'ids' must be a non-empty list of token ids"),
    ("decode", {"ids": [1, "2"]}, "'ids' must be a non-empty list of token ids"),
    ("decode", {"ids": [True]}, "'ids' must be a non-empty list of token ids"),
    ("decode", {"ids": [1], "skip_special_tokens": 0}, "'skip_special_tokens' must be bool, not int"),
])
def test_tokenize_and_decode_refuse_bad_bodies_naming_the_field(parse, body, says):
    from academus.services.gateway.http import decode_args, tokenize_args

    with pytest.raises(InvalidArgument, match=says):
        (tokenize_args if parse == "tokenize" else decode_args)(body, "minilm" if "model" not in body else "")


async def test_tokenize_decode_and_info_answer_in_teis_shapes():
    """Over a real loopback socket: the routes' answers as TEI gives them, the key, model and options passed to the
    core; /info names the model the query names, else ACADEMUS_HTTP_MODEL's."""
    from aiohttp.test_utils import TestClient, TestServer

    from academus.shared.models.tokenization import Token

    seen: list[tuple] = []
    specs = {"emb": ModelSpec("emb", EMBEDDING, dim=384, max_tokens=256, pooling="cls", normalized=False),
             "cls": ModelSpec("cls", CLASSIFICATION, ["neg", "pos"], max_tokens=128),
             "rr": ModelSpec("rr", CLASSIFICATION, ["relevance"], pairs=True)}

    async def tokens(key, model, texts, specials, peer):
        seen.append(("tokenize", key, model, texts, specials))
        return [[Token(101, "[CLS]", True, None, None), Token(7592, t, False, 0, len(t))] for t in texts]

    async def decode(key, model, ids, skip, peer):
        seen.append(("decode", key, model, ids, skip))
        return ["hello"] * len(ids)

    async def describe(_key, name, _peer):
        return specs[name]

    config = GatewayConfig(http_model="emb")
    api = HttpApi(config, unused_models, unused_models, lambda: True, any_key, describe, tokens, decode)
    async with TestClient(TestServer(api.app())) as client:
        told = await client.post("/tokenize", json={"inputs": "Hi", "add_special_tokens": False},
                                 headers={"x-api-key": "k"})
        assert told.status == 200 and await told.json() == [[
            {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
            {"id": 7592, "text": "Hi", "special": False, "start": 0, "stop": 2}]]
        decoded = await client.post("/decode", json={"ids": [[101, 7592, 102], [7592]], "model": "cls"})
        assert decoded.status == 200 and await decoded.json() == ["hello", "hello"]
        info = await (await client.get("/info")).json()
        assert (info["model_id"], info["model_type"], info["max_input_length"]) == (
            "emb", {"embedding": {"dim": 384, "pooling": "cls", "normalized": False}}, 256)
        assert info["max_client_batch_size"] == config.max_inputs and info["version"]
        classifier = await (await client.get("/info", params={"model": "cls"})).json()
        assert classifier["model_type"] == {"classifier": {"id2label": {"0": "neg", "1": "pos"},
                                                           "label2id": {"neg": 0, "pos": 1}}}
        reranker = await (await client.get("/info", params={"model": "rr"})).json()   # a classifier of text pairs
        assert reranker["model_type"] == {"reranker": {"id2label": {"0": "relevance"}, "label2id": {"relevance": 0}}}
        bad = await client.post("/decode", json={"ids": "1"})
        assert bad.status == 400 and (await bad.json())["error_type"] == "INVALID_ARGUMENT"
    assert seen == [("tokenize", "k", "emb", ["Hi"], False), ("decode", None, "cls", [[101, 7592, 102], [7592]], True)]


def test_similarity_pairs_the_source_with_each_sentence():
    from academus.services.gateway.http import similarity_call

    call = similarity_call({"inputs": {"source_sentence": "q", "sentences": ["a", "b"]}}, "minilm")
    assert (call.call.model, call.call.texts, call.call.pairs, call.call.truncate) == ("minilm", ["q", "q"],
                                                                                       ["a", "b"], False)
    with pytest.raises(InvalidArgument, match="field 'inputs' is required"):
        similarity_call({}, "minilm")
    with pytest.raises(InvalidArgument, match="field 'source_sentence' must be str, not int"):
        similarity_call({"inputs": {"source_sentence": 3, "sentences": ["a"]}}, "minilm")
