"""`academus distill --model NAME --data F.jsonl`: students of a user's model distilled on the user's own examples
(the bundled MiniLM's files added as a user's model, a head trained on a file of real Rotten Tomatoes reviews),
and each bad combination refused by name."""

from __future__ import annotations

import io
from collections import Counter
from contextlib import redirect_stdout
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models.model import SequenceClassifierHead, pad_batch
from academus.shared.models.students import SEQUENCE
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import add_model
from academus.shared.models.work import Batch
from academus.shared.runtime.errors import InvalidArgument
from academus.shared.state.artifacts import read_manifest
from academus.shared.training.data import held_out_split, load_task
from academus.shared.training.distill import distill
from academus.shared.training.distill_cli import main
from academus.shared.training.distill_data import QUICK
from academus.shared.training.student_artifacts import load_student_group, students_dir
from academus.shared.training.user_heads import train_user_head
from tests.conftest import CriticStudents, write_reviews, write_texts
from tests.models import tiny_model_dir

REVIEWS = 300
CONFIG = replace(QUICK, max_students=2)


@pytest.fixture(scope="module")
def examples(dataset_dir: Path) -> list[tuple[str, str]]:
    """The first real reviews of the sentiment task's training split, as a user's labelled file holds them."""
    task = load_task("sentiment", dataset_dir)
    return [(e.text, task.labels[e.label]) for e in task.train[:REVIEWS]]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, examples: list[tuple[str, str]]) -> Path:
    """The bundled MiniLM's files added as the user's model `mini`, and the head `reviews` trained on it from the
    file."""
    root = tmp_path_factory.mktemp("distill-file")
    artifacts = root / "artifacts"
    add_model(artifacts, "mini", teacher_dir())
    train_user_head(artifacts, "mini", "reviews", data=write_reviews(root / "reviews.jsonl", examples),
                    data_dir=root / "data")
    return artifacts


def test_a_heads_students_learn_from_the_users_file(artifacts: Path, examples: list, tmp_path: Path) -> None:
    data = write_reviews(tmp_path / "reviews.jsonl", examples)
    summary = distill(None, artifacts, tmp_path / "data", CONFIG, quick=True, model="reviews", data_file=data)
    assert summary["served"] == ["reviews-2l", "reviews-students"]
    manifest = read_manifest(students_dir(artifacts, "reviews"))
    assert manifest.metrics["counts"] == dict(Counter(held_out_split(text) for text, _ in examples))
    assert manifest.extra["data"] == str(data) and manifest.labels == ["fresh", "rotten"]   # the head's: sorted
    best = summary["validation"][summary["best_k"] - 1]
    assert best["cosine"] >= summary["untrained_validation"]["cosine"] + 0.2   # moved towards the teacher
    group = load_student_group(artifacts, "reviews", teacher="reviews", task=manifest.task)
    assert group.labels == ["fresh", "rotten"] and group.max_students == 2
    ids = torch.tensor([[101, 2307, 3185, 102]])
    with torch.no_grad():
        assert group.head(group(ids, torch.ones_like(ids), None)).shape == (1, 2)


def test_an_embedding_models_students_learn_from_a_file_of_texts(artifacts: Path, examples: list,
                                                                 tmp_path: Path) -> None:
    texts = write_texts(tmp_path / "texts.jsonl", (text for text, _ in examples))
    summary = distill(None, artifacts, tmp_path / "data", CONFIG, quick=True, model="mini", data_file=texts)
    assert summary["served"] == ["mini-2l", "mini-students"] and summary["task"] == "embedding"
    assert read_manifest(students_dir(artifacts, "mini")).labels == []
    best = summary["validation"][summary["best_k"] - 1]
    assert best["cosine"] >= summary["untrained_validation"]["cosine"] + 0.2


