from academus.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Finish(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_NONE: _ClassVar[Finish]
    FINISH_SOFTMAX: _ClassVar[Finish]
    FINISH_L2: _ClassVar[Finish]
    FINISH_SUM: _ClassVar[Finish]
FINISH_NONE: Finish
FINISH_SOFTMAX: Finish
FINISH_L2: Finish
FINISH_SUM: Finish

class TokenBatch(_message.Message):
    __slots__ = ("input_ids", "token_type_ids", "lengths")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TYPE_IDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    token_type_ids: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, input_ids: _Optional[_Iterable[int]] = ..., token_type_ids: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class Matrix(_message.Message):
    __slots__ = ("values", "rows", "dim", "data")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    rows: int
    dim: int
    data: bytes
    def __init__(self, values: _Optional[_Iterable[float]] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ModelOutput(_message.Message):
    __slots__ = ("output", "values", "labels", "metadata", "finish", "rows", "exit_layer")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    EXIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    output: _inference_pb2.Output
    values: Matrix
    labels: _containers.RepeatedScalarFieldContainer[str]
    metadata: _inference_pb2.InferMetadata
    finish: Finish
    rows: _containers.RepeatedScalarFieldContainer[int]
    exit_layer: int
    def __init__(self, output: _Optional[_Union[_inference_pb2.Output, str]] = ..., values: _Optional[_Union[Matrix, _Mapping]] = ..., labels: _Optional[_Iterable[str]] = ..., metadata: _Optional[_Union[_inference_pb2.InferMetadata, _Mapping]] = ..., finish: _Optional[_Union[Finish, str]] = ..., rows: _Optional[_Iterable[int]] = ..., exit_layer: _Optional[int] = ...) -> None: ...

class AdapterRef(_message.Message):
    __slots__ = ("tenant", "name", "version", "domain")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    version: int
    domain: str
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[int] = ..., domain: _Optional[str] = ...) -> None: ...
