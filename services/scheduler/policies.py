"""Dispatch policies behind one interface (DESIGN.md §5); chosen by name through `make_policy`.

A policy only holds waiting jobs and forms batches; the Dispatcher owns groups, deadlines and
admission. `fifo` (one request a dispatch, no waiting), `padded` (the classic dynamic batcher,
Triton-style), `student` (Student Parallelism's immediate dispatch + length-aware buffer), `concat`
(TCB: DAS row selection + ConcatBatching, pure or slotted, or the FCFS/SJF/EDF row fills) and
`bucketed` (TurboBatching-like length buckets, padded).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import filterfalse
from typing import TYPE_CHECKING, cast

from academus.services.scheduler import das
from academus.services.scheduler.buffer import LengthAwareBuffer
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument, ServingError

if TYPE_CHECKING:
    from academus.services.scheduler.core import Job

Accepts = Callable[["Job"], bool]


class DispatchPolicy(ABC):
    """Holds jobs until a worker frees; hands out the next batch that worker can run."""

    name: str
    sends_ahead = False  # never holds a batch back to grow: a busy group may be sent its next one

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()
        self.max_wait_s = 0.0   # the queue's wait bound (0: none), for a policy that reorders jobs

    def bound_wait(self, seconds: float) -> None:
        """The wait admission promised each job (ACADEMUS_MAX_QUEUE_WAIT_MS): a policy that passes jobs over
        (DAS) starts one that reached it first. `fifo`, `padded` and the student buffer keep it by their arrival
        order; the baselines (`bucketed`, the FCFS/SJF/EDF row fills) stay as their papers have them."""
        self.max_wait_s = seconds

    def push(self, job: Job, now: float, front: bool = False) -> None:
        """Adds a job; `front` puts a retried job back at the head."""
        if front:
            self._jobs.appendleft(job)
        else:
            self._jobs.append(job)

    @abstractmethod
    def next_batch(self, accepts: Accepts, now: float) -> list[Job]:
        """Removes and returns the jobs to run together now on a worker that `accepts` them ([] if none)."""

    def wake_at(self) -> float | None:
        """When a held-back batch becomes ready on its own (None: only new jobs or a freed worker change it)."""
        return None

    def resize(self, groups: int) -> None:
        """The dispatcher's live group count changed: the student buffer's capacity follows it, and `concat`
        counts how soon the batches after this one start."""
        return None

    def ahead_of_merge(self, job: Job) -> int | None:
        """Dispatch units ahead of the waiting one `job` would join on arrival, at most (None: it would
        wait behind all of them)."""
        return None

    def depth(self, model: str | None = None) -> int:
        """Waiting dispatch units (buffer elements for `student`, jobs otherwise): the load signal; with
        `model`, only that model's (O(n): for a deployment of several models)."""
        return len(self.waiting_of(model))

    def batches_ahead(self, model: str | None = None) -> int:
        """The batches the waiting jobs will form, at least: what the admission estimate multiplies by one
        batch time (`depth` unless a policy merges waiting jobs into fewer batches)."""
        return self.depth(model)

    def waiting_of(self, model: str | None) -> Sequence[Job]:
        """The waiting jobs; with `model`, only that model's."""
        return self._jobs if model is None else [j for j in self._jobs if j.model == model]

    def take_dropped(self) -> list[tuple[Job, ServingError]]:
        """Jobs the policy took out unrun since the last call (e.g. DAS found they cannot meet their
        deadline), each with the error to answer it with; the Dispatcher settles them."""
        return []

    def observe(self, batch: list[Job], seconds: float) -> None:
        """A batch this policy formed ran in `seconds` (policies with a latency model learn from it)."""
        return None

    def computed_tokens(self, batch: list[Job]) -> int | None:
        """The tokens `batch`, formed by this policy, computes: what its time grows with (None: the policy
        does not shape its batches by tokens)."""
        return None

    def full_batch_tokens(self) -> int | None:
        """The tokens of each batch `batches_ahead` counts (None: its batches have no fixed shape)."""
        return None

    def stats(self) -> dict[str, float]:
        """Counters for the scheduler's load report."""
        return {}

    def remove(self, predicate: Callable[[Job], bool]) -> list[Job]:
        """Takes out every waiting job matching `predicate` (expired, orphaned)."""
        kept, removed = deque(), []
        for job in self._jobs:
            (removed if predicate(job) else kept).append(job)
        self._jobs = kept
        return removed

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._jobs)

    def _take(self, job: Job) -> Job:
        self._jobs.remove(job)
        return job


