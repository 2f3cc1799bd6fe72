"""One real, tiny `academus distill ablations` run (the real teacher and sentiment data, all five variants)
and the report rows it adds; the served student group is never written."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from academus.shared.training.ablations import VARIANTS, ablations_path, run_ablations
from academus.shared.training.distill_cli import main
from academus.shared.training.distill_data import QUICK
from academus.shared.training.distill_report import report
from academus.shared.training.student_artifacts import students_dir
from tests.unit.test_distill_e2e import _heads

TINY_RUN = replace(QUICK, boost_epochs=1.0, prune_epochs=0.5,
                   limits={"train": 300, "validation": 120, "test": 200})


@pytest.fixture(scope="module")
def ablation_run(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> tuple[Path, dict[str, Any]]:
    artifacts = _heads(tmp_path_factory.mktemp("artifacts"), dataset_dir)
    summary = run_ablations("sentiment", artifacts, dataset_dir, TINY_RUN, quick=True, full_test=False)
    return artifacts, summary


def test_every_variant_is_scored_on_the_same_test_split(ablation_run: tuple[Path, dict[str, Any]]) -> None:
    artifacts, summary = ablation_run
    assert set(summary["variants"]) == set(VARIANTS)
    assert summary["counts"]["test"] == 200
    for name, v in summary["variants"].items():
        assert len(v["test"]) == v["students"] and v["row"] == v["test"][v["k"] - 1], name
        assert 0.5 <= v["row"]["accuracy"] <= 1.0, name          # better than a coin, none degenerate
    variants = summary["variants"]
    assert variants["no-pruning"]["k"] == variants["no-pruning"]["students"]
    assert variants["bert-2l"]["students"] == 1
    assert variants["no-stacking"]["config"]["lam"] == 1.0            # the run's λ; the variant sets 0 itself
    assert all("dropped" in r or r["samples"] == 300 for r in variants["bagging"]["algorithm1"])
    assert not students_dir(artifacts, "sentiment").exists()          # the served group is untouched
    assert json.loads(ablations_path(artifacts, "sentiment", quick=True).read_text()) == summary
    assert not ablations_path(artifacts, "sentiment").exists()         # default runs are kept apart


def test_report_prints_the_ablation_rows(ablation_run: tuple[Path, dict[str, Any]],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    artifacts, _ = ablation_run
    out = report(artifacts)["sentiment"]
    assert out["status"] == "missing" and len(out["ablations"]["rows"]) == len(VARIANTS)
    printed = capsys.readouterr().out
    for label in ("BERT-2L", "w/o stacking", "bagging", "w/o pruning", "Student Parallelism (same run)"):
        assert label in printed
    assert json.loads((artifacts / "students" / "report.json").read_text())["sentiment"]["ablations"]


def test_bad_ablation_arguments_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with redirect_stdout(io.StringIO()):
        assert main(["ablations", "--task", "sentiment", "--only", "dropout", "--artifacts", str(tmp_path)]) == 1
        assert main(["ablations", "--task", "embedding", "--only", "bert-2l", "--artifacts", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unknown ablation(s) ['dropout']" in err and "bert-2l needs task labels" in err
    assert not (tmp_path / "students").exists()
