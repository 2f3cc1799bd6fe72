"""The length-aware buffer of Student Parallelism (App. B.4.2), exactly as the paper builds it.

The token range is split into bins of `bin_width` tokens (16 bins of 8 for 128). A FIFO of elements
holds the buffered work; a dict maps each (batch key, bin) to the tail element of that bin. A new
sample merges into its bin's tail element while that element holds fewer than `max_merge` samples,
else it becomes a new tail element. Dispatch pops the head element and deletes its bin pointer when
the pointer still names it. Push and pop are O(1): one dict lookup, one deque operation.

Only samples with equal batch keys (model, output, student number) merge: they must run as one batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from academus.services.scheduler.core import Job


@dataclass(eq=False)
class BufferElement:
    """A sample, or a small batch of samples of one length bin: what one group runs at once."""

    key: Hashable
    jobs: list[Job] = field(default_factory=list)
    samples: int = 0               # texts in the element (a job may carry several)
    seq: int = 0                   # rises from head to tail: how many elements are ahead, at most

    def add(self, job: Job) -> None:
        self.jobs.append(job)
        self.samples += job.num_texts


class LengthAwareBuffer:
    def __init__(self, max_merge: int = 4, bin_width: int = 8, max_length: int = 128) -> None:
        if max_merge < 1 or bin_width < 1 or max_length < bin_width:
            raise ValueError(f"length-aware buffer needs max_merge >= 1, bin_width >= 1 and max_length >= bin_width, "
                             f"got {max_merge}, {bin_width}, {max_length}")
        self.max_merge = max_merge
        self.bin_width = bin_width
        self.num_bins = -(-max_length // bin_width)
        self._elements: deque[BufferElement] = deque()
        self._tails: dict[Hashable, BufferElement] = {}
        self._next_seq = 0
        self.samples = 0

    def bin_of(self, length: int) -> int:
        """Bin index of a sample of `length` tokens; longer than the range: the last bin."""
        return min(max(length - 1, 0) // self.bin_width, self.num_bins - 1)

    def key_of(self, job: Job) -> Hashable:
        return job.batch_key, self.bin_of(job.max_length)

    def _joins(self, job: Job, key: Hashable) -> BufferElement | None:
        """The tail element of `key` that `job` would join: it has room for the job's texts."""
        tail = self._tails.get(key)
        return tail if tail is not None and tail.samples + job.num_texts <= self.max_merge else None

    def merges(self, job: Job) -> bool:
        """Whether `job` would join its bin's tail element rather than start a new one."""
        return self._joins(job, self.key_of(job)) is not None

    def ahead_of_merge(self, job: Job) -> int | None:
        """Elements ahead of the one `job` would join (None: it would not merge), at most; O(1). Exact
        unless elements left from the middle (another model's, or expired jobs'), then over."""
        tail = self._joins(job, self.key_of(job))
        return None if tail is None else min(len(self._elements) - 1, tail.seq - self._elements[0].seq)

    def push(self, job: Job) -> bool:
        """Buffers `job`; True when it merged into an existing element."""
        key = self.key_of(job)
        self.samples += job.num_texts
        if (tail := self._joins(job, key)) is not None:
            tail.add(job)
            return True
        element = BufferElement(key, seq=self._next_seq)
        self._next_seq += 1
        element.add(job)
        self._elements.append(element)
        self._tails[key] = element
        return False

    def push_front(self, job: Job) -> None:
        """A retried job goes first, alone (it already waited once)."""
        ahead = self._elements[0].seq if self._elements else self._next_seq
        element = BufferElement(("retry", id(job)), seq=ahead - 1)
        element.add(job)
        self._elements.appendleft(element)
        self.samples += job.num_texts

    def pop(self, accepts: Callable[[Job], bool] | None = None) -> BufferElement | None:
        """The head element (or, when `accepts` filters by model, the first element it accepts)."""
        if not self._elements:
            return None
        if accepts is None or accepts(self._elements[0].jobs[0]):
            element = self._elements.popleft()
        else:
            element = next((e for e in self._elements if accepts(e.jobs[0])), None)
            if element is None:
                return None
            self._elements.remove(element)  # several models in one scheduler: a short scan (≤ groups)
        if self._tails.get(element.key) is element:
            del self._tails[element.key]
        self.samples -= element.samples
        return element

    def remove(self, predicate: Callable[[Job], bool]) -> list[Job]:
        """Takes out matching jobs (expired, orphaned); O(n), off the hot path."""
        removed: list[Job] = []
        for element in list(self._elements):
            kept = [j for j in element.jobs if not predicate(j)]
            if len(kept) == len(element.jobs):
                continue
            removed += [j for j in element.jobs if predicate(j)]
            element.jobs, element.samples = kept, sum(j.num_texts for j in kept)
            if not kept:
                self._elements.remove(element)
                if self._tails.get(element.key) is element:
                    del self._tails[element.key]
        self.samples -= sum(j.num_texts for j in removed)
        return removed

    def tail_keys(self) -> list[Hashable]:
        """The keys that have a tail element (where a sample of that key would merge)."""
        return list(self._tails)

    def __len__(self) -> int:
        """Elements, not samples: the buffer's capacity is counted in elements (one a group)."""
        return len(self._elements)

    def __iter__(self) -> Iterator[BufferElement]:
        return iter(self._elements)

    def jobs(self) -> Iterator[Job]:
        for element in self._elements:
            yield from element.jobs