@pytest.mark.parametrize("case, message", [
    ("labels", "labels ['meh'] are not the head's (fresh, rotten)"),
    ("no model", "--data distils a user's model on the file's examples: give --model"),
    ("task too", "and no --task"),
    ("few", "leave the"),
    ("bad line", "bad.jsonl:2: not valid JSON"),
])
def test_a_bad_file_or_combination_is_refused_by_name_and_writes_nothing(artifacts: Path, examples: list,
                                                                         tmp_path: Path, case: str,
                                                                         message: str) -> None:
    meh = [(t, "meh" if lab == "rotten" else lab) for t, lab in examples]
    files = {"labels": write_reviews(tmp_path / "meh.jsonl", meh),
             "few": write_reviews(tmp_path / "few.jsonl", [e for e in examples if e[1] == "fresh"][:2]
                                  + [e for e in examples if e[1] == "rotten"][:2]), "bad": tmp_path / "bad.jsonl"}
    files["bad"].write_text('{"text": "fine", "label": "fresh"}\n{"text": oops}\n')
    model, task, data = {"labels": ("reviews", None, files["labels"]), "no model": ("", "sentiment", files["few"]),
                         "task too": ("reviews", "sentiment", files["few"]), "few": ("reviews", None, files["few"]),
                         "bad line": ("reviews", None, files["bad"])}[case]
    before = sorted(p.name for p in artifacts.glob("students/*"))
    with pytest.raises(ValueError) as refused:
        distill(task, artifacts, tmp_path / "data", CONFIG, quick=True, model=model, data_file=data)
    assert message in str(refused.value)
    assert sorted(p.name for p in artifacts.glob("students/*")) == before


def test_a_head_trained_on_a_file_is_distilled_only_on_a_file(artifacts: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["--model", "reviews", "--quick", "--artifacts", str(artifacts), "--data-dir", str(tmp_path)])
    assert rc == 1
    assert "is a head trained on 'reviews', not on a bundled task: distil it on a file of its examples (--data" \
        in capsys.readouterr().err


def test_a_sequence_classifiers_students_carry_its_own_nonlinear_head(examples: list,
                                                                      critic_students: CriticStudents) -> None:
    """Students of a user's fine-tuned classifier (its pooler's dense + tanh, then its classifier; fitted on other
    reviews than the file's), distilled on its labelled file (`examples`), keep a copy of that head and move towards
    its representation; the worker serves them through it, whole on one worker."""
    artifacts, summary = critic_students
    assert summary["served"] == ["critic-2l", "critic-students"] and summary["task"] == "critic"
    manifest = read_manifest(students_dir(artifacts, "critic"))
    assert manifest.extra["head"] == SEQUENCE and manifest.labels == ["fresh", "rotten"]
    assert summary["teacher"]["test"]["accuracy"] >= 0.6, "the classifier the students learn from learned nothing"
    best = summary["validation"][summary["best_k"] - 1]
    assert best["cosine"] >= summary["untrained_validation"]["cosine"] + 0.2   # towards what its head reads

    group = load_student_group(artifacts, "critic", teacher="critic", task="critic")
    assert isinstance(group.head, SequenceClassifierHead) and group.head.pooler is not None
    runner = ModelRunner(artifacts, ["critic-students"], traced=False)
    texts = [text for text, _ in examples[:5]]
    encoded = TeacherTokenizer(teacher_dir()).encode(texts)
    ids, lengths = [i for e in encoded for i in e.input_ids], [len(e.input_ids) for e in encoded]
    served = runner.run(Batch("critic-students", OUTPUT_PROBS, ids, lengths)).values
    with torch.no_grad():
        padded = pad_batch([e.input_ids for e in encoded], [e.token_type_ids for e in encoded])
        expected = torch.softmax(group.head(group(*padded)), dim=-1).numpy()
    np.testing.assert_allclose(served, expected, atol=1e-5)
    with pytest.raises(InvalidArgument, match="nonlinear head: its students run whole on one worker"):
        runner.run(Batch("critic-students", OUTPUT_PROBS, ids, lengths, student_indices=(0,)))


def test_a_sequence_classifier_is_distilled_only_on_a_file(tmp_path: Path, examples: list) -> None:
    artifacts = tmp_path / "artifacts"
    tiny_model_dir("roberta", True, tmp_path / "tiny")
    add_model(artifacts, "tiny-critic", tmp_path / "tiny")
    with pytest.raises(ValueError, match="'tiny-critic' is a sequence classifier with labels of its own: distil it on"):
        distill(None, artifacts, tmp_path / "data", CONFIG, quick=True, model="tiny-critic")