class FifoPolicy(DispatchPolicy):
    """First come, first served, one request a dispatch, never waiting while a worker is idle."""

    name = "fifo"

    def next_batch(self, accepts: Accepts, now: float) -> list[Job]:
        for job in self._jobs:
            if accepts(job):
                return [self._take(job)]
        return []


class PaddedPolicy(DispatchPolicy):
    """The classic dynamic batcher (the baseline): the oldest job's model and output form a batch of up
    to `max_batch` texts, padded to the longest; it waits up to `max_delay_s` for the batch to fill."""

    name = "padded"

    def __init__(self, max_batch: int = 32, max_delay_s: float = 0.010) -> None:
        super().__init__()
        if max_batch < 1 or max_delay_s < 0:
            raise ValueError(f"padded policy needs max_batch >= 1 and max_delay_s >= 0, got {max_batch}, {max_delay_s}")
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s

    def next_batch(self, accepts: Accepts, now: float) -> list[Job]:
        head = next((j for j in self._jobs if accepts(j)), None)
        if head is None:
            return []
        mates = [j for j in self._jobs if j.batch_key == head.batch_key and accepts(j)]
        texts = sum(j.num_texts for j in mates)
        if texts < self.max_batch and now < head.enqueued_at + self.max_delay_s:
            return []  # not full yet and the head may still wait
        batch, size = [], 0
        for job in mates:
            if batch and size + job.num_texts > self.max_batch:
                break
            batch.append(self._take(job))
            size += job.num_texts
        return batch

    def wake_at(self) -> float | None:
        return min((j.enqueued_at + self.max_delay_s for j in self._jobs), default=None)

    def depth(self, model: str | None = None) -> int:
        """Waiting batches, not jobs: the admission check multiplies it by one batch time."""
        return math.ceil(len(self.waiting_of(model)) / self.max_batch)


