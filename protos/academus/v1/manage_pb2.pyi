from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATUS_UNSPECIFIED: _ClassVar[JobStatus]
    JOB_STATUS_QUEUED: _ClassVar[JobStatus]
    JOB_STATUS_RUNNING: _ClassVar[JobStatus]
    JOB_STATUS_SUCCEEDED: _ClassVar[JobStatus]
    JOB_STATUS_FAILED: _ClassVar[JobStatus]
JOB_STATUS_UNSPECIFIED: JobStatus
JOB_STATUS_QUEUED: JobStatus
JOB_STATUS_RUNNING: JobStatus
JOB_STATUS_SUCCEEDED: JobStatus
JOB_STATUS_FAILED: JobStatus

class AddModelRequest(_message.Message):
    __slots__ = ("name", "source", "task", "pooling")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: str
    task: str
    pooling: str
    def __init__(self, name: _Optional[str] = ..., source: _Optional[str] = ..., task: _Optional[str] = ..., pooling: _Optional[str] = ...) -> None: ...

class RemoveModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "kind", "status", "progress", "message", "result_json", "target", "created", "updated")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    kind: str
    status: JobStatus
    progress: float
    message: str
    result_json: str
    target: str
    created: float
    updated: float
    def __init__(self, id: _Optional[str] = ..., kind: _Optional[str] = ..., status: _Optional[_Union[JobStatus, str]] = ..., progress: _Optional[float] = ..., message: _Optional[str] = ..., result_json: _Optional[str] = ..., target: _Optional[str] = ..., created: _Optional[float] = ..., updated: _Optional[float] = ...) -> None: ...

class CreateDomainRequest(_message.Message):
    __slots__ = ("name", "corpus", "top_percent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    TOP_PERCENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    corpus: bytes
    top_percent: float
    def __init__(self, name: _Optional[str] = ..., corpus: _Optional[bytes] = ..., top_percent: _Optional[float] = ...) -> None: ...

class Domain(_message.Message):
    __slots__ = ("name", "status", "top_percent", "job_id", "message", "created", "lines")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOP_PERCENT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: str
    top_percent: float
    job_id: str
    message: str
    created: float
    lines: int
    def __init__(self, name: _Optional[str] = ..., status: _Optional[str] = ..., top_percent: _Optional[float] = ..., job_id: _Optional[str] = ..., message: _Optional[str] = ..., created: _Optional[float] = ..., lines: _Optional[int] = ...) -> None: ...

class ListDomainsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDomainsResponse(_message.Message):
    __slots__ = ("domains",)
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    domains: _containers.RepeatedCompositeFieldContainer[Domain]
    def __init__(self, domains: _Optional[_Iterable[_Union[Domain, _Mapping]]] = ...) -> None: ...

class DeleteDomainRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteDomainResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class CreateTenantModelRequest(_message.Message):
    __slots__ = ("name", "base", "domain", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    base: str
    domain: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., base: _Optional[str] = ..., domain: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateTenantModelRequest(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class TenantModel(_message.Message):
    __slots__ = ("name", "base", "domain", "version", "labels", "status", "job_id", "message", "created")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    name: str
    base: str
    domain: str
    version: int
    labels: _containers.RepeatedScalarFieldContainer[str]
    status: str
    job_id: str
    message: str
    created: float
    def __init__(self, name: _Optional[str] = ..., base: _Optional[str] = ..., domain: _Optional[str] = ..., version: _Optional[int] = ..., labels: _Optional[_Iterable[str]] = ..., status: _Optional[str] = ..., job_id: _Optional[str] = ..., message: _Optional[str] = ..., created: _Optional[float] = ...) -> None: ...

class ListTenantModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTenantModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[TenantModel]
    def __init__(self, models: _Optional[_Iterable[_Union[TenantModel, _Mapping]]] = ...) -> None: ...

class DeleteTenantModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTenantModelResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...
