"""Work on the wire: the one place where the hops' messages (`ScheduleRequest`, `RunRequest`, `ModelOutput`)
become core work objects (`work.py`) and back. Each service's edge calls these; its core never sees a protobuf.

A `Matrix` travels as float32 bytes (`Matrix.data`): a 384-wide embedding costs one copy at each end instead of
384 Python floats built and parsed at every hop. `values`, the older repeated field, is still read.
"""

from __future__ import annotations

import functools

import numpy as np
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from academus.shared.models.plot.store import Lookup, LookupCounts
from academus.shared.models.plot.wire import lookup_from_pb, lookup_to_pb
from academus.shared.models.work import (
    EMBEDDING,
    FINISH_L2,
    FINISH_NONE,
    FINISH_SOFTMAX,
    FINISH_SUM,
    LABEL,
    SCORE,
    AdapterRef,
    Batch,
    BatchMeta,
    BatchOutput,
    PackingPlan,
    PlotStates,
    ShardRun,
    WorkItem,
)
from academus.shared.runtime.errors import InvalidArgument
from academus.v1 import inference_pb2, scheduler_pb2, tensors_pb2, worker_pb2

WIRE_FLOAT = np.dtype("<f4")
OUTPUTS = {LABEL: inference_pb2.OUTPUT_LABEL, SCORE: inference_pb2.OUTPUT_SCORE,
           EMBEDDING: inference_pb2.OUTPUT_EMBEDDING}
OUTPUT_NAMES = {enum: name for name, enum in OUTPUTS.items()} | {inference_pb2.OUTPUT_UNSPECIFIED: ""}
FINISHES = {FINISH_NONE: tensors_pb2.FINISH_NONE, FINISH_SOFTMAX: tensors_pb2.FINISH_SOFTMAX,
            FINISH_L2: tensors_pb2.FINISH_L2, FINISH_SUM: tensors_pb2.FINISH_SUM}
FINISH_NAMES = {enum: name for name, enum in FINISHES.items()}


def matrix_to_pb(values: np.ndarray) -> tensors_pb2.Matrix:
    rows, dim = values.shape
    return tensors_pb2.Matrix(data=np.ascontiguousarray(values, dtype=WIRE_FLOAT).tobytes(), rows=rows, dim=dim)


def matrix_from_pb(matrix: tensors_pb2.Matrix) -> np.ndarray:
    """rows x dim float32 (a read-only view of the message's bytes); a size that does not match is refused."""
    flat = np.frombuffer(matrix.data, dtype=WIRE_FLOAT) if matrix.data else np.asarray(matrix.values, np.float32)
    if flat.size != matrix.rows * matrix.dim:
        raise InvalidArgument(f"values holds {flat.size} floats, not rows x dim = {matrix.rows} x {matrix.dim}")
    return flat.reshape(matrix.rows, matrix.dim)


def merge_floats(message: Message, field: str, values: np.ndarray) -> None:
    """Appends `values` to the repeated float `field` of `message` through the field's wire form (tag, length,
    little-endian float32s), which protobuf copies in C. Filling the field from a Python list builds a float object
    for each value: 4-7x slower for a 384-768-wide embedding (`loadgen/probes/embedding_fill.py`)."""
    raw = np.ascontiguousarray(values, dtype=WIRE_FLOAT).tobytes()
    message.MergeFromString(_packed_tag(message.DESCRIPTOR, field) + _varint(len(raw)) + raw)


@functools.cache
def _packed_tag(descriptor: Descriptor, field: str) -> bytes:
    """A length-delimited field's tag, worked out once a field (every prediction of a response fills one)."""
    return _varint(descriptor.fields_by_name[field].number << 3 | 2)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def adapter_to_pb(adapter: AdapterRef | None) -> tensors_pb2.AdapterRef:
    if adapter is None:
        return tensors_pb2.AdapterRef()
    return tensors_pb2.AdapterRef(tenant=adapter.tenant, name=adapter.name, version=adapter.version,
                                  domain=adapter.domain)


def adapter_from_pb(adapter: tensors_pb2.AdapterRef) -> AdapterRef | None:
    """None for an empty entry: that text runs no adapter."""
    if not adapter.tenant:
        return None
    return AdapterRef(adapter.tenant, adapter.name, adapter.version, adapter.domain)


def item_from_pb(request: scheduler_pb2.ScheduleRequest, num_students: int, early_exit: bool) -> WorkItem:
    tokens = request.tokens
    return WorkItem(request.model, OUTPUT_NAMES.get(request.output, ""), list(tokens.input_ids), list(tokens.lengths),
                    list(tokens.token_type_ids),
                    adapter_from_pb(request.adapter) if request.HasField("adapter") else None,
                    num_students, early_exit, request.request_id)


def batch_to_pb(batch: Batch) -> worker_pb2.RunRequest:
    request = worker_pb2.RunRequest(
        batch_id=batch.batch_id, model=batch.model, output=OUTPUTS.get(batch.output, 0),
        tokens=tensors_pb2.TokenBatch(input_ids=batch.input_ids, lengths=batch.lengths,
                                      token_type_ids=batch.token_type_ids))
    if batch.num_students:   # only what is set: each keyword costs on every call
        request.num_students = batch.num_students
    if batch.student_indices:
        request.student_indices.extend(batch.student_indices)
    if batch.early_exit:
        request.early_exit = True
    if batch.adapters:
        request.adapters.extend(adapter_to_pb(a) for a in batch.adapters)
    if batch.plan is not None:
        request.packing.CopyFrom(plan_to_pb(batch.plan))
    if batch.plot_states is not None:
        states = batch.plot_states
        request.plot_states.CopyFrom(lookup_to_pb(Lookup(states.states, states.lengths, LookupCounts()),
                                                  states.model, states.lower_layers))
    return request


