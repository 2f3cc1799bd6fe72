"""A worker serving a model from shards (STI) through its ModelRunner: planned for each batch's deadline, the
plan reported, budgets refused below the minimum and planned within when lowered, bad shards never served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.services.worker.sti import StiSettings
from academus.shared.models.model import mean_pool, pad_batch
from academus.shared.models.sti_planner import Pace
from academus.shared.models.work import Batch
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument, NotFound
from academus.shared.state.catalogue import write_entry
from tests.unit.test_shards import tiny_encoder, tiny_shard_artifact

IDS = [[1, 5, 9, 7, 2], [1, 3, 2]]


@pytest.fixture()
def artifacts(tmp_path: Path) -> Path:
    tiny_shard_artifact(tmp_path / "shards" / "tiny")
    write_entry(tmp_path, "toy-sti", {"kind": "classification", "labels": ["no", "yes"], "shards": "shards/tiny",
                                      "task": "toy"})
    return tmp_path


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(runner: ModelRunner, deadline: float | None = None, output: str = OUTPUT_PROBS):
    flat = [t for ids in IDS for t in ids]
    return runner.run(Batch("toy-sti", output, flat, [len(i) for i in IDS]), deadline=deadline)


def test_ample_time_runs_the_whole_model_at_full_precision(artifacts: Path) -> None:
    runner = ModelRunner(artifacts, [], sti_settings=StiSettings(io="file"))
    result = run(runner)
    assert (result.shards.layers, result.shards.width, result.shards.mean_bits) == (2, 4, 32)
    assert result.labels == ["no", "yes"] and result.values.shape == (2, 2)
    encoder = tiny_encoder()                  # the same seed: the weights the shards were cut from
    ids, mask, types = pad_batch(IDS)
    served = runner.models["toy-sti"].sti.model
    with torch.inference_mode():
        hidden = encoder.body(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        pooled = torch.nn.functional.normalize(mean_pool(hidden, mask), p=2, dim=1)
        expected = torch.softmax(served.heads[(2, 4)](pooled), dim=-1)
    torch.testing.assert_close(torch.from_numpy(result.values), expected, atol=1e-5, rtol=1e-5)


def test_the_remaining_deadline_is_the_target_and_too_little_is_refused_at_once(artifacts: Path) -> None:
    clock = Clock()
    runner = ModelRunner(artifacts, [], clock=clock)
    sti = runner.models["toy-sti"].sti
    plan = sti.plan_for(2, 5, clock.now + 2.0)
    assert plan.target_ms == pytest.approx(2000 * sti.settings.deadline_share)
    with pytest.raises(DeadlineExceeded, match=r"toy-sti: 0\.0 ms left for 2 text\(s\) of 5 tokens fits no submodel"):
        run(runner, deadline=clock.now + 1e-6)


def test_a_set_target_overrides_the_deadline(artifacts: Path) -> None:
    runner = ModelRunner(artifacts, [], sti_settings=StiSettings(target_ms=0.001))
    with pytest.raises(DeadlineExceeded, match="fits no submodel"):
        run(runner)


def test_a_run_behind_its_pace_is_answered_from_fewer_layers_and_says_so(artifacts: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A served batch the pace cuts short (here a pace whose bound is already spent) is answered, not failed: by
    the shallower shape's head, and its metadata gives the layers that ran."""
    runner = ModelRunner(artifacts, [], sti_settings=StiSettings(io="file"))
    sti = runner.models["toy-sti"].sti
    monkeypatch.setattr(sti.planner, "pace", lambda plan, length: Pace(0.0, 1.0, 0.0, frozenset({1, 2})))
    result = run(runner)
    assert (result.shards.layers, result.shards.width) == (1, 4)
    plan = sti.plan_for(2, 5, None)
    bank = {(k, s, b): sti.store.decode(k, s, b, sti.store.read_stored(k, s, b)) for (k, s), b in plan.bits.items()}
    ids, mask, types = pad_batch(IDS)
    expected = sti.model.run(ids, mask, sti.model.assemble_plan(plan.truncated(1), bank), types)
    torch.testing.assert_close(torch.from_numpy(result.values), expected, atol=1e-5, rtol=1e-5)


def test_budgets(artifacts: Path) -> None:
    runner = ModelRunner(artifacts, [])
    sti = runner.models["toy-sti"].sti
    minimum = sti.minimum_bytes()
    with pytest.raises(InvalidArgument, match=rf"a budget of 1000 bytes is below the {minimum} bytes its smallest "
                                              rf"plan needs \(\d+ resident, \d+ working buffer\)"):
        runner.set_shard_budget("toy-sti", 1000)
    generous = runner.set_shard_budget("toy-sti", minimum + (1 << 20))
    assert sti.pipeline.resident_bytes() > 0 and generous > sti.common_bytes
    held = runner.set_shard_budget("toy-sti", minimum)
    assert held == sti.fixed_bytes + sti.model.rows.held_bytes() and sti.pipeline.resident_bytes() == 0
    rows = sti.model.rows
    assert 0 < rows.held_bytes() <= rows.cache_bytes == sti.common_bytes - sti.fixed_bytes   # the runs' rows
    assert run(runner).shards.resident_bytes == sti.resident_bytes() <= sti.common_bytes
    with pytest.raises(NotFound, match="not served from shards"):
        runner.set_shard_budget("other", 0)


def test_embeddings_are_refused(artifacts: Path) -> None:
    runner = ModelRunner(artifacts, [])
    with pytest.raises(InvalidArgument, match="answers labels and scores, not embeddings"):
        run(runner, output=OUTPUT_EMBEDDING)


def test_a_shard_corrupted_after_loading_is_refused_not_served(artifacts: Path) -> None:
    runner = ModelRunner(artifacts, [])
    sti = runner.models["toy-sti"].sti
    entry = sti.store.entry(1, 0, 32)
    path = sti.store.directory / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidArgument, match=r"toy-sti cannot be served: .*layer1\.q32: shard 0 of layer 1"):
        run(runner)


def test_a_bad_artifact_is_refused_at_load_and_the_others_serve(artifacts: Path) -> None:
    resident = artifacts / "shards" / "tiny" / "resident.safetensors"
    data = bytearray(resident.read_bytes())
    data[-3] ^= 0xFF
    resident.write_bytes(bytes(data))
    write_entry(artifacts, "null", {"kind": "embedding", "null": True, "dim": 8})
    runner = ModelRunner(artifacts, [])
    assert set(runner.models) == {"null"}
    assert json.loads((artifacts / "models.json").read_text())["toy-sti"]["shards"] == "shards/tiny"
