"""Online student parallelism on the real mesh (processes, real Redis, real gRPC, the real teacher's
layers as students): groups across two workers, the immediate path and buffer merges, overload,
student-number adaptation, and a killed worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from academus.client import AcademusError, AsyncClient
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up, wait_exit
from academus.shared.state.keys import Keys
from tests.conftest import small_student_artifacts
from tests.e2e.conftest import metric, wait_for

pytestmark = pytest.mark.e2e
MODEL = "sentiment-students"
TEXT = "a warm and funny film whose cast makes every scene feel new, even the slow ones near the end"


def two_worker_mesh(tmp_path_factory, name: str, env: dict[str, str] | None = None,
                    **options) -> Iterator[MeshState]:
    """The untrained student group on two workers of two slots, adaptation held off, and `options` (the
    deployments, nodes) and `env` (more settings): the meshes of the shards' and the nodes' tests."""
    artifacts = small_student_artifacts(tmp_path_factory.mktemp(f"{name}-artifacts"), best_k=2)
    run_dir = tmp_path_factory.mktemp(f"{name}-run")
    state = up(MeshOptions(
        run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=2, worker_threads=1, instances=2,
        env={"ACADEMUS_MODELS": MODEL, "ACADEMUS_ADAPT_WINDOW_S": "600", "ACADEMUS_GRACE_S": "10", **(env or {})},
        **options))
    state.key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
    yield state
    down(run_dir)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """A 2-student sentiment group from the teacher's bottom layers, untrained: serving mechanics,
    not quality, are under test here."""
    return small_student_artifacts(tmp_path_factory.mktemp("sp-artifacts"), best_k=2)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, artifacts):
    run_dir = tmp_path_factory.mktemp("sp-run")
    state = up(MeshOptions(
        run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=2, worker_threads=1, instances=2,
        deployments=[Deployment("student", MODEL), Deployment("padded", "sentiment")],
        env={"ACADEMUS_MODELS": f"{MODEL},sentiment", "ACADEMUS_ADAPT_WINDOW_S": "2",
             "ACADEMUS_ADAPT_COOLDOWN_S": "0.5", "ACADEMUS_ADAPT_INTERVAL_S": "0.1",
             "ACADEMUS_QUEUE_CAPACITY": "24", "ACADEMUS_GRACE_S": "10"}))
    state.key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
    yield state
    down(run_dir)


def table(state) -> dict:
    r = redis.Redis.from_url(state.redis_url, decode_responses=True)
    raw = r.get(Keys(state.key_prefix).groups(MODEL))
    return json.loads(raw) if raw else {}


async def burst(state, count: int, text: str = TEXT, timeout: float = 30.0, policy: str = "",
                rate: float = 0.0, follow: int = 0) -> list:
    """`count` requests at once, or open loop at `rate` per second; then `follow` more, sent the moment
    the first RESOURCE_EXHAUSTED came back (the gateway has seen that refusal by then)."""
    async with AsyncClient(state.gateway, api_key=state.key, timeout=timeout) as client:
        refused = asyncio.Event()

        async def one(i: int, delay: float):
            await asyncio.sleep(delay)
            try:
                return await client.infer(MODEL, [f"{i} {text}"], policy=policy)
            except AcademusError as e:
                if e.code == "RESOURCE_EXHAUSTED":
                    refused.set()
                return e

        first = [asyncio.create_task(one(i, i / rate if rate else 0)) for i in range(count)]
        if follow:
            await asyncio.wait_for(refused.wait(), timeout)
        then = [asyncio.create_task(one(count + i, 0)) for i in range(follow)]
        return await asyncio.gather(*first, *then)


def test_two_groups_across_both_workers_take_samples_at_once_then_merge_in_the_buffer(mesh):
    wait_for(lambda: table(mesh).get("students") == 2 and len(table(mesh)["groups"]) == 2, what="two groups")
    groups = table(mesh)["groups"]
    # eq. 6 with S = 2 on G = 2 devices: student i of every group on device i
    assert [[w for w, _ in g] for g in groups] == [["worker-0", "worker-1"], ["worker-0", "worker-1"]]
    answers = asyncio.run(burst(mesh, 16))
    assert all(not isinstance(a, AcademusError) for a in answers), answers
    meta = [a.metadata for a in answers]
    assert {m.policy for m in meta} == {"student"}
    # S = 2 answers came from groups spanning both workers; the burst may already have dropped S to 1
    assert {m.worker_id for m in meta if m.student_count == 2} == {"worker-0+worker-1"}
    assert {m.worker_id for m in meta if m.student_count != 2} <= {"worker-0", "worker-1"}
    assert any(m.batch_size == 1 for m in meta)   # the immediate path (a group was idle)
    assert any(m.batch_size > 1 for m in meta)    # samples that met busy groups merged by length bin


def test_the_padded_deployment_of_the_teacher_runs_beside_it(mesh):
    async def call():
        async with AsyncClient(mesh.gateway, api_key=mesh.key) as client:
            return await client.infer("sentiment", [TEXT], policy="padded")
    answer = asyncio.run(call())
    assert answer.metadata.policy == "padded" and answer.metadata.student_count == 1


def test_overload_answers_resource_exhausted_at_once_and_nothing_hangs(mesh):
    long_text = " ".join([TEXT] * 5)
    start = time.monotonic()
    # 1,000/s: the queue fills within the first tens of requests, and the rest arrive after its first
    # refusals came back (sent all at once, every request could reach the scheduler before any refusal did);
    # five more follow the first refusal at once, in case a loaded machine bunched the burst anyway
    answers = asyncio.run(burst(mesh, 120, long_text, timeout=60, rate=1000, follow=5))
    codes = {a.code if isinstance(a, AcademusError) else "OK" for a in answers}
    assert "RESOURCE_EXHAUSTED" in codes and "OK" in codes
    assert codes <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
    assert time.monotonic() - start < 60
    # Once the scheduler refused for its full queue, the gateway honours its pushback hint: the requests
    # that follow within it are refused at the edge, never sent on.
    refused = [a.details for a in answers if isinstance(a, AcademusError) and a.code == "RESOURCE_EXHAUSTED"]
    at_edge = [d for d in refused if d.startswith(f"every scheduler serving model {MODEL!r} has a full queue")]
    assert at_edge and len(at_edge) < len(refused), refused


def test_a_burst_drops_a_student_and_a_quiet_window_adds_it_back(mesh):
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    key = Keys(mesh.key_prefix).students(MODEL)
    wait_for(lambda: r.get(key) == "2", what="the student number back at 2")
    seen: list[str] = []

    async def load_and_watch():
        watcher = asyncio.create_task(watch(seen, r, key))
        answers = await burst(mesh, 400, " ".join([TEXT] * 3), timeout=60, rate=200)  # 2 s of overload
        await asyncio.sleep(0.5)
        watcher.cancel()
        return answers

    answers = asyncio.run(load_and_watch())
    assert "1" in seen  # the buffer reached the group count: S dropped to 1, more groups started
    served = [a for a in answers if not isinstance(a, AcademusError)]
    assert any(a.metadata.student_count == 1 for a in served) and any(a.metadata.student_count == 2 for a in served)
    wait_for(lambda: table(mesh).get("students") == 1 and len(table(mesh)["groups"]) == 4, what="four groups")
    wait_for(lambda: r.get(key) == "2", timeout_s=20, what="a student added back after the quiet window")


def test_a_silent_schedulers_load_signals_are_gone_within_a_second(mesh):
    """A scheduler that stops reporting (frozen here with SIGSTOP, as a dead one) leaves no stale signals, whose
    old student number would pause the resource manager's adaptation, for longer than ten reports (1 s)."""
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    keys = Keys(mesh.key_prefix)
    ids = [i for i in r.smembers(keys.schedulers()) if r.hget(keys.scheduler(i), "policy") == "student"]
    address = r.hget(keys.scheduler(ids[0]), "address")
    scheduler = next(s for s in mesh.services if s.name.startswith("scheduler") and s.address == address)
    assert 0 < r.pttl(keys.load(ids[0])) <= 1000
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: not r.exists(keys.load(ids[0])), timeout_s=5, what="the silent scheduler's signals gone")
        assert time.monotonic() - stopped < 1.5
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    wait_for(lambda: r.exists(keys.load(ids[0])), timeout_s=5, what="the scheduler reporting again")


