"""The scheduler core: admission, immediate dispatch to an idle worker, the waiting policy, retries.

State (workers, busy flags, the policy's queue) is changed only by plain methods called on the
event loop thread, never across an `await`, so each change is atomic without locks — the same
single-owner discipline as TEI's queue task, without a channel hop on the hot path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from academus.services.scheduler.policies import DispatchPolicy
from academus.shared.errors import DeadlineExceeded, ResourceExhausted, ServingError, Unavailable


@dataclass
class WorkerRef:
    worker_id: str
    address: str
    models: frozenset[str]
    busy: bool = False
    lost: bool = False


@dataclass
class Job:
    model: str
    payload: Any                   # opaque to the core: what `send` needs (token batch, output kind)
    num_texts: int
    num_tokens: int
    deadline: float                # clock time
    enqueued_at: float
    future: asyncio.Future = field(repr=False, default=None)  # type: ignore[assignment]
    attempts: int = 0
    tried: set[str] = field(default_factory=set)
    started_at: float = 0.0


class WorkerLost(Exception):
    """The worker did not answer (connection refused or dropped): the job may run elsewhere."""


Send = Callable[[WorkerRef, Job], Awaitable[Any]]


@dataclass
class DispatchStats:
    dispatched: int = 0
    expired: int = 0
    cancelled: int = 0
    retried: int = 0
    rejected: int = 0


class Dispatcher:
    def __init__(self, policy: DispatchPolicy, send: Send, queue_capacity: int,
                 retry_pushback_ms: int = 50, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.send = send
        self.queue_capacity = queue_capacity
        self.retry_pushback_ms = retry_pushback_ms
        self.clock = clock
        self.workers: dict[str, WorkerRef] = {}
        self.stats = DispatchStats()

    # -- membership -------------------------------------------------------------------------
    def update_workers(self, live: dict[str, tuple[str, frozenset[str]]]) -> None:
        """Replaces the worker set with the placements read from Redis, keeping busy flags."""
        for worker_id in list(self.workers):
            if worker_id not in live:
                del self.workers[worker_id]
        for worker_id, (address, models) in live.items():
            ref = self.workers.get(worker_id)
            if ref is None or ref.address != address or ref.lost:
                self.workers[worker_id] = WorkerRef(worker_id, address, models)
            else:
                ref.models = models
        self._drain()
        self._fail_orphans()

    def serves(self, model: str) -> bool:
        return any(model in w.models and not w.lost for w in self.workers.values())

    # -- the request path -------------------------------------------------------------------
    async def submit(self, job: Job) -> Any:
        """Runs the job on an idle worker now, or queues it; returns the worker's result."""
        if not self.serves(job.model):
            raise Unavailable(f"no live worker serves model {job.model!r}")
        if len(self.policy) >= self.queue_capacity:
            self.stats.rejected += 1
            raise ResourceExhausted(f"scheduler queue is full ({self.queue_capacity} requests waiting)",
                                    pushback_ms=self.retry_pushback_ms)
        job.future = asyncio.get_running_loop().create_future()
        worker = self._idle_worker(job)
        if worker is not None:
            self._start(worker, job)
        else:
            self.policy.push(job)
        return await job.future

    def _idle_worker(self, job: Job) -> WorkerRef | None:
        candidates = [w for w in self.workers.values()
                      if not w.busy and not w.lost and job.model in w.models]
        fresh = [w for w in candidates if w.worker_id not in job.tried]
        pool = fresh or candidates
        return pool[0] if pool else None

    def _start(self, worker: WorkerRef, job: Job) -> None:
        worker.busy = True
        job.attempts += 1
        job.tried.add(worker.worker_id)
        job.started_at = self.clock()
        self.stats.dispatched += 1
        task = asyncio.get_running_loop().create_task(self._run(worker, job))
        # A caller that goes away cancels the downstream call too: its work stops there.
        job.future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)

    async def _run(self, worker: WorkerRef, job: Job) -> None:
        try:
            result = await self.send(worker, job)
        except WorkerLost as e:
            worker.lost = True
            self._retry_or_fail(job, e)
            self._fail_orphans()
        except asyncio.CancelledError:
            self._settle(job, exc=Unavailable("dispatch cancelled"))
        except ServingError as e:
            self._settle(job, exc=e)
        except Exception as e:
            self._settle(job, exc=e)
        else:
            self._settle(job, result=result)
        finally:
            worker.busy = False
            self._drain()

    def _retry_or_fail(self, job: Job, error: Exception) -> None:
        if job.future.done():
            return
        if self.clock() >= job.deadline:
            self._settle(job, exc=DeadlineExceeded("deadline passed while retrying after a lost worker"))
        elif not self.serves(job.model):
            self._settle(job, exc=Unavailable(f"worker lost and no other worker serves {job.model!r}: {error}"))
        else:
            self.stats.retried += 1
            worker = self._idle_worker(job)
            if worker is not None:
                self._start(worker, job)
            else:
                self.policy.push(job)

    def _settle(self, job: Job, result: Any = None, exc: BaseException | None = None) -> None:
        if job.future.done():
            return
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _drain(self) -> None:
        """Every idle worker takes the next waiting job it can run; dead jobs are dropped unrun."""
        for worker in self.workers.values():
            while not worker.busy and not worker.lost:
                job = self.policy.pop(lambda j, w=worker: j.model in w.models)
                if job is None:
                    break
                if self._still_wanted(job):
                    self._start(worker, job)

    def _still_wanted(self, job: Job) -> bool:
        if job.future.done():  # the caller went away (cancelled)
            self.stats.cancelled += 1
            return False
        if self.clock() >= job.deadline:
            self.stats.expired += 1
            self._settle(job, exc=DeadlineExceeded("deadline passed while queued; not computed"))
            return False
        return True

    def _fail_orphans(self) -> None:
        """Waiting jobs whose model lost its last worker get UNAVAILABLE instead of hanging."""
        orphans = [j for j in self.policy if not self.serves(j.model)]
        for job in orphans:
            self.policy.pop(lambda j, o=job: j is o)
            self._settle(job, exc=Unavailable(f"no live worker serves model {job.model!r}"))

    def expire_waiting(self) -> int:
        """Answers queued jobs whose deadline passed (called periodically): never left hanging."""
        expired = [j for j in self.policy if self.clock() >= j.deadline or j.future.done()]
        for job in expired:
            self.policy.pop(lambda j, e=job: j is e)
            self._still_wanted(job)
        return len(expired)

    def load(self) -> dict[str, int]:
        return {"queued": len(self.policy), "idle": sum(not w.busy and not w.lost for w in self.workers.values()),
                "workers": len(self.workers)}
