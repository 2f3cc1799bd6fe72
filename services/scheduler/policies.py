"""Dispatch policies behind one interface (DESIGN.md §5); chosen by name through `make_policy`.

A policy only holds waiting jobs and forms batches; the Dispatcher owns workers, deadlines and
admission. `fifo` (one request a dispatch, no waiting) and `padded` (the classic dynamic batcher,
Triton-style) live here; the `student` length-aware buffer and `concat` (DAS) plug in the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

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


POLICIES: dict[str, Callable[..., DispatchPolicy]] = {"fifo": FifoPolicy, "padded": PaddedPolicy}


def make_policy(name: str, **options: float) -> DispatchPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(**options) if name == "padded" else factory()
