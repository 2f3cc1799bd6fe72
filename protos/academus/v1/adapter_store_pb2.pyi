from academus.v1 import tensors_pb2 as _tensors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutAdapterRequest(_message.Message):
    __slots__ = ("ref", "weights", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REF_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ref: _tensors_pb2.AdapterRef
    weights: bytes
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, ref: _Optional[_Union[_tensors_pb2.AdapterRef, _Mapping]] = ..., weights: _Optional[bytes] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PutAdapterResponse(_message.Message):
    __slots__ = ("ref", "bytes")
    REF_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ref: _tensors_pb2.AdapterRef
    bytes: int
    def __init__(self, ref: _Optional[_Union[_tensors_pb2.AdapterRef, _Mapping]] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("ref", "layers", "head")
    REF_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    ref: _tensors_pb2.AdapterRef
    layers: _containers.RepeatedScalarFieldContainer[int]
    head: bool
    def __init__(self, ref: _Optional[_Union[_tensors_pb2.AdapterRef, _Mapping]] = ..., layers: _Optional[_Iterable[int]] = ..., head: _Optional[bool] = ...) -> None: ...

class GetAdapterResponse(_message.Message):
    __slots__ = ("ref", "weights", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REF_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ref: _tensors_pb2.AdapterRef
    weights: bytes
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, ref: _Optional[_Union[_tensors_pb2.AdapterRef, _Mapping]] = ..., weights: _Optional[bytes] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GetManyRequest(_message.Message):
    __slots__ = ("gets",)
    GETS_FIELD_NUMBER: _ClassVar[int]
    gets: _containers.RepeatedCompositeFieldContainer[GetAdapterRequest]
    def __init__(self, gets: _Optional[_Iterable[_Union[GetAdapterRequest, _Mapping]]] = ...) -> None: ...

class GetManyItem(_message.Message):
    __slots__ = ("adapter", "code", "error")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    adapter: GetAdapterResponse
    code: int
    error: str
    def __init__(self, adapter: _Optional[_Union[GetAdapterResponse, _Mapping]] = ..., code: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class GetManyResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetManyItem]
    def __init__(self, items: _Optional[_Iterable[_Union[GetManyItem, _Mapping]]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("ref", "versions", "bytes", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REF_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ref: _tensors_pb2.AdapterRef
    versions: _containers.RepeatedScalarFieldContainer[int]
    bytes: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, ref: _Optional[_Union[_tensors_pb2.AdapterRef, _Mapping]] = ..., versions: _Optional[_Iterable[int]] = ..., bytes: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: _tensors_pb2.AdapterRef
    def __init__(self, ref: _Optional[_Union[_tensors_pb2.AdapterRef, _Mapping]] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...
