from academus.v1 import inference_pb2 as _inference_pb2
from academus.v1 import tensors_pb2 as _tensors_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "model", "tenant", "output", "tokens", "adapter", "early_exit")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    tenant: str
    output: _inference_pb2.Output
    tokens: _tensors_pb2.TokenBatch
    adapter: _tensors_pb2.AdapterRef
    early_exit: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., output: _Optional[_Union[_inference_pb2.Output, str]] = ..., tokens: _Optional[_Union[_tensors_pb2.TokenBatch, _Mapping]] = ..., adapter: _Optional[_Union[_tensors_pb2.AdapterRef, _Mapping]] = ..., early_exit: _Optional[bool] = ...) -> None: ...
