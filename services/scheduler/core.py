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
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from academus.services.scheduler.policies import BatchPlan, DispatchPolicy
from academus.shared.runtime.errors import DeadlineExceeded, ResourceExhausted, ServingError, Unavailable
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.metrics import LATENCY_BUCKETS, children

QUEUE_WAIT = Histogram("academus_scheduler_queue_wait_seconds",
                       "Seconds a request waited in the scheduler's queue or buffer before its first dispatch",
                       ["policy", "model"], buckets=LATENCY_BUCKETS)
STUDENT_NUMBER = Gauge("academus_scheduler_student_number",
                       "Students each live group of a student model runs now (S, adapted by the resource manager)",
                       ["model"])
DROPPED = Counter("academus_scheduler_dropped_total", "Jobs dropped unrun", ["reason"])
EXPIRED, CANCELLED, DOOMED = (DROPPED.labels(r) for r in ("expired", "cancelled", "doomed"))
SENT_AHEAD = Counter("academus_scheduler_sent_ahead_total",
                     "Batches sent to a group still running one (ACADEMUS_SEND_AHEAD)")


@dataclass
class WorkerRef:
    worker_id: str
    address: str
    models: frozenset[str]
    capacity: int = 1              # student instances (compute slots) it runs at once
    running: int = 0
    lost: bool = False
    lost_at: float = 0.0           # when a call to it failed as lost (the dispatcher's clock)
    registration: str = ""         # the resource manager's token for its latest registration

    @property
    def busy(self) -> bool:
        return self.running >= self.capacity


@dataclass(frozen=True)
class Member:
    """One worker's part of a group: the students it runs (() = the whole model, e.g. the teacher).
    It is one call on one compute slot; students co-located on a worker run in that call."""

    worker_id: str
    students: tuple[int, ...] = ()

    slots = 1


@dataclass(eq=False)
class Group:
    """A dispatch target. For a teacher model: one compute slot of one worker. For a student model:
    the S student instances of group j, placed by the resource manager (eq. 6) on several workers,
    whose partial outputs the scheduler adds up (the group's combiner)."""

    name: str
    models: frozenset[str]
    members: tuple[Member, ...]
    students: int = 1              # S: the student number this group was formed with
    in_flight: int = 0             # batches sent and not answered: the running one, and one sent ahead
    started_at: float = 0.0        # when the running batch began (the scheduler's reckoning)
    running_s: float = 0.0         # what the running batch was expected to take when it began
    ahead_s: float = 0.0           # and the batch sent ahead of it

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    @property
    def worker_id(self) -> str:
        return "+".join(m.worker_id for m in self.members)


