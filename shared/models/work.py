"""One request's texts end to end, as core objects.

A `WorkItem` is one caller's request at the scheduler. A `Batch` is what one worker call runs: items merged, with
a ConcatBatching plan, a student group member's share or prefetched PLOT states. A `BatchOutput` is what came back.
Protobufs become these at each service's edge (`work_wire.py`) and nowhere else: the scheduler merges, splits and
combines them, the worker runs them. Nothing here imports torch, so the scheduler can use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from academus.shared.models.plot.store import PlotStore

LABEL, SCORE, EMBEDDING = "label", "score", "embedding"   # what the caller asked for; label and score are probs
FINISH_NONE, FINISH_SOFTMAX, FINISH_L2, FINISH_SUM = "", "softmax", "l2", "sum"   # a group member's partial sums


@dataclass(frozen=True)
class AdapterRef:
    """A tenant model's adapter and head (HMI §3.2.2); version 0: the latest. `domain`: its PLOT overlay."""

    tenant: str = ""
    name: str = ""
    version: int = 0
    domain: str = ""


@dataclass(frozen=True)
class PackingPlan:
    """Where each request sits: row → its slots → request indices, in placement order."""

    rows: tuple[tuple[tuple[int, ...], ...], ...]
    row_length: int     # L
    slot_size: int      # z; equal to L for pure ConcatBatching

    @classmethod
    def concat(cls, rows: Sequence[Sequence[int]], row_length: int) -> PackingPlan:
        """Pure ConcatBatching: each row is one slot of L tokens."""
        return cls(tuple((tuple(row),) for row in rows), row_length, row_length)

    @classmethod
    def slotted(cls, rows: Sequence[Sequence[Sequence[int]]], row_length: int, slot_size: int) -> PackingPlan:
        """Slotted ConcatBatching: at most L // z slots of z tokens a row."""
        if not 1 <= slot_size <= row_length:
            raise ValueError(f"slot_size={slot_size} must be within 1..row_length={row_length}")
        for k, row in enumerate(rows):
            if len(row) > row_length // slot_size:
                raise ValueError(f"row {k} has {len(row)} slots; L={row_length} holds {row_length // slot_size}"
                                 f" slots of z={slot_size}")
        return cls(tuple(tuple(tuple(slot) for slot in row) for row in rows), row_length, slot_size)

    def slots(self) -> list[tuple[int, ...]]:
        """The non-empty slots of every row, in row order: the units attention is computed over."""
        return [slot for row in self.rows for slot in row if slot]

    def requests(self) -> list[int]:
        return [i for slot in self.slots() for i in slot]


@dataclass(frozen=True)
class PlotStates:
    """Layer-K states looked up elsewhere (the scheduler's prefetch from a plot service, HMI §6.1),
    the texts' tokens back to back, with the table they came from."""

    states: np.ndarray             # (sum(lengths), hidden) float32
    lengths: np.ndarray
    model: str
    lower_layers: int

    @classmethod
    def merge(cls, parts: Sequence[PlotStates]) -> PlotStates:
        """The parts' states back to back, in order: a merged batch's text order."""
        if len(parts) == 1:
            return parts[0]
        return cls(np.concatenate([p.states for p in parts]), np.concatenate([p.lengths for p in parts]),
                   parts[0].model, parts[0].lower_layers)

    def check(self, store: PlotStore) -> None:
        """Refuses states of another table, or that do not fit the lengths (ValueError)."""
        if (self.model, self.lower_layers) != (store.model, store.lower_layers):
            raise ValueError(f"plot_states come from a {self.model!r} K={self.lower_layers} table; this model "
                             f"serves {store.model!r} K={store.lower_layers}")
        if self.states.shape != (int(np.sum(self.lengths)), store.hidden):
            raise ValueError(f"plot_states has shape {self.states.shape}; the texts need "
                             f"({int(np.sum(self.lengths))}, {store.hidden})")


@dataclass(slots=True)   # not frozen: a frozen dataclass costs a µs more to build, once a request at every hop
class WorkItem:
    """One caller's request for a worker: its texts' tokens back to back, `lengths[i]` of them text i's."""

    model: str
    output: str                          # LABEL, SCORE or EMBEDDING
    input_ids: Sequence[int]
    lengths: Sequence[int]
    token_type_ids: Sequence[int] = ()   # empty: all zero
    adapter: AdapterRef | None = None    # a tenant model: every text runs its adapter and head on the base
    num_students: int = 0                # a student group: students to run; 0: the group's best-pruned k
    early_exit: bool = False             # release texts at confident exit ramps ahead of the full answer
    request_id: str = ""


