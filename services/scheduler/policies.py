"""Dispatch policies behind one interface (DESIGN.md §5); chosen by name through `make_policy`.

A policy only orders waiting jobs. The Dispatcher owns workers, deadlines and admission. The
`student` (length-aware buffer), `concat` (DAS) and `padded` policies plug in here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from academus.services.scheduler.core import Job


class DispatchPolicy(ABC):
    """Holds jobs that found no idle worker; hands one out when a worker frees."""

    name: str

    @abstractmethod
    def push(self, job: Job) -> None: ...

    @abstractmethod
    def pop(self, accepts: Callable[[Job], bool]) -> Job | None:
        """Removes and returns the next job the freed worker `accepts` (serves its model)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Job]: ...


class FifoPolicy(DispatchPolicy):
    """First come, first served: the oldest waiting job the free worker can run."""

    name = "fifo"

    def __init__(self) -> None:
        self._jobs: deque[Job] = deque()

    def push(self, job: Job) -> None:
        self._jobs.append(job)

    def pop(self, accepts: Callable[[Job], bool]) -> Job | None:
        for i, job in enumerate(self._jobs):
            if accepts(job):
                del self._jobs[i]
                return job
        return None

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._jobs)


POLICIES: dict[str, Callable[[], DispatchPolicy]] = {"fifo": FifoPolicy}


def make_policy(name: str) -> DispatchPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
