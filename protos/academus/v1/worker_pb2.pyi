from academus.v1 import inference_pb2 as _inference_pb2
from academus.v1 import plot_pb2 as _plot_pb2
from academus.v1 import tensors_pb2 as _tensors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunRequest(_message.Message):
    __slots__ = ("batch_id", "model", "output", "tokens", "num_students", "student_indices", "packing", "adapters", "plot_states", "early_exit")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STUDENTS_FIELD_NUMBER: _ClassVar[int]
    STUDENT_INDICES_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    PLOT_STATES_FIELD_NUMBER: _ClassVar[int]
    EARLY_EXIT_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    model: str
    output: _inference_pb2.Output
    tokens: _tensors_pb2.TokenBatch
    num_students: int
    student_indices: _containers.RepeatedScalarFieldContainer[int]
    packing: PackingPlan
    adapters: _containers.RepeatedCompositeFieldContainer[_tensors_pb2.AdapterRef]
    plot_states: _plot_pb2.LookupResponse
    early_exit: bool
    def __init__(self, batch_id: _Optional[str] = ..., model: _Optional[str] = ..., output: _Optional[_Union[_inference_pb2.Output, str]] = ..., tokens: _Optional[_Union[_tensors_pb2.TokenBatch, _Mapping]] = ..., num_students: _Optional[int] = ..., student_indices: _Optional[_Iterable[int]] = ..., packing: _Optional[_Union[PackingPlan, _Mapping]] = ..., adapters: _Optional[_Iterable[_Union[_tensors_pb2.AdapterRef, _Mapping]]] = ..., plot_states: _Optional[_Union[_plot_pb2.LookupResponse, _Mapping]] = ..., early_exit: _Optional[bool] = ...) -> None: ...

class PackingPlan(_message.Message):
    __slots__ = ("row_length", "slot_size", "rows")
    ROW_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    row_length: int
    slot_size: int
    rows: _containers.RepeatedCompositeFieldContainer[PackedRow]
    def __init__(self, row_length: _Optional[int] = ..., slot_size: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[PackedRow, _Mapping]]] = ...) -> None: ...

class PackedRow(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[PackedSlot]
    def __init__(self, slots: _Optional[_Iterable[_Union[PackedSlot, _Mapping]]] = ...) -> None: ...

class PackedSlot(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, requests: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardBudgetRequest(_message.Message):
    __slots__ = ("model", "budget_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    budget_bytes: int
    def __init__(self, model: _Optional[str] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class ShardBudgetResponse(_message.Message):
    __slots__ = ("budget_bytes", "resident_bytes")
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    budget_bytes: int
    resident_bytes: int
    def __init__(self, budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ...) -> None: ...