def batch_from_pb(request: worker_pb2.RunRequest) -> Batch:
    """The worker's batch; a malformed plan or PLOT states are INVALID_ARGUMENT naming the field."""
    tokens = request.tokens
    return Batch(request.model, OUTPUT_NAMES.get(request.output, ""), list(tokens.input_ids), list(tokens.lengths),
                 list(tokens.token_type_ids), tuple(adapter_from_pb(a) for a in request.adapters), request.num_students,
                 tuple(request.student_indices), plan_from_pb(request), plot_states_from_pb(request),
                 request.early_exit, request.batch_id)


def plan_to_pb(plan: PackingPlan) -> worker_pb2.PackingPlan:
    return worker_pb2.PackingPlan(row_length=plan.row_length, slot_size=plan.slot_size, rows=[
        worker_pb2.PackedRow(slots=[worker_pb2.PackedSlot(requests=slot) for slot in row]) for row in plan.rows])


def plan_from_pb(request: worker_pb2.RunRequest) -> PackingPlan | None:
    """The scheduler's ConcatBatching plan (None: run padded); a malformed one is INVALID_ARGUMENT."""
    if not request.HasField("packing"):
        return None
    plan = request.packing
    rows = [[list(slot.requests) for slot in row.slots] for row in plan.rows]
    if plan.row_length < 1:
        raise InvalidArgument(f"packing.row_length={plan.row_length} must be at least 1")
    try:
        return PackingPlan.slotted(rows, plan.row_length, plan.slot_size or plan.row_length)
    except ValueError as e:
        raise InvalidArgument(f"packing: {e}") from e


def plot_states_from_pb(request: worker_pb2.RunRequest) -> PlotStates | None:
    """The layer-K states the scheduler prefetched (HMI §6.1); None: the worker looks them up itself."""
    if not request.HasField("plot_states"):
        return None
    plot = request.plot_states
    if list(plot.lengths) != list(request.tokens.lengths):
        raise InvalidArgument(f"plot_states.lengths {list(plot.lengths)[:8]} do not match tokens.lengths "
                              f"{list(request.tokens.lengths)[:8]}")
    try:
        lookup = lookup_from_pb(plot)
    except ValueError as e:  # another dtype, or bytes that are not lengths x hidden
        raise InvalidArgument(f"plot_states: {e}") from e
    return PlotStates(lookup.states, lookup.lengths, plot.model, plot.lower_layers)


def shard_run_to_pb(run: ShardRun | None) -> inference_pb2.ShardRun | None:
    if run is None:
        return None
    return inference_pb2.ShardRun(layers=run.layers, width=run.width, mean_bits=run.mean_bits, io_ms=run.io_ms,
                                  stall_ms=run.stall_ms, resident_bytes=run.resident_bytes, io_source=run.io_source)


def shard_run_from_pb(meta: inference_pb2.InferMetadata) -> ShardRun | None:
    if not meta.HasField("shards"):
        return None
    s = meta.shards
    return ShardRun(s.layers, s.width, s.mean_bits, s.io_ms, s.stall_ms, s.resident_bytes, s.io_source)


def meta_to_pb(meta: BatchMeta, **scheduler: object) -> inference_pb2.InferMetadata:
    """The batch's metadata; `scheduler`: the scheduler's own fields (policy, queue_ms, ...)."""
    return inference_pb2.InferMetadata(
        batch_size=meta.batch_size, student_count=meta.student_count, worker_id=meta.worker_id,
        compute_ms=meta.compute_ms, worker_ms=meta.worker_ms, padded_tokens=meta.padded_tokens,
        real_tokens=meta.real_tokens, plot_prefetched=meta.plot_prefetched, shards=shard_run_to_pb(meta.shards),
        **scheduler)


def meta_from_pb(meta: inference_pb2.InferMetadata) -> BatchMeta:
    return BatchMeta(meta.batch_size, meta.student_count, meta.worker_id, meta.compute_ms, meta.worker_ms,
                     meta.padded_tokens, meta.real_tokens, meta.plot_prefetched, shard_run_from_pb(meta))


def output_to_pb(output: BatchOutput, kind: str, **scheduler: object) -> tensors_pb2.ModelOutput:
    """`kind`: what the caller asked for (LABEL, SCORE, EMBEDDING); `scheduler`: its metadata fields."""
    message = tensors_pb2.ModelOutput(output=OUTPUTS.get(kind, 0), values=matrix_to_pb(output.values),
                                      metadata=meta_to_pb(output.meta, **scheduler))
    if output.labels:
        message.labels.extend(output.labels)
    if output.finish:
        message.finish = FINISHES[output.finish]
    if output.rows:
        message.rows.extend(output.rows)
        message.exit_layer = output.exit_layer
    return message


def output_from_pb(output: tensors_pb2.ModelOutput) -> BatchOutput:
    return BatchOutput(matrix_from_pb(output.values), list(output.labels), meta_from_pb(output.metadata),
                       FINISH_NAMES.get(output.finish, FINISH_NONE), tuple(output.rows), output.exit_layer)
