"""gRPC edge of the scheduler: Schedule calls enter the Dispatcher; workers come from Redis placements."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import grpc
from prometheus_client import Gauge

from academus.services.scheduler.core import Dispatcher, Job, WorkerLost, WorkerRef
from academus.services.scheduler.policies import make_policy
from academus.shared import config as cfg
from academus.shared.errors import DeadlineExceeded, ServingError, abort_with, from_rpc_error
from academus.shared.keys import Keys
from academus.shared.logs import log_event
from academus.shared.redis_conn import connect
from academus.shared.serving import ServiceSpec, Stubs, run
from academus.shared.tracing import annotate
from academus.v1 import scheduler_pb2_grpc, tensors_pb2, worker_pb2, worker_pb2_grpc

QUEUE_DEPTH = Gauge("academus_scheduler_queue_depth", "Jobs waiting for a worker")
DROPPED = Gauge("academus_scheduler_dropped", "Jobs dropped unrun", ["reason"])
LOST_CODES = (grpc.StatusCode.UNAVAILABLE,)


async def send_to_worker(stubs: Stubs, clock, worker: WorkerRef, batch: Sequence[Job]) -> list:
    """One worker call for the whole batch: payloads merged, the answer split back a job each."""
    remaining = max(j.deadline for j in batch) - clock()
    if remaining <= 0:
        raise DeadlineExceeded("deadline passed before dispatch; not computed")
    request = batch[0].payload if len(batch) == 1 else merge_requests([j.payload for j in batch])
    try:
        output = await stubs(worker.address).Run(request, timeout=remaining)
    except grpc.aio.AioRpcError as e:
        if e.code() in LOST_CODES:
            raise WorkerLost(f"{worker.worker_id} at {worker.address}: {e.details()}") from e
        raise from_rpc_error(e, f"worker {worker.worker_id}") from e
    return [output] if len(batch) == 1 else split_output(output, [j.num_texts for j in batch])


def merge_requests(requests: Sequence[worker_pb2.RunRequest]) -> worker_pb2.RunRequest:
    merged = worker_pb2.RunRequest(batch_id=",".join(r.batch_id for r in requests), model=requests[0].model,
                                   output=requests[0].output, num_students=requests[0].num_students)
    typed = any(r.tokens.token_type_ids for r in requests)
    for r in requests:
        merged.tokens.input_ids.extend(r.tokens.input_ids)
        merged.tokens.lengths.extend(r.tokens.lengths)
        if typed:
            merged.tokens.token_type_ids.extend(r.tokens.token_type_ids or [0] * len(r.tokens.input_ids))
    return merged


def split_output(output: tensors_pb2.ModelOutput, rows: Sequence[int]) -> list[tensors_pb2.ModelOutput]:
    dim, values, parts, start = output.values.dim, output.values.values, [], 0
    for n in rows:
        part = tensors_pb2.ModelOutput(output=output.output, labels=output.labels, metadata=output.metadata)
        part.values.CopyFrom(tensors_pb2.Matrix(values=values[start * dim : (start + n) * dim], rows=n, dim=dim))
        parts.append(part)
        start += n
    return parts


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, dispatcher: Dispatcher, policy: str, student_numbers: dict[str, int]) -> None:
        self.dispatcher = dispatcher
        self.policy = policy
        self.student_numbers = student_numbers  # model -> students to run (0: the group's best k)

    async def Schedule(self, request, context: grpc.aio.ServicerContext):
        entered = time.perf_counter()
        now = self.dispatcher.clock()
        remaining = context.time_remaining()
        tokens = request.tokens
        job = Job(
            model=request.model,
            payload=worker_pb2.RunRequest(batch_id=request.request_id, model=request.model,
                                          output=request.output, tokens=tokens,
                                          num_students=self.student_numbers.get(request.model, 0)),
            num_texts=len(tokens.lengths), num_tokens=len(tokens.input_ids),
            deadline=now + (remaining if remaining is not None else 30.0), enqueued_at=now,
            batch_key=(request.model, request.output, self.student_numbers.get(request.model, 0)),
        )
        annotate(model=request.model, tenant=request.tenant, policy=self.policy, batch_size=job.num_texts)
        try:
            result = await self.dispatcher.submit(job)
        except ServingError as e:
            await abort_with(context, e)
        finally:
            QUEUE_DEPTH.set(len(self.dispatcher.policy))
        meta = result.metadata
        meta.policy = self.policy
        meta.queue_ms = (job.started_at - job.enqueued_at) * 1e3
        meta.attempts = job.attempts
        meta.scheduler_ms = (time.perf_counter() - entered) * 1e3
        return result


class PlacementWatcher:
    """Keeps the dispatcher's worker set equal to the live placements in Redis."""

    def __init__(self, redis, keys: Keys, dispatcher: Dispatcher, refresh_s: float) -> None:
        self.redis, self.keys, self.dispatcher, self.refresh_s = redis, keys, dispatcher, refresh_s
        self.changed = asyncio.Event()
        self.student_numbers: dict[str, int] = {}

    async def refresh(self) -> None:
        live: dict[str, tuple[str, set[str]]] = {}
        for model in await self.redis.smembers(self.keys.placements()):
            for worker_id in await self.redis.smembers(self.keys.placement(model)):
                if worker_id not in live:
                    address = await self.redis.hget(self.keys.worker(worker_id), "address")
                    if not address:
                        continue  # heartbeat expired: not live
                    live[worker_id] = (address, set())
                live[worker_id][1].add(model)
        self.dispatcher.update_workers({w: (a, frozenset(m)) for w, (a, m) in live.items()})
        await self.refresh_student_numbers()

    async def refresh_student_numbers(self) -> None:
        """`students:<model>` in Redis (set by the resource manager, issue 4) picks the prefix to run."""
        models = sorted({m for w in self.dispatcher.workers.values() for m in w.models})
        values = await self.redis.mget([self.keys.students(m) for m in models]) if models else []
        self.student_numbers.clear()
        self.student_numbers.update({m: int(v) for m, v in zip(models, values, strict=True) if v})

    async def watch_events(self) -> None:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.keys.events())
        async for message in pubsub.listen():
            if message.get("type") == "message":
                self.changed.set()

    async def loop(self) -> None:
        while True:
            try:
                await self.refresh()
                DROPPED.labels("expired").set(self.dispatcher.stats.expired)
                DROPPED.labels("cancelled").set(self.dispatcher.stats.cancelled)
            except Exception as e:  # Redis away: keep the last known workers
                log_event("placement_refresh_failed", error=repr(e))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), self.refresh_s)
            self.changed.clear()


