"""Exit ramps in the worker's forward, with the real teacher and the spam head: padded and packed batches release
the same texts at the same layers with the same probabilities, the final answer is unchanged, the controller
gets its feedback and measured costs; malformed ramps artifacts are refused naming the file; the scheduler
splits a merged batch's early answer to the requests it came from."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from academus.services.scheduler.core import Job
from academus.services.scheduler.sender import deliver_partial
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.services.worker.exits import ExitRun, ModelExits, load_exits
from academus.shared.models.exits import (
    DEEBERT,
    STATIC,
    WARM_UP_BATCHES,
    ControllerSettings,
    Evidence,
    controller_for,
    ramp_signal,
    softmax,
)
from academus.shared.models.model import HIDDEN_SIZE
from academus.shared.models.packing import PackingPlan
from academus.shared.models.ramps import ExitRamps, load_ramps, ramps_dir, save_ramps
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch, BatchOutput
from academus.shared.state.artifacts import ArtifactError
from academus.shared.state.catalogue import read_catalogue, write_entry
from tests.conftest import artifacts_path

TEXTS = ["Congratulations! You have won a free cruise, click here to claim it now",
         "Hi Bob, the meeting moved to 3pm; the agenda is attached", "cheap meds online, no prescription needed",
         "Can you send me the slides from yesterday?", "URGENT: your account is suspended, verify your password"]
LABELS = ["ham", "spam"]


def write_ramps(artifacts: Path, thresholds: dict[int, float], seed: int = 0) -> Path:
    """Ramps after layers 1-5 with seeded random heads (large enough weights to be confident somewhere)."""
    torch.manual_seed(seed)
    ramps = ExitRamps(range(1, 6), HIDDEN_SIZE, LABELS)
    for head in ramps.heads.values():
        torch.nn.init.normal_(head.weight, std=3.0)
    directory = ramps_dir(artifacts, "spam")
    save_ramps(directory, ramps, teacher="test", task="spam", metrics={}, extra={
        "cost": {str(k): 0.002 for k in range(1, 6)}, "saving": {str(k): 1 - k / 6 for k in range(1, 6)},
        "tuned_once": {"static": {str(k): t for k, t in thresholds.items()}, "deebert_entropy": 0.1}})
    return directory


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("artifacts")
    write_entry(root, "spam", read_catalogue(artifacts_path())["spam"])
    shutil.copytree(artifacts_path() / "heads" / "spam", root / "heads" / "spam")
    write_ramps(root, {k: 0.8 for k in range(1, 6)})
    return root


@pytest.fixture(scope="module")
def runner(artifacts: Path) -> ModelRunner:
    torch.set_num_threads(1)
    return ModelRunner(artifacts, ["spam"], exit_settings=ControllerSettings(policy=STATIC), traced=False)


def tokens() -> tuple[list[int], list[int]]:
    encoded = TeacherTokenizer(teacher_dir()).encode(TEXTS)
    return [i for e in encoded for i in e.input_ids], [len(e.input_ids) for e in encoded]


def released_by(runner: ModelRunner, plan: PackingPlan | None = None):
    events: list[tuple[list[int], int, np.ndarray]] = []
    ids, lengths = tokens()
    result = runner.run(Batch("spam", OUTPUT_PROBS, ids, lengths, plan=plan),
                        release=lambda rows, layer, probs: events.append((rows, layer, probs)))
    return events, result


def test_padded_and_packed_batches_release_alike_and_answer_exactly(runner: ModelRunner) -> None:
    padded, padded_result = released_by(runner)
    packed, packed_result = released_by(runner, PackingPlan.concat([[0, 1], [2, 3, 4]], 128))
    assert padded, "the thresholds release no text: the comparison would be empty"
    by_text = {row: (layer, probs[i]) for rows, layer, probs in padded for i, row in enumerate(rows)}
    assert sorted(by_text) == sorted({row for rows, _, _ in packed for row in rows})
    for rows, layer, probs in packed:
        for i, row in enumerate(rows):
            assert by_text[row][0] == layer
            np.testing.assert_allclose(probs[i], by_text[row][1], atol=1e-5)
    ids, lengths = tokens()
    plain = runner.run(Batch("spam", OUTPUT_PROBS, ids, lengths))   # no release: no ramps run
    np.testing.assert_allclose(padded_result.values, plain.values, atol=1e-6)
    np.testing.assert_allclose(packed_result.values, plain.values, atol=1e-5)


def test_each_text_is_released_once_at_its_first_confident_ramp(runner: ModelRunner) -> None:
    events, _ = released_by(runner)
    rows = [row for rows, _, _ in events for row in rows]
    assert len(rows) == len(set(rows))
    layers = [layer for _, layer, _ in events]
    assert layers == sorted(layers)
    for _, _, probs in events:
        assert (probs.max(1) > 0.8).all()


def test_the_controller_gets_feedback_and_measured_costs(artifacts: Path) -> None:
    runner = ModelRunner(artifacts, ["spam"], exit_settings=ControllerSettings(), traced=False)
    controller = runner.models["spam"].exits.controller
    for batch in range(WARM_UP_BATCHES + 1):   # the first batches' times are the device's set-up, left out
        released_by(runner)
        assert controller.seen == batch * len(TEXTS)    # the compute thread only queued the batch's feedback
        assert controller.drain() == 1
        assert controller.seen == (batch + 1) * len(TEXTS)
        assert len(controller.window.conf) == (batch + 1) * len(TEXTS)
        measured = [cost != 0.002 for layer, cost in controller.cost.items() if layer in controller.active.layers]
        assert measured and (all(measured) if batch == WARM_UP_BATCHES else not any(measured))


def test_an_embedding_output_or_no_release_runs_no_ramp(runner: ModelRunner) -> None:
    ids, lengths = tokens()
    events: list = []
    runner.run(Batch("spam", "embedding", ids, lengths), release=lambda *a: events.append(a))
    assert events == []


def test_malformed_ramps_are_refused_naming_the_file(tmp_path: Path) -> None:
    directory = write_ramps(tmp_path, {1: 0.9})
    with pytest.raises(ArtifactError, match="labels"):
        load_ramps(directory, HIDDEN_SIZE, ["no", "yes", "maybe"])
    with pytest.raises(ArtifactError, match=r"weights\.safetensors"):
        load_ramps(directory, 768, LABELS)
    manifest = directory / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "extra": {}}))
    with pytest.raises(ArtifactError, match=r"manifest\.json"):
        load_ramps(directory, HIDDEN_SIZE, LABELS)
    weights = directory / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ArtifactError, match=r"weights\.safetensors"):
        load_ramps(directory, HIDDEN_SIZE, LABELS)
    assert load_exits(tmp_path, "spam", HIDDEN_SIZE, LABELS, torch.device("cpu"), ControllerSettings(), "spam") \
        is None
    assert load_exits(tmp_path, "sentiment", HIDDEN_SIZE, LABELS, torch.device("cpu"), ControllerSettings(),
                      "sentiment") is None   # no ramps at all: no early exits, no error


def test_the_scheduler_splits_an_early_answer_to_its_requests() -> None:
    loop = asyncio.new_event_loop()
    got: dict[str, list] = {"a": [], "c": []}
    jobs = [Job("spam", None, n, 0, 0.0, 0.0, future=loop.create_future(),
                on_partial=(lambda out, name=name: got[name].append(out)) if name in got else None)
            for name, n in (("a", 2), ("b", 1), ("c", 3))]
    values = np.array([[0.1, 0.9], [0.2, 0.8], [0.3, 0.7]], dtype=np.float32)   # rows 1, 2 and 5 of the batch
    deliver_partial(BatchOutput(values, LABELS, rows=(1, 2, 5), exit_layer=3), jobs)
    (a,), (c,) = got["a"], got["c"]
    assert a.rows == (1,) and a.values.ravel().tolist() == pytest.approx([0.1, 0.9]) and a.exit_layer == 3
    assert c.rows == (2,) and c.values.ravel().tolist() == pytest.approx([0.3, 0.7])   # row 5 is c's third
    loop.close()


def test_a_batch_run_again_sends_no_text_early_twice() -> None:
    """A worker lost mid-batch: the job runs again elsewhere, and that run's ramps release its texts again. Each
    text goes to the gateway once, its first release; a text not released before still goes."""
    loop = asyncio.new_event_loop()
    got: list = []
    job = Job("spam", None, 3, 0, 0.0, 0.0, future=loop.create_future(), on_partial=got.append)
    deliver_partial(BatchOutput(np.array([[0.1, 0.9]], np.float32), LABELS, rows=(0,), exit_layer=2), [job])
    again = np.array([[0.6, 0.4], [0.7, 0.3], [0.8, 0.2]], np.float32)
    deliver_partial(BatchOutput(again, LABELS, rows=(0, 1, 2), exit_layer=4), [job])
    deliver_partial(BatchOutput(again[:2], LABELS, rows=(1, 2), exit_layer=5), [job])
    assert [(o.rows, o.exit_layer) for o in got] == [((0,), 2), ((1, 2), 4)]
    np.testing.assert_array_equal(got[1].values, again[1:])
    loop.close()


def test_the_ramps_evidence_starts_an_adaptive_workers_window(tmp_path: Path) -> None:
    """`save_ramps` stores the evidence with the heads; a worker's adaptive controller starts its window with it
    (a baseline's stays empty); evidence of another width is refused naming the weights file."""
    rng = np.random.default_rng(0)
    evidence = Evidence(rng.uniform(0.5, 1.0, (40, 5)).astype(np.float32), rng.uniform(size=(40, 5)) < 0.9)
    torch.manual_seed(0)
    ramps = ExitRamps(range(1, 6), HIDDEN_SIZE, LABELS)
    directory = ramps_dir(tmp_path, "spam")
    extra = {"cost": {str(k): 0.002 for k in range(1, 6)}, "saving": {str(k): 1 - k / 6 for k in range(1, 6)},
             "tuned_once": {"static": {"1": 0.9}, "deebert_entropy": 0.1}}
    save_ramps(directory, ramps, teacher="test", task="spam", metrics={}, extra=extra, evidence=evidence)
    loaded, _ = load_ramps(directory, HIDDEN_SIZE, LABELS)
    assert loaded.evidence is not None
    np.testing.assert_array_equal(loaded.evidence.conf, evidence.conf)
    np.testing.assert_array_equal(loaded.evidence.agree, evidence.agree)
    exits = load_exits(tmp_path, "spam", HIDDEN_SIZE, LABELS, torch.device("cpu"), ControllerSettings(), "spam")
    assert exits is not None
    np.testing.assert_array_equal(np.array(exits.controller.window.conf), evidence.conf)
    assert exits.controller.seen == 0   # the evidence is no served text
    static = load_exits(tmp_path, "spam", HIDDEN_SIZE, LABELS, torch.device("cpu"),
                        ControllerSettings(policy=STATIC), "spam")
    assert static is not None and not static.controller.window.conf
    save_ramps(directory, ramps, teacher="test", task="spam", metrics={}, extra=extra,
               evidence=Evidence(evidence.conf[:, :3], evidence.agree[:, :3]))
    with pytest.raises(ArtifactError, match=r"weights\.safetensors: evidence"):
        load_ramps(directory, HIDDEN_SIZE, LABELS)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_served_ramp_decides_on_what_the_trained_head_computes(normalize: bool) -> None:
    """The worker's host head (NumPy, the L2 normalisation folded into the logits) gives the trained torch head's
    logits; an ExitRun records the confidence, prediction and entropy `ramp_signal` gives for its probabilities,
    and releases those probabilities, for every text and for a packed batch's subset of rows."""
    torch.manual_seed(1)
    ramps = ExitRamps(range(1, 4), HIDDEN_SIZE, LABELS, normalize=normalize)
    for head in ramps.heads.values():
        torch.nn.init.normal_(head.weight, std=3.0 if normalize else 0.2)
    pooled = torch.randn(6, HIDDEN_SIZE) * torch.tensor([0.5, 1, 2, 4, 8, 16])[:, None]
    with torch.inference_mode():
        reference = {k: torch.softmax(ramps.heads[str(k)](ramps.finish(pooled)), -1).numpy() for k in ramps.layers}
        for k in ramps.layers:   # a padded batch pools on the host (NumPy), a packed one in torch
            np.testing.assert_allclose(softmax(ramps.host_logits(k, pooled)), reference[k], atol=1e-5)
            np.testing.assert_allclose(softmax(ramps.host_logits(k, pooled.numpy())), reference[k], atol=1e-5)
        for rows in (None, np.array([1, 4, 5])):
            at = slice(None) if rows is None else rows
            controller = controller_for(ramps.layers, {"cost": {str(k): 0.001 for k in ramps.layers},
                                                       "saving": {str(k): 0.5 for k in ramps.layers},
                                                       "tuned_once": {"deebert_entropy": 0.3}},
                                        ControllerSettings(policy=DEEBERT))
            released: list[tuple[list[int], int, np.ndarray]] = []
            run = ExitRun(ModelExits(ramps, controller), 6, lambda r, k, p, out=released: out.append((r, k, p)))
            states = pooled[at]
            for k in ramps.layers:
                run.at_layer(k, lambda states=states: states, rows)
            for j, k in enumerate(ramps.layers):
                conf, preds, entropy = ramp_signal(reference[k][at])
                np.testing.assert_allclose(run.conf[at, j], conf, atol=1e-5)
                np.testing.assert_array_equal(run.preds[at, j], preds)
                np.testing.assert_allclose(run.entropy[at, j], entropy, atol=1e-4)
            assert released, "no ramp was confident: nothing released to compare"
            for released_rows, k, probs in released:
                np.testing.assert_allclose(probs, reference[k][released_rows], atol=1e-5)
                assert (run.exit_at[released_rows] == ramps.layers.index(k)).all()


def test_deferred_ramps_release_in_turn_when_settled_as_they_would_at_once() -> None:
    """On a GPU a ramp's step is queued behind its layer and decided after the forward is queued (`settle`),
    so the device never waits for the host. Deferred, nothing is released before `settle`; then the ramps decide
    in their order, with the confidences and releases of a run that decides at once, and each ramp's cost is
    charged to it."""
    torch.manual_seed(2)
    ramps = ExitRamps([1, 2, 4], HIDDEN_SIZE, LABELS)
    for head in ramps.heads.values():
        torch.nn.init.normal_(head.weight, std=3.0)
    extra = {"cost": {str(k): 0.001 for k in ramps.layers}, "saving": {str(k): 0.5 for k in ramps.layers},
             "tuned_once": {"deebert_entropy": 0.3}}
    controller = controller_for(ramps.layers, extra, ControllerSettings(policy=DEEBERT))
    states = {k: torch.randn(8, HIDDEN_SIZE) * torch.linspace(0.5, 16, 8)[:, None] for k in ramps.layers}
    runs, released = {}, {}
    for deferred in (False, True):
        out: list[tuple[list[int], int, np.ndarray]] = released.setdefault(deferred, [])
        run = runs[deferred] = ExitRun(ModelExits(ramps, controller), 8, lambda r, k, p, out=out: out.append((r, k, p)),
                                       deferred=deferred)
        with torch.inference_mode():
            for k in (1, 2, 3, 4):
                run.at_layer(k, lambda k=k: states[k])
        if deferred:
            assert not out and len(run.pending) == 3, "a deferred ramp released before the forward was queued"
            run.settle()
            assert not run.pending
    assert released[False], "no ramp was confident: nothing to compare"
    assert [(r, k) for r, k, _ in released[True]] == [(r, k) for r, k, _ in released[False]]
    for (_, _, a), (_, _, b) in zip(released[True], released[False], strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_array_equal(runs[True].exit_at, runs[False].exit_at)
    np.testing.assert_allclose(runs[True].conf, runs[False].conf, atol=1e-6)
    assert (runs[True].spent > 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ramps_deferred_on_a_gpu_release_what_they_release_on_the_host() -> None:
    """On a GPU the ramps' logits come back through pinned memory, timed by device events: the same releases as
    a run on the host, and a positive device time charged to each ramp."""
    torch.manual_seed(3)
    ramps = ExitRamps([1, 2], HIDDEN_SIZE, LABELS)
    for head in ramps.heads.values():
        torch.nn.init.normal_(head.weight, std=3.0)
    extra = {"cost": {"1": 0.001, "2": 0.001}, "saving": {"1": 0.5, "2": 0.3}, "tuned_once": {"deebert_entropy": 0.3}}
    states = {k: torch.randn(8, HIDDEN_SIZE) * torch.linspace(0.5, 16, 8)[:, None] for k in ramps.layers}
    runs, released = {}, {}
    for device in ("cpu", "cuda"):
        placed = ExitRamps([1, 2], HIDDEN_SIZE, LABELS)
        placed.load_state_dict(ramps.state_dict())
        placed.to(device)
        controller = controller_for(placed.layers, extra, ControllerSettings(policy=DEEBERT))
        out: list[tuple[list[int], int, np.ndarray]] = released.setdefault(device, [])
        run = runs[device] = ExitRun(ModelExits(placed, controller), 8,
                                     lambda r, k, p, out=out: out.append((r, k, p)), deferred=device == "cuda")
        with torch.inference_mode():
            for k in placed.layers:
                run.at_layer(k, lambda k=k, device=device: states[k].to(device))
            run.settle()
    assert released["cpu"], "no ramp was confident: nothing to compare"
    assert [(r, k) for r, k, _ in released["cuda"]] == [(r, k) for r, k, _ in released["cpu"]]
    np.testing.assert_allclose(runs["cuda"].conf, runs["cpu"].conf, atol=1e-4)
    assert (runs["cuda"].spent > 0).all()