async def watch(seen: list[str], r: redis.Redis, key: str) -> None:
    while True:
        seen.append(r.get(key))
        await asyncio.sleep(0.05)


def test_a_killed_worker_loses_no_request(mesh):
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 1)  # four one-student groups, two on each worker
    wait_for(lambda: table(mesh).get("students") == 1 and len(table(mesh)["groups"]) == 4, what="S = 1")
    victim, answers = asyncio.run(kill_under_load(mesh))
    assert wait_exit(victim.pid, 10)
    errors = [a for a in answers if isinstance(a, AcademusError)]
    assert not errors, [e.code for e in errors]
    assert any(a.metadata.attempts > 1 for a in answers)  # in flight on the dead worker, run again
    survivor = next(s.name for s in mesh.services if s.name.startswith("worker-") and s is not victim)
    assert {a.metadata.worker_id for a in answers if a.metadata.attempts > 1} == {survivor}


async def kill_under_load(mesh, count: int = 60, rate: float = 40, frozen_s: float = 0.0) -> tuple[object, list]:
    """Kills whichever worker is first seen computing during a burst (`count` requests at `rate`), and returns it
    with the burst's answers: the scheduler may keep one worker's groups idle for a whole burst, so waiting on a
    fixed victim could let the burst end unkilled. `frozen_s`: the victim is stopped (SIGSTOP) that long first,
    so that the batches sent to it meanwhile are in flight when it dies, however fast a batch runs."""
    workers = [s for s in mesh.services if s.name.startswith("worker-")]

    def busy() -> object | None:
        return next((w for w in workers if metric(w.metrics_port, "academus_rpc_in_flight", service="worker",
                                                  method="Run") >= 1), None)

    pending = asyncio.create_task(burst(mesh, count, " ".join([TEXT] * 4), timeout=60, rate=rate))
    end, victim = time.monotonic() + 30, None
    while time.monotonic() < end and (victim := await asyncio.to_thread(busy)) is None:  # off the loop
        await asyncio.sleep(0.005)
    assert victim is not None, "no worker became busy"
    if frozen_s:
        os.kill(victim.pid, signal.SIGSTOP)
        await asyncio.sleep(frozen_s)
    os.kill(victim.pid, signal.SIGKILL)  # while it computes a request
    return victim, await pending


