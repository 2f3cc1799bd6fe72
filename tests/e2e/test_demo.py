"""`make demo`'s script, shortened: the teacher and its students side by side through the real mesh."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import small_student_artifacts

pytestmark = pytest.mark.e2e


def test_the_demo_compares_the_teacher_and_its_students_under_the_same_load(tmp_path):
    (tmp_path / "artifacts").mkdir()
    artifacts = small_student_artifacts(tmp_path / "artifacts", best_k=1)
    out = subprocess.run([sys.executable, "-m", "academus.loadgen.demo", "--artifacts", str(artifacts),
                          "--callers", "2", "--seconds", "1", "--rounds", "2", "--out", str(tmp_path / "out"),
                          "--run-dir", str(tmp_path / "mesh")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "deployment: policy student  models sentiment-2l,sentiment-students" in out.stdout
    assert "teacher (concat)" in out.stdout and "students (student)" in out.stdout
    assert "students / teacher: throughput" in out.stdout
    assert "academus-worker" in out.stdout   # the trace reaches the worker
    report = json.loads((tmp_path / "out" / "demo.json").read_text())
    for side in ("teacher", "students"):
        assert report[side]["completed"] > 0 and not report[side]["errors"]
    assert report["teacher"]["served_by"] == {"concat": report["teacher"]["completed"]}
    assert report["students"]["served_by"] == {"student": report["students"]["completed"]}
    assert (tmp_path / "out" / "demo-latency.png").stat().st_size > 0
    assert f"starting the mesh in {tmp_path / 'mesh'}" in out.stdout and (tmp_path / "mesh" / "logs").is_dir()
