"""Placement table against a real Redis: register, deregister, heartbeat expiry, reaping."""

from __future__ import annotations

import asyncio
import json

from academus.services.resource_manager.allocation import GroupLoad
from academus.services.resource_manager.core import GroupPlanner, PlacementTable, WorkerInfo
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.state.keys import Keys

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


async def test_each_registration_writes_a_new_token(redis_url):
    """A scheduler takes back a worker it lost once the token changes: only a live process registers."""
    redis = connect(redis_url)
    table = PlacementTable(redis, KEYS, heartbeat_ttl_s=5)
    tokens = []
    for _ in range(3):
        await table.register(info("w1"), SPECS)
        tokens.append(await redis.hget(KEYS.worker("w1"), "registration"))
    assert all(tokens) and len(set(tokens)) == 3
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
    """Buffers add up; groups count by name, so a group two shards share (fewer groups than shards) is one
    group, busy when either shard runs a batch on it."""
    redis = connect(redis_url)
    keys = Keys("acd-load")

    async def report(scheduler_id: str, **models: dict) -> None:
        await redis.sadd(keys.schedulers(), scheduler_id)
        await redis.hset(keys.load(scheduler_id), "models", json.dumps(models))

    def signals(buffer: int, students: int, **by_group: int) -> dict:
        busy = sum(by_group.values())
        return {"buffer": buffer, "groups": len(by_group), "idle": len(by_group) - busy, "busy": busy,
                "students": students, "by_group": by_group}

    await report("s0", **{"sentiment-students": signals(3, 2, g0=1, g1=1)})
    await report("s1", **{"sentiment-students": signals(1, 2, g2=1, g3=0), "spam": signals(3, 1, w0=1, w1=1)})
    planner = GroupPlanner(redis, keys)
    assert await planner.load() == {"sentiment-students": GroupLoad(4, 4, 1, 3, students=2),
                                    "spam": GroupLoad(3, 2, 0, 2, students=1)}
    await report("s2", **{"sentiment-students": signals(2, 2, g3=1)})   # a third shard shares g3 with s1
    assert (await planner.load())["sentiment-students"] == GroupLoad(6, 4, 0, 4, students=2)
    await report("s1", **{"sentiment-students": signals(1, 3, g2=1, g3=0)})  # s1 re-formed, s0 not yet
    assert (await planner.load())["sentiment-students"].students == 0
    await redis.aclose()


async def test_groups_are_formed_within_a_node(redis_url):
    """Eq. 6 runs over each node's devices: no group's students wait on another machine. Three workers on
    node a and one on b, S = 2: a's three slots make one group, b's one slot a group of two co-located
    students (over all four slots as one pool, the second group would span the two nodes)."""
    redis = connect(redis_url)
    keys = Keys("acd-nodes")
    spec = ModelSpec("s", CLASSIFICATION, ["a", "b"], max_students=2, default_students=2)
    table = PlacementTable(redis, keys, 60)
    for i, node in enumerate("aaab"):
        await table.register(WorkerInfo(f"w{i}", f"h{i}:1", "cpu", 1, ["s"], node), [spec])
    assert await redis.hget(keys.worker("w3"), "node") == "b"
    planner = GroupPlanner(redis, keys)
    assert await planner.replan() == {"s": 2}
    written = json.loads(await redis.get(keys.groups("s")))
    assert written["groups"] == [[["w0", [0]], ["w1", [1]]], [["w3", [0, 1]]]]
    await redis.aclose()


async def test_a_group_whose_head_does_not_add_over_members_stays_on_one_worker(redis_url):
    """Two workers, S = 2: eq. 6 would spread each group over both; a model with `whole_groups` (a classifier's
    nonlinear head) gets a group a worker, every student on it."""
    redis = connect(redis_url)
    keys = Keys("acd-whole")
    spec = ModelSpec("c", CLASSIFICATION, ["a", "b"], max_students=2, default_students=2, whole_groups=True)
    table = PlacementTable(redis, keys, 60)
    for i in range(2):
        await table.register(WorkerInfo(f"w{i}", f"h{i}:1", "cpu", 1, ["c"], "a"), [spec])
    assert await GroupPlanner(redis, keys).replan() == {"c": 2}
    assert json.loads(await redis.get(keys.groups("c")))["groups"] == [[["w0", [0, 1]]], [["w1", [0, 1]]]]
    assert ModelSpec.from_json(await redis.hget(keys.models(), "c")).whole_groups   # as the worker registered it
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


async def test_drop_removes_the_process_found_dead_and_never_its_restart(redis_url):
    """The liveness watch drops a worker by the registration it watched: a restart on the same id registered a
    new token, and stays."""
    redis = connect(redis_url)
    table = PlacementTable(redis, KEYS, heartbeat_ttl_s=5)
    dead = await table.register(info("w1"), SPECS)
    await table.register(info("w2"), SPECS[:1])
    assert await table.registrations() == {"w1": ("127.0.0.1:2", dead), "w2": ("127.0.0.1:2", await redis.hget(
        KEYS.worker("w2"), "registration"))}
    restarted = await table.register(info("w1"), SPECS)
    assert await table.drop("w1", dead) is False
    assert await table.placements() == {"minilm": ["w1", "w2"], "spam": ["w1"]}
    assert await table.drop("w1", restarted) is True
    assert await table.placements() == {"minilm": ["w2"], "spam": []}
    assert await redis.exists(KEYS.worker("w1")) == 0
    assert await table.drop("w1", restarted) is False   # once
    await redis.aclose()
