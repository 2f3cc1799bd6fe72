"""Student groups across workers (eq. 6) on in-process services with real Redis, real gRPC, the real
model: the resource manager forms the groups, the scheduler fans a sample out to the group's members
and combines their partial outputs, which must equal the whole group run on one worker."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from academus.client import AsyncClient
from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.shared.models.work import Batch
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService
from academus.shared.state.keys import Keys
from tests.conftest import NO_WAIT_BOUND, env
from tests.integration.test_inprocess_mesh import KEY
from tests.integration.test_student_serving import artifacts, tokens  # noqa: F401  (module fixture)

pytestmark = pytest.mark.integration
PREFIX = "groups"
MODEL = "sentiment-students"
TEXTS = ["a warm, funny and wholly unexpected film", "a dull mess"]


async def start(redis_url: str, artifacts_root, workers: int = 2, **settings: str) -> list[RunningService]:
    from academus.services.gateway.server import build as gateway
    from academus.services.resource_manager.server import build as resource_manager
    from academus.services.scheduler.server import build as scheduler
    from academus.services.worker.server import build as worker

    redis = connect(redis_url)
    await redis.hset(Keys(PREFIX).api_key(KEY), mapping={"tenant": "it", "role": "tenant"})
    await redis.set(Keys(PREFIX).students(MODEL), 2)  # S = 2: one group spanning both workers
    await redis.aclose()
    common = {"ACADEMUS_REDIS_URL": redis_url, "ACADEMUS_KEY_PREFIX": PREFIX, "ACADEMUS_PORT": "0",
              "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ARTIFACTS": str(artifacts_root), "ACADEMUS_MODELS": MODEL,
              "ACADEMUS_GRACE_S": "5", "ACADEMUS_POLICY": "student", "ACADEMUS_ADAPT_INTERVAL_S": "0.05",
              "ACADEMUS_ADAPT_COOLDOWN_S": "0", "ACADEMUS_ADAPT_WINDOW_S": "3600", "ACADEMUS_INSTANCES": "1",
              **NO_WAIT_BOUND, **settings}
    running = []
    with env(**common):
        running.append(RunningService(await resource_manager()))
        await running[-1].start()
        for w in range(workers):
            with env(ACADEMUS_WORKER_ID=f"g-w{w}"):
                running.append(RunningService(await worker()))
                await running[-1].start()
        for build in (scheduler, gateway):
            running.append(RunningService(await build()))
            await running[-1].start()
    return running


async def groups_of(redis_url: str, students: int, count: int, timeout_s: float = 10.0) -> dict:
    redis = connect(redis_url)
    try:
        for _ in range(int(timeout_s / 0.05)):
            raw = await redis.get(Keys(PREFIX).groups(MODEL))
            table = json.loads(raw) if raw else {}
            if table.get("students") == students and len(table.get("groups", [])) == count:
                await asyncio.sleep(0.3)  # the scheduler re-reads on the pub/sub event
                return table
            await asyncio.sleep(0.05)
    finally:
        await redis.aclose()
    raise AssertionError(f"no table with S={students} and {count} groups: {table}")


@pytest.fixture
async def mesh(redis_server, artifacts):  # noqa: F811
    running = await start(redis_server.url, artifacts)
    yield running
    for service in reversed(running):
        await service.stop()


async def test_a_group_across_two_workers_equals_the_whole_group_on_one(mesh, redis_server, artifacts):  # noqa: F811
    table = await groups_of(redis_server.url, students=2, count=1)
    assert table["groups"] == [[["g-w0", [0]], ["g-w1", [1]]]]  # eq. 6: student i on device i
    async with AsyncClient(mesh[-1].address, api_key=KEY) as client:
        labelled = await client.infer(MODEL, TEXTS)
        embedded = await client.infer(MODEL, TEXTS, output="embedding")
    assert labelled.metadata.student_count == 2 and labelled.metadata.worker_id == "g-w0+g-w1"
    runner = ModelRunner(artifacts, [MODEL])
    ids, lengths = tokens(TEXTS)
    whole = runner.run(Batch(MODEL, OUTPUT_PROBS, ids, lengths, num_students=2)).values
    served = np.array([[p.probs["rotten"], p.probs["fresh"]] for p in labelled.predictions])
    assert np.abs(served - whole).max() < 1e-5
    pooled = runner.run(Batch(MODEL, OUTPUT_EMBEDDING, ids, lengths, num_students=2)).values
    assert np.abs(np.array([p.embedding for p in embedded.predictions]) - pooled).max() < 1e-4


async def test_fewer_students_make_two_groups_that_serve_concurrently(mesh, redis_server):
    redis = connect(redis_server.url)
    await redis.set(Keys(PREFIX).students(MODEL), 1)  # the operator's lever; the manager adopts it
    await redis.aclose()
    await groups_of(redis_server.url, students=1, count=2)
    async with AsyncClient(mesh[-1].address, api_key=KEY) as client:
        answers = await asyncio.gather(*(client.infer(MODEL, [t * 20]) for t in TEXTS * 4))
    assert {a.metadata.student_count for a in answers} == {1}
    assert {a.metadata.worker_id for a in answers} == {"g-w0", "g-w1"}
    assert {a.metadata.policy for a in answers} == {"student"}


async def test_a_lost_member_worker_moves_requests_to_the_group_that_remains(mesh, redis_server):
    redis = connect(redis_server.url)
    await redis.set(Keys(PREFIX).students(MODEL), 1)
    await redis.aclose()
    await groups_of(redis_server.url, students=1, count=2)
    await mesh[2].stop()  # worker g-w1 deregisters: its group is gone
    await groups_of(redis_server.url, students=1, count=1)
    async with AsyncClient(mesh[-1].address, api_key=KEY) as client:
        answers = await asyncio.gather(*(client.infer(MODEL, [t]) for t in TEXTS * 2))
    assert {a.metadata.worker_id for a in answers} == {"g-w0"}


async def test_the_start_up_profile_sets_instances_and_max_merge(redis_server, artifacts):  # noqa: F811
    running = await start(redis_server.url, artifacts, workers=1, ACADEMUS_PROFILE="true", ACADEMUS_INSTANCES="0")
    redis = connect(redis_server.url)
    try:
        keys = Keys(PREFIX)
        chosen = await redis.hgetall(keys.profile(MODEL))
        capacity = await redis.hget(keys.worker("g-w0"), "capacity")
    finally:
        await redis.aclose()
        for service in reversed(running):
            await service.stop()
    assert int(chosen["instances"]) in (1, 2, 4) and int(chosen["max_merge"]) in (1, 2, 4, 8, 16)
    assert capacity == chosen["instances"]  # the worker runs as many instances as the profile chose
