"""HTTP/JSON edge of the gateway: the routes a user of text-embeddings-inference or of OpenAI's embeddings API
already calls (`POST /embed`, `/predict`, `/rerank`, `/similarity`, `/tokenize`, `/decode`, `/v1/embeddings`;
`GET /info`, `/v1/models`, `/health`), over the same admission, quotas and routing as the gRPC `Infer`
(InferenceServicer.answer). JSON becomes an `InferCall` here and the core's `Answer` becomes JSON here; nothing past
this module knows HTTP. Routes and errors: docs/design/http_api.md."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import importlib.metadata
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from prometheus_client import Counter, Histogram
from redis.exceptions import RedisError

from academus.services.gateway.core import EMBED, LABEL, Answer, InferCall, api_key_from
from academus.shared.models.tokenization import Token
from academus.shared.runtime.certificates import public_certificates
from academus.shared.runtime.config import GatewayConfig
from academus.shared.runtime.errors import InvalidArgument, ResourceExhausted, ServingError, Unavailable
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.tracing import end_http_span, http_server_span, http_tracer, root_ratio
from academus.shared.state.catalogue import EMBEDDING, ModelSpec

# gRPC's codes as HTTP statuses (Google's API design guide's mapping)
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429,
               "CANCELLED": 499, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
HTTP_REQUESTS = Counter("academus_http_requests_total", "HTTP/JSON requests by route and status", ["route", "status"])
HTTP_SECONDS = Histogram("academus_http_request_seconds", "HTTP/JSON requests' time in the gateway", ["route"],
                         buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))

VERSION = importlib.metadata.version("academus")
REQUEST_LIMIT = web.AppKey("request_limit", int)   # bytes: the body a request may have
# key, call, id, seconds, peer, policy (the deployment's to serve it; "": any)
AnswerCall = Callable[[str | None, InferCall, str, float, str, str], Awaitable[Answer]]
# the same arguments: each exit event's answer, then the final one (the gRPC edge's InferStream)
StreamCall = Callable[[str | None, InferCall, str, float, str, str], AsyncIterator[Answer]]
ListModels = Callable[[str | None, str], Awaitable[list[dict[str, Any]]]]
Authenticate = Callable[[str | None, str], Awaitable[object]]   # key, peer: raises Unauthenticated
Describe = Callable[[str | None, str, str], Awaitable[ModelSpec]]   # key, model, peer: the spec the key may name
# key, model, texts, add special tokens, peer: each text's tokens
Tokenize = Callable[[str | None, str, list[str], bool, str], Awaitable[list[list[Token]]]]
# key, model, lists of ids, skip special tokens, peer: each list's text
Decode = Callable[[str | None, str, list[list[int]], bool, str], Awaitable[list[str]]]


@dataclass(frozen=True)
class HttpCall:
    """One JSON request as the gateway's core takes it: the call, and what the route does with the answer."""

    call: InferCall
    normalize: bool = False      # /embed: scale each embedding to unit length (TEI's default)
    single: bool = False         # /predict: one input, not a list: the answer is not a list of lists


def field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    """A body field of one of `kinds`, or INVALID_ARGUMENT naming it."""
    value = body.get(name, default)
    if value is not default and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        wanted = " or ".join(k.__name__ for k in kinds)
        raise InvalidArgument(f"field {name!r} must be {wanted}, not {type(value).__name__}")
    return value


