"""Students added under a memory budget, on the real mesh (processes, real Redis, real gRPC): two workers whose
budget holds one student each hold only the one placed on them; when the student number changes (down, and back
up: an addition), the worker given a student it lacks serves it at once (from its shards while it loads), then
holds it at full precision and lets go of the one no longer placed. No request is lost meanwhile."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from academus.client import AsyncClient
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, status, up
from academus.shared.models.students import Student
from academus.shared.state.keys import Keys
from academus.shared.training.student_artifacts import load_student_shell
from academus.shared.training.student_shards import build_students
from tests.conftest import small_student_artifacts
from tests.e2e.conftest import metric, wait_for

pytestmark = pytest.mark.e2e
MODEL = "sentiment-students"


def one_student_budget(artifacts: Path) -> int:
    """The shared parts and one student: the budget holds exactly one."""
    import torch

    from academus.shared.models.model import weight_bytes

    group, _ = load_student_shell(artifacts, "sentiment")
    with torch.device("meta"):
        return weight_bytes(group) + weight_bytes(Student(group.config))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Iterator[MeshState]:
    artifacts = small_student_artifacts(tmp_path_factory.mktemp("budget-artifacts"), best_k=2)
    build_students(artifacts, MODEL, quick=True)
    run_dir = tmp_path_factory.mktemp("budget-run")
    state = up(MeshOptions(
        run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=2, worker_threads=1, instances=1,
        deployments=[Deployment("student", MODEL)],
        # the numbers the tests set hold: no addition (window), no drop after a set number (cooldown)
        env={"ACADEMUS_MODELS": MODEL, "ACADEMUS_ADAPT_WINDOW_S": "600", "ACADEMUS_ADAPT_COOLDOWN_S": "600",
             "ACADEMUS_ADAPT_INTERVAL_S": "0.1",
             "ACADEMUS_GRACE_S": "10", "ACADEMUS_STUDENT_BUDGET_BYTES": str(one_student_budget(artifacts))}))
    state.key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
    yield state
    down(run_dir)


def held(state: MeshState) -> dict[str, dict[str, int]]:
    """Each worker's held students of MODEL as `academus status` reports them: {worker_id: {index: bits}}."""
    model = next(m for m in status(Path(state.run_dir))["models"] if m["name"] == MODEL)
    return model.get("held_students", {})


def placed(state: MeshState) -> dict[str, list[int]]:
    r = redis.Redis.from_url(state.redis_url, decode_responses=True)
    table = json.loads(r.get(Keys(state.key_prefix).groups(MODEL)) or "{}")
    out: dict[str, list[int]] = {}
    for members in table.get("groups", []):
        for worker, indices in members:
            out.setdefault(worker, []).extend(indices)
    return {w: sorted(set(i)) for w, i in out.items()}


async def requests(state: MeshState, count: int, at_once: bool = True) -> list:
    """`count` requests, at once or one after another (a burst makes the resource manager drop a student)."""
    async with AsyncClient(state.gateway, api_key=state.key, timeout=30) as client:
        calls = [client.infer(MODEL, [f"{i} a warm and funny film"]) for i in range(count)]
        if at_once:
            return await asyncio.gather(*calls)
        return [await call for call in calls]


def test_each_worker_holds_only_the_student_placed_on_it(mesh: MeshState) -> None:
    wait_for(lambda: sorted(i for w in placed(mesh).values() for i in w) == [0, 1], 60, "a group of two students")
    expected = {w: {str(i): 32 for i in indices} for w, indices in placed(mesh).items()}
    wait_for(lambda: held(mesh) == expected, 60, f"held students {expected}")
    answers = asyncio.run(requests(mesh, 8, at_once=False))
    assert all(a.metadata.student_count == 2 for a in answers)


def test_a_student_added_where_it_is_not_held_serves_at_once_and_loads(mesh: MeshState) -> None:
    wait_for(lambda: sorted(i for w in placed(mesh).values() for i in w) == [0, 1], 60, "a group of two students")
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 1)          # the operator's lever; the resource manager adopts it
    answers = asyncio.run(requests(mesh, 24))                 # sent while the groups re-form
    assert len(answers) == 24 and all(set(a.predictions[0].probs) == {"rotten", "fresh"} for a in answers)
    wait_for(lambda: placed(mesh) and all(i == [0] for i in placed(mesh).values()), 30, "two groups of student 0")
    wait_for(lambda: all(h == {"0": 32} for h in held(mesh).values()) and len(held(mesh)) == 2, 60,
             "student 0 held whole on both workers, student 1 let go")
    after = asyncio.run(requests(mesh, 8))
    assert all(a.metadata.student_count == 1 for a in after)
    workers = [s for s in mesh.services if s.name.startswith("worker-")]
    full = sum(metric(w.metrics_port, "academus_worker_student_loads_total", model=MODEL, source="whole")
               for w in workers)
    assert len(workers) == 2 and full >= 3   # one student each at the start, then student 0 where 1 was


def test_a_student_added_back_is_served_and_held_where_it_is_placed(mesh: MeshState) -> None:
    """From one student to two (the resource manager's addition after a quiet window, set here by hand): one
    worker lets student 0 go for student 1, which its budget of one then holds whole."""
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    r.set(Keys(mesh.key_prefix).students(MODEL), 1)
    wait_for(lambda: placed(mesh) and all(i == [0] for i in placed(mesh).values()), 30, "two groups of student 0")
    r.set(Keys(mesh.key_prefix).students(MODEL), 2)
    answers = asyncio.run(requests(mesh, 24))
    assert len(answers) == 24 and all(set(a.predictions[0].probs) == {"rotten", "fresh"} for a in answers)
    wait_for(lambda: sorted(i for w in placed(mesh).values() for i in w) == [0, 1], 30, "a group of two students")
    expected = {w: {str(i): 32 for i in indices} for w, indices in placed(mesh).items()}
    wait_for(lambda: held(mesh) == expected, 60, f"held students {expected}")
    after = asyncio.run(requests(mesh, 8, at_once=False))
    assert all(a.metadata.student_count == 2 for a in after)