@dataclass(slots=True)
class Batch:
    """What one worker call runs. Each of `adapters` belongs to one text (empty: no tenant in the batch);
    `student_indices`: a group member runs only these students and answers their additive share;
    `plan`: ConcatBatching rows (None: padded); `plot_states`: the texts' layer-K states, looked up already."""

    model: str
    output: str
    input_ids: Sequence[int]
    lengths: Sequence[int]
    token_type_ids: Sequence[int] = ()
    adapters: tuple[AdapterRef | None, ...] = ()
    num_students: int = 0
    student_indices: tuple[int, ...] = ()
    plan: PackingPlan | None = None
    plot_states: PlotStates | None = None
    early_exit: bool = False
    batch_id: str = ""

    @classmethod
    def of(cls, items: Sequence[WorkItem], plan: PackingPlan | None = None) -> Batch:
        """The items' texts back to back in item order (the plan indexes that order). Tenants' texts share a
        batch with the base's own (HMI §6.3): those get no adapter."""
        first = items[0]
        adapters = () if all(i.adapter is None for i in items) else tuple(
            a for i in items for a in itertools.repeat(i.adapter, len(i.lengths)))
        batch = cls(first.model, first.output, first.input_ids, first.lengths, first.token_type_ids, adapters,
                    first.num_students, plan=plan, early_exit=any(i.early_exit for i in items),
                    batch_id=",".join(i.request_id for i in items))
        if len(items) == 1:
            return batch
        typed = any(i.token_type_ids for i in items)
        return replace(batch, input_ids=[t for i in items for t in i.input_ids],
                       lengths=[n for i in items for n in i.lengths],
                       token_type_ids=[t for i in items for t in (i.token_type_ids or [0] * len(i.input_ids))]
                       if typed else ())

    @property
    def wants_probs(self) -> bool:
        return self.output != EMBEDDING

    def texts(self) -> list[Sequence[int]]:
        """Each text's token ids."""
        return split_flat(self.input_ids, self.lengths, "input_ids")

    def member(self, students: int, indices: Sequence[int]) -> Batch:
        """A student group member's call: these of the group's `students` students, their share only."""
        return replace(self, num_students=students, student_indices=tuple(indices))


def split_flat(flat: Sequence[int], lengths: Sequence[int], name: str) -> list[Sequence[int]]:
    """`flat` cut into consecutive pieces of `lengths`; ValueError naming `name` when they do not add up."""
    if sum(lengths) != len(flat):
        raise ValueError(f"tokens.lengths sum to {sum(lengths)} but tokens.{name} has {len(flat)} ids")
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out


@dataclass(frozen=True)
class ShardRun:
    """What a batch of a model served from shards ran (STI): the submodel planned for the time it had."""

    layers: int
    width: int
    mean_bits: float
    io_ms: float
    stall_ms: float
    resident_bytes: int
    io_source: str


@dataclass(slots=True)
class BatchMeta:
    """What the worker reports of the batch a text ran in."""

    batch_size: int = 0
    student_count: int = 1
    worker_id: str = ""
    compute_ms: float = 0.0
    worker_ms: float = 0.0
    padded_tokens: int = 0
    real_tokens: int = 0
    plot_prefetched: bool = False
    shards: ShardRun | None = None


@dataclass(slots=True)
class BatchOutput:
    """A worker's answer: one row a text. An early answer (exit ramps) holds only `rows` of the batch, released at
    `exit_layer`; a group member's holds partial sums the combiner finishes (`finish`)."""

    values: np.ndarray                   # rows x dim, float32
    labels: Sequence[str] = ()
    meta: BatchMeta = field(default_factory=BatchMeta)
    finish: str = FINISH_NONE
    rows: tuple[int, ...] = ()
    exit_layer: int = 0

    def split(self, counts: Sequence[int]) -> list[BatchOutput]:
        """The answer cut into the merged items' parts, `counts[i]` rows each, in order (views, not copies)."""
        bounds = np.cumsum([0, *counts])
        return [replace(self, values=self.values[a:b]) for a, b in itertools.pairwise(bounds)]
