"""One host standing in for two nodes (`academus up --nodes 2`): a worker a node, and the student
deployment a scheduler a node (DESIGN: one scheduler a node). The resource manager forms groups within a
node, each node's scheduler dispatches to its own node's workers only, the gateway spreads requests over
both, and a killed worker loses no request: its node's scheduler stops saying it serves the model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from academus.client import AcademusError
from academus.shared.cli.mesh import Deployment, wait_exit
from academus.shared.state.keys import Keys
from tests.e2e.test_student_parallelism import MODEL, burst, kill_under_load, table, two_worker_mesh, wait_for

pytestmark = pytest.mark.e2e
NODE_OF = {"scheduler-0@node-0": "worker-0", "scheduler-0@node-1": "worker-1"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # the student number the tests set holds through their bursts: the burst rule waits a minute after it.
    # Unsupervised: the killed worker stays dead (a restart is back within 2 s, its node serving again).
    yield from two_worker_mesh(tmp_path_factory, "node", env={"ACADEMUS_ADAPT_COOLDOWN_S": "60"},
                               deployments=[Deployment("student", MODEL)], nodes=2, supervise=False)


def serving(state) -> dict[str, str]:
    """What each node's scheduler registered as serving."""
    r = redis.Redis.from_url(state.redis_url, decode_responses=True)
    return {s: r.hget(Keys(state.key_prefix).scheduler(s), "serving") for s in NODE_OF}


def placing(state) -> str:
    """The groups and the resource manager's log, for a wait that timed out."""
    log = Path(state.run_dir) / "logs" / "resource_manager.log"
    return f"groups {table(state)}; the resource manager's log:\n{log.read_text()[-6000:] if log.is_file() else ''}"


def test_groups_stay_within_a_node_and_each_nodes_scheduler_runs_its_own(mesh):
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    students = Keys(mesh.key_prefix).students(MODEL)
    # An operator's number starts the burst rule's cooldown only when it differs from the current one, and
    # two may be the current one: through one first, so that two holds through the burst below.
    r.set(students, 1)
    wait_for(lambda: len(table(mesh).get("groups", [])) == 4, what="a group a student", explain=lambda: placing(mesh))
    r.set(students, 2)
    # two slots a worker, a worker a node: a group of two students on each node (one pool of both workers
    # would have put each group's two students on the two nodes)
    wait_for(lambda: table(mesh).get("groups") == [[["worker-0", [0, 1]]], [["worker-1", [0, 1]]]],
             what="a group a node", explain=lambda: placing(mesh))
    wait_for(lambda: serving(mesh) == dict.fromkeys(NODE_OF, MODEL), what="both schedulers serving")
    answers = asyncio.run(burst(mesh, 30, rate=60))
    assert all(not isinstance(a, AcademusError) for a in answers), answers
    pairs = {(a.metadata.scheduler_id, a.metadata.worker_id) for a in answers}
    assert pairs == set(NODE_OF.items()), pairs      # both nodes served, each on its own worker only
    assert {a.metadata.student_count for a in answers} == {2}
    assert all((Path(mesh.run_dir) / "logs" / f"{s}.log").is_file() for s in NODE_OF)   # logs named by id


def test_a_killed_worker_loses_no_request_and_its_node_stops_serving(mesh):
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 1)
    wait_for(lambda: len(table(mesh).get("groups", [])) == 4, what="two groups a node", explain=lambda: placing(mesh))
    events = r.pubsub(ignore_subscribe_messages=True)
    events.subscribe(Keys(mesh.key_prefix).events())
    victim, answers = asyncio.run(kill_under_load(mesh))
    assert wait_exit(victim.pid, 10)
    errors = [a for a in answers if isinstance(a, AcademusError)]
    assert not errors, [e.code for e in errors]
    survivor = "worker-1" if victim.name == "worker-0" else "worker-0"
    orphaned = next(s for s, w in NODE_OF.items() if w == victim.name)
    wait_for(lambda: serving(mesh)[orphaned] == "", what="the orphaned node's scheduler to stop serving")
    seen: set[str] = set()   # and it announced the change, which wakes the gateways' registry reads

    def announced() -> bool:
        seen.update(m["data"] for m in iter(lambda: events.get_message(timeout=0.1), None))
        return f"serving {orphaned}" in seen

    wait_for(announced, what="the orphaned node's scheduler to announce it")
    events.close()
    after = asyncio.run(burst(mesh, 10, rate=20))
    assert all(not isinstance(a, AcademusError) for a in after), after
    assert {(a.metadata.scheduler_id, a.metadata.worker_id) for a in after} == {
        next((s, w) for s, w in NODE_OF.items() if w == survivor)}
