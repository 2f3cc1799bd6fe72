from academus.v1 import tensors_pb2 as _tensors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("batch", "domain")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    batch: _tensors_pb2.TokenBatch
    domain: str
    def __init__(self, batch: _Optional[_Union[_tensors_pb2.TokenBatch, _Mapping]] = ..., domain: _Optional[str] = ...) -> None: ...

class LookupCounts(_message.Message):
    __slots__ = ("domain", "root", "backoff", "short", "unknown_tokens")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_FIELD_NUMBER: _ClassVar[int]
    SHORT_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    domain: int
    root: int
    backoff: int
    short: int
    unknown_tokens: int
    def __init__(self, domain: _Optional[int] = ..., root: _Optional[int] = ..., backoff: _Optional[int] = ..., short: _Optional[int] = ..., unknown_tokens: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("states", "lengths", "hidden", "dtype", "lower_layers", "model", "counts")
    STATES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOWER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    states: bytes
    lengths: _containers.RepeatedScalarFieldContainer[int]
    hidden: int
    dtype: str
    lower_layers: int
    model: str
    counts: LookupCounts
    def __init__(self, states: _Optional[bytes] = ..., lengths: _Optional[_Iterable[int]] = ..., hidden: _Optional[int] = ..., dtype: _Optional[str] = ..., lower_layers: _Optional[int] = ..., model: _Optional[str] = ..., counts: _Optional[_Union[LookupCounts, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "lower_layers", "hidden", "domains", "root_entries")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOWER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    ROOT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    model: str
    lower_layers: int
    hidden: int
    domains: _containers.RepeatedScalarFieldContainer[str]
    root_entries: int
    def __init__(self, model: _Optional[str] = ..., lower_layers: _Optional[int] = ..., hidden: _Optional[int] = ..., domains: _Optional[_Iterable[str]] = ..., root_entries: _Optional[int] = ...) -> None: ...