def texts_of(value: Any, name: str) -> list[str]:
    """`inputs` / `input`: a string or a non-empty list of strings."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return value
    raise InvalidArgument(f"field {name!r} must be a string or a non-empty list of strings")


def model_of(body: dict[str, Any], default_model: str) -> str:
    model = field(body, "model", (str,), "") or default_model
    if not model:
        raise InvalidArgument("field 'model' is required: name a served model (or set ACADEMUS_HTTP_MODEL, the "
                              "model a request that names none is for)")
    return model


def refuse_prompt_name(body: dict[str, Any]) -> None:
    """TEI's `prompt_name` prepends a prompt the model was saved with; none is served, and ignoring it would change
    what the caller gets without saying so."""
    if field(body, "prompt_name", (str,)) is not None:
        raise InvalidArgument("field 'prompt_name' is not served: prepend the prompt to each input yourself")


def embed_call(body: dict[str, Any], default_model: str) -> HttpCall:
    """TEI's `/embed`: {"inputs": str | [str], "truncate": false, "normalize": true, "model"?}. TEI's options that would
    change the embeddings and are not served (a prompt prepended, truncation from the left) are refused, not ignored."""
    refuse_prompt_name(body)
    if str(field(body, "truncation_direction", (str,), "right")).lower() != "right":
        raise InvalidArgument("field 'truncation_direction' must be 'right': a text is truncated at its end")
    texts = texts_of(body.get("inputs"), "inputs")
    return HttpCall(InferCall(model_of(body, default_model), texts, [""] * len(texts), EMBED,
                              field(body, "truncate", (bool,), False)),
                    normalize=field(body, "normalize", (bool,), True))


def predict_call(body: dict[str, Any], default_model: str) -> HttpCall:
    """TEI's `/predict`: {"inputs": str | [str, str] | [str | [str] | [str, str], ...], "truncate": false, "model"?}.
    As in TEI, a list of two strings is one pair; `[["a"], ["b"]]` is two single texts. Scores are the served head's
    probabilities: `raw_scores` (logits) is refused."""
    if field(body, "raw_scores", (bool,), False):
        raise InvalidArgument("field 'raw_scores' cannot be true: the served heads give probabilities, not logits")
    inputs = body.get("inputs")
    single = isinstance(inputs, str) or is_pair(inputs)
    items = [inputs] if single else inputs
    if not isinstance(items, list) or not items or not all(isinstance(i, str) or is_sequence(i) for i in items):
        raise InvalidArgument("field 'inputs' must be a string, a pair [text, text_pair], or a non-empty list of "
                              "them (a single text in that list may also be [text])")
    texts = [i if isinstance(i, str) else i[0] for i in items]
    pairs = [i[1] if is_pair(i) else "" for i in items]
    output = "" if any(pairs) else LABEL   # single texts: a classifier's labels (an embedding model is refused)
    return HttpCall(InferCall(model_of(body, default_model), texts, pairs, output,
                              field(body, "truncate", (bool,), False)), single=single)


def embedded(answer: Answer, body: dict[str, Any], call: HttpCall) -> np.ndarray:
    return embeddings(answer, call.normalize)


def predicted(answer: Answer, body: dict[str, Any], call: HttpCall) -> list[Any]:
    return predictions(answer, call.single)


def is_pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(t, str) for t in value)


def is_sequence(value: Any) -> bool:
    """[text] or [text, text_pair]."""
    return isinstance(value, list) and len(value) in (1, 2) and all(isinstance(t, str) for t in value)


def rerank_call(body: dict[str, Any], default_model: str) -> HttpCall:
    """TEI's `/rerank`: {"query": str, "texts": [str], "truncate": false, "return_text": false, "model"?}: each text
    scored against the query as a pair (an embedding model's cosine similarity, the query embedded once; a pair
    classifier's score, each text read with the query)."""
    if field(body, "raw_scores", (bool,), False):
        raise InvalidArgument("field 'raw_scores' cannot be true: a score here is a cosine similarity or a "
                              "probability, not a logit")
    query = field(body, "query", (str,))
    if query is None:
        raise InvalidArgument("field 'query' is required: the text the others are ranked against")
    texts = texts_of(body.get("texts"), "texts")
    field(body, "return_text", (bool,), False)
    return HttpCall(InferCall(model_of(body, default_model), [query] * len(texts), texts, "",
                              field(body, "truncate", (bool,), False)))


def similarity_call(body: dict[str, Any], default_model: str) -> HttpCall:
    """TEI's `/similarity` (sentence-transformers' sentence similarity): {"inputs": {"source_sentence": str,
    "sentences": [str]}, "truncate": false, "model"?}: each sentence scored against the source as a pair (an embedding
    model's cosine similarity; the source is embedded once)."""
    inputs = field(body, "inputs", (dict,))
    if inputs is None:
        raise InvalidArgument("field 'inputs' is required: {\"source_sentence\": text, \"sentences\": [text, ...]}")
    source = field(inputs, "source_sentence", (str,))
    if source is None:
        raise InvalidArgument("field 'source_sentence' is required: the text the sentences are compared with")
    sentences = texts_of(inputs.get("sentences"), "sentences")
    return HttpCall(InferCall(model_of(body, default_model), [source] * len(sentences), sentences, "",
                              field(body, "truncate", (bool,), False)))


def similarities(answer: Answer, body: dict[str, Any], call: HttpCall) -> list[float]:
    """Each sentence's score, in the order sent."""
    return pair_scores_of(answer)


def pair_scores_of(answer: Answer) -> list[float]:
    """Each pair's one score: an embedding model's cosine similarity; a pair classifier's (a cross-encoder's) last
    label's probability, as gRPC's `Prediction.score` gives it (a reranker of one label: its relevance)."""
    return answer.pair_scores if answer.pair_scores is not None else answer.rows[:, -1].tolist()


def is_similarity(body: dict[str, Any]) -> bool:
    """A sentence-similarity body (Hugging Face's `InferenceClient.sentence_similarity` posts it to the root)."""
    return isinstance(body.get("inputs"), dict)


def ranked(answer: Answer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """TEI's shape: every text's index and score, the best first; its text too with `return_text`."""
    texts = body["texts"] if isinstance(body["texts"], list) else [body["texts"]]
    scored = sorted(enumerate(pair_scores_of(answer)), key=lambda pair: -pair[1])
    if body.get("return_text"):
        return [{"index": i, "score": score, "text": texts[i]} for i, score in scored]
    return [{"index": i, "score": score} for i, score in scored]


def openai_call(body: dict[str, Any], _default_model: str) -> HttpCall:
    """OpenAI's `/v1/embeddings`: {"input": str | [str], "model", "encoding_format": "float" | "base64"} (OpenAI's
    Python client asks for base64 unless told otherwise); token-id inputs are refused, and `dimensions` unless it is the
    model's own (checked against the answer)."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidArgument("field 'model' is required: name a served embedding model")
    if field(body, "encoding_format", (str,), "float") not in ("float", "base64"):
        raise InvalidArgument("field 'encoding_format' must be 'float' or 'base64'")
    field(body, "dimensions", (int,))
    texts = texts_of(body.get("input"), "input")
    return HttpCall(InferCall(body["model"], texts, [""] * len(texts), EMBED, False))


def embeddings(answer: Answer, normalize: bool) -> np.ndarray:
    """texts x dim float32, each row at unit length where `normalize` (a zero row stays zero)."""
    rows = np.ascontiguousarray(answer.rows)   # orjson writes C-ordered arrays only
    if normalize and rows.size:
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        rows = np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)
    return rows


def predictions(answer: Answer, single: bool) -> list[Any]:
    """TEI's shape: each input's labels with their scores, the likeliest first; a pair scored by an embedding model
    (no labels): its cosine similarity as one score."""
    if answer.pair_scores is not None:
        answers = [[{"label": "similarity", "score": score}] for score in answer.pair_scores]
    else:
        answers = [[{"label": label, "score": score}
                    for label, score in sorted(zip(answer.labels, row, strict=False), key=lambda lp: -lp[1])]
                   for row in answer.rows.tolist()]
    return answers[0] if single else answers


def stream_event(answer: Answer) -> bytes:
    """One server-sent event of a streamed `/predict`: the inputs an exit ramp released (`"final": false`, the layer),
    or every input's full-model result (`"final": true`, layer 0); each input by its index, its scores as `/predict`
    gives them."""
    scores = predictions(answer, single=False)
    final = answer.indices is None
    layer = answer.exit_layers[0] if not final and answer.exit_layers else 0
    indices = range(len(scores)) if final else answer.indices
    event = {"final": final, "exit_layer": layer,
             "predictions": [{"index": i, "scores": s} for i, s in zip(indices, scores, strict=True)]}
    return b"data: " + orjson.dumps(event) + b"\n\n"


def error_event(e: ServingError) -> bytes:
    """A refusal after the stream started (the full model's answer failed): the last event, named `error`."""
    return b"event: error\ndata: " + orjson.dumps({"error": e.message, "error_type": e.code.name}) + b"\n\n"


def openai_answer(answer: Answer, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's shape; with base64, each embedding's little-endian float32 bytes in base64, as OpenAI sends them."""
    data = embeddings(answer, normalize=False)
    if (wanted := body.get("dimensions")) is not None and wanted != data.shape[1]:
        raise InvalidArgument(f"field 'dimensions' is {wanted}; model {answer.model!r} gives {data.shape[1]}")
    if body.get("encoding_format") == "base64":
        data = [base64.b64encode(row.tobytes()).decode() for row in data.astype("<f4", copy=False)]
    tokens = sum(answer.num_tokens)
    return {"object": "list", "model": answer.model,
            "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def tokenize_args(body: dict[str, Any], default_model: str) -> tuple[str, list[str], bool]:
    """TEI's `/tokenize`: {"inputs": str | [str], "add_special_tokens": true, "model"?}."""
    refuse_prompt_name(body)
    return (model_of(body, default_model), texts_of(body.get("inputs"), "inputs"),
            field(body, "add_special_tokens", (bool,), True))


def decode_args(body: dict[str, Any], default_model: str) -> tuple[str, list[list[int]], bool]:
    """TEI's `/decode`: {"ids": [int] | [[int]], "skip_special_tokens": true, "model"?}."""
    ids = body.get("ids")
    if is_ids(ids):
        ids = [ids]
    elif not (isinstance(ids, list) and ids and all(is_ids(i) for i in ids)):
        raise InvalidArgument("field 'ids' must be a non-empty list of token ids, or a non-empty list of such lists")
    return model_of(body, default_model), ids, field(body, "skip_special_tokens", (bool,), True)


def is_ids(value: Any) -> bool:
    """A non-empty list of ints (JSON's true and false are not ids)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value)


def token_json(tokens: list[list[Token]]) -> list[list[dict[str, Any]]]:
    """TEI's shape: each text's tokens as {"id", "text", "special", "start", "stop"} (offsets in characters)."""
    return [[{"id": t.id, "text": t.text, "special": t.special, "start": t.start, "stop": t.stop} for t in text]
            for text in tokens]


def model_info(spec: ModelSpec, config: GatewayConfig) -> dict[str, Any]:
    """TEI's `/info`, for the model a request names: what it is and the limits a request to it meets."""
    labels = {"id2label": {str(i): label for i, label in enumerate(spec.labels)},
              "label2id": {label: i for i, label in enumerate(spec.labels)}}
    # TEI's kinds: a classifier of text pairs (a cross-encoder) is its "reranker"
    embedding = {"dim": spec.dim, "pooling": spec.pooling, "normalized": spec.normalized}
    kind = {"embedding": embedding} if spec.kind == EMBEDDING else {"reranker" if spec.pairs else "classifier": labels}
    return {"model_id": spec.name, "model_type": kind, "max_input_length": spec.max_tokens,
            "max_client_batch_size": config.max_inputs, "max_input_characters": config.max_text_chars,
            "version": VERSION}


def api_key(request: web.Request) -> str | None:
    """The key as the gRPC port reads it from metadata, from the headers."""
    return api_key_from((name.lower(), value) for name, value in request.headers.items())


TIMEOUT_HEADER = "x-timeout-ms"
EXIT_LAYERS_HEADER = "x-academus-exit-layers"


def timeout_s(request: web.Request, default_s: float) -> float:
    """The request's deadline, as gRPC's: `x-timeout-ms` (milliseconds, more than 0), else `default_s`. The queue
    refuses at once what it cannot start in time (DEADLINE_EXCEEDED, 504), as it does a gRPC call's."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return default_s
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not 0 < ms < math.inf:
        raise InvalidArgument(f"header {TIMEOUT_HEADER!r} is {raw!r}: milliseconds, a number more than 0")
    return ms / 1e3


def peer_of(request: web.Request) -> str:
    """The client in grpc's peer form, which the failed-key limit counts by host."""
    host = request.remote or ""
    return f"ipv6:[{host}]:0" if ":" in host else f"ipv4:{host}:0"


def error_response(e: ServingError, openai: bool) -> web.Response:
    """The status as HTTP's, with the same details; a pushback hint as Retry-After (whole seconds, at least 1)."""
    code = e.code.name
    status = getattr(e, "http_status", None) or HTTP_STATUS.get(code, 500)
    body = {"error": {"message": e.message, "type": code, "code": status}} if openai else \
        {"error": e.message, "error_type": code}
    headers = {"Retry-After": str(max(1, math.ceil(e.pushback_ms / 1e3)))} if e.pushback_ms else None
    return json_response(body, status, headers)


def answer_headers(answer: Answer, call: InferCall, request_id: str, total_ms: float) -> dict[str, str]:
    """TEI's headers on an answer (whole milliseconds, as TEI gives them; characters and tokens of every text, a pair's
    both), the request's id, the policy of the deployment that served it (gRPC's `metadata.policy`) and, with
    `early_exit`, the layer that released each input's result, in order (0: the full model; gRPC's `exit_layer`)."""
    own = {"x-academus-policy": answer.policy} if answer.policy else {}
    if answer.exit_layers is not None:
        own[EXIT_LAYERS_HEADER] = ",".join(map(str, answer.exit_layers))
    return {"x-request-id": request_id, **own, "x-compute-time": str(int(total_ms)),
            "x-total-time": str(int(total_ms)), "x-compute-characters": str(call.chars),
            "x-compute-tokens": str(sum(answer.num_tokens)), "x-tokenization-time": str(int(answer.tokenize_ms)),
            "x-queue-time": str(int(answer.queue_ms)), "x-inference-time": str(int(answer.compute_ms))}


def json_response(answer: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """orjson, NumPy arrays as they are: a float32 embedding of 384 written about 30 times as fast as by `json`
    from Python floats, and in fewer digits (each float32's shortest form)."""
    return web.Response(body=orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY), status=status,
                        headers=headers, content_type="application/json")


class HttpApi:
    """The routes over calls of the gRPC edge: `answer` (key, call, request id, seconds left, peer → the core's
    Answer), `list_models` (key, peer → the models the key may name, as {"name", "owner"}), `authenticate` (key,
    peer), which a request passes before its body is read, as a gRPC call's credentials are checked before its
    fields, `describe` (key, model, peer → its ModelSpec), for the routes that serve a model's own task and describe
    it, `tokenize` and `decode`, the model's own tokenizer both ways, and `stream` (the same arguments as `answer`
    → each exit event's Answer, then the final one), for a streamed /predict."""

    def __init__(self, config: GatewayConfig, answer: AnswerCall, list_models: ListModels,
                 serving: Callable[[], bool], authenticate: Authenticate, describe: Describe,
                 tokenize: Tokenize, decode: Decode, stream: StreamCall | None = None) -> None:
        self.config, self.answer, self.list_models, self.serving = config, answer, list_models, serving
        self.stream = stream
        self.authenticate, self.describe = authenticate, describe
        self.tokenize_call, self.decode_call = tokenize, decode
        self.stopping = False   # the gateway is stopping: load balancers should send elsewhere
        self.tracer, self.trace_ratio = http_tracer(), root_ratio(config.trace_ratio)   # read once, not a request

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.request_limit)
        app[REQUEST_LIMIT] = self.config.request_limit
        app.router.add_post("/embed", self.embed)
        app.router.add_post("/predict", self.predict)
        app.router.add_post("/rerank", self.rerank)
        app.router.add_post("/similarity", self.similarity)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/decode", self.decode)
        app.router.add_get("/info", self.info)
        app.router.add_post("/v1/embeddings", self.openai_embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        # TEI's other names: its root and SageMaker's route serve the model's own task (Hugging Face's
        # InferenceClient posts to the root), `/embeddings` is OpenAI's route, and the root and `/ping` its health
        for path in ("/", "/invocations"):
            app.router.add_post(path, self.task)
        app.router.add_post("/embeddings", self.openai_embeddings)
        for path in ("/", "/ping"):
            app.router.add_get(path, self.health)
        return app

    async def embed(self, request: web.Request) -> web.Response:
        return await self._infer(request, "/embed", embed_call, embedded)

    async def predict(self, request: web.Request) -> web.Response:
        return await self._infer(request, "/predict", predict_call, predicted)

    async def task(self, request: web.Request) -> web.Response:
        """TEI's root: `/embed` for an embedding model, `/predict` for a classifier, the body read as that route's;
        `/similarity` for a body of its shape."""
        async def answered(key: str | None, peer: str, body: dict[str, Any]) -> tuple[Any, dict[str, str]]:
            spec = await self.describe(key, model_of(body, self.config.http_model), peer)
            parse, shape = ((similarity_call, similarities) if is_similarity(body) else
                            (embed_call, embedded) if spec.kind == EMBEDDING else (predict_call, predicted))
            return await self._call(request, body, parse, shape)
        return await self._with_body(request, request.path, answered)

    async def similarity(self, request: web.Request) -> web.Response:
        return await self._infer(request, "/similarity", similarity_call, similarities)

    async def rerank(self, request: web.Request) -> web.Response:
        return await self._infer(request, "/rerank", rerank_call, lambda r, b, c: ranked(r, b))

    async def tokenize(self, request: web.Request) -> web.Response:
        async def answered(key: str | None, peer: str, body: dict[str, Any]) -> tuple[Any, dict[str, str]]:
            model, texts, specials = tokenize_args(body, self.config.http_model)
            return token_json(await self.tokenize_call(key, model, texts, specials, peer)), {}
        return await self._with_body(request, "/tokenize", answered)

    async def decode(self, request: web.Request) -> web.Response:
        async def answered(key: str | None, peer: str, body: dict[str, Any]) -> tuple[Any, dict[str, str]]:
            model, ids, skip = decode_args(body, self.config.http_model)
            return await self.decode_call(key, model, ids, skip, peer), {}
        return await self._with_body(request, "/decode", answered)

    async def info(self, request: web.Request) -> web.Response:
        """The model named by `?model=`, else ACADEMUS_HTTP_MODEL's."""
        async def answered() -> tuple[Any, dict[str, str]]:
            key, peer = api_key(request), peer_of(request)
            spec = await self.describe(key, model_of(dict(request.query), self.config.http_model), peer)
            return model_info(spec, self.config), {}
        return await self._answer(request, "/info", answered, openai=False)

    async def openai_embeddings(self, request: web.Request) -> web.Response:
        return await self._infer(request, "/v1/embeddings", openai_call, lambda r, b, c: openai_answer(r, b),
                                 openai=True)

    async def models(self, request: web.Request) -> web.Response:
        async def listed() -> tuple[dict[str, Any], dict[str, str]]:
            found = await self.list_models(api_key(request), peer_of(request))
            return {"object": "list", "data": [{"id": m["name"], "object": "model", "owned_by": m["owner"]}
                                               for m in found]}, {}
        return await self._answer(request, "/v1/models", listed, openai=True)

    async def health(self, request: web.Request) -> web.Response:
        """200 while a scheduler serves (a request can be answered) and the gateway is not stopping, else 503: TEI's
        contract for load balancers."""
        status = "stopping" if self.stopping else "serving" if self.serving() else "no scheduler serves"
        return json_response({"status": status}, 200 if status == "serving" else 503)

    async def _infer(self, request: web.Request, route: str, parse: Callable[[dict[str, Any], str], HttpCall],
                     shape: Callable[[Answer, dict[str, Any], HttpCall], Any],
                     openai: bool = False) -> web.Response:
        async def answered(_key: str | None, _peer: str, body: dict[str, Any]) -> tuple[Any, dict[str, str]]:
            return await self._call(request, body, parse, shape)
        return await self._with_body(request, route, answered, openai)

    async def _with_body(self, request: web.Request, route: str,
                         work: Callable[[str | None, str, dict[str, Any]], Awaitable[tuple[Any, dict[str, str]]]],
                         openai: bool = False) -> web.Response:
        """`work` (key, peer, body) once the key is checked, then the body read: a caller without a key learns nothing
        more, as gRPC checks a call's credentials before its fields."""
        async def answered() -> tuple[Any, dict[str, str]]:
            key, peer = api_key(request), peer_of(request)
            await self.authenticate(key, peer)
            return await work(key, peer, await json_body(request))
        return await self._answer(request, route, answered, openai)

    async def _call(self, request: web.Request, body: dict[str, Any], parse: Callable[[dict[str, Any], str], HttpCall],
                    shape: Callable[[Answer, dict[str, Any], HttpCall], Any]) -> tuple[Any, dict[str, str]]:
        """The body as `parse` reads it, answered by the core and shaped by `shape`; the answer's headers."""
        start = time.perf_counter()
        parsed = parse(body, self.config.http_model)
        # gRPC's InferRequest.policy and .early_exit, for every inference route
        policy = field(body, "policy", (str,), "")
        early_exit = field(body, "early_exit", (bool,), False)
        call = dataclasses.replace(parsed.call, early_exit=True) if early_exit else parsed.call
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        if field(body, "stream", (bool,), False):
            if parse is not predict_call or self.stream is None:
                raise InvalidArgument("field 'stream' is served by /predict only (a classifier's exit ramps "
                                      "release its inputs' results early)")
            return await self._stream(request, call, request_id, policy), {}
        answer = await self.answer(api_key(request), call, request_id,
                                   timeout_s(request, self.config.default_deadline_s), peer_of(request), policy)
        shaped = shape(answer, body, parsed)
        return shaped, answer_headers(answer, call, request_id, (time.perf_counter() - start) * 1e3)

    async def _stream(self, request: web.Request, call: InferCall, request_id: str, policy: str) -> web.StreamResponse:
        """gRPC's `InferStream` as server-sent events: one a released set of inputs, then the final one. A refusal at
        admission comes before the response starts, as a status of its own; one after it, as an `error` event."""
        events = self.stream(api_key(request), call, request_id, timeout_s(request, self.config.default_deadline_s),
                             peer_of(request), policy)
        first = await anext(events)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "x-request-id": request_id})
        await response.prepare(request)
        try:
            await response.write(stream_event(first))
            async for answer in events:
                await response.write(stream_event(answer))
        except ServingError as e:
            await response.write(error_event(e))
        except ConnectionResetError:   # the client left: nothing more to send
            return response
        finally:
            await events.aclose()   # before the final answer: the work stops downstream
        await response.write_eof()
        return response

    async def _answer(self, request: web.Request, route: str,
                      work: Callable[[], Awaitable[tuple[Any, dict[str, str]]]], openai: bool) -> web.Response:
        """The answer to one request, in a SERVER span of its own (as a gRPC call's), counted by route and status."""
        start = time.perf_counter()
        with http_server_span(self.tracer, request.method, route, request.headers, self.trace_ratio) as span:
            try:
                answer, headers = await work()
                # a streamed answer was sent already, event by event
                response = answer if isinstance(answer, web.StreamResponse) else json_response(answer, headers=headers)
            except ServingError as e:
                response = error_response(e, openai)
            except RedisError as e:   # keys and catalogue unreachable: nothing ran, a retry may succeed
                response = error_response(Unavailable(f"credential and model store unreachable: {e}"), openai)
            except Exception as e:
                log_event("http_handler_failed", route=route, error=repr(e))
                end_http_span(span, 500)
                raise
            end_http_span(span, response.status)
        HTTP_REQUESTS.labels(route, str(response.status)).inc()
        HTTP_SECONDS.labels(route).observe(time.perf_counter() - start)
        return response


class BodyTooLarge(ResourceExhausted):
    """A body past the public port's request limit, refused unread: 413 rather than 429 (a retry cannot help)."""

    http_status = 413


async def json_body(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, or INVALID_ARGUMENT saying what it is instead."""
    try:
        body = orjson.loads(await request.read())
    except web.HTTPRequestEntityTooLarge as e:
        raise BodyTooLarge(f"the body exceeds the request limit of {request.app[REQUEST_LIMIT]} bytes "
                           "(ACADEMUS_MAX_REQUEST_BYTES); nothing was read past it") from e
    except orjson.JSONDecodeError as e:   # bad UTF-8 too
        raise InvalidArgument(f"the body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidArgument(f"the body must be a JSON object, not {type(body).__name__}")
    return body


class HttpServer:
    """The API on its own port, beside the gRPC one, in the gateway's event loop: TLS with the public port's
    certificate when it has one. Several gateways share the port (SO_REUSEPORT), as they share the gRPC one."""

    def __init__(self, api: HttpApi, config: GatewayConfig) -> None:
        self.api, self.config = api, config
        self.runner: web.AppRunner | None = None
        self.port = 0
        self._certificates: asyncio.Task | None = None   # follows the TLS files: a rotation served without a restart

    async def start(self) -> int:
        # a client that leaves cancels its handler, and so its work downstream, as a gRPC caller's cancel does
        self.runner = web.AppRunner(self.api.app(), access_log=None, shutdown_timeout=self.config.grace_s,
                                    handler_cancellation=True)
        await self.runner.setup()
        certificates = public_certificates(self.config)
        context = certificates.ssl_context() if certificates is not None else None
        site = web.TCPSite(self.runner, self.config.host, self.config.http_port, reuse_port=True, ssl_context=context)
        await site.start()
        self.port = self.runner.addresses[0][1]   # the bound port: the OS's choice where ACADEMUS_HTTP_PORT is 0
        if certificates is not None:
            self._certificates = asyncio.get_running_loop().create_task(certificates.follow())
        log_event("http_serving", port=self.port, tls=bool(self.config.tls_cert))
        return self.port

    async def stop(self) -> None:
        """Stops accepting, then lets the requests in flight finish within the grace period."""
        if self._certificates is not None:
            self._certificates.cancel()
        if self.runner is not None:
            await self.runner.cleanup()



