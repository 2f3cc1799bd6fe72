"""Resource manager core: the placement table in Redis (workers, the models they serve, heartbeats).

Every write is idempotent (SADD/SREM/HSET on ids), so a Redis client retry cannot apply twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from academus.shared.catalogue import ModelSpec
from academus.shared.keys import Keys


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    address: str
    device: str
    capacity: int
    models: list[str]


class PlacementTable:
    """Registers workers and keeps `placement:<model>` equal to the set of live workers serving it."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, heartbeat_ttl_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl = max(1, round(heartbeat_ttl_s))

    async def register(self, info: WorkerInfo, specs: Sequence[ModelSpec]) -> None:
        key = self.keys.worker(info.worker_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping={"address": info.address, "device": info.device,
                                "capacity": info.capacity, "models": ",".join(info.models)})
        pipe.expire(key, self.ttl)
        for spec in specs:
            pipe.sadd(self.keys.placement(spec.name), info.worker_id)
            pipe.sadd(self.keys.placements(), spec.name)
            pipe.hset(self.keys.models(), spec.name, spec.to_json())
        await pipe.execute()
        await self.redis.publish(self.keys.events(), f"register {info.worker_id}")

    async def deregister(self, worker_id: str) -> bool:
        models = await self.redis.smembers(self.keys.placements())
        pipe = self.redis.pipeline(transaction=True)
        for model in models:
            pipe.srem(self.keys.placement(model), worker_id)
        pipe.delete(self.keys.worker(worker_id))
        removed = any(await pipe.execute())  # SREM / DEL counts: anything there to remove
        await self.redis.publish(self.keys.events(), f"deregister {worker_id}")
        return removed

    async def placements(self, model: str = "") -> dict[str, list[str]]:
        models = [model] if model else sorted(await self.redis.smembers(self.keys.placements()))
        return {m: sorted(await self.redis.smembers(self.keys.placement(m))) for m in models}

    async def reap(self) -> list[str]:
        """Drops workers whose heartbeat key expired from every placement; returns their ids."""
        dead: set[str] = set()
        for model, workers in (await self.placements()).items():
            for worker_id in workers:
                if not await self.redis.exists(self.keys.worker(worker_id)):
                    await self.redis.srem(self.keys.placement(model), worker_id)
                    dead.add(worker_id)
        if dead:
            await self.redis.publish(self.keys.events(), "reap " + ",".join(sorted(dead)))
        return sorted(dead)
