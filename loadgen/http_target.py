"""A load generator's HTTP/JSON target: the same calls as the SDK's `AsyncClient.infer`, sent to an HTTP port, so
`academus loadgen` measures Academus's HTTP edge, and text-embeddings-inference or infinity beside it, with the same
schedules and report.

A target is a URL. Without a path, requests go to TEI's root (`POST /`: the model's own task, as Academus and TEI
serve it); with one, to that route: `/embed`, `/predict` (TEI's body, `{"inputs": [...], "model": M, "truncate":
true}`, truncated as gRPC's `Infer` is), `/rerank`, or `/v1/embeddings` and `/embeddings` (OpenAI's, `{"input":
[...], "model": M}`, which truncates nothing). A policy goes in the body as `"policy"` (Academus's field, as gRPC's
`InferRequest.policy`), early exits as `"early_exit": true`, a text pair as TEI's `[text, text_pair]` (to
`/rerank`: its query and texts). The answer's TEI headers give the tokens, the queue's and the forward pass's time
where the server sends them, and Academus's the policy that served it and the layer that released each input; an
error keeps its status as the gRPC code the error contract maps it from (`error_type` where the body names it)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import grpc

from academus.client import AcademusError, InferResult, Metadata, Prediction
from academus.services.gateway.http import EXIT_LAYERS_HEADER, HTTP_STATUS

OPENAI_ROUTES = ("/v1/embeddings", "/embeddings")
# An HTTP status as the gRPC code it stands for: the gateway's own mapping read backwards (400 is INVALID_ARGUMENT,
# its first), with the body past its limit (413) and TEI's validation errors (422)
CODE_OF_STATUS = {**{status: code for code, status in reversed(HTTP_STATUS.items())},
                  413: "RESOURCE_EXHAUSTED", 422: "INVALID_ARGUMENT"}


def is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def is_openai(url: str) -> bool:
    """OpenAI's embeddings route: texts alone, no pairs."""
    return urlsplit(url).path.rstrip("/").endswith(OPENAI_ROUTES)


class HttpTarget:
    """`infer` over one aiohttp session (a kept-alive connection a request in flight)."""

    def __init__(self, url: str, api_key: str | None, timeout: float) -> None:
        parts = urlsplit(url)
        self.url = url if parts.path not in ("", "/") else f"{parts.scheme}://{parts.netloc}/"
        self.openai = is_openai(url)
        self.rerank = parts.path.rstrip("/").endswith("/rerank")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.session: aiohttp.ClientSession | None = None

    async def infer(self, model: str, texts: list[str], *, timeout: float | None = None, policy: str = "",
                    early_exit: bool = False, pairs: list[str] | None = None) -> InferResult:
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        seconds = timeout or self.timeout
        body = self.body(model, texts, pairs)
        if policy:
            body["policy"] = policy
        if early_exit:
            body["early_exit"] = True
        headers = {**self.headers, "x-timeout-ms": str(int(seconds * 1e3))}
        try:
            async with self.session.post(self.url, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=seconds)) as answer:
                text = await answer.text()
                try:
                    payload = json.loads(text)
                except ValueError:   # not JSON: a proxy's page, a server's plain text
                    payload = text
                if answer.status != 200:
                    raise refusal(answer.status, payload)
                return result_of(model, payload, answer.headers)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise AcademusError(grpc.StatusCode.UNAVAILABLE, f"{self.url}: {e}") from None
        except TimeoutError:
            raise AcademusError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.url}: no answer in {seconds} s") from None

    def body(self, model: str, texts: list[str], pairs: list[str] | None) -> dict[str, Any]:
        """The route's body. TEI's routes refuse a text past the token limit unless told to truncate, and gRPC's Infer
        truncates. Pairs go to `/rerank` as its query and texts (the pairs' first texts are one query), elsewhere as
        TEI's `[text, text_pair]` inputs; OpenAI's routes have none."""
        if pairs is not None and self.openai:
            raise ValueError(f"{self.url}: OpenAI's embeddings route takes no text pairs")
        if self.openai:
            return {"input": texts, "model": model}
        if self.rerank and pairs is not None:
            return {"query": texts[0], "texts": pairs, "model": model, "truncate": True}
        inputs = [[t, p] for t, p in zip(texts, pairs, strict=True)] if pairs is not None else texts
        return {"inputs": inputs, "model": model, "truncate": True}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def refusal(status: int, payload: Any) -> AcademusError:
    """The gRPC code an error answer stands for, and its message (Academus's, TEI's or OpenAI's shape)."""
    error = payload.get("error") if isinstance(payload, dict) else None
    named = payload.get("error_type") if isinstance(payload, dict) else None
    if isinstance(error, dict):   # OpenAI's shape
        named, error = error.get("type"), error.get("message")
    code = getattr(grpc.StatusCode, str(named), None) or getattr(grpc.StatusCode, CODE_OF_STATUS.get(status, "UNKNOWN"))
    return AcademusError(code, f"HTTP {status}: {error if error is not None else payload}")


def result_of(model: str, payload: Any, headers) -> InferResult:
    """The answer as the SDK's result: a classifier's likeliest label and its probabilities; an embedding's length
    only. Times and tokens from TEI's headers, where sent."""
    rows = payload.get("data", []) if isinstance(payload, dict) else payload
    predictions = [prediction(row) for row in rows]
    if layers := headers.get(EXIT_LAYERS_HEADER):   # an early exit's answer: the layer that released each input
        predictions = [replace(p, exit_layer=int(layer), final=layer == "0")
                       for p, layer in zip(predictions, layers.split(","), strict=False)]
    if predictions:   # the request's tokens (a single text's, as the load generator sends)
        predictions[0] = replace(predictions[0], num_tokens=int(headers.get("x-compute-tokens", 0)))
    queue_ms, compute_ms = float(headers.get("x-queue-time", 0)), float(headers.get("x-inference-time", 0))
    # whole milliseconds; what is neither queue nor forward pass counts as the gateway's (the hops between included)
    metadata = Metadata(policy=headers.get("x-academus-policy", ""), batch_size=0, student_count=0, worker_id="",
                        gateway_ms=float(headers.get("x-total-time", 0)),
                        tokenize_ms=float(headers.get("x-tokenization-time", 0)), scheduler_ms=queue_ms + compute_ms,
                        queue_ms=queue_ms, worker_ms=compute_ms, compute_ms=compute_ms, attempts=1)
    return InferResult(model, headers.get("x-request-id", ""), predictions, metadata)


def prediction(row: Any) -> Prediction:
    if isinstance(row, list) and row and isinstance(row[0], dict):   # a classifier's labels, likeliest first
        return Prediction(label=row[0].get("label", ""), probs={r["label"]: r["score"] for r in row})
    if isinstance(row, dict) and "score" in row:   # /rerank's: a text's index and score
        return Prediction(score=float(row["score"]), input_index=int(row.get("index", 0)))
    return Prediction()   # an embedding: not kept

