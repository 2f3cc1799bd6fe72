"""gRPC edge of the worker: Run batches on the ModelRunner; register and heartbeat via the resource manager."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import grpc
import torch
from prometheus_client import Counter, Gauge

from academus.services.worker.adapters import AdapterCache, StoreFetcher, TenantBatch
from academus.services.worker.compute_threads import (
    ComputePool,
    ComputeSaturation,
    YieldWhenSaturated,
    yield_cpu_to_serving,
)
from academus.services.worker.core import CallerLeft, ModelRunner, device_label
from academus.services.worker.exits import Release
from academus.services.worker.host_tier import HostAdapters, HostWarmer
from academus.services.worker.profiling import profile_model
from academus.services.worker.sti import StiSettings
from academus.shared.models.adapters import upper_layers
from academus.shared.models.exits import ControllerSettings
from academus.shared.models.work import Batch, BatchMeta, BatchOutput
from academus.shared.models.work_wire import batch_from_pb, output_to_pb
from academus.shared.runtime import config as cfg
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument, ServingError, abort_with
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.redis_conn import connect, wake_on, woken
from academus.shared.runtime.serving import ServiceSpec, Stubs, run
from academus.shared.runtime.tracing import annotate
from academus.shared.state.catalogue import catalogue_stamp, spec_to_pb
from academus.shared.state.groups import groups_from_json, placed_on
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantRegistry
from academus.v1 import (
    resource_manager_pb2,
    resource_manager_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

BATCHES = Counter("academus_worker_batches_total", "Batches computed", ["model"])
EXPIRED = Counter("academus_worker_expired_total", "Batches dropped because their deadline passed first")
ABANDONED = Counter("academus_worker_abandoned_total", "Batches stopped between layers because their caller left")
EXITS = Counter("academus_worker_exits_total", "Texts whose result a ramp released early (Apparate)",
                ["model", "layer"])
EXIT_AGREEMENT = Gauge("academus_worker_exit_agreement", "Released early results agreeing with the full model's, "
                       "over the tuning window", ["model"])
EXITS_STOOD_DOWN = Counter("academus_worker_exits_stood_down_total", "Batches that asked for early exits and ran "
                            "without ramps, the worker's compute being saturated", ["model"])
EXIT_TUNINGS = Counter("academus_worker_exit_tunings_total", "Threshold tunings of a model's ramps", ["model"])
ACTIVE_RAMPS = Gauge("academus_worker_active_ramps", "Exit ramps a model runs now (§3.3 adjusts them)", ["model"])




class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, worker_id: str, instances: int = 1, adapters: AdapterCache | None = None,
                 compute_sched: str = "normal", student_lane: bool = True, exits_when_saturated: bool = False) -> None:
        self.runner = runner
        self.worker_id = worker_id
        self.adapters = adapters
        self.compute_sched = compute_sched
        self.student_lane = student_lane
        self.exits_when_saturated = exits_when_saturated
        self.resize(instances)
        self.saturation = ComputeSaturation(self.pools)

    def resize(self, instances: int) -> None:
        """One compute thread a student instance: that many batches run at once (on a GPU, each in its
        own thread and CUDA stream; under MPS, separate worker processes share the GPU instead).

        Student groups' batches have threads of their own (`student_lane`). Each scheduler counts a worker's
        slots as its own, so a worker placed in a teacher's deployment and a student deployment is sent a
        batch of each at once. On one queue, a student batch of some 20 ms of compute waited behind a teacher
        batch of 0.7 s (the students' deployment answered 10 of the 147 requests a second offered to it at twice
        the capacity). On lanes of their own the two run side by side: on a CPU the kernel shares the cores
        between them, on a GPU each thread's CUDA stream overlaps the other's."""
        self.instances = max(1, instances)
        previous = {getattr(self, "compute", None), getattr(self, "student_compute", None)} - {None}
        self.compute = ComputePool(self.instances, self.compute_sched, self.runner.device)
        self.student_compute = (ComputePool(self.instances, self.compute_sched, self.runner.device)
                                if self.student_lane else self.compute)
        for pool in previous:
            pool.shutdown()

    def pools(self) -> set[ComputePool]:
        """The compute pools batches run on now (one where student groups share the whole models')."""
        return {self.compute, self.student_compute}

    def _lane(self, batch: Batch) -> ComputePool:
        """The student lane for a student group's batch, the whole models' for any other."""
        served = self.runner.models.get(batch.model)
        return self.student_compute if served is not None and served.max_students else self.compute

    async def Run(self, request, context: grpc.aio.ServicerContext):
        entered = time.perf_counter()
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        left = threading.Event()
        try:
            batch = batch_from_pb(request)
            tenants = await self._tenants(batch, deadline)
            result = await self._lane(batch).run(self._run, batch, deadline, tenants, left,
                                                 self._releaser(batch, context))
        except ServingError as e:
            await abort_with(context, e)
        except asyncio.CancelledError:  # the scheduler cancelled the call: the compute thread stops too
            left.set()
            raise
        annotate(model=batch.model, batch_size=len(batch.lengths), worker=self.worker_id,
                 padding_ratio=result.padding_ratio)
        meta = BatchMeta(batch_size=len(result.values), student_count=result.student_count, worker_id=self.worker_id,
                         compute_ms=result.compute_ms, worker_ms=(time.perf_counter() - entered) * 1e3,
                         padded_tokens=result.padded_tokens, real_tokens=result.real_tokens,
                         plot_prefetched=batch.plot_states is not None, shards=result.shards)
        return output_to_pb(BatchOutput(result.values, result.labels, meta, result.finish), batch.output)

    async def SetShardBudget(self, request, context: grpc.aio.ServicerContext):
        try:
            held = self.runner.set_shard_budget(request.model, request.budget_bytes)
        except ServingError as e:
            await abort_with(context, e)
        sti = self.runner.models[request.model].sti
        log_event("shard_budget", model=request.model, budget_bytes=sti.budget_bytes, resident_bytes=held)
        return worker_pb2.ShardBudgetResponse(budget_bytes=sti.budget_bytes, resident_bytes=held)

    def _releaser(self, batch: Batch, context) -> Release | None:
        """Early answers (exit ramps) for a call that asked and can take them: built on the compute thread,
        sent from the event loop ahead of the call's answer. None while the compute is saturated (unless
        `exits_when_saturated`): batches then run back to back, and the ramps and the early answers' sends through
        every hop would come out of the capacity, where the queue's wait dwarfs what an early answer saves."""
        send = getattr(context, "send_partial", None) if batch.early_exit else None
        if send is None:
            return None
        if self.saturation.saturated and not self.exits_when_saturated:
            if self.runner.runs_ramps(batch.model):
                EXITS_STOOD_DOWN.labels(batch.model).inc()
            return None
        loop, model = asyncio.get_running_loop(), batch.model

        def release(rows: list[int], layer: int, probs) -> None:
            EXITS.labels(model, str(layer)).inc(len(rows))
            early = BatchOutput(probs, self.runner.specs[model].labels, rows=tuple(rows), exit_layer=layer)
            loop.call_soon_threadsafe(send, output_to_pb(early, batch.output))

        return release

    async def _tenants(self, batch: Batch, deadline: float | None) -> TenantBatch | None:
        """The batch's tenant adapters from the cache (misses fetched from the store); None without."""
        if not batch.adapters:
            return None
        if self.adapters is None:
            raise InvalidArgument("adapters set, but this worker serves no tenant adapters")
        keys = [(a.tenant, a.name, a.version) if a is not None else None for a in batch.adapters]
        layers = self.runner.specs[batch.model].layers   # a user's base: its own depth (0: the teacher's)
        fetched = await self.adapters.acquire(keys, deadline, upper_layers(layers)[0] if layers else None)
        return replace(fetched, domains=tuple(a.domain if a is not None else "" for a in batch.adapters))

    def _run(self, batch: Batch, *args):
        """On the compute thread, so batches stopped after their caller left are counted too."""
        try:
            result = self.runner.run(batch, *args)
        except DeadlineExceeded:
            EXPIRED.inc()
            raise
        except CallerLeft:
            ABANDONED.inc()
            raise
        BATCHES.labels(batch.model).inc()
        return result


class ExitTuning:
    """Runs each model's due threshold tunings off the compute thread (Apparate §3.2: on a thread of its own,
    while batches go on), keeps the ramps' metrics, and publishes their state for `academus ramps status`."""

    def __init__(self, runner: ModelRunner, redis, keys: Keys, worker_id: str, ttl_s: float,
                 period_s: float = 0.25, publish_s: float = 1.0) -> None:
        self.runner, self.redis, self.keys, self.worker_id = runner, redis, keys, worker_id
        self.ttl_s, self.period_s, self.publish_s = ttl_s, period_s, publish_s

    async def step(self) -> None:
        """Each model's due tuning, if any."""
        for name, served in list(self.runner.models.items()):
            # `due` observes the batches fed since the last step: NumPy work, off the event loop too
            if served.exits is not None and (reason := await asyncio.to_thread(served.exits.controller.due)):
                await asyncio.to_thread(served.exits.controller.tune, reason)
                EXIT_TUNINGS.labels(name).inc()

    async def publish(self) -> None:
        """Ramps trained meanwhile are loaded; each model's ramps go to the metrics and to Redis."""
        await asyncio.to_thread(self.runner.refresh_exits)
        status = {}
        for name, served in list(self.runner.models.items()):
            if served.exits is not None:
                controller = served.exits.controller
                EXIT_AGREEMENT.labels(name).set(controller.window_agreement())
                ACTIVE_RAMPS.labels(name).set(len(controller.active.layers))
                status[name] = controller.status()
        if status:
            key = self.keys.ramps(self.worker_id)
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(key, mapping={m: json.dumps(v) for m, v in status.items()})
            pipe.expire(key, max(1, round(self.ttl_s)))
            await pipe.execute()

    async def run(self) -> None:
        published = 0.0
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.step()
                if time.monotonic() - published >= self.publish_s:
                    published = time.monotonic()
                    await self.publish()
            except Exception as e:  # Redis away: tuning goes on; the status is published again later
                log_event("exit_tuning_failed", logging.WARNING, error=repr(e))


class Registration:
    """Registers with the resource manager, keeps the heartbeat key alive, deregisters on stop."""

    def __init__(self, config: cfg.WorkerConfig, runner: ModelRunner, worker_id: str,
                 servicer: WorkerServicer) -> None:
        self.config, self.runner, self.worker_id, self.servicer = config, runner, worker_id, servicer
        self.keys = Keys(config.key_prefix)
        self.redis = connect(config.redis_url, config.redis_password)
        self.address = ""
        self.students_published = ""   # the held students last written to the worker's key (registering clears it)
        self.profile: list[resource_manager_pb2.ProfilePoint] = []
        self._stubs = Stubs(resource_manager_pb2_grpc.ResourceManagerStub)

    async def _rm_stub(self) -> resource_manager_pb2_grpc.ResourceManagerStub:
        """The resource manager's stub, its address from config or Redis; one channel per address."""
        target = self.config.resource_manager
        while not target:
            target = await self.redis.get(self.keys.resource_manager()) or ""
            if not target:
                await asyncio.sleep(0.2)
        return self._stubs(target)

    async def register(self, address: str) -> None:
        self.address = address
        stub = await self._rm_stub()
        await self.publish_tokenizers()
        models = [spec_to_pb(s, resource_manager_pb2.ModelSpec) for s in self.runner.specs.values()]
        if self.config.profiles(self.runner.device.type == "cuda") and not self.profile:
            self.profile = await asyncio.get_running_loop().run_in_executor(None, self._profile)
        reply = await stub.RegisterWorker(resource_manager_pb2.RegisterWorkerRequest(
            worker_id=self.worker_id, address=address, models=models, device=device_label(self.runner.device),
            capacity=self.config.instances, profile=self.profile, node=self.config.node,
        ), timeout=10, wait_for_ready=True)
        self.students_published = ""   # the worker's key was rewritten without them
        if reply.capacity and reply.capacity != self.servicer.instances:
            self.servicer.resize(reply.capacity)
        log_event("registered", worker_id=self.worker_id, address=address, models=list(self.runner.specs),
                  instances=self.servicer.instances)

    async def publish_tokenizers(self) -> None:
        """Puts each user's model's tokenizer.json in Redis under its sha256, before the model is registered:
        the gateway, which has no artifacts, tokenizes its texts with it."""
        for name, spec in self.runner.specs.items():
            path = self.runner.tokenizer_file(name) if spec.tokenizer else None
            if path is not None and not await self.redis.exists(self.keys.tokenizer(spec.tokenizer)):
                await self.redis.set(self.keys.tokenizer(spec.tokenizer), await asyncio.to_thread(path.read_text))

    async def follow_catalogue(self) -> None:
        """Loads models added to the catalogue and drops removed ones, then registers the new set: a model
        from `academus models add` serves without restarting the mesh."""
        while self.runner.follows_catalogue:
            await asyncio.sleep(self.config.catalogue_poll_s)
            if catalogue_stamp(self.runner.artifacts) == self.runner.catalogue_stamp:   # the one it loaded
                continue
            try:
                if await asyncio.to_thread(self.runner.refresh) and self.address:
                    await self.register(self.address)
            except Exception as e:  # a registration that failed is retried by the heartbeat
                log_event("catalogue_refresh_failed", logging.WARNING, error=repr(e))

    async def follow_placements(self, period_s: float = 2.0) -> None:
        """Tells each group held within a student budget which of its students the resource manager placed here
        (its groups in Redis), at once when it publishes new groups (else every `period_s`), and publishes what
        each holds in the worker's key when that changes."""
        changed = asyncio.Event()
        watch = asyncio.create_task(wake_on(self.redis, self.keys.events(), changed))
        seen: dict[str, str] = {}
        try:
            while True:
                await woken(changed, period_s)
                try:
                    await self._place(seen)
                except Exception as e:  # Redis away: the students held stay; batches still load what they need
                    log_event("placement_follow_failed", logging.WARNING, error=repr(e))
        finally:
            watch.cancel()

    async def _place(self, seen: dict[str, str]) -> None:
        memories = {name: s.memory for name, s in list(self.runner.models.items()) if s.memory is not None}
        if not memories:
            return
        for name, raw in zip(memories, await self.redis.mget([self.keys.groups(n) for n in memories]), strict=True):
            if raw is not None and raw != seen.get(name):
                seen[name] = raw
                memories[name].place(placed_on(groups_from_json(raw)[1], self.worker_id))
        held = json.dumps({name: memory.precision() for name, memory in memories.items()})
        if held != self.students_published:
            await self.redis.hset(self.keys.worker(self.worker_id), "students", held)
            self.students_published = held

    def _profile(self) -> list[resource_manager_pb2.ProfilePoint]:
        """The start-up grid search's measurements for every student model (the teacher when none)."""
        models = [n for n, s in self.runner.specs.items() if s.max_students] or list(self.runner.specs)[:1]
        return [resource_manager_pb2.ProfilePoint(model=m, instances=p.instances, merge=p.merge,
                                                  throughput=p.throughput, latency_ms=p.latency_ms)
                for m in models for p in profile_model(self.runner, m)]

    async def heartbeat(self) -> None:
        """Refreshes the TTL; re-registers when the key is gone (reaped, or Redis lost its data)."""
        ttl = self.config.heartbeat_ttl_s
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                if not await self.redis.expire(self.keys.worker(self.worker_id), max(1, round(ttl))):
                    await self.register(self.address)
                elif self.servicer.adapters is not None:  # the cache's hit rate and size, for operators
                    await self.redis.hset(self.keys.worker(self.worker_id), "adapter_cache",
                                          json.dumps(self.servicer.adapters.stats()))
            except Exception as e:  # keep beating through Redis or RM restarts
                log_event("heartbeat_failed", logging.WARNING, error=repr(e))

    async def deregister(self) -> None:
        try:
            stub = await asyncio.wait_for(self._rm_stub(), 2)
            request = resource_manager_pb2.DeregisterWorkerRequest(worker_id=self.worker_id)
            await stub.DeregisterWorker(request, timeout=3)
        except Exception as e:  # the TTL removes us anyway
            log_event("deregister_failed", logging.WARNING, error=repr(e))
        await self.redis.aclose()


async def build() -> ServiceSpec:
    config = cfg.load(cfg.WorkerConfig)
    if config.compute_nice:   # before torch starts its threads, which inherit it
        log_event("compute_nice", **yield_cpu_to_serving(config.compute_nice))
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    worker_id = config.worker_id or f"worker-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    exit_settings = ControllerSettings(config.exit_constraint, config.exit_window, config.exit_retune_every,
                                       config.exit_retune_s, config.exit_budget, policy=config.exit_policy)
    runner = ModelRunner(Path(config.artifacts), list(cfg.split_names(config.models)), config.device,
                         attention=config.packed_attention, traced=config.traced_layers, exit_settings=exit_settings,
                         sti_settings=StiSettings(config.sti_io, config.sti_budget_bytes, config.sti_target_ms),
                         student_budget_bytes=config.student_budget_bytes)
    keys = Keys(config.key_prefix)
    fetcher = StoreFetcher(config.redis_url, keys, config.adapter_store, redis_password=config.redis_password)
    host = HostAdapters(fetcher.many, config.adapter_host_bytes, pin=runner.device.type == "cuda",
                        batch=config.adapter_fetch_batch) if config.adapter_host_bytes else None
    adapters = AdapterCache(host or fetcher, config.adapter_cache_bytes, runner.device, config.adapter_prefetch,
                            config.adapter_batched, fetch_batch=config.adapter_fetch_batch)
    servicer = WorkerServicer(runner, worker_id, config.instances or 1, adapters, config.compute_sched,
                              config.student_lane, config.exits_when_saturated)
    registration = Registration(config, runner, worker_id, servicer)
    warmer = HostWarmer(host, TenantRegistry(registration.redis, keys), list(runner.models),
                        config.adapter_warm_s) if host else None
    tuning = ExitTuning(runner, registration.redis, keys, worker_id, config.heartbeat_ttl_s)
    yielding = YieldWhenSaturated.where_possible(config.saturated_nice, floor=config.compute_nice)
    return ServiceSpec(
        name="worker",
        config=config,
        add_servicers=lambda server: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server),
        service_names=["academus.v1.Worker"],
        hop_target=True,
        on_started=registration.register,
        on_stopping=registration.deregister,
        on_stopped=lambda: asyncio.to_thread(close_adapters, adapters, fetcher),
        extra_tasks=[registration.heartbeat, registration.follow_catalogue, registration.follow_placements, tuning.run,
                     *([warmer.run] if warmer else []),
                     lambda: servicer.saturation.run(yielding)],
    )


def close_adapters(adapters: AdapterCache, fetcher: StoreFetcher) -> None:
    adapters.close()
    fetcher.close()


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
