"""`academus up` without --deployment: each model served by one scheduler with the policy that suits it,
and `academus status` says which."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from academus.client import Client
from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshOptions, MeshState, down, up
from academus.shared.runtime.config import ModelSelection
from tests.conftest import small_student_artifacts
from tests.e2e.conftest import metric

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The prepared catalogue plus a student group (untrained: the policies are under test, not quality)."""
    return small_student_artifacts(tmp_path_factory.mktemp("defaults-artifacts"), best_k=1)


@pytest.fixture(scope="module")
def default_mesh(tmp_path_factory: pytest.TempPathFactory, artifacts: Path) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("defaults-run")
    state = up(MeshOptions(run_dir=run_dir, artifacts=artifacts, gateway_port=0, worker_threads=1,
                           env={"ACADEMUS_MODELS": "sentiment,sentiment-students", "ACADEMUS_GRACE_S": "10"}))
    yield state
    down(run_dir)


def status(mesh: MeshState, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", mesh.run_dir, "status", *args],
                          capture_output=True, text=True, timeout=60, check=True).stdout


def test_student_groups_are_served_by_student_and_every_other_model_by_concat(default_mesh, artifacts):
    catalogue = json.loads((artifacts / "models.json").read_text())
    students = {name for name, entry in catalogue.items() if entry.get("students")}
    assert students == {"sentiment-students", "sentiment-2l"}
    report = json.loads(status(default_mesh, "--json"))
    served = {d["policy"]: ModelSelection.parse(d["models"]) for d in report["deployments"]}
    assert served["student"].names == students   # concat: every model but them, those added later too
    assert all((name in served["concat"]) != (name in students) for name in [*catalogue, "added-later"])
    assert len([s for s in report["services"] if s["name"].startswith("scheduler")]) == 2
    shown = status(default_mesh)
    assert "policy student" in shown and "policy concat" in shown


def test_each_answer_names_the_policy_its_model_is_deployed_with(default_mesh, artifacts):
    key = (Path(default_mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    catalogue = json.loads((artifacts / "models.json").read_text())
    student_model, teacher_model = "sentiment-students", "sentiment"
    with Client(default_mesh.gateway, api_key=key) as client:
        teacher = client.infer(teacher_model, ["a warm, funny and moving film"])
        students = client.infer(student_model, ["a warm, funny and moving film"])
    assert teacher.metadata.policy == "concat"
    assert students.metadata.policy == "student"
    student_scheduler = next(s for s in default_mesh.services if s.name == "scheduler")   # the first deployment
    assert metric(student_scheduler.metrics_port, "academus_scheduler_student_number", model=student_model) >= 1
    assert teacher.predictions[0].label in catalogue[teacher_model]["labels"]
    assert students.predictions[0].label in catalogue[student_model]["labels"]
