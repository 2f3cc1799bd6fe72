"""Typed results and the request builder shared by the sync and asyncio clients."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from academus.shared.runtime import errors
from academus.v1 import inference_pb2 as pb

OUTPUTS = {"": pb.OUTPUT_UNSPECIFIED, "label": pb.OUTPUT_LABEL, "score": pb.OUTPUT_SCORE,
           "embedding": pb.OUTPUT_EMBEDDING}
DEFAULT_TIMEOUT_S = 10.0

# Retries UNAVAILABLE, the status that says nothing ran, and a server's CANCELLED: no service of ours answers it,
# but a stopping gRPC server cancels the calls it had received and not yet started (grpc/grpc#41785: a few of
# every gateway SIGTERM at twice the capacity, docs/benchmarks/reliability.md). A call its own caller cancelled is
# never retried. Inference is idempotent anyway. An overloaded
# server's RESOURCE_EXHAUSTED is retried by the clients themselves, when asked (`retry_overload`): the channel's
# policy would retry it without a pushback hint too (a message over the size limit), and would sit out a hint
# longer than the deadline to answer DEADLINE_EXCEEDED rather than the refusal.
MAX_ATTEMPTS, INITIAL_BACKOFF_S, MAX_BACKOFF_S, BACKOFF_MULTIPLIER = 3, 0.05, 0.5, 2
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": "academus.v1.Inference"}],
        "retryPolicy": {"maxAttempts": MAX_ATTEMPTS, "initialBackoff": f"{INITIAL_BACKOFF_S}s",
                        "maxBackoff": f"{MAX_BACKOFF_S}s", "backoffMultiplier": BACKOFF_MULTIPLIER,
                        "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]},
    }]
})
# A supervised gateway that dies serves again 1-2 s later, refusing connections meanwhile. A client that has been
# served rides that out within its deadline: its calls wait for the channel to be ready (`wait_for_ready`), and
# the channel tries to connect every 0.1 s growing to 1 s, not gRPC's 1 s growing to 120 s. A client never served
# fails at once (a wrong address, a mesh not up). gRPC takes `min_reconnect_backoff_ms` as the time one connection
# attempt may take (TCP and HTTP/2 handshakes), not as a backoff: at 0.1 s, connections opened in a burst to a
# busy gateway failed UNAVAILABLE ("tcp handshaker shutdown"). A refused connect fails at once whatever it is.
CONNECT_TIMEOUT_MS = 2000
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
CHANNEL_OPTIONS = [("grpc.service_config", json.dumps(json.loads(SERVICE_CONFIG))),
                   ("grpc.enable_retries", 1),
                   ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   *RECONNECT_OPTIONS]


def retry_wait(code: grpc.StatusCode, attempt: int, remaining_s: float, pushback_ms: int | None = None,
               draw: Callable[[float, float], float] = random.uniform, overload: bool = False) -> float | None:
    """How long to wait before trying again after attempt `attempt` (0: the first) failed with `code`, as the
    channel's retry policy above does for unary calls (a call on a multiplexed stream is not one the channel
    sees); None: do not retry. The server's pushback hint, when it sends one, replaces the backoff.
    `overload`: RESOURCE_EXHAUSTED is retried too, only when it carries a pushback hint (a quota, a full
    queue), after that wait."""
    overloaded = overload and code == grpc.StatusCode.RESOURCE_EXHAUSTED and pushback_ms is not None
    if not (code in RETRIED or overloaded) or attempt + 1 >= MAX_ATTEMPTS:
        return None
    if pushback_ms is not None:
        wait = pushback_ms / 1e3 if pushback_ms >= 0 else None
    else:
        wait = draw(0.0, min(INITIAL_BACKOFF_S * BACKOFF_MULTIPLIER ** attempt, MAX_BACKOFF_S))
    return wait if wait is not None and wait < remaining_s else None


def next_wait(error: grpc.RpcError, attempt: int, remaining_s: float, overload: bool,
              channel_retried: bool) -> float | None:
    """After attempt `attempt` of a call failed with `error`: how long the client waits before its next one
    (None: it raises). `channel_retried`: the call was a unary one, whose RETRIED codes the channel retried."""
    code = error.code()
    if channel_retried and code in RETRIED:
        return None
    return retry_wait(code, attempt, remaining_s, errors.pushback_ms(dict(error.trailing_metadata() or ()).items()),
                      overload=overload)


class AcademusError(Exception):
    """A call that ended with a non-OK gRPC status; `code` is its name, e.g. 'UNAUTHENTICATED'."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.status = code
        self.code = code.name
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> AcademusError:
        return cls(error.code(), error.details() or "")


@dataclass(frozen=True)
class Prediction:
    label: str = ""
    probs: dict[str, float] = field(default_factory=dict)
    score: float = 0.0
    embedding: list[float] = field(default_factory=list)
    num_tokens: int = 0
    truncated: bool = False
    input_index: int = 0       # the text's position in the request
    exit_layer: int = 0        # an early result (early exits): the layer whose ramp released it; 0: the full model
    final: bool = True         # the full model's result


