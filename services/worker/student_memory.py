"""A student group's students held within a memory budget (STI's elastic loading applied to student groups).

With `ACADEMUS_STUDENT_BUDGET_BYTES` a worker does not hold a whole group: it holds the shared parts (the
embeddings, α, the head) and only the students placed on it (the resource manager's groups in Redis), as many
as the budget fits. When a batch asks for a student the worker does not hold (the resource manager just added
it to a group here), the worker reads that student's shards, decodes them and runs the batch at once; the
full-precision student loads on a thread of its own and replaces it. A student that the budget cannot hold next
to the batch's others is run from its shards for that batch only.

The bit width read is planned from the batch's time left, as STI plans a submodel from its target: the most
bits whose load, as measured here so far, and the batch's compute still fit before the deadline. Until a load
and a run have been measured, and for a batch without a deadline, it is the artifact's floor: the fastest answer
the group's accuracy allows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch
from prometheus_client import Counter, Gauge, Histogram
from torch import nn

from academus.shared.models.model import weight_bytes
from academus.shared.models.shard_io import FileSource
from academus.shared.models.shards import FULL
from academus.shared.models.student_shards import ElasticStudent, StudentShards
from academus.shared.models.students import Student, StudentGroup
from academus.shared.runtime.errors import InvalidArgument
from academus.shared.runtime.logs import log_event

HELD = Gauge("academus_worker_students_held", "Students of a group this worker holds, by stored bit width "
             "(32: full precision)", ["model", "bits"])
LOADS = Counter("academus_worker_student_loads_total", "Students loaded under a memory budget: from shards at "
                "the bits a batch's time left affords, to serve it at once, or whole (the group's own student, 32)",
                ["model", "bits", "source"])
LOAD_MS = Histogram("academus_worker_student_load_ms", "Time to load one student under a memory budget",
                    ["model", "bits", "source"], buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000))
STREAMED = Counter("academus_worker_students_streamed_total", "Students run from shards for one batch only: the "
                   "budget could not hold them next to the batch's others", ["model"])

LoadFull = Callable[[int], Student]       # student index -> the full-precision student, prepared to serve
SHARDS, WHOLE = "shards", "whole"        # where a load read the student from (the metrics' `source`)
TimeLeft = Callable[[], float | None]     # seconds before the calling batch's deadline; None: it has none
ESTIMATE_MARGIN = 1.5      # measured loads vary with what else runs: a plan keeps this much headroom
SMOOTHING = 0.3            # weight of the newest measurement in the running estimates


class LoadCosts:
    """What reading one student from its shards costs at each stored bit width and what running a student
    costs a token, both measured on this worker as students load and run (exponentially smoothed); from these,
    the bit width a batch's time left affords. A width not measured yet is estimated from the nearest measured
    one below it, scaled by the bytes it reads: an overestimate, since part of a load does not grow with bytes."""

    def __init__(self, stored_bytes: dict[int, int], floor: int) -> None:
        self.stored_bytes, self.floor = stored_bytes, floor
        self.load_ms: dict[int, float] = {}
        self.compute_ms_per_token: float | None = None
        self._lock = threading.Lock()

    def loaded(self, bits: int, ms: float) -> None:
        with self._lock:
            self.load_ms[bits] = _smooth(self.load_ms.get(bits), ms)

    def computed(self, tokens: int, ms: float) -> None:
        if tokens > 0:
            with self._lock:
                self.compute_ms_per_token = _smooth(self.compute_ms_per_token, ms / tokens)

    def estimate_ms(self, bits: int) -> float | None:
        """One student's load at `bits`; None when no width at or below it was measured."""
        with self._lock:
            if bits in self.load_ms:
                return self.load_ms[bits]
            below = [b for b in self.load_ms if b < bits]
            if not below:
                return None
            nearest = max(below)
            return self.load_ms[nearest] * self.stored_bytes[bits] / self.stored_bytes[nearest]

    def bits_for(self, seconds_left: float | None, tokens: int, students: int) -> int:
        """The most bits (at least the floor) whose load and the batch's `students` runs over `tokens` fit in
        `seconds_left`, with `ESTIMATE_MARGIN` of headroom; the floor without a deadline or a measurement."""
        per_token = self.compute_ms_per_token
        if seconds_left is None or per_token is None:
            return self.floor
        budget = seconds_left * 1e3 / ESTIMATE_MARGIN - per_token * tokens * students
        fitting = [b for b in self.stored_bytes if b > self.floor
                   and (cost := self.estimate_ms(b)) is not None and cost <= budget]
        return max(fitting, default=self.floor)


