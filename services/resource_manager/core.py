"""Resource manager core: the placement table in Redis (workers, the models they serve, heartbeats),
and the group planner (student groups by eq. 6, the student number adapted to load).

Every write is idempotent (SADD/SREM/HSET on ids), so a Redis client retry cannot apply twice.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import WatchError

from academus.services.resource_manager.allocation import (
    Device,
    GroupLoad,
    StudentNumber,
    allocate_groups,
    allocate_whole,
)
from academus.shared.runtime.config import split_names
from academus.shared.state.catalogue import ModelSpec
from academus.shared.state.groups import groups_to_json
from academus.shared.state.keys import Keys


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    address: str
    device: str
    capacity: int
    models: list[str]
    node: str = ""   # the machine: groups are formed within one


class PlacementTable:
    """Registers workers and keeps `placement:<model>` equal to the set of live workers serving it."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, heartbeat_ttl_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl = max(1, round(heartbeat_ttl_s))

    async def register(self, info: WorkerInfo, specs: Sequence[ModelSpec]) -> str:
        """Records the worker and the models it serves now; a model it served before and no longer does (removed
        from the catalogue) loses it, and leaves the catalogue once no worker serves it. Returns the
        registration's token."""
        key = self.keys.worker(info.worker_id)
        dropped = set(split_names(await self.redis.hget(key, "models") or "")) - {spec.name for spec in specs}
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(key)
        # a new token each registration: only a live process registers, so a scheduler that lost this worker
        # mid-call takes it back at once when the token changes (a restart on the same address)
        registration = secrets.token_hex(8)
        pipe.hset(key, mapping={"address": info.address, "device": info.device,
                                "capacity": info.capacity, "models": ",".join(info.models), "node": info.node,
                                "registration": registration})
        pipe.expire(key, self.ttl)
        for spec in specs:
            pipe.sadd(self.keys.placement(spec.name), info.worker_id)
            pipe.sadd(self.keys.placements(), spec.name)
            pipe.hset(self.keys.models(), spec.name, spec.to_json())
        for model in dropped:
            pipe.srem(self.keys.placement(model), info.worker_id)
        await pipe.execute()
        for model in dropped:
            await self.forget_if_unplaced(model)
        await self.redis.publish(self.keys.events(), f"register {info.worker_id}")
        return registration

    async def forget_if_unplaced(self, model: str) -> None:
        """Drops a model no worker serves from the catalogue the gateways read."""
        if not await self.redis.scard(self.keys.placement(model)):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hdel(self.keys.models(), model)
            pipe.srem(self.keys.placements(), model)
            await pipe.execute()

    async def deregister(self, worker_id: str) -> bool:
        models = await self.redis.smembers(self.keys.placements())
        pipe = self.redis.pipeline(transaction=True)
        self._remove(pipe, worker_id, models)
        removed = any(await pipe.execute())  # SREM / DEL counts: anything there to remove
        await self.redis.publish(self.keys.events(), f"deregister {worker_id}")
        return removed

    async def drop(self, worker_id: str, registration: str) -> bool:
        """Deregisters a worker found dead, if its key still holds `registration`: never the process that
        registered on its id since (a restart), whose key a concurrent write would have changed."""
        key = self.keys.worker(worker_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                if await pipe.hget(key, "registration") != registration:
                    return False
                models = await pipe.smembers(self.keys.placements())
                pipe.multi()
                self._remove(pipe, worker_id, models)
                await pipe.execute()
            except WatchError:
                return False
        await self.redis.publish(self.keys.events(), f"lost {worker_id} {registration}")
        return True

    def _remove(self, pipe: Pipeline, worker_id: str, models: Iterable[str]) -> None:
        """Queues the worker's removal from every placement and its key's deletion."""
        for model in models:
            pipe.srem(self.keys.placement(model), worker_id)
        pipe.delete(self.keys.worker(worker_id))

    async def registrations(self) -> dict[str, tuple[str, str]]:
        """Each registered worker serving a model: its address and registration token."""
        ids = sorted({w for workers in (await self.placements()).values() for w in workers})
        pipe = self.redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hmget(self.keys.worker(worker_id), ["address", "registration"])
        return {worker_id: (address, registration)
                for worker_id, (address, registration) in zip(ids, await pipe.execute(), strict=True)
                if address and registration}

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


class GroupPlanner:
    """Writes each student model's groups (eq. 6) and student number to Redis, and adapts the student
    number to the schedulers' load signals. Writes are SETs of whole values, one replan at a time: a
    worker's registration, the reaper and the adaptation all replan, and one that read the live workers
    before another changed the number would write groups of the old size under the new number."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, ceiling: str = "max", window_s: float = 120.0,
                 cooldown_s: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        self.redis, self.keys, self.ceiling = redis, keys, ceiling
        self.window_s, self.cooldown_s, self.clock = window_s, cooldown_s, clock
        self.numbers: dict[str, StudentNumber] = {}
        self._replanning = asyncio.Lock()

    async def student_models(self) -> dict[str, ModelSpec]:
        specs = await self.redis.hgetall(self.keys.models())
        parsed = {name: ModelSpec.from_json(raw) for name, raw in specs.items()}
        return {name: spec for name, spec in parsed.items() if spec.max_students}

    async def devices(self, model: str) -> dict[str, list[Device]]:
        """The live workers serving `model`, grouped by node, and within a node by device (a GPU, or a CPU
        worker process)."""
        by_device: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for worker_id in sorted(await self.redis.smembers(self.keys.placement(model))):
            info = await self.redis.hgetall(self.keys.worker(worker_id))
            if not info:
                continue
            device = info.get("device", "cpu")
            name = worker_id if device.startswith("cpu") else f"{info['address'].rsplit(':', 1)[0]}/{device}"
            slot = (worker_id, max(1, int(info.get("capacity", 1))))
            by_device.setdefault((info.get("node", ""), name), []).append(slot)
        nodes: dict[str, list[Device]] = {}
        for (node, name), workers in sorted(by_device.items()):
            nodes.setdefault(node, []).append(Device(name, tuple(workers)))
        return nodes

    def number(self, spec: ModelSpec, stored: str | None) -> StudentNumber:
        ceiling = spec.max_students if self.ceiling == "max" else max(1, spec.default_students)
        entry = self.numbers.get(spec.name)
        if entry is None:
            start = int(stored) if stored else (spec.default_students or spec.max_students)
            entry = StudentNumber(min(max(1, start), ceiling), ceiling, self.window_s, self.cooldown_s, self.clock)
            self.numbers[spec.name] = entry
        return entry

    async def replan(self) -> dict[str, int]:
        """Re-forms every student model's groups for the live workers and current student numbers."""
        async with self._replanning:
            out = {}
            for name, spec in (await self.student_models()).items():
                number = self.number(spec, await self.redis.get(self.keys.students(name)))
                nodes = await self.devices(name)
                students = number.current   # read after the last await: the table is of one student number
                # eq. 6 within each node: a group's students are combined by its node's scheduler, so
                # none waits on another machine's network hop
                allocate = allocate_whole if spec.whole_groups else allocate_groups
                groups = [g for devices in nodes.values() for g in allocate(students, devices)]
                pipe = self.redis.pipeline(transaction=True)
                pipe.set(self.keys.students(name), students)
                pipe.set(self.keys.groups(name), groups_to_json(students, groups))
                await pipe.execute()
                out[name] = len(groups)
            await self.redis.publish(self.keys.events(), "groups")
            return out

    async def load(self) -> dict[str, GroupLoad]:
        """Every live scheduler's per-model signals, summed, with the student number their groups run
        when they all report the same one (else 0: some have not re-formed their groups yet). Groups are
        counted by name: one that two shards share is one group, busy when either runs a batch on it."""
        buffer: Counter[str] = Counter()
        busy: dict[str, dict[str, int]] = {}
        students: dict[str, set[int]] = {}
        for scheduler_id in await self.redis.smembers(self.keys.schedulers()):
            raw = await self.redis.hget(self.keys.load(scheduler_id), "models")
            for model, signals in (json.loads(raw) if raw else {}).items():
                buffer[model] += int(signals.get("buffer", 0))
                groups = busy.setdefault(model, {})
                for name, running in signals.get("by_group", {}).items():
                    groups[name] = max(groups.get(name, 0), int(running))
                students.setdefault(model, set()).add(int(signals.get("students", 0)))
        return {m: GroupLoad(buffer[m], len(g), len(g) - sum(g.values()), sum(g.values()), _one(students[m]))
                for m, g in busy.items()}

    async def adapt(self) -> dict[str, int]:
        """One adaptation step: the models whose student number changed, with the new number. A
        number an operator wrote to `students:<model>` is adopted (within 1..ceiling) first."""
        specs = await self.student_models()
        changed = {}
        loads = await self.load()
        for model, spec in specs.items():
            stored = await self.redis.get(self.keys.students(model))
            number = self.number(spec, stored)
            if stored and int(stored) != number.current:
                changed[model] = number.adopt(int(stored))
            elif model in loads and (new := number.observe(loads[model])) is not None:
                changed[model] = new
        if changed:
            await self.replan()
        return changed


def _one(values: set[int]) -> int:
    """The value when there is exactly one, else 0."""
    return next(iter(values)) if len(values) == 1 else 0