class StudentPolicy(DispatchPolicy):
    """Student Parallelism's dispatch (§3.3.2, App. B.4.2): a sample goes at once to an idle group;
    only while every group is busy does it wait in the length-aware buffer, merging with samples of
    its length bin, and a freed group takes the head element at once, never waiting to fill a batch.

    The buffer holds at most one element per group (its capacity follows `resize`); beyond it jobs
    wait in arrival order in the admission queue, whose bound the Dispatcher enforces. Merging takes no
    buffer place, so a sample whose bin has a buffered element with room joins it at once even while
    others queue, and an element that enters the buffer takes the queued samples of its bin (up to
    max_merge, in arrival order): under load elements fill instead of running one sample each. Queued
    jobs are indexed by bin as well, so both stay O(1) per job (a job taken through one index is
    skipped lazily in the other).

    Overload merge (ours, not the paper's): while a whole buffer's worth of samples (an element of
    `max_merge` a group) waits beyond the buffer, elements grow to `overload_merge` samples. Those samples
    wait for running elements either way, and one call of eight costs a CPU worker less than two of four
    (fewer hops, larger matmuls): at capacity on two cores the students served 1.17-1.19x as many requests,
    at lower latency (docs/benchmarks/scheduling.md). Short of that the paper's `max_merge` holds, so
    a sample that meets a brief cluster of arrivals does not wait on a larger batch (with the bound raised
    whenever the buffer was full, the students' p95 at half load rose by 2 ms). `overload_merge` equal to
    `max_merge` is the paper's buffer exactly (the ablation).
    """

    name = "student"
    sends_ahead = True

    def __init__(self, max_merge: int = 4, bin_width: int = 8, max_length: int = 128,
                 overload_merge: int = 0) -> None:
        super().__init__()
        self.buffer = LengthAwareBuffer(max_merge, bin_width, max_length)
        self.max_merge, self.overload_merge = max_merge, overload_merge
        self.capacity = 1
        self.merged = 0                # samples that joined an existing element (a metric)
        self._queued: dict[int, Job] = {}            # the admission queue's live jobs, by id
        self._by_key: dict[Hashable, deque[Job]] = {}  # the same jobs per buffer key, in arrival order
        self._queued_texts: Counter[tuple[str, Hashable]] = Counter()  # (model, buffer key) -> queued texts

    def resize(self, groups: int) -> None:
        self.capacity = max(1, groups)
        self._refill()

    def set_max_merge(self, max_merge: int) -> None:
        """The profiled merge bound (App. B.4.1); the overload bound keeps its ratio to it when derived.
        Called with every load report: only a changed bound re-bounds the buffer."""
        if max_merge == self.max_merge:
            return
        self.max_merge = max_merge
        self._bound()

    def _bound(self) -> None:
        """The buffer's merge bound for its state now: the overload bound while a full buffer's worth of
        samples is queued beyond it."""
        overloaded = len(self._queued) >= self.capacity * self.max_merge
        bound = max(self.overload_merge or 2 * self.max_merge, self.max_merge) if overloaded else self.max_merge
        rose, self.buffer.max_merge = bound > self.buffer.max_merge, bound
        if rose:   # queued samples fill the elements that now have room before any later arrival joins them
            for key in self.buffer.tail_keys():
                self._merge_waiting(key)
            self._bound()   # fewer queued now: the bound may fall back (it cannot rise again)

    def ahead_of_merge(self, job: Job) -> int | None:
        return self.buffer.ahead_of_merge(job)

    def push(self, job: Job, now: float, front: bool = False) -> None:
        if front:
            self.buffer.push_front(job)
        elif self.buffer.merges(job):
            self.merged += self.buffer.push(job)
        elif self._queued or len(self.buffer) >= self.capacity:
            self._queued[id(job)] = job
            self._queued_texts[job.model, self.buffer.key_of(job)] += job.num_texts
            self._jobs.append(job)
            self._by_key.setdefault(self.buffer.key_of(job), deque()).append(job)
        else:
            self.buffer.push(job)
        self._bound()

    def next_batch(self, accepts: Accepts, now: float) -> list[Job]:
        element = self.buffer.pop(accepts)
        if element is None and self._queued:  # the head of the admission queue may suit this group
            job = next((j for j in self._waiting() if accepts(j)), None)
            if job is None:
                return []
            self._unqueue(job)
            self._refill()
            return [job]
        self._refill()
        return element.jobs if element is not None else []

    def _refill(self) -> None:
        """Queued jobs enter the buffer in arrival order while it has room; each then draws its bin's
        queued jobs into its element."""
        self._bound()
        while self._queued:
            job = self._head()
            if len(self.buffer) >= self.capacity and not self.buffer.merges(job):
                return
            self._jobs.popleft()
            self._unqueue(job)
            self.merged += self.buffer.push(job)
            self._merge_waiting(self.buffer.key_of(job))
            self._bound()   # each step takes from the queue: the bound can only fall back
        self._jobs.clear()     # only entries already taken through the other index are left: let them go
        self._by_key.clear()

    def _head(self) -> Job:
        """The oldest queued job (entries already taken through their bin are dropped on the way)."""
        while id(self._jobs[0]) not in self._queued:
            self._jobs.popleft()
        return self._jobs[0]

    def _merge_waiting(self, key: Hashable) -> None:
        """Queued jobs of `key` join its tail element while they fit, oldest first."""
        waiting = self._by_key.get(key)
        while waiting:
            job = waiting[0]
            if id(job) in self._queued:
                if not self.buffer.merges(job):
                    return
                self._unqueue(job)
                self.merged += self.buffer.push(job)
            waiting.popleft()
        self._by_key.pop(key, None)

    def _unqueue(self, job: Job) -> None:
        del self._queued[id(job)]
        key = job.model, self.buffer.key_of(job)
        self._queued_texts[key] -= job.num_texts
        if self._queued_texts[key] <= 0:
            del self._queued_texts[key]

    def _waiting(self) -> Iterator[Job]:
        return (j for j in self._jobs if id(j) in self._queued)

    def remove(self, predicate: Callable[[Job], bool]) -> list[Job]:
        removed = self.buffer.remove(predicate)
        for job in [j for j in self._waiting() if predicate(j)]:
            self._unqueue(job)
            removed.append(job)
        self._jobs = deque(self._waiting())
        self._bound()
        for key in self.buffer.tail_keys():   # elements that lost jobs have room again
            self._merge_waiting(key)
        self._refill()
        return removed

    def depth(self, model: str | None = None) -> int:
        if model is None:
            return len(self.buffer) + len(self._queued)
        return (sum(1 for e in self.buffer if e.jobs[0].model == model)
                + sum(1 for j in self._queued.values() if j.model == model))

    def batches_ahead(self, model: str | None = None) -> int:
        """The buffer's elements, and each length bin's queued samples in elements of the merge bound now:
        they join elements of their bin as they enter the buffer (O(bins), not O(samples))."""
        elements = len(self.buffer) if model is None else sum(1 for e in self.buffer if e.jobs[0].model == model)
        merge = max(1, self.buffer.max_merge)
        return elements + sum(math.ceil(texts / merge) for (of, _), texts in self._queued_texts.items()
                              if model is None or of == model)

    def __len__(self) -> int:
        return self.buffer.samples + len(self._queued)

    def __iter__(self) -> Iterator[Job]:
        yield from self.buffer.jobs()
        yield from self._waiting()


