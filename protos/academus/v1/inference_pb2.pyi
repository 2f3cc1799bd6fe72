from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_UNSPECIFIED: _ClassVar[Output]
    OUTPUT_LABEL: _ClassVar[Output]
    OUTPUT_SCORE: _ClassVar[Output]
    OUTPUT_EMBEDDING: _ClassVar[Output]
OUTPUT_UNSPECIFIED: Output
OUTPUT_LABEL: Output
OUTPUT_SCORE: Output
OUTPUT_EMBEDDING: Output

class TextInput(_message.Message):
    __slots__ = ("text", "text_pair")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXT_PAIR_FIELD_NUMBER: _ClassVar[int]
    text: str
    text_pair: str
    def __init__(self, text: _Optional[str] = ..., text_pair: _Optional[str] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("model", "inputs", "output", "truncate", "request_id", "policy", "early_exit")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXIT_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[TextInput]
    output: Output
    truncate: bool
    request_id: str
    policy: str
    early_exit: bool
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TextInput, _Mapping]]] = ..., output: _Optional[_Union[Output, str]] = ..., truncate: _Optional[bool] = ..., request_id: _Optional[str] = ..., policy: _Optional[str] = ..., early_exit: _Optional[bool] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("label", "probs", "score", "embedding", "num_tokens", "truncated", "input_index", "exit_layer", "final")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    INPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    label: str
    probs: _containers.RepeatedScalarFieldContainer[float]
    score: float
    embedding: _containers.RepeatedScalarFieldContainer[float]
    num_tokens: int
    truncated: bool
    input_index: int
    exit_layer: int
    final: bool
    def __init__(self, label: _Optional[str] = ..., probs: _Optional[_Iterable[float]] = ..., score: _Optional[float] = ..., embedding: _Optional[_Iterable[float]] = ..., num_tokens: _Optional[int] = ..., truncated: _Optional[bool] = ..., input_index: _Optional[int] = ..., exit_layer: _Optional[int] = ..., final: _Optional[bool] = ...) -> None: ...

class InferMetadata(_message.Message):
    __slots__ = ("policy", "batch_size", "student_count", "worker_id", "gateway_ms", "tokenize_ms", "scheduler_ms", "queue_ms", "worker_ms", "compute_ms", "padded_tokens", "real_tokens", "attempts", "plot_prefetched", "scheduler_id", "shards")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STUDENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_MS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    PLOT_PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
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
    padded_tokens: int
    real_tokens: int
    attempts: int
    plot_prefetched: bool
    scheduler_id: str
    shards: ShardRun
    def __init__(self, policy: _Optional[str] = ..., batch_size: _Optional[int] = ..., student_count: _Optional[int] = ..., worker_id: _Optional[str] = ..., gateway_ms: _Optional[float] = ..., tokenize_ms: _Optional[float] = ..., scheduler_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., worker_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., padded_tokens: _Optional[int] = ..., real_tokens: _Optional[int] = ..., attempts: _Optional[int] = ..., plot_prefetched: _Optional[bool] = ..., scheduler_id: _Optional[str] = ..., shards: _Optional[_Union[ShardRun, _Mapping]] = ...) -> None: ...

class ShardRun(_message.Message):
    __slots__ = ("layers", "width", "mean_bits", "io_ms", "stall_ms", "resident_bytes", "io_source")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    MEAN_BITS_FIELD_NUMBER: _ClassVar[int]
    IO_MS_FIELD_NUMBER: _ClassVar[int]
    STALL_MS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    IO_SOURCE_FIELD_NUMBER: _ClassVar[int]
    layers: int
    width: int
    mean_bits: float
    io_ms: float
    stall_ms: float
    resident_bytes: int
    io_source: str
    def __init__(self, layers: _Optional[int] = ..., width: _Optional[int] = ..., mean_bits: _Optional[float] = ..., io_ms: _Optional[float] = ..., stall_ms: _Optional[float] = ..., resident_bytes: _Optional[int] = ..., io_source: _Optional[str] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("model", "request_id", "labels", "predictions", "metadata")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    metadata: InferMetadata
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., metadata: _Optional[_Union[InferMetadata, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "kind", "labels", "dim", "max_tokens", "base", "status", "architecture", "layers", "pairs", "pooling", "normalized")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    dim: int
    max_tokens: int
    base: str
    status: str
    architecture: str
    layers: int
    pairs: bool
    pooling: str
    normalized: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., dim: _Optional[int] = ..., max_tokens: _Optional[int] = ..., base: _Optional[str] = ..., status: _Optional[str] = ..., architecture: _Optional[str] = ..., layers: _Optional[int] = ..., pairs: _Optional[bool] = ..., pooling: _Optional[str] = ..., normalized: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "texts", "without_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    without_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., without_special_tokens: _Optional[bool] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "special", "start", "stop")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    special: bool
    start: int
    stop: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., special: _Optional[bool] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TokenizedText(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedCompositeFieldContainer[TokenizedText]
    def __init__(self, texts: _Optional[_Iterable[_Union[TokenizedText, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("model", "texts", "keep_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedCompositeFieldContainer[TokenIds]
    keep_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., keep_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...
