"""The load generator's HTTP target without a server: answers as the SDK's results, errors as their gRPC codes.
Against a real mesh: tests/e2e/test_http_api.py (`academus loadgen --gateway http://...`)."""

from __future__ import annotations

import grpc
import pytest

from academus.loadgen.http_target import HttpTarget, is_http, is_openai, refusal, result_of


def test_a_url_names_the_route_and_its_body():
    assert is_http("http://h:8080") and is_http("https://h/v1/embeddings") and not is_http("h:50051")
    assert (HttpTarget("http://h:8080", "k", 5.0).url, HttpTarget("http://h:8080", "k", 5.0).openai) == (
        "http://h:8080/", False)
    assert HttpTarget("http://h:8080/v1/embeddings", None, 5.0).openai
    assert HttpTarget("http://h:8080/predict", None, 5.0).url == "http://h:8080/predict"


def test_errors_keep_the_code_their_body_names_else_their_statuss():
    academus = refusal(429, {"error": "every scheduler is full", "error_type": "RESOURCE_EXHAUSTED"})
    openai = refusal(400, {"error": {"message": "bad input", "type": "INVALID_ARGUMENT", "code": 400}})
    tei = refusal(413, {"error": "payload too large", "error_type": "Validation"})   # TEI names its own types
    plain = refusal(502, "<html>bad gateway</html>")
    assert (academus.status, openai.status, tei.status, plain.status) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN)
    assert openai.details == "HTTP 400: bad input" and "bad gateway" in plain.details


def test_an_answer_becomes_the_sdks_result_with_teis_timings():
    headers = {"x-compute-tokens": "7", "x-queue-time": "3", "x-inference-time": "11", "x-total-time": "15",
               "x-request-id": "r", "x-academus-policy": "student"}
    result = result_of("spam", [[{"label": "spam", "score": 0.9}, {"label": "ham", "score": 0.1}]], headers)
    first = result.predictions[0]
    assert (first.label, first.probs, first.num_tokens, result.request_id) == ("spam", {"spam": 0.9, "ham": 0.1}, 7,
                                                                                "r")
    assert (result.metadata.queue_ms, result.metadata.compute_ms, result.metadata.gateway_ms,
            result.metadata.scheduler_ms, result.metadata.policy) == (3.0, 11.0, 15.0, 14.0, "student")
    embedded = result_of("minilm", {"data": [{"embedding": [0.1]}], "model": "minilm"}, {})
    assert embedded.predictions[0].label == "" and embedded.metadata.gateway_ms == 0.0
    assert embedded.metadata.policy == ""   # a server that does not say (TEI)


def test_an_early_answer_keeps_the_layer_that_released_each_input():
    """`x-academus-exit-layers`: a ramp's layer (not final) or 0 (the full model's), in the inputs' order."""
    rows = [[{"label": "spam", "score": 0.9}], [{"label": "ham", "score": 0.8}]]
    result = result_of("spam", rows, {"x-academus-exit-layers": "2,0"})
    assert [(p.exit_layer, p.final) for p in result.predictions] == [(2, False), (0, True)]
    assert [(p.exit_layer, p.final) for p in result_of("spam", rows, {}).predictions] == [(0, True), (0, True)]


def test_a_pair_goes_as_teis_pair_or_as_reranks_query_and_texts():
    """`loadgen --query`: [text, text_pair] inputs on TEI's root and /predict, the query and texts on /rerank, whose
    answer (index and score, the best first) becomes each text's score; OpenAI's route refuses pairs."""
    root, rerank = HttpTarget("http://h:8080", None, 5.0), HttpTarget("http://h:8080/rerank", None, 5.0)
    assert root.body("rr", ["q"], ["a passage"]) == {"inputs": [["q", "a passage"]], "model": "rr", "truncate": True}
    assert root.body("spam", ["a text"], None) == {"inputs": ["a text"], "model": "spam", "truncate": True}
    assert rerank.body("rr", ["q", "q"], ["a", "b"]) == {"query": "q", "texts": ["a", "b"], "model": "rr",
                                                          "truncate": True}
    assert is_openai("http://h/v1/embeddings/") and not is_openai("http://h/rerank")
    with pytest.raises(ValueError, match="takes no text pairs"):
        HttpTarget("http://h:8080/v1/embeddings", None, 5.0).body("minilm", ["q"], ["a"])
    ranked = result_of("rr", [{"index": 1, "score": 0.9}, {"index": 0, "score": 0.2}], {})
    assert [(p.input_index, p.score) for p in ranked.predictions] == [(1, 0.9), (0, 0.2)]
