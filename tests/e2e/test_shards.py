"""A student deployment split over three scheduler processes (shards) on the real mesh: each runs its
share of the groups (sharing one where there are fewer groups than shards), the gateway spreads requests
over all, a frozen shard's calls go to the others, and a killed worker loses no request, even where it held a
shard's only group."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import redis

from academus.client import AcademusError
from academus.shared.cli.mesh import Deployment, wait_exit
from academus.shared.runtime.logs import logged_events
from academus.shared.state.keys import Keys
from tests.e2e.conftest import metric
from tests.e2e.test_student_parallelism import MODEL, burst, kill_under_load, table, two_worker_mesh, wait_for

pytestmark = pytest.mark.e2e
SHARDS = ("scheduler-0.0", "scheduler-0.1", "scheduler-0.2")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # the student number the tests set holds through their bursts: the burst rule waits a minute after it.
    # Unsupervised: the killed worker stays dead (a restart is back within 2 s, taking requests again).
    yield from two_worker_mesh(tmp_path_factory, "shard", env={"ACADEMUS_ADAPT_COOLDOWN_S": "60"},
                               deployments=[Deployment("student", MODEL, shards=3)], supervise=False)


def shard_groups(state) -> dict[str, int]:
    """Each shard's reported group count for the model (its load signals)."""
    r = redis.Redis.from_url(state.redis_url, decode_responses=True)
    keys = Keys(state.key_prefix)
    out = {}
    for shard in SHARDS:
        raw = r.hget(keys.load(shard), "models")
        out[shard] = json.loads(raw).get(MODEL, {}).get("groups", 0) if raw else 0
    return out


def test_each_shard_runs_its_share_of_the_groups_and_all_serve(mesh):
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 1)   # four one-student groups over three shards
    wait_for(lambda: table(mesh).get("students") == 1 and len(table(mesh)["groups"]) == 4, what="four groups")
    wait_for(lambda: shard_groups(mesh) == dict(zip(SHARDS, (1, 1, 2), strict=True)), what="the split 1, 1, 2")
    answers = asyncio.run(burst(mesh, 30, rate=60))
    assert all(not isinstance(a, AcademusError) for a in answers), answers
    served_by = [a.metadata.scheduler_id for a in answers]
    assert set(served_by) == set(SHARDS), served_by           # the gateway spread them over all three
    assert {a.metadata.worker_id for a in answers} == {"worker-0", "worker-1"}


def test_a_shard_beyond_the_group_count_shares_a_group(mesh):
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 2)   # two groups of two students, three shards
    wait_for(lambda: table(mesh).get("students") == 2 and len(table(mesh)["groups"]) == 2, what="two groups")
    wait_for(lambda: shard_groups(mesh) == dict.fromkeys(SHARDS, 1), what="one group a shard, one shared")
    keys = Keys(mesh.key_prefix)
    named = [json.loads(r.hget(keys.load(s), "models"))[MODEL]["by_group"] for s in SHARDS]
    # the shared group goes by one name in both shards' signals: the resource manager counts two groups
    assert sorted(name for by_group in named for name in by_group) == [f"{MODEL}/g0", f"{MODEL}/g0", f"{MODEL}/g1"]
    answers = asyncio.run(burst(mesh, 12, rate=20))
    assert all(not isinstance(a, AcademusError) for a in answers), answers
    assert {a.metadata.scheduler_id for a in answers} == set(SHARDS)
    assert {a.metadata.student_count for a in answers} == {2}


def test_a_frozen_shards_calls_go_to_the_other_shards(mesh):
    """A hung scheduler (SIGSTOP) neither answers nor refuses: the calls the gateway sent it would wait out their
    deadlines (4 s here, the freeze 5 s). The gateway finds it silent to its health check, gives its calls up and
    sends them to the other shards, and sends it nothing more while it stays silent: no request fails."""
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 1)
    wait_for(lambda: shard_groups(mesh) == dict(zip(SHARDS, (1, 1, 2), strict=True)), what="the split 1, 1, 2")
    victim = next(s for s in mesh.services if s.name == SHARDS[1])
    gateway_log = Path(mesh.run_dir) / "logs" / "gateway.log"
    before = len(logged_events(gateway_log, "scheduler_calls_given_up"))

    async def frozen_under_load() -> list:
        pending = asyncio.create_task(burst(mesh, 200, timeout=4.0, rate=40))
        await asyncio.sleep(0.5)
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(5.0)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        return await pending

    answers = asyncio.run(frozen_under_load())
    errors = [a for a in answers if isinstance(a, AcademusError)]
    assert not errors, [e.code for e in errors]
    given_up = logged_events(gateway_log, "scheduler_calls_given_up")[before:]
    assert {e["address"] for e in given_up} == {victim.address} and sum(e["calls"] for e in given_up) >= 1
    wait_for(lambda: shard_groups(mesh)[SHARDS[1]] == 1, what="the continued shard reporting again")


def test_a_killed_worker_loses_no_request_in_any_shard(mesh):
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 1)
    wait_for(lambda: shard_groups(mesh) == dict(zip(SHARDS, (1, 1, 2), strict=True)), what="the split 1, 1, 2")
    victim, answers = asyncio.run(kill_under_load(mesh))   # the only group of one of the first two shards
    assert wait_exit(victim.pid, 10)
    errors = [a for a in answers if isinstance(a, AcademusError)]
    assert not errors, [e.code for e in errors]
    survivor = "worker-1" if victim.name == "worker-0" else "worker-0"
    assert {a.metadata.worker_id for a in answers if a.metadata.attempts > 1} <= {survivor}   # retried in-shard
    # the shard left with no group held its requests (the survivor still serves the model) until the resource
    # manager, seeing the victim's health stream break, re-planned the groups onto the survivor: no shard refused
    refused = sum(metric(s.metrics_port, "academus_rpc_errors_total", service="scheduler", method="Schedule",
                         code="UNAVAILABLE") for s in mesh.services if s.name.startswith("scheduler"))
    assert refused == 0
    assert {w for g in table(mesh)["groups"] for w, _ in g} == {survivor}   # the supervisor is off: it stays dead
    assert {a.metadata.worker_id for a in answers[-20:]} == {survivor}   # the last half second: on the survivor