class LatencyModel:
    """Batch latency as a linear model of computed tokens, t = a + b · tokens, with tokens = rows · L for
    a concat batch (TCB §5.1: one cost a batch shape) and size · longest for a padded one. a and b are a
    least-squares fit over the batches the Dispatcher measured (send → answer, so the hops are in a),
    exponentially weighted (`memory` batches), seeded with two points from the configured prior
    (a = overhead_s, b = per_token_s) so the first estimates are sane. Attention's L² term is left out:
    at L ≤ 256 the token-wise layers dominate on this model."""

    PRIOR_TOKENS = 1024

    def __init__(self, overhead_s: float = 0.002, per_token_s: float = 20e-6, memory: int = 50) -> None:
        if overhead_s < 0 or per_token_s <= 0 or memory < 1:
            raise ValueError(f"latency model needs overhead_s >= 0, per_token_s > 0 and memory >= 1, got "
                             f"{overhead_s}, {per_token_s}, {memory}")
        self.overhead_s, self.per_token_s = overhead_s, per_token_s
        self._keep = 1 - 1 / memory
        self._sums = [0.0] * 5      # weighted Σ1, Σx, Σy, Σx², Σxy
        for tokens in (0, self.PRIOR_TOKENS):
            self._add(tokens, overhead_s + per_token_s * tokens, decay=False)

    def __call__(self, rows: int, length: int) -> float:
        return self.overhead_s + self.per_token_s * rows * length

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._add(tokens, seconds, decay=True)
            self._fit()

    def _add(self, x: float, y: float, decay: bool) -> None:
        keep = self._keep if decay else 1.0
        self._sums = [keep * s + v for s, v in zip(self._sums, (1.0, x, y, x * x, x * y), strict=True)]

    def _fit(self) -> None:
        n, sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        if spread <= 1e-9 * n * sxx:     # every recent batch had one shape: keep the slope, move the level
            self.overhead_s = max(0.0, (sy - self.per_token_s * sx) / n)
            return
        slope = (n * sxy - sx * sy) / spread
        intercept = (sy - slope * sx) / n
        if slope <= 0:                   # noise hides the token cost: a flat cost, the mean batch time
            slope, intercept = 1e-12, sy / n
        elif intercept < 0:              # a steep line: through the origin instead
            slope, intercept = sxy / sxx, 0.0
        self.per_token_s, self.overhead_s = slope, intercept


@dataclass(frozen=True)
class Piece:
    """Some texts of one job (indices into its own texts) that sit together in one slot."""

    job: Job
    texts: tuple[int, ...]


@dataclass(frozen=True)
class BatchPlan:
    """A concat batch's layout over jobs: row → slots → pieces. The scheduler's edge re-indexes it to
    the merged batch's flat text order (`sender.flat_plan`); jobs dropped before sending are skipped."""

    rows: tuple[tuple[tuple[Piece, ...], ...], ...]
    row_length: int
    slot_size: int

    @property
    def computed_tokens(self) -> int:
        """The batch shape's tokens, rows · L: what the latency model is fitted on."""
        return len(self.rows) * self.row_length


def text_lengths(job: Job) -> tuple[int, ...]:
    return tuple(job.lengths) or (job.num_tokens,)


