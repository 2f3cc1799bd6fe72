from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelSpec(_message.Message):
    __slots__ = ("name", "kind", "labels", "dim", "max_tokens", "max_students", "default_students", "plot", "lower_layers", "domain", "tokenizer", "architecture", "layers", "memory_bytes", "whole_groups", "pairs", "pooling", "normalized")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STUDENTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STUDENTS_FIELD_NUMBER: _ClassVar[int]
    PLOT_FIELD_NUMBER: _ClassVar[int]
    LOWER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WHOLE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    dim: int
    max_tokens: int
    max_students: int
    default_students: int
    plot: str
    lower_layers: int
    domain: str
    tokenizer: str
    architecture: str
    layers: int
    memory_bytes: int
    whole_groups: bool
    pairs: bool
    pooling: str
    normalized: bool
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., dim: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_students: _Optional[int] = ..., default_students: _Optional[int] = ..., plot: _Optional[str] = ..., lower_layers: _Optional[int] = ..., domain: _Optional[str] = ..., tokenizer: _Optional[str] = ..., architecture: _Optional[str] = ..., layers: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., whole_groups: _Optional[bool] = ..., pairs: _Optional[bool] = ..., pooling: _Optional[str] = ..., normalized: _Optional[bool] = ...) -> None: ...

class ProfilePoint(_message.Message):
    __slots__ = ("model", "instances", "merge", "throughput", "latency_ms")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MERGE_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    model: str
    instances: int
    merge: int
    throughput: float
    latency_ms: float
    def __init__(self, model: _Optional[str] = ..., instances: _Optional[int] = ..., merge: _Optional[int] = ..., throughput: _Optional[float] = ..., latency_ms: _Optional[float] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "models", "device", "capacity", "profile", "node")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    models: _containers.RepeatedCompositeFieldContainer[ModelSpec]
    device: str
    capacity: int
    profile: _containers.RepeatedCompositeFieldContainer[ProfilePoint]
    node: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelSpec, _Mapping]]] = ..., device: _Optional[str] = ..., capacity: _Optional[int] = ..., profile: _Optional[_Iterable[_Union[ProfilePoint, _Mapping]]] = ..., node: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("heartbeat_ttl_s", "capacity")
    HEARTBEAT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ttl_s: int
    capacity: int
    def __init__(self, heartbeat_ttl_s: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListPlacementsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("model", "worker_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., worker_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ListPlacementsResponse(_message.Message):
    __slots__ = ("placements",)
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    def __init__(self, placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ...) -> None: ...