@pytest.fixture
def spanning_mesh(tmp_path_factory):
    """Two groups of S = 2, each with a student on both workers, the student number held (no adaptation), and
    a heartbeat TTL no test outlasts: only the resource manager's liveness watch can re-plan after a kill. No
    queue wait bound: the victim's frozen batches run long, and admission would refuse for them (over 1 s of work
    ahead) what the kill itself loses nothing of."""
    yield from two_worker_mesh(tmp_path_factory, "span", env={"ACADEMUS_ADAPT_INTERVAL_S": "3600",
                                                              "ACADEMUS_HEARTBEAT_TTL_S": "60",
                                                              "ACADEMUS_MAX_QUEUE_WAIT_MS": "0"})


def test_a_killed_workers_groups_move_to_the_survivor_and_no_request_fails(spanning_mesh):
    """eq. 6 put a student of every group on each worker, so a kill leaves no group whole: the resource manager
    sees the worker's health stream break and re-plans the groups onto the survivor, the scheduler holding the
    requests meanwhile (never an UNAVAILABLE for the SDK to retry), and the batches in flight on the dead worker
    run again there, all before the supervisor's restart of the victim serves."""
    mesh = spanning_mesh
    wait_for(lambda: table(mesh).get("students") == 2 and len(table(mesh)["groups"]) == 2, what="two groups")
    assert [[w for w, _ in g] for g in table(mesh)["groups"]] == [["worker-0", "worker-1"]] * 2
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    events = r.pubsub(ignore_subscribe_messages=True)
    events.subscribe(Keys(mesh.key_prefix).events())
    victim, answers = asyncio.run(kill_under_load(mesh, frozen_s=0.3))
    errors = [a for a in answers if isinstance(a, AcademusError)]
    assert not errors, [(e.code, e.details) for e in errors]
    survivor = next(s.name for s in mesh.services if s.name.startswith("worker-") and s is not victim)
    retried = [a.metadata for a in answers if a.metadata.attempts > 1]
    assert retried and {m.worker_id for m in retried} == {survivor}
    scheduler = next(s for s in mesh.services if s.name.startswith("scheduler"))
    assert metric(scheduler.metrics_port, "academus_rpc_errors_total", service="scheduler", method="Schedule",
                  code="UNAVAILABLE") == 0
    published, end = [], time.monotonic() + 2
    while time.monotonic() < end:   # None for the subscription's own confirmation too: read on to the end
        if (message := events.get_message(timeout=0.1)) is not None:
            published.append(message["data"])
    # the lost process's registration rides along: a scheduler gives up its batches without asking it again
    assert [m.split()[:2] for m in published if m.startswith("lost ")] == [["lost", victim.name]], published
    assert all(len(m.split()) == 3 for m in published if m.startswith("lost ")), published
    events.close()
