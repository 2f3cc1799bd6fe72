"""Students of a user's sequence classifier through the real mesh: two workers of two instance slots. Their head is
the classifier's own (dense + tanh before its projection), which does not add over a group's members, so the
resource manager gives each group a slot of its own with every student on it, and the scheduler runs such a group
as one model; the answers equal the group's own forward through that head."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from academus.client import AcademusError, AsyncClient
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up
from academus.shared.models.model import pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.state.keys import Keys
from academus.shared.training.student_artifacts import load_student_group
from tests.conftest import CriticStudents
from tests.e2e.conftest import wait_for

pytestmark = pytest.mark.e2e
MODEL = "critic-students"
TEXTS = ["a quietly devastating film", "dull, long and loud", "worth the ticket", "a cast that never finds its feet"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, critic_students: CriticStudents) -> Path:
    """A classifier fitted on 600 reviews, added as `critic`, and its students distilled --quick on 300 others."""
    return Path(shutil.copytree(critic_students.artifacts, tmp_path_factory.mktemp("critic") / "artifacts"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, artifacts: Path) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("critic-run")
    state = up(MeshOptions(run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=2, worker_threads=1,
                           instances=2, deployments=[Deployment("student", MODEL)],
                           env={"ACADEMUS_MODELS": MODEL, "ACADEMUS_ADAPT_WINDOW_S": "600", "ACADEMUS_GRACE_S": "10"}))
    state.key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
    yield state
    down(run_dir)


def groups(state: MeshState) -> list:
    raw = redis.Redis.from_url(state.redis_url, decode_responses=True).get(Keys(state.key_prefix).groups(MODEL))
    return json.loads(raw)["groups"] if raw else []


async def answers(state: MeshState, count: int, at_once: int = 3) -> list:
    """`count` answers, `at_once` in flight: fewer than the mesh's four groups, so the buffer never holds a job a
    group, which the resource manager reads as a burst and answers by dropping a student (its student-number
    adaptation)."""
    gate = asyncio.Semaphore(at_once)
    async with AsyncClient(state.gateway, api_key=state.key, timeout=60) as client:
        async def one(i: int):
            async with gate:
                try:
                    return await client.infer(MODEL, TEXTS)
                except AcademusError as e:
                    return e
        return await asyncio.gather(*(one(i) for i in range(count)))


def test_each_group_runs_whole_on_one_worker_through_the_classifiers_own_head(mesh: MeshState,
                                                                              artifacts: Path) -> None:
    redis.Redis.from_url(mesh.redis_url).set(Keys(mesh.key_prefix).students(MODEL), 2)   # both students serve
    wait_for(lambda: sorted(map(json.dumps, groups(mesh))) == sorted(
        json.dumps([[w, [0, 1]]]) for w in ("worker-0", "worker-0", "worker-1", "worker-1")), 60,
        "a group a slot, both students on it")
    # the scheduler reads the new groups after the resource manager writes them: wait for its view, not Redis's
    wait_for(lambda: all(not isinstance(r, AcademusError) and r.metadata.student_count == 2
                         for r in asyncio.run(answers(mesh, 2))), 60, "the scheduler running both students")
    results = asyncio.run(answers(mesh, 12))
    errors = [r for r in results if isinstance(r, AcademusError)]
    assert not errors, [(e.code, e.details) for e in errors]
    assert {r.metadata.worker_id for r in results} == {"worker-0", "worker-1"}   # both workers serve groups
    assert {r.metadata.student_count for r in results} == {2}

    group = load_student_group(artifacts, "critic", teacher="critic", task="critic")
    encoded = TeacherTokenizer(teacher_dir()).encode(TEXTS)
    with torch.no_grad():
        padded = pad_batch([e.input_ids for e in encoded], [e.token_type_ids for e in encoded])
        expected = torch.softmax(group.head(group(*padded, num_students=2)), dim=-1)
    for result in results:
        got = torch.tensor([[p.probs[label] for label in group.labels] for p in result.predictions])
        assert (got - expected).abs().max().item() <= 1e-4
