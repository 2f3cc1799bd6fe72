"""Dispatch policies behind one interface (DESIGN.md §5); chosen by name through `make_policy`.

A policy only holds waiting jobs and forms batches; the Dispatcher owns groups, deadlines and
admission. `fifo` (one request a dispatch, no waiting), `padded` (the classic dynamic batcher,
Triton-style) and `student` (Student Parallelism's immediate dispatch + length-aware buffer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from academus.services.scheduler.buffer import LengthAwareBuffer

if TYPE_CHECKING:
    from academus.services.scheduler.core import Job

Accepts = Callable[["Job"], bool]


class DispatchPolicy(ABC):
    """Holds jobs until a worker frees; hands out the next batch that worker can run."""

    name: str

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()

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
        """The dispatcher's group count changed (the student buffer's capacity follows it)."""
        return None

    def depth(self) -> int:
        """Waiting dispatch units (buffer elements for `student`, jobs otherwise): the load signal."""
        return len(self)

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


class StudentPolicy(DispatchPolicy):
    """Student Parallelism's dispatch (§3.3.2, App. B.4.2): a sample goes at once to an idle group;
    only while every group is busy does it wait in the length-aware buffer, merging with samples of
    its length bin, and a freed group takes the head element at once, never waiting to fill a batch.

    The buffer holds at most one element per group (its capacity follows `resize`); beyond it jobs
    wait in arrival order in the admission queue, whose bound the Dispatcher enforces.
    """

    name = "student"

    def __init__(self, max_merge: int = 4, bin_width: int = 8, max_length: int = 128) -> None:
        super().__init__()
        self.buffer = LengthAwareBuffer(max_merge, bin_width, max_length)
        self.capacity = 1
        self.merged = 0                # samples that joined an existing element (a metric)

    def resize(self, groups: int) -> None:
        self.capacity = max(1, groups)
        self._refill()

    def push(self, job: Job, now: float, front: bool = False) -> None:
        if front:
            self.buffer.push_front(job)
        elif self._jobs or len(self.buffer) >= self.capacity:
            self._jobs.append(job)
            self._refill()
        else:
            self.merged += self.buffer.push(job)

    def next_batch(self, accepts: Accepts, now: float) -> list[Job]:
        element = self.buffer.pop(accepts)
        if element is None and self._jobs:  # the head of the admission queue may suit this group
            job = next((j for j in self._jobs if accepts(j)), None)
            return [self._take(job)] if job is not None else []
        self._refill()
        return element.jobs if element is not None else []

    def _refill(self) -> None:
        """Moves queued jobs into the buffer while it has room (merging as they enter)."""
        while self._jobs and (len(self.buffer) < self.capacity or self.buffer.merges(self._jobs[0])):
            self.merged += self.buffer.push(self._jobs.popleft())

    def remove(self, predicate: Callable[[Job], bool]) -> list[Job]:
        removed = self.buffer.remove(predicate) + super().remove(predicate)
        self._refill()
        return removed

    def depth(self) -> int:
        return len(self.buffer) + len(self._jobs)

    def __len__(self) -> int:
        return self.buffer.samples + len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        yield from self.buffer.jobs()
        yield from self._jobs


POLICIES: dict[str, Callable[..., DispatchPolicy]] = {
    "fifo": FifoPolicy, "padded": PaddedPolicy, "student": StudentPolicy}


def make_policy(name: str, max_batch: int = 32, max_delay_s: float = 0.010, max_merge: int = 4,
                max_length: int = 128) -> DispatchPolicy:
    if name == "padded":
        return PaddedPolicy(max_batch, max_delay_s)
    if name == "student":
        return StudentPolicy(max_merge, max_length=max_length)
    if name in POLICIES:
        return POLICIES[name]()
    raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