@dataclass(frozen=True)
class Shard:
    """This scheduler's share of its deployment's groups, where several scheduler processes split them: a
    core each (on the H200 node one scheduler spent 0.71 ms of CPU a request, a ceiling near 1400/s).
    Of a model's n groups, shard k takes the k-th of `count` runs of consecutive ones: consecutive groups
    sit on different devices (eq. 6; teacher slots are formed slot by slot), so a shard of two groups or
    more spreads over the devices, and a lost device leaves it some. A shard of one group loses it with
    its device, and answers UNAVAILABLE (the gateway sends its requests to another shard) until the
    resource manager re-plans. With fewer groups than shards, shard k shares group k % n with another,
    whose worker then queues the two shards' batches (the resource manager counts it once, by name).
    Shards re-read the placements each on its own refresh: for a moment after a change a group may be
    sent work by two shards, or by none."""

    index: int = 0
    count: int = 1

    def take(self, groups: list[Group]) -> list[Group]:
        """This shard's groups of `groups` (in their order), taken per model set."""
        if self.count == 1:
            return groups
        by_models: dict[frozenset[str], list[Group]] = {}
        for group in groups:
            by_models.setdefault(frozenset(group.models), []).append(group)
        mine: set[Group] = set()
        for same in by_models.values():
            n, k = len(same), self.index
            mine.update(same[k * n // self.count:(k + 1) * n // self.count] if n >= self.count else [same[k % n]])
        return [g for g in groups if g in mine]


@dataclass(frozen=True)
class GroupTable:
    """The resource manager's allocation for one student model (`groups:<model>` in Redis)."""

    model: str
    students: int
    groups: tuple[tuple[Member, ...], ...]


@dataclass(eq=False)   # a job is itself, never equal to another: DAS's items name their jobs
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
    started_at: float = 0.0
    max_length: int = 0            # the longest text, in tokens (the length-aware buffer's bin)
    lengths: tuple[int, ...] = ()  # each text's tokens (concat places texts; empty: one text of num_tokens)
    plan: BatchPlan | None = None  # set by the concat policy: where this batch's texts sit (ConcatBatching)
    prefetch: asyncio.Task | None = field(repr=False, default=None)  # work done while it waits (PLOT states)
    on_partial: Callable[[Any], None] | None = field(repr=False, default=None)  # its early answers (exit ramps)
    released: set[int] | None = field(repr=False, default=None)   # its texts answered early (none: not asked)
    trace: Any = field(repr=False, default=None)   # opaque to the core: the request's trace, which its batch joins


# A batch running long stands for the batches that start before the smoothed batch time (a fifth a sample) could
# follow a lasting slowdown: after 10 of them it covers 89 % of it. Counted for every batch ahead, a batch that ran
# a few milliseconds refused most of 256 closed loops whose batches took 0.4 ms (docs/benchmarks/stack.md).
SLOWDOWN_BATCHES = 10


def smooth(values: dict[str, float], key: str, sample: float, weight: float = 1.0) -> None:
    """An exponentially smoothed value (a fifth of each new sample, times its `weight` in 0..1): the first sample
    as it is."""
    previous = values.get(key)
    values[key] = sample if previous is None else previous + 0.2 * weight * (sample - previous)


class WorkerLost(Exception):
    """A worker did not answer (connection refused or dropped): the jobs may run on another group."""

    def __init__(self, message: str, worker_id: str = "") -> None:
        super().__init__(message)
        self.worker_id = worker_id


Send = Callable[[Group, Sequence[Job]], Awaitable[Sequence[Any]]]

# A batch in flight on a worker that left the placements, run this many times what it should take and this long at
# least, has its worker probed: a hung process (its heartbeat's key lapsed; its open connection neither answers nor
# refuses) does not answer, and its batches are given up and run elsewhere. One that answers is draining (it
# deregistered to stop) and keeps them; it is probed again PROBE_AGAIN_S later.
ABANDON_FACTOR, ABANDON_MIN_S, PROBE_AGAIN_S = 4.0, 1.0, 1.0
# A batch's time is learnt as at most this many times what it was expected to take: one answered after its worker
# stood still for seconds (stopped, a host's stall) would lift the estimate many-fold, and the queue's bound would
# refuse what the workers have room for until later batches brought it down. A lasting slowdown is still learnt,
# 1 + 0.2 x 3 fold a full batch.
LEARNT_FACTOR = 4.0
Probe = Callable[["WorkerRef"], Awaitable[bool]]   # whether the worker answered


@dataclass(eq=False)
class Flight:
    """A batch on its way: the workers it runs on, when it started, what it should take, the task that sends it,
    and whether it was given up (its worker departed and silent)."""
    refs: list[WorkerRef]
    started_at: float
    expected_s: float
    task: asyncio.Task | None = None
    given_up: bool = False


@dataclass
class DispatchStats:
    dispatched: int = 0            # batches sent
    expired: int = 0
    cancelled: int = 0
    retried: int = 0
    rejected: int = 0
    doomed: int = 0                # not started: the batch could not finish before the job's deadline
    sent_ahead: int = 0            # batches sent to a group still running one (send_ahead)
    abandoned: int = 0             # batches given up on a worker that left the placements (abandon_departed)


class Dispatcher:
    def __init__(self, policy: DispatchPolicy, send: Send, queue_capacity: int,
                 retry_pushback_ms: int = 50, clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[Job], None] | None = None, drop_doomed: bool = True,
                 send_ahead: bool = False, lost_quarantine_s: float = 5.0, shard: Shard = Shard(),
                 policy_name: str = "", max_queue_wait_s: float = 0.0, regroup_wait_s: float = 0.0,
                 probe: Probe | None = None) -> None:
        self.policy = policy
        self.max_queue_wait_s = max_queue_wait_s
        self._queue_wait = children(QUEUE_WAIT, policy_name or policy.name)  # the deployment's name (a variant's)
        self._students: set[str] = set()   # the models STUDENT_NUMBER has a value for
        self.shard = shard
        # a worker lost mid-call stays out this long while Redis still lists it: a heartbeat TTL, after
        # which a dead worker's key has expired, so one still listed is alive (its heartbeat renewed)
        self.lost_quarantine_s = lost_quarantine_s
        # a student model whose every group lost a member while a live worker here still serves it waits this
        # long for the resource manager's re-plan onto the workers left, its jobs held (each to its deadline)
        self.regroup_wait_s = regroup_wait_s
        self._regrouping: dict[str, float] = {}   # model -> when its wait for a re-plan ends (the clock's)
        # a busy group is sent its next batch while it runs one, where the policy never holds a batch back
        # to grow: it starts when the first ends, without the reply's and the dispatch's hops in between
        self.send_ahead = send_ahead and policy.sends_ahead
        self.drop_doomed = drop_doomed  # off: every job is started (the ablation; the worker stops it late)
        self.on_wait = on_wait  # called for a job that found no free group: prefetch for it meanwhile
        self.send = send
        self.queue_capacity = queue_capacity
        self.retry_pushback_ms = retry_pushback_ms
        self.clock = clock
        self.workers: dict[str, WorkerRef] = {}
        self.tables: dict[str, GroupTable] = {}
        self.groups: list[Group] = []
        self._served: frozenset[str] = frozenset()   # the models a live group runs, as of `_resize`
        self.stats = DispatchStats()
        self.service_s: dict[str, float] = {}  # model -> smoothed batch time: can a deadline still be met?
        self.batch_texts: dict[str, float] = {}  # model -> smoothed texts a batch (what service_s was measured at)
        self.token_s: dict[str, float] = {}  # model -> smoothed time a computed token (batches shaped by tokens)
        self.token_dev: dict[str, float] = {}  # model -> smoothed deviation of token_s's samples from it
        self._timer: asyncio.TimerHandle | None = None
        self._arriving: Job | None = None  # a job that finds a free group on arrival is left to the worker
        self._flights: set[Flight] = set()   # the batches in flight
        self.probe = probe   # asks a departed worker whether it still answers; None: none does (given up at once)
        self._probed_at: dict[str, float] = {}   # worker_id -> when its last probe began (one at a time)
        self._probes: set[asyncio.Task] = set()   # the probes under way (the loop keeps only weak references)

    @property
    def max_queue_wait_s(self) -> float:
        """Admission bounds the queue in time, not only in requests: past it a request is refused at once
        (RESOURCE_EXHAUSTED, pushback until the queue is back under it) instead of waiting most of its
        deadline in a queue that only grows under overload; 0: bounded by each request's deadline only.
        The policy holds it: one that reorders jobs starts those that reach it first."""
        return self.policy.max_wait_s

    @max_queue_wait_s.setter
    def max_queue_wait_s(self, seconds: float) -> None:
        self.policy.bound_wait(seconds)

    # -- membership -------------------------------------------------------------------------
    def update_workers(self, live: dict[str, tuple], tables: dict[str, GroupTable] | None = None) -> None:
        """Replaces the worker set (id -> (address, models[, capacity[, registration]])) and the student group
        tables with what Redis says, keeping the running counts of workers that stay. A lost worker stays lost
        until it is listed at another address, registers again (a restart on its address: only a live process
        registers) or its quarantine has passed: until its heartbeat key expires, Redis lists a dead worker
        too, and a retry sent back to it would be lost again."""
        for worker_id in list(self.workers):
            if worker_id not in live:
                del self.workers[worker_id]
        now = self.clock()
        for worker_id, (address, models, *rest) in live.items():
            capacity = rest[0] if rest else 1
            registration = rest[1] if len(rest) > 1 else ""
            ref = self.workers.get(worker_id)
            if ref is None or ref.address != address or (ref.lost and (
                    registration != ref.registration or now - ref.lost_at >= self.lost_quarantine_s)):
                self.workers[worker_id] = WorkerRef(worker_id, address, models, capacity, registration=registration)
            else:
                ref.models, ref.capacity, ref.registration = models, capacity, registration
        if tables is not None:
            self.tables = tables
        self.groups = self._form_groups()
        self._report_students()
        self._resize()
        self.abandon_departed()
        self._drain()
        self._fail_orphans()

    def _form_groups(self) -> list[Group]:
        """Student models: the published groups. Every other model: one group a worker slot. A group that
        is the same as before stays the same object, its batches in flight counted: a refresh (every
        second) must not make a busy group look idle to the load signals, nor lose a batch sent ahead."""
        def same(g: Group) -> tuple:
            return g.name, frozenset(g.models), g.members, g.students

        before = {same(g): g for g in self.groups}
        formed = []
        for table in self.tables.values():
            for j, members in enumerate(table.groups):
                if all(m.worker_id in self.workers for m in members):
                    formed.append(Group(f"{table.model}/g{j}", frozenset({table.model}), members, table.students))
        workers = sorted(self.workers.values(), key=lambda w: w.worker_id)
        for slot in range(max((w.capacity for w in workers), default=0)):   # slot by slot: every worker's
            for worker in workers:                                          # first slot before any second
                models = worker.models - self.tables.keys()
                if models and slot < worker.capacity:
                    formed.append(Group(f"{worker.worker_id}#{slot}", models, (Member(worker.worker_id),)))
        return [before.get(same(g), g) for g in self.shard.take(formed)]

    def _report_students(self) -> None:
        """STUDENT_NUMBER of each student model with a live group here; dropped for one that has none left."""
        students = {m: g.students for g in self.groups if self._live(g) for m in g.models if m in self.tables}
        for model in self._students - students.keys():
            STUDENT_NUMBER.remove(model)
        for model, number in students.items():
            STUDENT_NUMBER.labels(model).set(number)
        self._students = set(students)

    def serves(self, model: str) -> bool:
        """A live group runs the model, or one will once the groups are re-planned (`_regroup`)."""
        return model in self._served or model in self._regrouping

    def _resize(self) -> None:
        """The buffer holds an element a live group: a lost worker's groups are out until it is back. Every
        change of the groups or of a worker's state comes here; the models served are kept with the count, since
        `serves` runs on every request (scanning the groups took 4 % of a busy scheduler)."""
        live = [g for g in self.groups if self._live(g)]
        served = frozenset(m for g in live for m in g.models)
        if self._regrouping or self._served - served:
            self._regroup(served)
        self._served = served
        self.policy.resize(len(live))

    def _regroup(self, served: frozenset[str]) -> None:
        """Models that lost their last live group while a live worker here still serves them wait for a re-plan
        (eq. 6 spreads a group's students over the workers, so one lost worker can break every group, and the
        resource manager re-forms them on the others within a round trip): their jobs are held, not failed,
        for at most `regroup_wait_s`. A model no live worker serves fails its jobs at once, as before."""
        now = self.clock()
        survivors = {m for w in self.workers.values() if not w.lost for m in w.models}
        waiting = {}
        for model in (self._served | self._regrouping.keys()) - served:
            until = self._regrouping.get(model, now + self.regroup_wait_s)
            if model in survivors and now < until:
                waiting[model] = until
        if _loop_running():   # the wait's end fails what is still held
            for model in waiting.keys() - self._regrouping.keys():
                asyncio.get_running_loop().call_later(self.regroup_wait_s, self._regroup_over, model)
        self._regrouping = waiting

    def _regroup_over(self, model: str) -> None:
        left = self._regrouping.get(model, 0.0) - self.clock()
        if left > 0:   # a timer a moment early: the wait ends by the dispatcher's clock
            asyncio.get_running_loop().call_later(left, self._regroup_over, model)
            return
        self._resize()
        self._fail_orphans()

    def _live(self, group: Group) -> bool:
        return all(m.worker_id in self.workers and not self.workers[m.worker_id].lost for m in group.members)

    def _free(self, group: Group) -> bool:
        """Idle, alive, and every member worker has the compute slots its students need."""
        if group.busy or not self._live(group):
            return False
        return all(self.workers[m.worker_id].running + m.slots <= self.workers[m.worker_id].capacity
                   for m in group.members)

    # -- the request path -------------------------------------------------------------------
    async def submit(self, job: Job) -> Any:
        """Queues the job with the policy and dispatches what is ready; returns the job's result."""
        if not self.serves(job.model):
            raise Unavailable(f"no live worker serves model {job.model!r}")
        if len(self.policy) >= self.queue_capacity:
            self.stats.rejected += 1
            raise ResourceExhausted(f"scheduler queue is full ({self.queue_capacity} requests waiting)",
                                    pushback_ms=self.retry_pushback_ms)
        self._admit(job)
        job.future = asyncio.get_running_loop().create_future()
        self.policy.push(job, self.clock())
        self._arriving = job
        try:
            self._drain()
        finally:
            self._arriving = None
        if self.on_wait is not None and not job.attempts and not job.future.done():  # it waits for a group
            self.on_wait(job)
        return await job.future

    def _admit(self, job: Job) -> None:
        """Refuses at once what the queue cannot start in time: DEADLINE_EXCEEDED when the work ahead at the
        measured batch times outlasts the job's deadline, RESOURCE_EXHAUSTED when the work ahead, a batch running
        long counted in, exceeds the queue's wait bound, with a pushback hint of the excess, the bound at most (the
        gateway then sends this scheduler nothing while the queue drains to the bound).

        The deadline's refusal is final, so it does not count a batch running long: one batch running for
        seconds, taken as the time of every batch queued behind it, promised a standby scheduler at 10 requests
        a second 11-13 s of work, its measured batches taking 76-85 ms. The bound's refusal is retried after
        its pushback, so it counts the slowdown as it forms."""
        measured, slowed = self._wait_ahead(job)
        if not slowed:
            return
        left = job.deadline - self.clock()
        if measured > left:
            self.stats.rejected += 1
            raise DeadlineExceeded(f"the deadline cannot be met: about {measured * 1e3:.0f} ms of work ahead "
                                   f"(running and queued), {max(0.0, left) * 1e3:.0f} ms left", nothing_ran=True)
        if self.max_queue_wait_s and slowed > self.max_queue_wait_s:
            self.stats.rejected += 1
            # the hint is the excess, the bound at most: past it the excess is a running batch's stall taken as
            # the time of the batches behind it, which can end at any moment (a hung worker's batch given up)
            # while the gateway would still send the model nothing for seconds
            excess_ms = max(1, round(min(slowed - self.max_queue_wait_s, self.max_queue_wait_s) * 1e3))
            raise ResourceExhausted(f"scheduler queue holds about {slowed * 1e3:.0f} ms of work ahead; the limit "
                                    f"is ACADEMUS_MAX_QUEUE_WAIT_MS={self.max_queue_wait_s * 1e3:.0f}; retry in "
                                    f"{excess_ms} ms", pushback_ms=excess_ms)

    def _wait_ahead(self, job: Job) -> tuple[float, float]:
        """How long the job would wait to start (0: at once, or nothing measured yet), at the measured batch
        times and with a batch running long counted in (as the time of the first SLOWDOWN_BATCHES batches ahead):
        what is left of the running batches and the batches queued ahead of it (of a job that joins a buffered
        element, the elements before that one, of any model), shared out over the model's live groups, and never
        before the first of them frees. Every queued batch waits for a running one to end, so the remainders
        count: without them a job behind one batch on each of two groups was promised half a batch and waited a
        whole one. A lower bound still: its own compute is not counted."""
        mine = [g for g in self.groups if job.model in g.models]
        if any(self._free(g) for g in mine):
            return 0.0, 0.0   # it starts at once: what waits is another model's (a deployment may serve several)
        lanes = [g for g in mine if self._live(g)]
        if not lanes:
            return 0.0, 0.0   # waiting for a re-plan (`_regroup`), which bounds the wait
        now = self.clock()
        measured, running = self._batch_time(job.model), self._running_long(lanes, now)
        if not (measured or running):
            return 0.0, 0.0
        depth = self.policy.ahead_of_merge(job)   # it joins a buffered element: those before it (O(1))
        if depth is None:
            depth = self._depth_ahead(job.model, mine)
        left = [self._left_on(g, now) for g in lanes]
        first, ahead = min(left), sum(left) + measured * depth
        overrun = min(depth, SLOWDOWN_BATCHES) * max(0.0, running - measured)
        return max(first, ahead / len(lanes)), max(first, (ahead + overrun) / len(lanes))

    def _batch_time(self, model: str) -> float:
        """The time of one queued batch for admission (0: nothing measured): a full batch by its tokens where the
        policy's batches have a fixed shape, else the smoothed batch time.

        By tokens: a concat deployment's batches range from one row to eight, so its smoothed batch time
        averages unlike batches (a full one counted about a quarter of its time under overload). DAS's own
        latency model is fitted over 50 batches and lags the workers' speed as their load changes."""
        full = self._by_tokens(model, self.policy.full_batch_tokens())
        return self.service_s.get(model, 0.0) if full is None else full

    @staticmethod
    def _running_long(lanes: list[Group], now: float) -> float:
        """The longest that a batch of `lanes` has been running: a load that slows the workers (another
        deployment's batches on them) shows as it forms, not only once its first slow batch answers."""
        return max((now - g.started_at for g in lanes if g.busy), default=0.0)

    def _by_tokens(self, model: str, tokens: int | None) -> float | None:
        """`tokens` at the model's smoothed time a computed token plus one smoothed deviation of it (None: no
        tokens, or none measured). The deviation is the margin that holds the wait bound where batch times
        vary: admitted at the mean, a request waits past the bound whenever the batches ahead run slow."""
        per_token = self.token_s.get(model)
        if not tokens or per_token is None:
            return None
        return tokens * (per_token + self.token_dev.get(model, 0.0))

    @staticmethod
    def _left_on(group: Group, now: float) -> float:
        """The time until `group` frees: what its running batch was expected to take less what it has run,
        and the batch sent ahead to it. Admission counts it, and so does the finish estimate of a batch sent
        ahead."""
        if not group.busy:
            return 0.0
        return max(0.0, group.started_at + group.running_s - now) + (group.ahead_s if group.in_flight > 1 else 0.0)

    def _depth_ahead(self, model: str, mine: list[Group]) -> int:
        """The batches waiting ahead of a job of `model` (`mine`: the groups that run it): every one,
        unless its groups run no other model while other groups exist (student groups of several student
        models in one deployment): then only its own model's, since another model's go to their groups."""
        if len(mine) < len(self.groups) and all(g.models == {model} for g in mine):
            return self.policy.batches_ahead(model)
        return self.policy.batches_ahead()

    def _drain(self) -> None:
        """Every free group takes the next ready batch it can run; dead jobs are dropped unrun. Then, with
        send_ahead, what still waits goes to busy groups, the one whose batch began first first."""
        now = self.clock()
        for group in self.groups:
            while self._free(group):
                batch = self._next_batch(group, now)
                if batch is None:
                    break
                if batch:
                    self._start(group, batch)
        if self.send_ahead and len(self.policy):
            for group in sorted((g for g in self.groups if self._open_ahead(g)), key=lambda g: g.started_at):
                batch = self._next_batch(group, now, ahead=True)
                if batch is None:
                    break
                if batch:
                    self._start(group, batch)
        self._arm_timer()

    def _next_batch(self, group: Group, now: float, ahead: bool = False) -> list[Job] | None:
        """The policy's next batch for `group` less the jobs no longer wanted or doomed (None: nothing
        ready). `ahead`: sent to the busy group, it waits out the running batch first."""
        batch = self.policy.next_batch(lambda j: j.model in group.models, now)
        self._settle_dropped()
        if not batch:
            return None
        batch = [j for j in batch if self._still_wanted(j, now)]
        if self.drop_doomed and batch:  # the ablation skips the estimate altogether
            expected = (self._left_on(group, now) if ahead else 0.0) + self._batch_estimate(batch)
            batch = [j for j in batch if self._can_finish(j, now, expected, queued=ahead)]
        return batch

    def _open_ahead(self, group: Group) -> bool:
        """Running one batch, none sent ahead yet, alive, and on workers of one compute slot each: such a
        worker runs its calls one after the other, so the element waits behind the running one. On a
        worker of several slots it would start at once on a slot another group holds."""
        return (group.in_flight == 1 and self._live(group)
                and all(self.workers[m.worker_id].capacity == 1 for m in group.members))

    def _settle_dropped(self) -> None:
        """Answers the jobs the policy took out unrun (a deadline it found cannot be met)."""
        for job, error in self.policy.take_dropped():
            if isinstance(error, DeadlineExceeded) and not job.future.done():
                self.stats.expired += 1
                EXPIRED.inc()
            self._settle(job, exc=error)

    def _arm_timer(self) -> None:
        """Policies that hold jobs back (a batching delay) say when to look again."""
        wake = self.policy.wake_at()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake is not None and any(self._free(g) for g in self.groups):
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(max(0.0, wake - self.clock()), self._drain)

    def _start(self, group: Group, batch: list[Job]) -> None:
        refs = [self.workers[m.worker_id] for m in group.members]
        now, expected = self.clock(), self._running_estimate(batch)
        group.in_flight += 1
        if group.in_flight == 1:
            group.started_at, group.running_s = now, expected
            for ref, member in zip(refs, group.members, strict=True):
                ref.running += member.slots
        else:  # sent ahead: it runs on the slots its predecessor holds
            group.ahead_s = expected
            self.stats.sent_ahead += 1
            SENT_AHEAD.inc()
        for job in batch:
            job.attempts += 1
            job.started_at = now
            if job.attempts == 1:   # a retried job waited once: counted at its first dispatch only
                self._queue_wait(job.model).observe(now - job.enqueued_at)
        self.stats.dispatched += 1
        flight = Flight(refs, now, expected)
        task = flight.task = asyncio.get_running_loop().create_task(self._run(group, refs, batch, flight))
        self._flights.add(flight)
        cancel_when_every_caller_left(batch, task)

    async def _run(self, group: Group, refs: list[WorkerRef], batch: list[Job], flight: Flight) -> None:
        started = self.clock()
        results: Sequence[Any] | None = None
        try:
            results = await self.send(group, batch)
        except WorkerLost as e:
            for ref in refs:
                if ref.worker_id == e.worker_id or len(refs) == 1:
                    ref.lost, ref.lost_at = True, self.clock()
            self._resize()
            for job in batch:
                self._retry_or_fail(job, e)
            self._fail_orphans()
        except asyncio.CancelledError:
            if flight.given_up:   # its worker left, hung: the jobs run elsewhere
                lost = WorkerLost("the worker left the placements with this batch unanswered")
                for job in batch:
                    self._retry_or_fail(job, lost)
                self._fail_orphans()
            else:
                for job in batch:
                    self._settle(job, exc=Unavailable("dispatch cancelled"))
        except Exception as e:  # a ServingError, or a bug: every caller gets an answer
            for job in batch:
                self._settle(job, exc=e)
        else:
            took = self.clock() - max(started, group.started_at)  # one sent ahead began when its predecessor ended
            if flight.expected_s:
                took = min(took, LEARNT_FACTOR * flight.expected_s)
            self._observe(batch, took)
            self.policy.observe(batch, took)
        finally:
            self._flights.discard(flight)
            # The freed group takes the next element before the answers go back: their callers' code runs
            # on this loop, and the element waiting for the group should not wait for it too.
            try:
                self._release(group, refs)
            finally:
                if results is not None:
                    self._answer(batch, results)

    def _release(self, group: Group, refs: list[WorkerRef]) -> None:
        """The group's batch ended: its slots free (or the batch sent ahead runs on them), and what waits
        is dispatched."""
        group.in_flight -= 1
        if group.in_flight:  # the batch sent ahead runs now (a member runs its calls in arrival order)
            group.started_at, group.running_s, group.ahead_s = self.clock(), group.ahead_s, 0.0
        else:
            for ref, member in zip(refs, group.members, strict=True):
                ref.running = max(0, ref.running - member.slots)
        if _loop_running():  # not when a never-finished task is closed by the garbage collector
            self._drain()

    def _answer(self, batch: list[Job], results: Sequence[Any]) -> None:
        if len(results) != len(batch):
            error = ServingError(f"worker returned {len(results)} results for {len(batch)} requests")
            for job in batch:
                self._settle(job, exc=error)
        for job, result in zip(batch, results, strict=False):
            self._settle(job, result=result)

    def _observe(self, batch: list[Job], seconds: float) -> None:
        model, texts, tokens = batch[0].model, sum(j.num_texts for j in batch), self.policy.computed_tokens(batch)
        smooth(self.service_s, model, seconds)
        smooth(self.batch_texts, model, texts)
        if tokens:
            per_token = seconds / tokens
            # A batch weighs by its share of a full one, whose time admission counts: a row's batch of a fast
            # model is mostly fixed costs, and one held up 10-25 ms by a busy core lifted a full batch's estimate
            # several-fold, refusing requests that would have waited a fifth of the bound (stack.md, 2026-12-05).
            full = self.policy.full_batch_tokens()
            weight = min(1.0, tokens / full) if full else 1.0
            if model in self.token_s:   # how far a sample strays from the smoothed time, as TCP's RTT variance
                smooth(self.token_dev, model, abs(per_token - self.token_s[model]), weight)
            smooth(self.token_s, model, per_token, weight)

    def _running_estimate(self, batch: list[Job]) -> float:
        """What a batch about to start will take, for what is left of it once it runs (admission, the doom
        check of a batch sent ahead): its computed tokens at the smoothed time a token and its margin
        (`_by_tokens`), where the policy shapes batches by tokens; else the smoothed batch time scaled down to its
        size; 0 unmeasured."""
        by_tokens = self._by_tokens(batch[0].model, self.policy.computed_tokens(batch))
        return self._batch_estimate(batch) if by_tokens is None else by_tokens

    def _batch_estimate(self, batch: list[Job]) -> float:
        """What the batch will take: the smoothed batch time, scaled down for a batch smaller than the
        average (never up: a job is refused only when its batch clearly cannot finish); 0 unmeasured."""
        service = self.service_s.get(batch[0].model)
        if service is None:
            return 0.0
        texts = sum(j.num_texts for j in batch)
        return service * min(1.0, texts / max(self.batch_texts.get(batch[0].model, texts), 1.0))

    def _can_finish(self, job: Job, now: float, expected: float, queued: bool = False) -> bool:
        """A job that waited is not started when its batch cannot finish before its deadline: under
        overload the oldest jobs are the nearest their deadline, and starting them computes answers
        nobody waits for (the worker stops a batch only once its last deadline has passed). One that
        found a free group on arrival is left to the worker, as admission's lower bound let it in; one
        sent ahead on arrival (`queued` behind a running batch) is checked like a job that waited."""
        if (job is self._arriving and not queued) or now + expected <= job.deadline:
            return True
        self.stats.doomed += 1
        DOOMED.inc()
        why = (f"a batch takes about {expected * 1e3:.0f} ms, {max(0.0, job.deadline - now) * 1e3:.0f} ms left; "
               "not computed")
        # a job back after a lost worker that its deadline no longer allows to retry: DESIGN §8's UNAVAILABLE
        self._settle(job, exc=Unavailable(f"worker lost, and no time left to retry: {why}") if job.attempts
                     else DeadlineExceeded(f"cannot finish in time: {why}"))
        return False

    def _retry_or_fail(self, job: Job, error: Exception) -> None:
        if job.future.done():
            return
        if self.clock() >= job.deadline:
            self._settle(job, exc=Unavailable(f"worker lost, and the deadline passed before a retry: {error}"))
        elif not self.serves(job.model):
            self._settle(job, exc=Unavailable(f"worker lost and no other group serves {job.model!r}: {error}"))
        else:
            self.stats.retried += 1
            self.policy.push(job, self.clock(), front=True)

    def _settle(self, job: Job, result: Any = None, exc: BaseException | None = None) -> None:
        if job.prefetch is not None:  # answered before its prefetch was used (dropped, failed)
            job.prefetch.cancel()
            job.prefetch = None
        if job.future.done():
            return
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    def _still_wanted(self, job: Job, now: float) -> bool:
        if job.future.done():  # the caller went away (cancelled)
            self.stats.cancelled += 1
            CANCELLED.inc()
            return False
        if now >= job.deadline:
            self.stats.expired += 1
            EXPIRED.inc()
            self._settle(job, exc=DeadlineExceeded("deadline passed while queued; not computed"))
            return False
        return True

    def _fail_orphans(self) -> None:
        """Waiting jobs whose model lost its last group get UNAVAILABLE instead of hanging."""
        for job in self.policy.remove(lambda j: not self.serves(j.model)):
            self._settle(job, exc=Unavailable(f"no live worker serves model {job.model!r}"))

    def abandon_departed(self) -> None:
        """Probes each worker that left the placements (or is listed as another registration) while a batch on it
        ran past ABANDON_FACTOR times its estimate; one that does not answer has its batches given up, their jobs
        retried, deadlines permitting."""
        now = self.clock()
        for flight in self._flights:
            if flight.given_up or now - flight.started_at < max(ABANDON_FACTOR * flight.expected_s, ABANDON_MIN_S):
                continue
            for ref in flight.refs:
                departed = self.workers.get(ref.worker_id) is not ref
                if departed and now - self._probed_at.get(ref.worker_id, float("-inf")) >= PROBE_AGAIN_S:
                    self._probed_at[ref.worker_id] = now
                    probe = asyncio.get_running_loop().create_task(self._probe_departed(ref))
                    self._probes.add(probe)
                    probe.add_done_callback(self._probes.discard)

    async def _probe_departed(self, ref: WorkerRef) -> None:
        if self.probe is not None and await self.probe(ref):
            return   # draining: its batches end within the grace it stops in
        given_up = [f for f in self._flights if any(r is ref for r in f.refs) and not f.given_up]
        for flight in given_up:
            flight.given_up = True
            flight.task.cancel()
        self.stats.abandoned += len(given_up)
        if given_up:   # none left: they ended while the worker was asked
            log_event("batches_given_up", logging.WARNING, worker_id=ref.worker_id, address=ref.address,
                      batches=len(given_up))

    def expire_waiting(self) -> int:
        """Answers queued jobs whose deadline passed or whose caller left, and probes the departed workers that
        hold overdue batches (called periodically)."""
        self.abandon_departed()
        now = self.clock()
        dead = self.policy.remove(lambda j: now >= j.deadline or j.future.done())
        for job in dead:
            self._still_wanted(job, now)
        return len(dead)

    TIMINGS = ("service_s", "batch_texts", "token_s", "token_dev")

    def timings(self) -> dict[str, dict[str, float]]:
        """Per model timed here: the smoothed batch times admission estimates with."""
        return {model: {name: values[model] for name in self.TIMINGS if model in (values := getattr(self, name))}
                for model in self.service_s}

    def seed(self, model: str, timings: dict[str, float]) -> bool:
        """Starts a model not yet timed here from timings its deployment reported before (a restarted scheduler
        has none of its own: on the running batches' time alone it admitted a backlog past the wait bound).
        False when the model is timed already, or `timings` has no batch time."""
        if model in self.service_s or "service_s" not in timings:
            return False
        for name in self.TIMINGS:
            if name in timings:
                getattr(self, name)[model] = float(timings[name])
        return True

    def load(self) -> dict[str, int]:
        idle = sum(1 for g in self.groups if self._free(g))
        return {"queued": len(self.policy), "idle": idle, "groups": len(self.groups), "workers": len(self.workers),
                "buffer": self.policy.depth()}

    def model_load(self) -> dict[str, dict[str, Any]]:
        """Per model: the resource manager's adaptation signals (App. B.4.1), with each group's busy flag by
        name (`by_group`): a group two shards share is then counted once when the manager adds them up."""
        out: dict[str, dict[str, Any]] = {}
        waiting: dict[str, int] = {}
        for job in self.policy:
            waiting[job.model] = waiting.get(job.model, 0) + 1
        for group in filter(self._live, self.groups):   # a lost worker's group is neither idle nor busy
            for model in group.models:
                entry = out.setdefault(model, {"groups": 0, "idle": 0, "busy": 0, "students": group.students,
                                               "buffer": 0, "by_group": {}})
                entry["groups"] += 1
                entry["busy" if group.busy else "idle"] += 1
                entry["by_group"][group.name] = int(group.busy)
                entry["buffer"] += group.in_flight > 1  # a batch sent ahead waits as a buffer element does
        depth = self.policy.depth()
        for model, entry in out.items():
            entry["buffer"] += min(depth, waiting.get(model, 0))
        return out


def cancel_when_every_caller_left(batch: list[Job], task: asyncio.Task) -> None:
    """A caller that goes away cancels its job; once every job of a batch is cancelled, so is the batch's
    downstream call, and the worker stops between layers: nobody waits for the answer."""
    waiting = len(batch)

    def left(future: asyncio.Future) -> None:
        nonlocal waiting
        if future.cancelled():
            waiting -= 1
            if waiting == 0:
                task.cancel()

    for job in batch:
        job.future.add_done_callback(left)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
