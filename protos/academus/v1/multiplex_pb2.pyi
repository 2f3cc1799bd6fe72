from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MetadataEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class CallFrame(_message.Message):
    __slots__ = ("id", "method", "payload", "timeout_s", "metadata", "cancel", "sent_s", "batch")
    ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SENT_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    id: int
    method: str
    payload: bytes
    timeout_s: float
    metadata: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    cancel: bool
    sent_s: float
    batch: _containers.RepeatedCompositeFieldContainer[CallFrame]
    def __init__(self, id: _Optional[int] = ..., method: _Optional[str] = ..., payload: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., metadata: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ..., cancel: _Optional[bool] = ..., sent_s: _Optional[float] = ..., batch: _Optional[_Iterable[_Union[CallFrame, _Mapping]]] = ...) -> None: ...

class ReplyFrame(_message.Message):
    __slots__ = ("id", "code", "details", "payload", "trailers", "more", "batch", "partial")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TRAILERS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    details: str
    payload: bytes
    trailers: _containers.RepeatedCompositeFieldContainer[MetadataEntry]
    more: bool
    batch: _containers.RepeatedCompositeFieldContainer[ReplyFrame]
    partial: bool
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., payload: _Optional[bytes] = ..., trailers: _Optional[_Iterable[_Union[MetadataEntry, _Mapping]]] = ..., more: _Optional[bool] = ..., batch: _Optional[_Iterable[_Union[ReplyFrame, _Mapping]]] = ..., partial: _Optional[bool] = ...) -> None: ...