class StudentMemory:
    """Which students of one group are held, at what precision, within `budget_bytes`; thread-safe."""

    def __init__(self, name: str, group: StudentGroup, shards: StudentShards, load_full: LoadFull,
                 budget_bytes: int, source: FileSource, device: torch.device | str = "cpu",
                 time_left: TimeLeft = lambda: None) -> None:
        """`time_left`: the calling batch's seconds before its deadline (read on the compute thread)."""
        self.name, self.group, self.shards, self.source, self.device = name, group, shards, source, device
        self.load_full, self.time_left = load_full, time_left
        floor = shards.min_bits
        self.costs = LoadCosts({b: shards.stored_bytes(0, b) for b in shards.store.versions if b >= floor}, floor)
        self.shared_bytes = weight_bytes(group)   # embeddings, α, head: its students are absent
        with torch.device("meta"):
            self.student_bytes = weight_bytes(Student(group.config))
        minimum = self.shared_bytes + self.student_bytes
        if budget_bytes < minimum:
            raise InvalidArgument(f"{name}: a student memory budget of {budget_bytes} bytes is below the {minimum} "
                                  f"bytes one student needs ({self.shared_bytes} shared, {self.student_bytes} a "
                                  f"student)")
        self.budget_bytes = budget_bytes
        self.held: OrderedDict[int, nn.Module] = OrderedDict()   # least recently used first
        self.placed: set[int] = set()
        self._upgrades: list[int] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._upgrade_loop, name=f"students-{name}", daemon=True)
        self._thread.start()

    @property
    def capacity(self) -> int:
        """Students the budget holds."""
        return (self.budget_bytes - self.shared_bytes) // self.student_bytes

    def held_bytes(self) -> int:
        with self._lock:
            return self.shared_bytes + len(self.held) * self.student_bytes

    def precision(self) -> dict[int, int]:
        """Each held student's bit width (32: full precision)."""
        with self._lock:
            return {i: _bits(m) for i, m in sorted(self.held.items())}

    def members(self, indices: Iterable[int], tokens: int = 0) -> dict[int, nn.Module]:
        """The students a batch of `tokens` (padded) runs, by index; one not held is read from its shards now (on
        the calling compute thread) at the bits its time left affords, and held if the budget has room, its full
        precision queued."""
        wanted = list(dict.fromkeys(indices))
        out: dict[int, nn.Module] = {}
        with self._lock:
            for i in wanted:
                if i in self.held:
                    self.held.move_to_end(i)
                    out[i] = self.held[i]
        for i in (i for i in wanted if i not in out):
            bits = self.costs.bits_for(self.time_left(), tokens, len(wanted))
            out[i] = self._elastic(i, bits, keep=wanted)
        return out

    def place(self, indices: Iterable[int]) -> None:
        """The students the resource manager placed on this worker now: those not held are loaded at full
        precision in the background; held ones no longer placed are let go."""
        with self._lock:
            self.placed = {i for i in indices if 0 <= i < self.group.max_students}
            for i in [i for i in self.held if i not in self.placed]:
                del self.held[i]
            for i in sorted(self.placed):
                if (i not in self.held or not _whole(self.held[i])) and i not in self._upgrades:
                    self._upgrades.append(i)
            self._wake.notify()
        self._publish()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=5)
        self.source.close()

    def _elastic(self, index: int, bits: int, keep: Sequence[int]) -> nn.Module:
        started = time.perf_counter()
        student = self.shards.load(index, bits, self.source, self.device)
        self.costs.loaded(bits, _observe(self.name, bits, SHARDS, started))
        student.on_run = self.costs.computed
        with self._lock:
            if index in self.held:            # another compute thread loaded it meanwhile
                return self.held[index]
            if not self._make_room(keep):
                STREAMED.labels(self.name).inc()
                return student
            self.held[index] = student
            if index not in self._upgrades:
                self._upgrades.append(index)
            self._wake.notify()
        log_event("student_served_from_shards", model=self.name, student=index, bits=student.bits,
                  load_ms=round((time.perf_counter() - started) * 1e3, 2))
        self._publish()
        return student

    def _make_room(self, keep: Sequence[int], evict_placed: bool = True) -> bool:
        """Frees one student's room if the budget is full, dropping the least recently used one that this batch
        does not run (those not placed here first); False when none may go. Under the lock."""
        if len(self.held) < self.capacity:
            return True
        candidates = [i for i in self.held if i not in keep]
        unplaced = [i for i in candidates if i not in self.placed]
        if not unplaced and not (evict_placed and candidates):
            return False
        del self.held[(unplaced or candidates)[0]]
        return True

    def _upgrade_loop(self) -> None:
        while True:
            with self._lock:
                while not self._upgrades and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                index = self._upgrades.pop(0)
                current = self.held.get(index)
                wanted = index in self.placed or current is not None
                if not wanted or (current is not None and _whole(current)):
                    continue
            self._upgrade(index)

    def _upgrade(self, index: int) -> None:
        started = time.perf_counter()
        try:
            student = self.load_full(index)
        except Exception as e:   # the shards keep serving it; a later placement or batch queues it again
            log_event("student_load_failed", logging.ERROR, model=self.name, student=index, error=repr(e))
            return
        _observe(self.name, FULL, WHOLE, started)
        with self._lock:
            # a placed student not yet held takes the room of one not placed, never of another placed one
            if index not in self.held and (index not in self.placed or not self._make_room((), evict_placed=False)):
                return
            self.held[index] = student
        log_event("student_held", model=self.name, student=index, bits=FULL,
                  load_ms=round((time.perf_counter() - started) * 1e3, 2))
        self._publish()

    def _publish(self) -> None:
        counts = dict.fromkeys(self.shards.store.versions, 0)
        for bits in self.precision().values():
            counts[bits] = counts.get(bits, 0) + 1
        for bits, count in counts.items():
            HELD.labels(self.name, str(bits)).set(count)


def _whole(student: nn.Module) -> bool:
    """The group's own (traced) student, not one decoded from shards, even at 32 bits."""
    return not isinstance(student, ElasticStudent)


def _bits(student: nn.Module) -> int:
    return student.bits if isinstance(student, ElasticStudent) else FULL


def _observe(model: str, bits: int, source: str, started: float) -> float:
    """Counts one load and returns its milliseconds."""
    ms = (time.perf_counter() - started) * 1e3
    LOADS.labels(model, str(bits), source).inc()
    LOAD_MS.labels(model, str(bits), source).observe(ms)
    return ms


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * value

