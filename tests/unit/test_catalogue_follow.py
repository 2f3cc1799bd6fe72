"""A worker serving the whole catalogue follows it (ModelRunner.refresh): added models load, removed ones drop,
one that cannot load is left out without stopping the others, and is tried again once its entry changes. Its
watch catches up with what changed between the build and the serving (a standby's worker)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from academus.services.worker.core import OUTPUT_EMBEDDING, ModelRunner
from academus.services.worker.server import Registration, WorkerServicer
from academus.shared.models.user_models import add_model, remove_model
from academus.shared.models.work import Batch
from academus.shared.runtime import config as cfg
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.catalogue import catalogue_stamp, read_catalogue, write_entry
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


async def test_a_watch_started_after_the_build_loads_what_was_added_in_between(artifacts: Path) -> None:
    """A standby builds its worker long before it serves: the watch, started once it serves, compares with the
    catalogue the runner read, not with the file as it is then."""
    runner = ModelRunner(artifacts, [], traced=False)
    assert runner.catalogue_stamp == catalogue_stamp(artifacts)
    write_entry(artifacts, "other", read_catalogue(artifacts_dir())["null"])   # after the build, before serving
    config = cfg.load(cfg.WorkerConfig, env={}, catalogue_poll_s=0.05)
    watch = asyncio.create_task(Registration(config, runner, "w", WorkerServicer(runner, "w")).follow_catalogue())
    try:
        for _ in range(200):
            if "other" in runner.models:
                break
            await asyncio.sleep(0.05)
    finally:
        watch.cancel()
    assert sorted(runner.models) == ["null", "other"]
    assert runner.catalogue_stamp == catalogue_stamp(artifacts)
