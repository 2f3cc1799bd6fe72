"""Exit ramps (Apparate) on a user's classifiers: a sequence classifier added with `models add` (a tiny BERT, its own
nonlinear head on the first token) and a head trained on a user's MPNet. `ramps train --model` fits a ramp after
each of the model's own layers on the user's texts; the worker loads them with the model and releases each text at
a ramp with the probabilities the ramp gives in process, padded and packed alike, the final answer unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models.exits import NONE, STATIC, ControllerSettings
from academus.shared.models.model import FIRST, MEAN
from academus.shared.models.packing import PackingPlan
from academus.shared.models.ramps import load_ramps, ramps_dir, save_ramps
from academus.shared.models.user_models import add_model
from academus.shared.models.work import Batch
from academus.shared.state.artifacts import read_manifest
from academus.shared.training.data import load_task
from academus.shared.training.ramps import Subject, layer_states, main, train_ramps
from academus.shared.training.user_heads import train_user_head
from tests.conftest import write_reviews
from tests.models import LABELS, SHAPE, tiny_model_dir

TEXTS = ["the film was a quiet triumph", "dull, long and loud", "a cast that never once finds its footing",
         "worth the ticket", "great film, lovely cast"]


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    task = load_task("sentiment")
    return write_reviews(tmp_path_factory.mktemp("texts") / "reviews.jsonl",
                         [(e.text, task.labels[e.label]) for e in task.train[:240]])


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, texts_file: Path) -> Path:
    """A tiny BERT sequence classifier `tiny-cls`, and a head `tiny-head` trained on a tiny MPNet `tiny-enc`, with
    ramps trained on both (--quick, on the reviews' texts)."""
    root = tmp_path_factory.mktemp("user-ramps")
    artifacts = root / "artifacts"
    tiny_model_dir("bert", True, root / "cls", seed=6)
    tiny_model_dir("mpnet", False, root / "enc", seed=7)
    add_model(artifacts, "tiny-cls", root / "cls")
    add_model(artifacts, "tiny-enc", root / "enc")
    train_user_head(artifacts, "tiny-enc", "tiny-head", data=texts_file, data_dir=root / "data")
    for model in ("tiny-cls", "tiny-head"):
        train_ramps(artifacts, model=model, data_file=texts_file, quick=True)
    return artifacts


def release_everything_at_the_first_ramp(artifacts: Path, model: str) -> None:
    """The ramps' bootstrap thresholds set to 0: every text leaves at the first ramp (the mechanics under test)."""
    directory = ramps_dir(artifacts, model)
    manifest = read_manifest(directory)
    ramps, _ = load_ramps(directory, SHAPE["hidden_size"], manifest.labels)
    tuned = {**manifest.extra["tuned_once"], "static": {str(k): 0.0 for k in ramps.layers}}
    save_ramps(directory, ramps, teacher=manifest.teacher, task=manifest.task, metrics=manifest.metrics,
               extra={**manifest.extra, "tuned_once": tuned})


def test_ramps_are_fitted_after_each_of_the_models_own_layers(artifacts: Path, texts_file: Path) -> None:
    for model, teacher, labels in (("tiny-cls", "tiny-cls", LABELS), ("tiny-head", "tiny-enc", ["fresh", "rotten"])):
        manifest = read_manifest(ramps_dir(artifacts, model))
        assert (manifest.task, manifest.teacher, manifest.extra["layers"]) == (model, teacher, [1, 2])
        assert sorted(manifest.labels) == sorted(labels) and set(manifest.metrics["agreement"]) == {"1", "2"}
    cls, head = (read_manifest(ramps_dir(artifacts, m)).extra for m in ("tiny-cls", "tiny-head"))
    assert (cls["pooling"], cls["normalize"]) == (FIRST, False)   # as the classifier reads its first token
    assert (head["pooling"], head["normalize"]) == (MEAN, True)    # as the embedding model pools


@pytest.mark.parametrize("model", ["tiny-cls", "tiny-head"])
def test_the_worker_releases_what_the_ramps_give_in_process(artifacts: Path, model: str) -> None:
    release_everything_at_the_first_ramp(artifacts, model)
    runner = ModelRunner(artifacts, [model], exit_settings=ControllerSettings(policy=STATIC), traced=False)
    assert runner.models[model].exits is not None
    subject = Subject.user(artifacts, model)
    encoded = subject.tokenizer.encode(TEXTS)
    ids, lengths = [i for e in encoded for i in e.input_ids], [len(e.input_ids) for e in encoded]
    ramps = runner.models[model].exits.ramps
    with torch.no_grad():
        expected = ramps.probs(1, layer_states(subject.encoder, subject.tokenizer, TEXTS, ramps)[:, 1]).numpy()
    plain = runner.run(Batch(model, OUTPUT_PROBS, ids, lengths)).values
    for plan in (None, PackingPlan.concat([[0, 1], [2, 3, 4]], 64)):
        events: list[tuple] = []
        result = runner.run(Batch(model, OUTPUT_PROBS, ids, lengths, plan=plan),
                            release=lambda rows, layer, probs, events=events: events.append((rows, layer, probs)))
        released = {row: (layer, probs[i]) for rows, layer, probs in events for i, row in enumerate(rows)}
        assert sorted(released) == list(range(len(TEXTS))) and {layer for layer, _ in released.values()} == {1}
        np.testing.assert_allclose(np.stack([released[i][1] for i in range(len(TEXTS))]), expected, atol=1e-5)
        np.testing.assert_allclose(result.values, plain, atol=1e-5)


def test_a_model_runs_ramps_while_some_are_active(artifacts: Path) -> None:
    """What a saturated worker counts as stood down: a batch that would have run ramps."""
    for policy, runs in ((STATIC, True), (NONE, False)):
        runner = ModelRunner(artifacts, ["tiny-cls"], exit_settings=ControllerSettings(policy=policy), traced=False)
        assert runner.runs_ramps("tiny-cls") is runs and not runner.runs_ramps("unknown")
    assert not ModelRunner(artifacts, ["tiny-cls"], traced=False).runs_ramps("tiny-cls")   # no exit settings: none


def test_what_has_no_ramps_of_its_own_is_refused_by_name(artifacts: Path, texts_file: Path, capsys) -> None:
    with pytest.raises(ValueError, match="--model 'tiny-enc' is neither a head trained on a user's model"):
        train_ramps(artifacts, model="tiny-enc", data_file=texts_file)
    with pytest.raises(ValueError, match="--model 'tiny-cls' has no bundled task of its own: give its texts"):
        train_ramps(artifacts, model="tiny-cls")
    with pytest.raises(ValueError, match="--data gives a user's model its texts: give --model too"):
        train_ramps(artifacts, task="sentiment", data_file=texts_file)
    assert main(["train", "--artifacts", str(artifacts)]) == 2
    assert "give --task (a bundled task's classifier) or --model (a user's)" in capsys.readouterr().err


def test_the_saving_probe_tunes_in_hindsight_within_the_constraint(artifacts: Path, texts_file: Path, capsys) -> None:
    """`probes.ramp_saving`: thresholds tuned on the given texts keep 99 % agreement with the model, and the saving
    it reports is the texts released at each ramp times that ramp's saving from the artifact."""
    from academus.loadgen.probes.ramp_saving import main as ramp_saving

    assert ramp_saving(["--artifacts", str(artifacts), "--model", "tiny-cls", "--texts", str(texts_file)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saving = read_manifest(ramps_dir(artifacts, "tiny-cls")).extra["saving"]
    assert out["texts"] == 240 and set(out["ramp_agreement"]) == set(out["released"]) == {"1", "2"}
    assert out["agreement"] >= 0.99 and sum(out["released"].values()) <= 1
    assert out["saving"] == pytest.approx(sum(r * saving[k] for k, r in out["released"].items()), abs=1e-3)


def test_the_replay_bench_takes_a_users_classifier_on_its_texts(artifacts: Path, texts_file: Path, capsys) -> None:
    """`exits_bench --model --texts`: every arm replays the file's texts through the classifier's own ramps; vanilla
    is the unit, and the oracle releases exactly the texts on which some ramp agrees with the model's answer."""
    from academus.loadgen.exits_bench import ARMS
    from academus.loadgen.exits_bench import main as exits_bench
    from academus.shared.state.uploads import parse_texts_jsonl

    argv = ["--artifacts", str(artifacts), "--rounds", "1", "--texts", str(texts_file)]
    assert exits_bench([*argv, "--model", "tiny-cls"]) == 0
    arms = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tasks"]["tiny-cls"]
    assert arms["texts"] == 240 and set(ARMS) <= set(arms)
    assert arms["vanilla"]["first_p50_ratio"] == 1.0 and arms["oracle"]["agreement"] == 1.0
    subject = Subject.user(artifacts, "tiny-cls")
    ramps, _ = load_ramps(ramps_dir(artifacts, "tiny-cls"), SHAPE["hidden_size"], list(subject.head.labels))
    texts = parse_texts_jsonl(texts_file.read_bytes(), str(texts_file))
    states = layer_states(subject.encoder, subject.tokenizer, texts, ramps)
    with torch.no_grad():
        final = subject.head(states[:, -1]).argmax(1).numpy()
        agree = np.stack([ramps.probs(k, states[:, k]).argmax(1).numpy() == final for k in ramps.layers], axis=1)
    assert arms["oracle"]["exit_rate"] == pytest.approx(agree.any(axis=1).mean(), abs=1e-4)
    refused = {"neither a head trained on a user's model": [*argv, "--model", "tiny-enc"],
               "--model and --texts go together": ["--artifacts", str(artifacts), "--model", "tiny-cls"],
               "none.jsonl": [*argv[:4], "--texts", str(texts_file.with_name("none.jsonl")), "--model", "tiny-cls"]}
    for message, wrong in refused.items():
        with pytest.raises(SystemExit):
            exits_bench(wrong)
        assert message in capsys.readouterr().err