async def build() -> ServiceSpec:
    config = cfg.load(cfg.SchedulerConfig)
    redis = connect(config.redis_url)
    keys = Keys(config.key_prefix)
    worker_stubs = Stubs(worker_pb2_grpc.WorkerStub)
    clock = time.monotonic
    policy = make_policy(config.policy, max_batch=config.max_batch, max_delay_s=config.max_delay_ms / 1e3)
    dispatcher = Dispatcher(policy,
                            lambda w, j: send_to_worker(worker_stubs, clock, w, j),
                            config.queue_capacity, config.retry_pushback_ms, clock)
    watcher = PlacementWatcher(redis, keys, dispatcher, config.refresh_s)
    state = {"id": config.scheduler_id, "address": ""}
    ttl = max(1, round(config.heartbeat_ttl_s))

    async def announce(address: str) -> None:
        state["address"] = address
        state["id"] = state["id"] or address
        await watcher.refresh()
        await beat()

    async def beat() -> None:
        pipe = redis.pipeline(transaction=True)
        pipe.set(keys.scheduler(state["id"]), state["address"], ex=ttl)
        pipe.sadd(keys.schedulers(), state["id"])
        pipe.hset(keys.load(state["id"]), mapping=dispatcher.load())
        pipe.expire(keys.load(state["id"]), ttl)
        await pipe.execute()

    async def expire() -> None:
        """Answers waiting jobs whose deadline passed and frees their queue slots promptly."""
        while True:
            await asyncio.sleep(config.expire_interval_s)
            dispatcher.expire_waiting()

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await beat()
            except Exception as e:
                log_event("heartbeat_failed", error=repr(e))

    async def deregister() -> None:
        await redis.srem(keys.schedulers(), state["id"])
        await redis.delete(keys.scheduler(state["id"]), keys.load(state["id"]))

    return ServiceSpec(
        name="scheduler",
        config=config,
        add_servicers=lambda s: scheduler_pb2_grpc.add_SchedulerServicer_to_server(
            SchedulerServicer(dispatcher, config.policy, watcher.student_numbers), s),
        service_names=["academus.v1.Scheduler"],
        on_started=announce,
        on_stopping=deregister,
        on_stopped=redis.aclose,
        extra_tasks=[watcher.loop, watcher.watch_events, heartbeat, expire],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
