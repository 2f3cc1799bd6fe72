"""`academus shard adapt` end to end: the command ranks the bundled teacher's heads, trains it at every width on
a few texts and adds it to the catalogue as an embedding model whose config says its widths are in shard order;
the model loads as a user's model and, after two steps, is still the teacher's near enough. Bad input is refused
by name before anything is trained or written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.shards import ADAPTED_HEADS, WIDTH_ORDERED
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import open_model
from academus.shared.state.catalogue import read_catalogue
from academus.shared.training.shard_plans import main
from tests.conftest import artifacts_path

TEXTS = ["a quiet triumph of a film", "dull, long and loud", "win a free cruise now, reply today"]


@pytest.fixture(scope="module")
def adapted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    artifacts = tmp_path_factory.mktemp("adapt") / "artifacts"
    shutil.copytree(artifacts_path() / "heads", artifacts / "heads")
    run = subprocess.run([sys.executable, "-m", "academus.shared.cli", "shard", "adapt", "--artifacts", str(artifacts),
                          "--name", "minilm-wide", "--tasks", "sentiment", "--texts", "16", "--batch", "8"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return artifacts, json.loads(run.stdout.strip().splitlines()[-1])


def test_the_trained_teacher_is_added_as_an_embedding_model_in_shard_order(adapted: tuple[Path, dict]) -> None:
    artifacts, summary = adapted
    assert (summary["steps"], summary["widths"], summary["texts"]) == (2, [3, 6, 9, 12], {"sentiment": 16})
    assert all(sorted(order) == list(range(12)) for order in summary["head_order"]) and len(summary["head_order"]) == 6
    entry = read_catalogue(artifacts)["minilm-wide"]
    assert (entry["kind"], entry["pooling"], entry["normalize"], entry["layers"]) == ("embedding", "mean", True, 6)
    source = artifacts / entry["source"]
    config = json.loads((source / "config.json").read_text())
    assert (config[WIDTH_ORDERED], config[ADAPTED_HEADS]) == ([3, 6, 9, 12], ["sentiment"])
    encoder, head, _ = open_model(source)
    assert head is None
    ids, mask, types = pad_batch([list(e.input_ids) for e in TeacherTokenizer(teacher_dir()).encode(TEXTS)])
    with torch.inference_mode():
        adapted_out, teacher_out = encoder(ids, mask, types), TeacherEncoder.load()(ids, mask, types)
    cosine = (adapted_out * teacher_out).sum(1)
    assert (cosine > 0.98).all() and (cosine < 1 - 1e-6).any(), cosine


@pytest.mark.parametrize(("args", "message"), [
    (["--name", "minilm-wide"], "--name 'minilm-wide' is already in the catalogue"),
    (["--name", "Wide Model"], "--name 'Wide Model': a model name is 1-63 of a-z 0-9"),
    (["--name", "w2", "--model", "critic"], "--model 'critic': `shard adapt` trains the bundled teacher"),
    (["--name", "w2", "--epochs", "0"], "--epochs 0, --batch 32, --lr 5e-05 and --texts None must be positive"),
    (["--name", "w2", "--tasks", "sentiment,nope"], "unknown task 'nope'; known tasks: sentiment, spam"),
])
def test_bad_input_is_refused_by_name_before_anything_is_trained(adapted: tuple[Path, dict], args: list[str],
                                                                 message: str, capsys: pytest.CaptureFixture) -> None:
    artifacts, _ = adapted
    before = read_catalogue(artifacts)
    assert main(["adapt", "--artifacts", str(artifacts), *args]) == 1
    assert message in capsys.readouterr().err
    assert read_catalogue(artifacts) == before
    assert sorted(p.name for p in (artifacts / "models").iterdir()) == ["minilm-wide"]
