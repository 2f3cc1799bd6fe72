"""The scheduler core: admission, dispatch of batches to idle workers, the waiting policy, retries.

State (workers, busy flags, the policy's queue) is changed only by plain methods called on the
event loop thread, never across an `await`, so each change is atomic without locks — the same
single-owner discipline as TEI's queue task, without a channel hop on the hot path.

A policy decides which waiting jobs form the next batch for a freed worker (one job for `fifo`,
several same-model jobs for `padded`); the edge's `send` merges their payloads into one worker call
and splits the answer back, one result a job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
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
    batch_key: tuple = ()          # jobs batch together only with equal keys (model, output, ...)
    future: asyncio.Future = field(repr=False, default=None)  # type: ignore[assignment]
    attempts: int = 0
    tried: set[str] = field(default_factory=set)
    started_at: float = 0.0


class WorkerLost(Exception):
    """The worker did not answer (connection refused or dropped): the jobs may run elsewhere."""


Send = Callable[[WorkerRef, Sequence[Job]], Awaitable[Sequence[Any]]]


@dataclass
class DispatchStats:
    dispatched: int = 0            # batches sent
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
        self._timer: asyncio.TimerHandle | None = None

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
        """Queues the job with the policy and dispatches what is ready; returns the job's result."""
        if not self.serves(job.model):
            raise Unavailable(f"no live worker serves model {job.model!r}")
        if len(self.policy) >= self.queue_capacity:
            self.stats.rejected += 1
            raise ResourceExhausted(f"scheduler queue is full ({self.queue_capacity} requests waiting)",
                                    pushback_ms=self.retry_pushback_ms)
        job.future = asyncio.get_running_loop().create_future()
        self.policy.push(job, self.clock())
        self._drain()
        return await job.future

    def _drain(self) -> None:
        """Every idle worker takes the next ready batch it can run; dead jobs are dropped unrun."""
        now = self.clock()
        for worker in self._idle_workers():
            while not worker.busy:
                batch = self.policy.next_batch(lambda j, w=worker: j.model in w.models, now)
                if not batch:
                    break
                batch = [j for j in batch if self._still_wanted(j, now)]
                if batch:
                    self._start(worker, batch)
        self._arm_timer()

    def _idle_workers(self) -> list[WorkerRef]:
        idle = [w for w in self.workers.values() if not w.busy and not w.lost]
        return sorted(idle, key=lambda w: w.worker_id)

    def _arm_timer(self) -> None:
        """Policies that hold jobs back (a batching delay) say when to look again."""
        wake = self.policy.wake_at()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake is not None and any(not w.busy and not w.lost for w in self.workers.values()):
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, wake - self.clock()), self._drain)

    def _start(self, worker: WorkerRef, batch: list[Job]) -> None:
        worker.busy = True
        now = self.clock()
        for job in batch:
            job.attempts += 1
            job.tried.add(worker.worker_id)
            job.started_at = now
        self.stats.dispatched += 1
        task = asyncio.get_running_loop().create_task(self._run(worker, batch))
        if len(batch) == 1:  # a caller that goes away cancels its downstream call: the work stops there
            batch[0].future.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)

    async def _run(self, worker: WorkerRef, batch: list[Job]) -> None:
        try:
            results = await self.send(worker, batch)
        except WorkerLost as e:
            worker.lost = True
            for job in batch:
                self._retry_or_fail(job, e)
            self._fail_orphans()
        except asyncio.CancelledError:
            for job in batch:
                self._settle(job, exc=Unavailable("dispatch cancelled"))
        except Exception as e:  # a ServingError, or a bug: every caller gets an answer
            for job in batch:
                self._settle(job, exc=e)
        else:
            if len(results) != len(batch):
                error = ServingError(f"worker returned {len(results)} results for {len(batch)} requests")
                for job in batch:
                    self._settle(job, exc=error)
            for job, result in zip(batch, results, strict=False):
                self._settle(job, result=result)
        finally:
            worker.busy = False
            if _loop_running():  # not when a never-finished task is closed by the garbage collector
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
            self.policy.push(job, self.clock(), front=True)

    def _settle(self, job: Job, result: Any = None, exc: BaseException | None = None) -> None:
        if job.future.done():
            return
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _still_wanted(self, job: Job, now: float) -> bool:
        if job.future.done():  # the caller went away (cancelled)
            self.stats.cancelled += 1
            return False
        if now >= job.deadline:
            self.stats.expired += 1
            self._settle(job, exc=DeadlineExceeded("deadline passed while queued; not computed"))
            return False
        return True

    def _fail_orphans(self) -> None:
        """Waiting jobs whose model lost its last worker get UNAVAILABLE instead of hanging."""
        for job in self.policy.remove(lambda j: not self.serves(j.model)):
            self._settle(job, exc=Unavailable(f"no live worker serves model {job.model!r}"))

    def expire_waiting(self) -> int:
        """Answers queued jobs whose deadline passed or whose caller left (called periodically)."""
        now = self.clock()
        dead = self.policy.remove(lambda j: now >= j.deadline or j.future.done())
        for job in dead:
            self._still_wanted(job, now)
        return len(dead)

    def load(self) -> dict[str, int]:
        return {"queued": len(self.policy), "idle": len(self._idle_workers()), "workers": len(self.workers)}


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
