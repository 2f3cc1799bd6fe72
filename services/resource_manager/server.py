"""gRPC edge of the resource manager: worker registration and placements over the PlacementTable."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from academus.services.resource_manager.allocation import ProfilePoint, choose_profile
from academus.services.resource_manager.core import GroupPlanner, PlacementTable, WorkerInfo
from academus.services.resource_manager.liveness import LivenessWatch
from academus.shared.runtime import config as cfg
from academus.shared.runtime.gpu import start_mps
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import PeerHealth, ServiceSpec, run
from academus.shared.state.catalogue import spec_from_pb
from academus.shared.state.keys import Keys
from academus.v1 import resource_manager_pb2 as pb
from academus.v1 import resource_manager_pb2_grpc

PROBE_S = 1.0          # a check's time limit
PROBE_AGAIN_S = 0.1    # a worker refuses a second check this long after the first before it is lost
HANG_CONFIRM_S = 0.5   # a check left unanswered is followed by one more this long before the worker is hung


async def worker_probe(health: PeerHealth, address: str, registration: str) -> bool:
    """The liveness watch's probe: False only when two checks PROBE_AGAIN_S apart are both refused (UNAVAILABLE:
    nothing listens, or the connection was reset), as a dead process's port refuses; a check that is slow (a loaded
    host, a remote one gone silent) proves nothing, and the heartbeat's TTL decides."""
    for attempt in range(2):
        if attempt:
            await asyncio.sleep(PROBE_AGAIN_S)
        if await health.check(address, registration, PROBE_S) != grpc.StatusCode.UNAVAILABLE:
            return True
    return False


async def worker_silent(health: PeerHealth, hang_s: float, address: str, registration: str) -> bool | None:
    """The liveness watch's hang check: True when the worker answers (serving or not); False when a check stays
    unanswered for hang_s and the next for HANG_CONFIRM_S (a pause of this process's own, which can delay an answer
    past the first deadline, does not also swallow the second); None when it refuses (the stream's watch decides)."""
    code = await health.check(address, registration, hang_s)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        code = await health.check(address, registration, HANG_CONFIRM_S)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    return True if code == grpc.StatusCode.OK else None


class ResourceManagerServicer(resource_manager_pb2_grpc.ResourceManagerServicer):
    def __init__(self, table: PlacementTable, planner: GroupPlanner, liveness: LivenessWatch | None = None) -> None:
        self.table = table
        self.planner = planner
        self.liveness = liveness

    async def RegisterWorker(self, request, context):
        specs = [spec_from_pb(m) for m in request.models]
        capacity = request.capacity or 1
        if request.profile:
            capacity = await self.choose(request.profile, request.capacity)
        info = WorkerInfo(request.worker_id, request.address, request.device, capacity, [s.name for s in specs],
                          request.node)
        registration = await self.table.register(info, specs)
        if self.liveness is not None:
            self.liveness.follow(info.worker_id, info.address, registration)
        groups = await self.planner.replan()
        log_event("worker_registered", worker_id=info.worker_id, address=info.address, models=info.models,
                  capacity=capacity, groups=groups)
        return pb.RegisterWorkerResponse(heartbeat_ttl_s=self.table.ttl, capacity=capacity)

    async def choose(self, profile, fixed: int) -> int:
        """The grid search's pick per model (App. B.4.1), stored for the schedulers' max_merge."""
        chosen = {}
        for model in sorted({p.model for p in profile}):
            points = [ProfilePoint(p.instances, p.merge, p.throughput, p.latency_ms) for p in profile
                      if p.model == model]
            best = choose_profile(points)
            chosen[model] = best
            await self.table.redis.hset(self.table.keys.profile(model), mapping={
                "instances": best.instances, "max_merge": best.merge, "throughput": best.throughput,
                "latency_ms": best.latency_ms})
        log_event("profile_chosen", **{m: f"{p.instances}x{p.merge}" for m, p in chosen.items()})
        return fixed or max(p.instances for p in chosen.values())

    async def DeregisterWorker(self, request, context):
        removed = await self.table.deregister(request.worker_id)
        if self.liveness is not None:   # a stopping worker's stream ends: no loss
            self.liveness.forget(request.worker_id)
        await self.planner.replan()
        log_event("worker_deregistered", worker_id=request.worker_id, removed=removed)
        return pb.DeregisterWorkerResponse(removed=removed)

    async def ListPlacements(self, request, context):
        placements = await self.table.placements(request.model)
        return pb.ListPlacementsResponse(
            placements=[pb.Placement(model=m, worker_ids=w) for m, w in placements.items()]
        )


async def build() -> ServiceSpec:
    config = cfg.load(cfg.ResourceManagerConfig)
    redis = connect(config.redis_url, config.redis_password)
    keys = Keys(config.key_prefix)
    table = PlacementTable(redis, keys, config.heartbeat_ttl_s)
    planner = GroupPlanner(redis, keys, config.student_ceiling, config.adapt_window_s, config.adapt_cooldown_s)

    async def drop_lost(worker_id: str, registration: str) -> None:
        if await table.drop(worker_id, registration):
            groups = await planner.replan()
            log_event("worker_dropped", worker_id=worker_id, groups=groups)

    health = PeerHealth()
    silent = functools.partial(worker_silent, health, config.worker_hang_s) if config.worker_hang_s else None
    liveness = (LivenessWatch(health.watch, functools.partial(worker_probe, health), drop_lost, silent=silent)
                if config.watch_workers else None)

    async def announce(address: str) -> None:
        log_event("mps", action=start_mps(config.mps))
        await redis.set(keys.resource_manager(), address)
        await planner.replan()
        if liveness is not None:   # the workers that registered with a resource manager before this one
            liveness.sync(await table.registrations())

    async def stopped() -> None:
        if liveness is not None:
            await liveness.close()
        await redis.aclose()

    async def adapter() -> None:
        """Student number adaptation (App. B.4.1) on the schedulers' buffer and group signals."""
        while True:
            await asyncio.sleep(config.adapt_interval_s)
            try:
                changed = await planner.adapt()
                if changed:
                    log_event("student_number_changed", **changed)
            except Exception as e:  # Redis restarting: try again next round
                log_event("adapt_failed", logging.WARNING, error=repr(e))

    async def reaper() -> None:
        while True:
            await asyncio.sleep(config.reap_interval_s)
            try:
                dead = await table.reap()
                if dead:
                    await planner.replan()
                    log_event("workers_reaped", workers=dead)
                if liveness is not None:
                    for worker_id in dead:
                        liveness.forget(worker_id)
            except Exception as e:  # Redis restarting: try again next round
                log_event("reap_failed", logging.WARNING, error=repr(e))

    return ServiceSpec(
        name="resource_manager",
        config=config,
        add_servicers=lambda s: resource_manager_pb2_grpc.add_ResourceManagerServicer_to_server(
            ResourceManagerServicer(table, planner, liveness), s),
        service_names=["academus.v1.ResourceManager"],
        on_started=announce,
        on_stopped=stopped,
        extra_tasks=[reaper, adapter],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
