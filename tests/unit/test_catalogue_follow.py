"""A worker serving the whole catalogue follows it (ModelRunner.refresh): added models load, removed ones drop,
one that cannot load is left out without stopping the others, and is tried again once its entry changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from academus.services.worker.core import OUTPUT_EMBEDDING, ModelRunner
from academus.shared.models.user_models import add_model, remove_model
from academus.shared.models.work import Batch
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.catalogue import read_catalogue, write_entry
from tests.models import tiny_model_dir


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    write_entry(tmp_path / "artifacts", "null", read_catalogue(artifacts_dir())["null"])
    return tmp_path / "artifacts"


def test_added_models_load_and_removed_ones_drop(artifacts: Path, tmp_path: Path) -> None:
    runner = ModelRunner(artifacts, [], traced=False)
    assert list(runner.models) == ["null"] and not runner.refresh()
    tiny_model_dir("roberta", False, tmp_path / "src")
    add_model(artifacts, "tiny", tmp_path / "src")
    assert runner.refresh() and sorted(runner.specs) == ["null", "tiny"]
    spec = runner.specs["tiny"]
    assert (spec.dim, spec.layers, spec.architecture) == (36, 3, "RobertaModel") and spec.memory_bytes > 0
    assert runner.run(Batch("tiny", OUTPUT_EMBEDDING, [101, 2009, 102], [3])).values.shape == (1, 36)
    remove_model(artifacts, "tiny")
    assert runner.refresh() and list(runner.models) == ["null"]


def test_a_model_that_cannot_load_is_left_out_and_retried_when_its_entry_changes(artifacts: Path,
                                                                                  tmp_path: Path) -> None:
    runner = ModelRunner(artifacts, [], traced=False)
    tiny_model_dir("bert", False, tmp_path / "src")
    add_model(artifacts, "tiny", tmp_path / "src")
    (artifacts / "models" / "tiny" / "model.safetensors").write_bytes(b"corrupt")   # fails its checksum
    write_entry(artifacts, "other", read_catalogue(artifacts_dir())["null"])
    assert runner.refresh() and sorted(runner.models) == ["null", "other"]
    assert not runner.refresh()                      # unchanged: not tried again
    remove_model(artifacts, "tiny")
    add_model(artifacts, "tiny", tmp_path / "src")  # the same model again, whole: tried, and it loads
    assert runner.refresh() and "tiny" in runner.models


def test_a_runner_given_its_models_does_not_follow(artifacts: Path, tmp_path: Path) -> None:
    runner = ModelRunner(artifacts, ["null"], traced=False)
    tiny_model_dir("mpnet", False, tmp_path / "src")
    add_model(artifacts, "tiny", tmp_path / "src")
    assert not runner.refresh() and list(runner.models) == ["null"]