def spill(job: Job, row_length: int, slot_size: int) -> list[list[list[Piece]]]:
    """A job too long for one slot, as rows of its own: its texts in order, next fit, into slots of z
    tokens, L // z slots a row. A text longer than z takes a slot alone (it runs at its own length)."""
    slots: list[list[int]] = [[]]
    free = slot_size
    for k, n in enumerate(text_lengths(job)):
        if slots[-1] and n > free:
            slots.append([])
            free = slot_size
        slots[-1].append(k)
        free -= n
    per_row = row_length // slot_size
    pieces = [[Piece(job, tuple(slot))] for slot in slots]
    return [pieces[i:i + per_row] for i in range(0, len(pieces), per_row)]


SELECTIONS: dict[str, Callable[..., das.Batch]] = {
    "fcfs": das.fcfs_rows, "sjf": das.sjf_rows, "edf": das.edf_rows}


class _BatchingPolicy(DispatchPolicy):
    """Shared by `concat` and `bucketed`: a freed group takes a batch of the oldest job's model and
    output, chosen over every such job waiting; jobs that cannot meet their deadline are handed back."""

    def __init__(self, latency: LatencyModel | None) -> None:
        super().__init__()
        self.latency = latency or LatencyModel()
        self._dropped: list[tuple[Job, ServingError]] = []
        self.counters = {"batches": 0, "select_ms": 0.0, "batch_ms": 0.0, "dropped_expired": 0}
        # per model, the waiting jobs' `_weight`s, kept as jobs come and go: `depth` runs on every admission
        # behind busy groups, and summing a full queue there took 0.1 ms a request
        self._weights: Counter[str] = Counter()

    def _weight(self, job: Job) -> int:
        """What one waiting job adds to `depth`'s count."""
        return 1

    def _waiting_weight(self, model: str | None) -> int:
        return self._weights.total() if model is None else self._weights[model]

    def _forget(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            self._weights[job.model] -= self._weight(job)

    def push(self, job: Job, now: float, front: bool = False) -> None:
        super().push(job, now, front)
        self._weights[job.model] += self._weight(job)

    def remove(self, predicate: Callable[[Job], bool]) -> list[Job]:
        removed = super().remove(predicate)
        self._forget(removed)
        return removed

    def next_batch(self, accepts: Accepts, now: float) -> list[Job]:
        head = next((j for j in self._jobs if accepts(j)), None)
        if head is None:
            return []
        started = time.perf_counter()
        mates = [j for j in self._jobs if j.batch_key == head.batch_key and accepts(j)]
        chosen, expired = self._select(mates, now)
        done = [*chosen, *expired]
        self._jobs = deque(filterfalse(set(done).__contains__, self._jobs))   # jobs hash as themselves
        self._forget(done)
        for job in expired:
            self._dropped.append((job, DeadlineExceeded(
                "the deadline cannot be met even in the next batch (DAS); not computed")))
        self.counters["dropped_expired"] += len(expired)
        self.counters["select_ms"] += (time.perf_counter() - started) * 1e3
        self.counters["batches"] += bool(chosen)
        return chosen

    @abstractmethod
    def _select(self, mates: list[Job], now: float) -> tuple[list[Job], list[Job]]:
        """(the batch, the expired) among same-key waiting jobs, oldest first."""

    def take_dropped(self) -> list[tuple[Job, ServingError]]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def observe(self, batch: list[Job], seconds: float) -> None:
        self.counters["batch_ms"] += seconds * 1e3
        self.latency.observe(self.computed_tokens(batch), seconds)

    @abstractmethod
    def computed_tokens(self, batch: list[Job]) -> int:
        """Tokens of the batch's shape: the latency model's x, and what admission counts a batch by."""

    def stats(self) -> dict[str, float]:
        return dict(self.counters) | {"token_us": self.latency.per_token_s * 1e6,
                                      "overhead_ms": self.latency.overhead_s * 1e3}


class ConcatPolicy(_BatchingPolicy):
    """TCB (§4, §5): each time a group frees, Alg. 1 (DAS) — or Alg. 2, slotted — picks the requests
    for `rows` rows of L tokens among all waiting, by utility 1/l with the deadline-aware set (η + q = 1);
    the plan (rows → slots → texts) goes with the batch to the worker, which runs it packed. Requests
    that cannot finish within one batch time are answered DEADLINE_EXCEEDED and never computed. It does
    not wait for a batch to fill. `selection` swaps DAS for the FCFS, SJF or EDF row fill (TCB §6.2.2).
    Under DAS a job about to pass the queue's wait bound (`bound_wait`) goes first (see `das`); `due_first`
    off is DAS alone (the ablation).

    A job is one DAS item of its total tokens (a request's texts stay together in one slot); a job
    over L (one long text, or many texts) runs alone in rows of its own (`spill`), never truncated —
    unless `oversize="reject"`, where a text over L is refused at once with INVALID_ARGUMENT."""

    name = "concat"

    def __init__(self, row_length: int = 128, rows: int = 8, eta: float = 0.5, selection: str = "das",
                 slotted: bool = False, oversize: das.Oversize = "alone", latency: LatencyModel | None = None,
                 due_first: bool = True) -> None:
        super().__init__(latency)
        self.due_first = due_first
        if row_length < 1 or rows < 1 or not 0 < eta < 1:
            raise ValueError(f"concat needs row_length >= 1, rows >= 1 and 0 < eta < 1, got {row_length}, {rows}, "
                             f"{eta}")
        if selection != "das" and (selection not in SELECTIONS or slotted):
            raise ValueError(f"concat selection {selection!r} must be das|fcfs|sjf|edf; slotted needs das")
        if oversize not in ("alone", "reject"):
            raise ValueError(f"concat oversize {oversize!r} must be alone|reject")
        self.row_length, self.rows, self.eta = row_length, rows, eta
        self.selection, self.slotted, self.oversize = selection, slotted, oversize
        self.lanes = 1    # groups running batches side by side: how soon the batches after this one start
        # each waiting job's DAS item, made once as it queues: under overload a decision reads every job waiting,
        # and making 1,024 items took a quarter of it
        self._items: dict[Job, das.WaitingItem] = {}

    def resize(self, groups: int) -> None:
        self.lanes = max(1, groups)

    def push(self, job: Job, now: float, front: bool = False) -> None:
        job.plan = None   # a retried job is placed afresh
        if self.oversize == "reject" and job.max_length > self.row_length:
            raise InvalidArgument(f"a text of {job.max_length} tokens is longer than the row length "
                                  f"L={self.row_length} (ACADEMUS_CONCAT_ROW_LENGTH); ACADEMUS_CONCAT_OVERSIZE=reject "
                                  f"refuses it rather than truncate it")
        self._items[job] = self._waiting_item(job)
        super().push(job, now, front)

    def bound_wait(self, seconds: float) -> None:
        super().bound_wait(seconds)
        self._items = {job: self._waiting_item(job) for job in self._jobs}

    def _forget(self, jobs: Iterable[Job]) -> None:
        super()._forget(jobs)
        for job in jobs:
            del self._items[job]

    def _waiting_item(self, job: Job) -> das.WaitingItem:
        """The job as DAS sees it, named by the job itself."""
        bound = self.max_wait_s if self.due_first and self.max_wait_s else math.inf
        return das.WaitingItem(job, job.num_tokens, job.deadline, job.enqueued_at, job.enqueued_at + bound)

    def _select(self, mates: list[Job], now: float) -> tuple[list[Job], list[Job]]:
        items = self._items
        decision = self._decide([items[j] for j in mates], now)
        plan = self._plan(decision)
        chosen = cast("list[Job]", decision.scheduled())   # the items are named by their jobs
        for job in chosen:
            job.plan = plan
        return chosen, cast("list[Job]", decision.expired)

    def _decide(self, items: list[das.WaitingItem], now: float) -> das.Batch:
        common = dict(now=now, row_length=self.row_length, rows=self.rows, batch_latency=self.latency)
        if self.selection != "das":
            return SELECTIONS[self.selection](items, **common)
        select = das.slotted_das_rows if self.slotted else das.das_rows
        return select(items, eta=self.eta, q=1 - self.eta, lanes=self.lanes, **common)

    def _plan(self, decision: das.Batch) -> BatchPlan:
        z = decision.slot_size or self.row_length
        row_slots = decision.slots or [[row] for row in decision.rows]
        rows: list[list[list[Piece]]] = []
        for slots in row_slots:
            jobs = [job for slot in slots for job in slot]
            if len(jobs) == 1 and jobs[0].num_tokens > z:
                rows.extend(spill(jobs[0], self.row_length, z))   # alone, over its slot: rows of its own
            else:
                rows.append([[Piece(job, tuple(range(len(text_lengths(job))))) for job in slot] for slot in slots])
        return BatchPlan(tuple(tuple(tuple(slot) for slot in row) for row in rows), self.row_length, z)

    def computed_tokens(self, batch: list[Job]) -> int:
        plan = batch[0].plan if batch else None
        return plan.computed_tokens if plan is not None else 0

    def full_batch_tokens(self) -> int:
        return self.rows * self.row_length

    def _weight(self, job: Job) -> int:
        return min(job.num_tokens, self.row_length)

    def depth(self, model: str | None = None) -> int:
        """Waiting batches: the queue's tokens over one batch's R·L (what the admission estimate needs)."""
        return math.ceil(self._waiting_weight(model) / (self.rows * self.row_length))


class BucketedPolicy(_BatchingPolicy):
    """TurboBatching-like baseline (`das.bucketed_batches`): each time a group frees, the waiting jobs
    sorted by length are cut into the padded batches of least total cost (the latency model), at most
    `max_batch` jobs each; the most urgent batch runs, padded to its longest. Jobs that cannot finish in
    the costliest batch are answered DEADLINE_EXCEEDED unrun. No waiting for a batch to fill."""

    name = "bucketed"

    def __init__(self, max_batch: int = 32, latency: LatencyModel | None = None) -> None:
        super().__init__(latency)
        if max_batch < 1:
            raise ValueError(f"bucketed policy needs max_batch >= 1, got {max_batch}")
        self.max_batch = max_batch

    def _select(self, mates: list[Job], now: float) -> tuple[list[Job], list[Job]]:
        items = [das.WaitingItem(k, max(j.max_length, 1), j.deadline, j.enqueued_at) for k, j in enumerate(mates)]
        buckets = das.bucketed_batches(items, now, self.max_batch, self.latency)
        chosen = [mates[k] for k in buckets.batches[0]] if buckets.batches else []
        return chosen, [mates[k] for k in buckets.expired]

    def computed_tokens(self, batch: list[Job]) -> int:
        return sum(j.num_texts for j in batch) * max((j.max_length for j in batch), default=0)

    def depth(self, model: str | None = None) -> int:
        return math.ceil(self._waiting_weight(model) / self.max_batch)


POLICIES: dict[str, Callable[..., DispatchPolicy]] = {
    "fifo": FifoPolicy, "padded": PaddedPolicy, "student": StudentPolicy, "concat": ConcatPolicy,
    "bucketed": BucketedPolicy}
# Named variants of `concat` (deployments side by side are told apart by policy name).
CONCAT_VARIANTS = {"concat-slotted": {"slotted": True, "selection": "das"},
                   **{f"concat-{k}": {"selection": k, "slotted": False} for k in SELECTIONS}}


@dataclass(frozen=True)
class ConcatSettings:
    row_length: int = 128
    rows: int = 8
    eta: float = 0.5
    selection: str = "das"
    slotted: bool = False
    oversize: das.Oversize = "alone"
    due_first: bool = True


def make_policy(name: str, max_batch: int = 32, max_delay_s: float = 0.010, max_merge: int = 4,
                max_length: int = 128, concat: ConcatSettings | None = None,
                latency: LatencyModel | None = None, bin_width: int = 8, overload_merge: int = 0) -> DispatchPolicy:
    if name == "padded":
        return PaddedPolicy(max_batch, max_delay_s)
    if name == "student":
        return StudentPolicy(max_merge, bin_width, max_length, overload_merge)
    if name == "bucketed":
        return BucketedPolicy(max_batch, latency)
    if name == "concat" or name in CONCAT_VARIANTS:
        settings = vars(concat or ConcatSettings()) | CONCAT_VARIANTS.get(name, {})
        return ConcatPolicy(**settings, latency=latency)
    if name in POLICIES:
        return POLICIES[name]()
    raise ValueError(f"unknown policy {name!r}; known: {sorted([*POLICIES, *CONCAT_VARIANTS])}")
