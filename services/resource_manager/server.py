"""gRPC edge of the resource manager: worker registration and placements over the PlacementTable."""

from __future__ import annotations

import asyncio

from academus.services.resource_manager.core import PlacementTable, WorkerInfo
from academus.shared import config as cfg
from academus.shared.catalogue import ModelSpec
from academus.shared.keys import Keys
from academus.shared.logs import log_event
from academus.shared.redis_conn import connect
from academus.shared.serving import ServiceSpec, run
from academus.v1 import resource_manager_pb2 as pb
from academus.v1 import resource_manager_pb2_grpc


class ResourceManagerServicer(resource_manager_pb2_grpc.ResourceManagerServicer):
    def __init__(self, table: PlacementTable) -> None:
        self.table = table

    async def RegisterWorker(self, request, context):
        specs = [ModelSpec(m.name, m.kind, list(m.labels), m.dim, m.max_tokens) for m in request.models]
        info = WorkerInfo(request.worker_id, request.address, request.device, request.capacity or 1,
                          [s.name for s in specs])
        await self.table.register(info, specs)
        log_event("worker_registered", worker_id=info.worker_id, address=info.address, models=info.models)
        return pb.RegisterWorkerResponse(heartbeat_ttl_s=self.table.ttl)

    async def DeregisterWorker(self, request, context):
        removed = await self.table.deregister(request.worker_id)
        log_event("worker_deregistered", worker_id=request.worker_id, removed=removed)
        return pb.DeregisterWorkerResponse(removed=removed)

    async def ListPlacements(self, request, context):
        placements = await self.table.placements(request.model)
        return pb.ListPlacementsResponse(
            placements=[pb.Placement(model=m, worker_ids=w) for m, w in placements.items()]
        )


async def build() -> ServiceSpec:
    config = cfg.load(cfg.ResourceManagerConfig)
    redis = connect(config.redis_url)
    keys = Keys(config.key_prefix)
    table = PlacementTable(redis, keys, config.heartbeat_ttl_s)

    async def announce(address: str) -> None:
        await redis.set(keys.resource_manager(), address)

    async def reaper() -> None:
        while True:
            await asyncio.sleep(config.reap_interval_s)
            try:
                dead = await table.reap()
                if dead:
                    log_event("workers_reaped", workers=dead)
            except Exception as e:  # Redis restarting: try again next round
                log_event("reap_failed", error=repr(e))

    return ServiceSpec(
        name="resource_manager",
        config=config,
        add_servicers=lambda s: resource_manager_pb2_grpc.add_ResourceManagerServicer_to_server(
            ResourceManagerServicer(table), s),
        service_names=["academus.v1.ResourceManager"],
        on_started=announce,
        on_stopped=redis.aclose,
        extra_tasks=[reaper],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
