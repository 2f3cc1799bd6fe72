"""gRPC edge of the scheduler: Schedule calls enter the Dispatcher; workers come from Redis placements."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from opentelemetry.trace import Tracer, get_tracer
from prometheus_client import Gauge

from academus.services.scheduler.core import (
    Dispatcher,
    Group,
    GroupTable,
    Job,
    Member,
    Probe,
    Send,
    Shard,
    WorkerLost,
    WorkerRef,
)
from academus.services.scheduler.plot_prefetch import PlotPrefetcher
from academus.services.scheduler.policies import (
    ConcatSettings,
    DispatchPolicy,
    LatencyModel,
    StudentPolicy,
    make_policy,
)
from academus.services.scheduler.sender import GroupSender, OnPartial
from academus.shared.models.plot.registry import live_plot_services
from academus.shared.models.work import Batch, BatchOutput
from academus.shared.models.work_wire import batch_to_pb, item_from_pb, output_from_pb, output_to_pb
from academus.shared.runtime import config as cfg
from academus.shared.runtime.errors import ServingError, abort_with, answered, from_rpc_error
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.multiplex import call_with_partials
from academus.shared.runtime.redis_conn import connect, wake_on, woken
from academus.shared.runtime.serving import PeerHealth, ServiceSpec, Stubs, run
from academus.shared.runtime.tracing import annotate, batch_trace, request_trace
from academus.shared.state.catalogue import ModelSpec
from academus.shared.state.groups import groups_from_json
from academus.shared.state.keys import Keys
from academus.shared.state.registration import Registration
from academus.v1 import plot_pb2_grpc, scheduler_pb2_grpc, worker_pb2_grpc

TIMING_TTL_S = 600   # a deployment's reported batch times outlive its schedulers this long: restarts start from them
QUEUE_DEPTH = Gauge("academus_scheduler_queue_depth", "Jobs waiting for a worker")
BUFFER_DEPTH = Gauge("academus_scheduler_buffer_depth", "Waiting dispatch units (length-aware buffer elements)")
LOST_CODES = (grpc.StatusCode.UNAVAILABLE,)
PROBE_S = 1.0   # a departed worker silent this long to its health check is hung


class WorkerCalls:
    """The sender's `RunOn` over the wire: a batch to a worker's `Run` and its answer back, early answers included;
    a worker that does not answer is lost (the dispatcher retries elsewhere), one that refused is its error."""

    def __init__(self, stubs: Stubs, workers: dict[str, WorkerRef]) -> None:
        self.stubs, self.workers = stubs, workers

    async def __call__(self, worker_id: str, batch: Batch, remaining: float,
                       on_partial: OnPartial | None = None) -> BatchOutput:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise WorkerLost(f"{worker_id} left the placement", worker_id)
        early = None if on_partial is None else lambda reply: on_partial(output_from_pb(reply))
        try:
            # a worker that registered again is a new process on its address: called on a new channel
            reply = await call_with_partials(self.stubs(worker.address, worker.registration).Run, batch_to_pb(batch),
                                             remaining, early)
        except grpc.aio.AioRpcError as e:
            if e.code() in LOST_CODES and not answered(e):   # the worker itself chose it: not lost
                raise WorkerLost(f"{worker_id} at {worker.address}: {e.details()}", worker_id) from e
            raise from_rpc_error(e, f"worker {worker_id}") from e
        return output_from_pb(reply)


class LostRegistrations:
    """The worker registrations the resource manager announced lost (`lost <worker id> <registration>` on the
    events channel: it found the process dead, or silent to its checks), the latest `kept` of them."""

    def __init__(self, kept: int = 1024) -> None:
        self.kept = kept
        self._order: deque[str] = deque()
        self._lost: set[str] = set()

    def hear(self, message: str) -> None:
        kind, *rest = message.split()
        if kind == "lost" and len(rest) == 2 and rest[1] not in self._lost:
            self._order.append(rest[1])
            self._lost.add(rest[1])
            if len(self._order) > self.kept:
                self._lost.discard(self._order.popleft())

    def __contains__(self, registration: str) -> bool:
        return registration in self._lost


def worker_probe(health: PeerHealth, lost: LostRegistrations | None = None) -> Probe:
    """Whether a worker that left the placements still answers (the dispatcher's `probe`): only silence for PROBE_S
    is a hung process. One draining after it deregistered answers NOT_SERVING, or refuses the call once its server
    stops taking new ones while its own calls finish; a dead one refuses, and its calls have failed already. One the
    resource manager announced lost was found dead or silent there already: it is not asked again."""
    async def answers(worker: WorkerRef) -> bool:
        if lost is not None and worker.registration in lost:
            return False
        return await health.answers(worker.address, PROBE_S, worker.registration)

    return answers


def traced(send: Send, tracer: Tracer | None = None) -> Send:
    """`send` with the batch's worker calls in its own requests' trace (tracing.batch_trace), not in that of the
    task that happened to dispatch it (an arriving request's, or the batch that ended before it). The process's
    tracer by default, resolved once (a proxy until the service installs its provider)."""
    tracer = tracer or get_tracer("academus.scheduler")

    async def traced_send(group: Group, jobs: Sequence[Job]) -> Sequence[Any]:
        with batch_trace([job.trace for job in jobs], tracer):
            return await send(group, jobs)

    return traced_send


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, dispatcher: Dispatcher, policy: str, student_numbers: dict[str, int]) -> None:
        self.dispatcher = dispatcher
        self.policy = policy
        self.scheduler_id = ""  # known once the server is bound (it defaults to the address)
        self.student_numbers = student_numbers  # model -> students to run (0: the group's best k)

    async def Schedule(self, request, context: grpc.aio.ServicerContext):
        entered = time.perf_counter()
        now = self.dispatcher.clock()
        remaining = context.time_remaining()
        students = self.student_numbers.get(request.model, 0)
        # early answers go back on the gateway's call, where it rides a multiplexed hop that asked for them
        send = getattr(context, "send_partial", None) if request.early_exit else None
        item = item_from_pb(request, students, early_exit=send is not None)
        on_partial = None if send is None else lambda early: send(output_to_pb(early, item.output))
        job = Job(
            model=item.model, payload=item,
            num_texts=len(item.lengths), num_tokens=len(item.input_ids),
            deadline=now + (remaining if remaining is not None else 30.0), enqueued_at=now,
            batch_key=(item.model, item.output, students),
            max_length=max(item.lengths, default=0), lengths=tuple(item.lengths), on_partial=on_partial,
            trace=request_trace(),
        )
        annotate(model=request.model, tenant=request.tenant, policy=self.policy, batch_size=job.num_texts)
        try:
            result = await self.dispatcher.submit(job)
        except ServingError as e:
            await abort_with(context, e)
        return output_to_pb(result, item.output, policy=self.policy, scheduler_id=self.scheduler_id,
                            queue_ms=(job.started_at - job.enqueued_at) * 1e3, attempts=job.attempts,
                            scheduler_ms=(time.perf_counter() - entered) * 1e3)


class PlacementWatcher:
    """Keeps the dispatcher's workers and student groups equal to the live placements in Redis. A scheduler
    given a node (DESIGN: one scheduler a node) takes that node's workers only, and with them the groups the
    resource manager formed there; `serving` is then the models it has a live group for, which it registers
    so that gateways send it no other."""

    def __init__(self, redis, keys: Keys, dispatcher: Dispatcher, refresh_s: float,
                 models: cfg.ModelSelection = cfg.EVERY_MODEL, prefetcher: PlotPrefetcher | None = None,
                 node: str = "", on_serving: Callable[[], Awaitable[None]] | None = None,
                 heard: Callable[[str], None] | None = None) -> None:
        self.redis, self.keys, self.dispatcher, self.refresh_s = redis, keys, dispatcher, refresh_s
        self.heard = heard   # takes each event's text
        self.prefetcher = prefetcher
        self.models = models  # this deployment's models
        self.node = node
        self.on_serving = on_serving  # called when `serving` changed
        self.serving: frozenset[str] = frozenset()
        self.changed = asyncio.Event()
        self.student_numbers: dict[str, int] = {}
        self.max_merge: int | None = None

    async def refresh(self) -> None:
        live = await self.read_live()
        models = sorted({m for _, served, *_ in live.values() for m in served})
        tables = await self.read_tables(models)
        if any(m.worker_id not in live for t in tables.values() for g in t.groups for m in g):
            # a worker registered and was placed between the two reads: without it, its groups would
            # be dropped and the jobs waiting for them failed as orphans
            live = await self.read_live()
        self.dispatcher.update_workers({w: (a, frozenset(m), c, r) for w, (a, m, c, node, r) in live.items()
                                        if not self.node or node == self.node}, tables)
        serving = frozenset(m for m in models if self.dispatcher.serves(m))
        if serving != self.serving:
            self.serving = serving
            if self.on_serving is not None:
                await self.on_serving()
        await self.refresh_student_numbers(models)
        await self.refresh_profile(models)
        if self.prefetcher is not None:
            await self.refresh_plot(models)

    async def read_live(self) -> dict[str, tuple[str, set[str], int, str, str]]:
        """Workers with a live heartbeat placed for this deployment's models, on every node:
        id -> (address, models, slots, node, registration)."""
        live: dict[str, tuple[str, set[str], int, str, str]] = {}
        for model in await self.redis.smembers(self.keys.placements()):
            if model not in self.models:
                continue
            for worker_id in await self.redis.smembers(self.keys.placement(model)):
                if worker_id not in live:
                    address, capacity, node, registration = await self.redis.hmget(
                        self.keys.worker(worker_id), "address", "capacity", "node", "registration")
                    if not address:
                        continue  # heartbeat expired: not live
                    live[worker_id] = (address, set(), max(1, int(capacity or 1)), node or "", registration or "")
                live[worker_id][1].add(model)
        return live

    async def refresh_plot(self, models: list[str]) -> None:
        """The PLOT models among `models` (their catalogue specs) and the plot services that can serve them."""
        raw = await self.redis.hmget(self.keys.models(), models) if models else []
        specs = {m: ModelSpec.from_json(v) for m, v in zip(models, raw, strict=True) if v}
        plot = any(spec.plot for spec in specs.values())
        self.prefetcher.update(specs, await live_plot_services(self.redis, self.keys) if plot else [])

    async def read_tables(self, models: list[str]) -> dict[str, GroupTable]:
        """The resource manager's student groups (eq. 6) for the student models among `models`."""
        raw = await self.redis.mget([self.keys.groups(m) for m in models]) if models else []
        return {m: parse_table(m, v) for m, v in zip(models, raw, strict=True) if v}

    async def refresh_student_numbers(self, models: list[str]) -> None:
        """`students:<model>` (set by the resource manager) picks the prefix a whole-group worker runs."""
        values = await self.redis.mget([self.keys.students(m) for m in models]) if models else []
        self.student_numbers.clear()
        self.student_numbers.update({m: int(v) for m, v in zip(models, values, strict=True) if v})

    async def refresh_profile(self, models: list[str]) -> None:
        """max_merge from the start-up profile (App. B.4.1), unless the config fixed it."""
        merges = [await self.redis.hget(self.keys.profile(m), "max_merge") for m in models]
        known = [int(v) for v in merges if v]
        self.max_merge = max(known) if known else None

    async def watch_events(self) -> None:
        """Wakes the refresh loop on placement events (each one's text to `heard` first)."""
        await wake_on(self.redis, self.keys.events(), self.changed, self.heard)

    async def loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # Redis away: keep the last known workers
                log_event("placement_refresh_failed", logging.WARNING, error=repr(e))
            await woken(self.changed, self.refresh_s)


def parse_table(model: str, raw: str) -> GroupTable:
    """`{"students": S, "groups": [[[worker_id, [student, ...]], ...], ...]}` as the RM writes it."""
    students, groups = groups_from_json(raw)
    return GroupTable(model, students, tuple(tuple(Member(w, tuple(s)) for w, s in members) for members in groups))


def policy_from(config: cfg.SchedulerConfig) -> DispatchPolicy:
    """The deployment's dispatch policy with every setting of its configuration."""
    return make_policy(config.policy, max_batch=config.max_batch, max_delay_s=config.max_delay_ms / 1e3,
                       max_merge=config.max_merge or 4, max_length=config.max_length,
                       overload_merge=config.overload_merge,
                       concat=ConcatSettings(config.concat_row_length, config.concat_rows, config.concat_eta,
                                             config.concat_selection, config.concat_slotted, config.concat_oversize,
                                             config.concat_due_first),
                       latency=LatencyModel(config.batch_overhead_ms / 1e3, config.token_us / 1e6),
                       bin_width=config.bin_width)


class SchedulerRegistration(Registration):
    """The scheduler in Redis: its registration (address, policy, models and, for a node's scheduler, the models
    it has live groups for), kept alive by the heartbeat, and the load signals the resource manager adapts the
    student number on, reported with each beat and on their own period."""

    def __init__(self, redis, keys: Keys, config: cfg.SchedulerConfig, dispatcher: Dispatcher,
                 policy: DispatchPolicy, watcher: PlacementWatcher, prefetcher: PlotPrefetcher | None) -> None:
        super().__init__(redis, keys.scheduler, keys.schedulers(), config.heartbeat_ttl_s, config.scheduler_id)
        self.keys, self.config = keys, config
        self.dispatcher, self.policy, self.watcher, self.prefetcher = dispatcher, policy, watcher, prefetcher
        # the load signals outlive a dead scheduler by at most ten reports (>= 1 s), not a heartbeat TTL: a stale
        # report holding an old student number would pause the resource manager's adaptation until it expired
        self.load_ttl_ms = max(1000, round(10_000 * config.load_report_s))
        self._sought: set[str] = set()   # looked up once: a model its deployment had not timed starts from its own

    @property
    def scheduler_id(self) -> str:
        return self.member_id

    def bind(self, address: str) -> str:
        """The server's bound address; the scheduler's id (the address unless configured)."""
        self.address = address
        self.member_id = self.member_id or address
        return self.member_id

    async def announce(self) -> None:
        await self.watcher.refresh()
        await self.register(self.address)

    async def reregister(self) -> None:
        """What this node's scheduler serves changed: rewritten now, and announced on the events channel,
        which wakes the gateways' registry reads (else a newly serving node waited for their next period)."""
        if self.address and self.config.node:
            await self.register(self.address)
            await self.redis.publish(self.keys.events(), f"serving {self.scheduler_id}")

    async def fields(self) -> dict[str, str]:
        config = self.config
        fields = {"policy": config.policy, "models": config.models}
        if config.node:   # it serves its node's groups only: gateways send it what it has groups for
            fields |= {"node": config.node, "serving": ",".join(sorted(self.watcher.serving))}
        return fields

    def owned(self) -> list[str]:
        return [*super().owned(), self.keys.load(self.scheduler_id)]

    async def register(self, address: str) -> None:
        await super().register(address)
        await self.report_load()

    async def report_load(self) -> None:
        """The signals the resource manager adapts the student number on (buffer depth, idle groups)."""
        policy, dispatcher = self.policy, self.dispatcher
        if self.watcher.max_merge and not self.config.max_merge and isinstance(policy, StudentPolicy):
            policy.set_max_merge(self.watcher.max_merge)
        load = dispatcher.load() | policy.stats() | {"merged": getattr(policy, "merged", 0),
                                                     "policy": self.config.policy,
                                                     "models": json.dumps(dispatcher.model_load())}
        if self.prefetcher is not None:
            load |= self.prefetcher.stats
        await self.seed_timings()
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.load(self.scheduler_id), mapping=load)
        pipe.pexpire(self.keys.load(self.scheduler_id), self.load_ttl_ms)
        for model, timings in dispatcher.timings().items():
            pipe.hset(self.keys.timing(self.config.policy, model), mapping=timings)
            pipe.expire(self.keys.timing(self.config.policy, model), TIMING_TTL_S)
        await pipe.execute()
        QUEUE_DEPTH.set(load["queued"])
        BUFFER_DEPTH.set(load["buffer"])

    async def seed_timings(self) -> None:
        """The models this scheduler runs and has not timed yet start from what its deployment reported."""
        dispatcher = self.dispatcher
        new = sorted({m for g in dispatcher.groups for m in g.models} - dispatcher.service_s.keys() - self._sought)
        if not new:
            return
        self._sought.update(new)
        pipe = self.redis.pipeline(transaction=False)
        for model in new:
            pipe.hgetall(self.keys.timing(self.config.policy, model))
        for model, reported in zip(new, await pipe.execute(), strict=True):
            timings = {name: float(value) for name, value in reported.items()}
            if timings and dispatcher.seed(model, timings):
                log_event("timings_seeded", model=model, **timings)

    async def load_reporter(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_report_s)
            if self.address:
                with contextlib.suppress(Exception):  # Redis away: the heartbeat logs it
                    await self.report_load()



async def build() -> ServiceSpec:
    config = cfg.load(cfg.SchedulerConfig)
    redis = connect(config.redis_url, config.redis_password)
    keys = Keys(config.key_prefix)
    worker_stubs = Stubs.for_hops(worker_pb2_grpc.WorkerStub, config)
    clock = time.monotonic
    policy = policy_from(config)
    workers: dict[str, WorkerRef] = {}
    prefetcher = PlotPrefetcher(Stubs(plot_pb2_grpc.PlotStub), clock) if config.plot_prefetch else None
    lost = LostRegistrations()
    dispatcher = Dispatcher(policy, traced(GroupSender(WorkerCalls(worker_stubs, workers), clock, prefetcher)),
                            config.queue_capacity, config.retry_pushback_ms, clock,
                            on_wait=prefetcher.on_wait if prefetcher is not None else None,
                            drop_doomed=config.drop_doomed, send_ahead=config.send_ahead,
                            lost_quarantine_s=max(1, round(config.heartbeat_ttl_s)),   # the key's TTL
                            shard=Shard(config.shard, config.shards), policy_name=config.policy,
                            max_queue_wait_s=config.max_queue_wait_ms / 1e3, regroup_wait_s=config.regroup_wait_s,
                            probe=worker_probe(PeerHealth(), lost))
    dispatcher.workers = workers  # the sender resolves member addresses from the same live table
    watcher = PlacementWatcher(redis, keys, dispatcher, config.refresh_s, cfg.ModelSelection.parse(config.models),
                               prefetcher, config.node, heard=lost.hear)
    registration = SchedulerRegistration(redis, keys, config, dispatcher, policy, watcher, prefetcher)
    watcher.on_serving = registration.reregister
    servicer = SchedulerServicer(dispatcher, config.policy, watcher.student_numbers)

    async def announce(address: str) -> None:
        servicer.scheduler_id = registration.bind(address)   # its replies name it from the first
        await registration.announce()

    async def expire() -> None:
        """Answers waiting jobs whose deadline passed and frees their queue slots promptly."""
        while True:
            await asyncio.sleep(config.expire_interval_s)
            dispatcher.expire_waiting()

    return ServiceSpec(
        name="scheduler",
        config=config,
        add_servicers=lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, s),
        service_names=["academus.v1.Scheduler"],
        hop_target=True,
        on_started=announce,
        on_stopping=registration.deregister,
        on_stopped=redis.aclose,
        extra_tasks=[watcher.loop, watcher.watch_events, registration.heartbeat, expire, registration.load_reporter],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
