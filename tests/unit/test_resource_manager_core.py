"""Placement table against a real Redis: register, deregister, heartbeat expiry, reaping."""

from __future__ import annotations

import asyncio
import json

from academus.services.resource_manager.allocation import GroupLoad
from academus.services.resource_manager.core import GroupPlanner, PlacementTable, WorkerInfo
from academus.shared.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.keys import Keys
from academus.shared.redis_conn import connect

KEYS = Keys("acd")
SPECS = [ModelSpec("minilm", EMBEDDING), ModelSpec("spam", CLASSIFICATION, ["ham", "spam"])]


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, f"127.0.0.1:{len(worker_id)}", "cpu", 1, [s.name for s in SPECS])


async def test_register_places_worker_and_publishes_catalogue(redis_url):
    redis = connect(redis_url)
    table = PlacementTable(redis, KEYS, heartbeat_ttl_s=5)
    await table.register(info("w1"), SPECS)
    await table.register(info("w1"), SPECS)  # idempotent: a retried call changes nothing
    assert await table.placements() == {"minilm": ["w1"], "spam": ["w1"]}
    assert ModelSpec.from_json(await redis.hget(KEYS.models(), "spam")).labels == ["ham", "spam"]
    assert 0 < await redis.ttl(KEYS.worker("w1")) <= 5
    await redis.aclose()


async def test_deregister_removes_from_every_placement(redis_url):
    redis = connect(redis_url)
    table = PlacementTable(redis, KEYS, heartbeat_ttl_s=5)
    await table.register(info("w1"), SPECS)
    await table.register(info("w2"), SPECS[:1])
    assert await table.deregister("w1") is True
    assert await table.placements() == {"minilm": ["w2"], "spam": []}
    assert await table.deregister("w1") is False
    await redis.aclose()


async def test_reap_drops_workers_whose_heartbeat_expired(redis_url):
    redis = connect(redis_url)
    table = PlacementTable(redis, KEYS, heartbeat_ttl_s=1)
    await table.register(info("w1"), SPECS)
    await table.register(info("w2"), SPECS)
    await redis.persist(KEYS.worker("w2"))  # w2 keeps beating, w1 stops
    await asyncio.sleep(1.2)
    assert await table.reap() == ["w1"]
    assert await table.placements() == {"minilm": ["w2"], "spam": ["w2"]}
    await redis.aclose()


async def test_planner_sums_the_schedulers_signals_and_names_their_common_student_number(redis_url):
    redis = connect(redis_url)
    keys = Keys("acd-load")

    async def report(scheduler_id: str, **models: dict) -> None:
        await redis.sadd(keys.schedulers(), scheduler_id)
        await redis.hset(keys.load(scheduler_id), "models", json.dumps(models))

    signals = {"buffer": 3, "groups": 2, "idle": 0, "busy": 2, "students": 2}
    await report("s0", **{"sentiment-students": signals})
    await report("s1", **{"sentiment-students": signals | {"buffer": 1}, "spam": signals | {"students": 1}})
    planner = GroupPlanner(redis, keys)
    assert await planner.load() == {"sentiment-students": GroupLoad(4, 4, 0, 4, students=2),
                                    "spam": GroupLoad(3, 2, 0, 2, students=1)}
    await report("s1", **{"sentiment-students": signals | {"students": 3}})  # s1 re-formed, s0 not yet
    assert (await planner.load())["sentiment-students"].students == 0
    await redis.aclose()


async def test_a_replan_overlapping_an_adaptation_writes_groups_of_the_number_it_names(redis_url):
    """A replan paused while reading the live workers (a registration's, the reaper's) and an adaptation
    that drops the student number meanwhile: the table left names one student number, and its groups
    have that many students."""
    redis = connect(redis_url)
    keys = Keys("acd-overlap")
    spec = ModelSpec("s", CLASSIFICATION, ["a", "b"], max_students=4, default_students=4)
    table = PlacementTable(redis, keys, 60)
    for i in range(8):
        await table.register(WorkerInfo(f"w{i}", f"h:{i}", "cpu", 1, ["s"]), [spec])
    planner = GroupPlanner(redis, keys, cooldown_s=0.0)
    await planner.replan()
    gate, devices = asyncio.Event(), planner.devices

    async def paused_devices(model):
        await gate.wait()
        return await devices(model)

    planner.devices = paused_devices
    paused = asyncio.ensure_future(planner.replan())
    await asyncio.sleep(0.05)
    planner.devices = devices

    async def burst():
        return {"s": GroupLoad(buffer=5, groups=2, idle=0, busy=2, students=4)}

    planner.load = burst
    adapting = asyncio.ensure_future(planner.adapt())
    await asyncio.sleep(0.05)
    gate.set()
    await paused
    assert await adapting == {"s": 3}
    written = json.loads(await redis.get(keys.groups("s")))
    assert written["students"] == 3 == int(await redis.get(keys.students("s")))
    assert {sum(len(students) for _, students in group) for group in written["groups"]} == {3}
    await redis.aclose()