@dataclass(frozen=True)
class Metadata:
    policy: str
    batch_size: int
    student_count: int
    worker_id: str
    gateway_ms: float
    tokenize_ms: float
    scheduler_ms: float
    queue_ms: float
    worker_ms: float
    compute_ms: float
    attempts: int
    plot_prefetched: bool = False   # PLOT models: the scheduler looked the texts up while they waited
    scheduler_id: str = ""          # the scheduler that dispatched it: a deployment, or one shard of it
    shards: ShardRun | None = None  # a model served from shards (`<task>-sti`): the submodel that ran


@dataclass(frozen=True)
class ShardRun:
    """What a shard-served batch ran (STI): planned for the time it had, under the worker's memory budget."""

    layers: int
    width: int              # shards (heads with their FFN neurons) a layer
    mean_bits: float        # the shards' mean stored bit width (32: full precision)
    io_ms: float            # the loader's busy time: reads, checksums, decoding
    stall_ms: float         # the compute waiting for shards
    resident_bytes: int     # parameter bytes the model holds
    io_source: str


@dataclass(frozen=True)
class InferResult:
    model: str
    request_id: str
    predictions: list[Prediction]
    metadata: Metadata


@dataclass(frozen=True)
class ModelInfo:
    """A model the caller may name: a served one, or one of its tenant models (`base`: the model that runs it)."""

    name: str
    kind: str                  # "classification" | "embedding"
    labels: list[str]
    dim: int
    max_tokens: int
    base: str = ""
    status: str = "ready"      # a tenant model may be "training" or "failed"
    architecture: str = ""     # a served model's transformers class (BertModel, MPNetForSequenceClassification...)
    layers: int = 0            # transformer layers computed for one text (0: not reported)
    pairs: bool = False        # a classifier of text pairs (a cross-encoder): every text needs its pair
    pooling: str = ""          # an embedding model's: "mean" (over its real tokens) or "cls" (the first token's)
    normalized: bool = False   # an embedding model's vectors have unit length (cosine = dot product)


@dataclass(frozen=True)
class Token:
    """One token of a text as the model's tokenizer cut it: its id, the text it covers, and that text's character
    offsets in the input (None for a special token the template added, whose text is the token's own)."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


def tokenize_request(model: str, texts: Sequence[str], add_special_tokens: bool) -> pb.TokenizeRequest:
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one string")
    return pb.TokenizeRequest(model=model, texts=list(texts), without_special_tokens=not add_special_tokens)


def tokens_from(response: pb.TokenizeResponse) -> list[list[Token]]:
    return [[Token(t.id, t.text, t.special, None if t.special else t.start, None if t.special else t.stop)
             for t in text.tokens] for text in response.texts]


def decode_request(model: str, ids: Sequence[Sequence[int]], skip_special_tokens: bool) -> pb.DecodeRequest:
    return pb.DecodeRequest(model=model, texts=[pb.TokenIds(ids=list(i)) for i in ids],
                            keep_special_tokens=not skip_special_tokens)


def models_from(response: pb.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.name, m.kind, list(m.labels), m.dim, m.max_tokens, m.base, m.status, m.architecture,
                      m.layers, m.pairs, m.pooling, m.normalized) for m in response.models]


def build_request(model: str, texts: Sequence[str], output: str = "", pairs: Sequence[str] | None = None,
                  truncate: bool | None = None, request_id: str = "", policy: str = "",
                  early_exit: bool = False) -> pb.InferRequest:
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {sorted(o for o in OUTPUTS if o)}, not {output!r}")
    if isinstance(texts, str):
        raise TypeError("texts must be a sequence of strings, not one string")
    pairs = list(pairs) if pairs is not None else [""] * len(texts)
    request = pb.InferRequest(model=model, output=OUTPUTS[output], request_id=request_id, policy=policy,
                              early_exit=early_exit,
                              inputs=[pb.TextInput(text=t, text_pair=p) for t, p in zip(texts, pairs, strict=True)])
    if truncate is not None:
        request.truncate = truncate
    return request


def from_response(response: pb.InferResponse) -> InferResult:
    labels = list(response.labels)
    m = response.metadata
    return InferResult(
        model=response.model,
        request_id=response.request_id,
        predictions=[Prediction(label=p.label, probs=dict(zip(labels, p.probs, strict=False)), score=p.score,
                                embedding=list(p.embedding), num_tokens=p.num_tokens, truncated=p.truncated,
                                input_index=p.input_index, exit_layer=p.exit_layer, final=p.final)
                     for p in response.predictions],
        metadata=Metadata(m.policy, m.batch_size, m.student_count, m.worker_id, m.gateway_ms, m.tokenize_ms,
                          m.scheduler_ms, m.queue_ms, m.worker_ms, m.compute_ms, m.attempts, m.plot_prefetched,
                          m.scheduler_id, shard_run(m)),
    )


def shard_run(m: pb.InferMetadata) -> ShardRun | None:
    if not m.HasField("shards"):
        return None
    r = m.shards
    return ShardRun(r.layers, r.width, r.mean_bits, r.io_ms, r.stall_ms, r.resident_bytes, r.io_source)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("x-api-key", api_key),) if api_key else ()
