"""The worker's ModelRunner directly: outputs, deadlines checked between layers, bad batches."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from academus.services.worker.adapters import TenantBatch
from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, CallerLeft, ModelRunner, split_lengths
from academus.shared.models.packing import PackingPlan
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument, NotFound
from academus.shared.state.catalogue import ModelSpec
from academus.shared.training.prepare import write_catalogue
from tests.conftest import sample


class SteppingClock:
    """Advances one second per reading: lets a test expire a deadline mid forward pass."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    if not (artifacts_dir() / "models.json").exists():
        pytest.fail(f"no artifacts in {artifacts_dir()}: `make test` runs `academus prepare` first")
    return ModelRunner(artifacts_dir(), ["minilm", "spam"])


def flat(texts: list[str]) -> tuple[list[int], list[int]]:
    encoded = TeacherTokenizer(teacher_dir()).encode(texts)
    return [i for e in encoded for i in e.input_ids], [len(e.input_ids) for e in encoded]


def test_batch_equals_one_by_one(runner):
    ids, lengths = flat(["a short one", "a noticeably longer sentence with more tokens in it"])
    together = runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths)).values
    first = runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids[: lengths[0]], lengths[:1])).values
    assert together.shape == (2, 384)
    assert torch.allclose(torch.from_numpy(together[:1]), torch.from_numpy(first), atol=1e-5)


def test_probs_sum_to_one_with_labels(runner):
    ids, lengths = flat(["free money!!! click here", "see you at the standup"])
    result = runner.run(Batch("spam", OUTPUT_PROBS, ids, lengths))
    assert result.labels == ["ham", "spam"] and result.values.shape == (2, 2)
    assert abs(result.values.sum(1) - 1).max() < 1e-5
    assert result.real_tokens == sum(lengths) and result.padded_tokens == 2 * max(lengths)


def test_expired_deadline_is_not_computed(runner):
    ids, lengths = flat(["late"])
    runner.clock = lambda: 10.0
    try:
        with pytest.raises(DeadlineExceeded, match="before the batch started"):
            runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths), deadline=5.0)
    finally:
        runner.clock = time.monotonic


def test_deadline_passing_mid_forward_stops_between_layers(runner):
    ids, lengths = flat(["expires while the encoder runs"])
    runner.clock = SteppingClock()  # 1 s per reading: the check before the batch passes, layer 2 does not
    try:
        with pytest.raises(DeadlineExceeded, match=r"before body\.encoder\.layer\.1"):
            runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths), deadline=2.5)
    finally:
        runner.clock = time.monotonic
    assert runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths)).values.shape == (1, 384)


class LeavesAtSecondLayer(threading.Event):
    """Reads unset at the first layer and set from the second: the caller leaves mid forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.readings = 0

    def is_set(self) -> bool:
        self.readings += 1
        return self.readings > 1


@pytest.mark.parametrize("plan", [None, PackingPlan.concat([[0]], 64)], ids=["padded", "packed"])
def test_a_caller_that_leaves_stops_the_batch_between_layers(runner, plan):
    ids, lengths = flat(["the caller goes away while the encoder runs"])
    with pytest.raises(CallerLeft, match=r"before (body\.encoder\.layer\.1|layer 1);"):
        runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths, plan=plan), deadline=time.monotonic() + 60,
                   left=LeavesAtSecondLayer())
    stayed = threading.Event()
    assert runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths), left=stayed).values.shape == (1, 384)


def test_bad_batches_are_refused(runner):
    with pytest.raises(InvalidArgument, match="lengths sum to 5"):
        split_lengths([1, 2, 3], [5])
    with pytest.raises(NotFound):
        runner.run(Batch("sentiment", OUTPUT_PROBS, [101, 102], [2]))
    with pytest.raises(InvalidArgument, match="no labels"):
        runner.run(Batch("minilm", OUTPUT_PROBS, [101, 102], [2]))


def test_unknown_model_in_catalogue_names_the_commands_that_make_one(tmp_path):
    (tmp_path / "models.json").write_text("{}")
    with pytest.raises(NotFound, match=r"\['spam-students'\] are not in .*models.json: `academus prepare` makes the "
                                       r"bundled heads, `academus distill` student groups, `academus models add`"):
        ModelRunner(tmp_path, ["spam-students"])


def batch_observations(model: str) -> list[float]:
    """The batch size and padding ratio histograms' count and sum for `model`."""
    return [sample(f"academus_worker_{name}_{part}", model=model)
            for name in ("batch_size_texts", "padding_ratio") for part in ("count", "sum")]


def test_each_batch_observes_its_size_and_padding_ratio_padded_or_packed(runner):
    """One observation a batch: its texts, and the share of its computed token positions that held none."""
    ids, lengths = [101, 7, 8, 102, 101, 102, 101, 102], [4, 2, 2]   # padded: 3 x 4 positions, 4 of them padding
    before = batch_observations("minilm")
    runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths))
    runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths, plan=PackingPlan.concat([[0], [1, 2]], 8)))  # 2 rows
    with pytest.raises(InvalidArgument):
        runner.run(Batch("minilm", OUTPUT_PROBS, ids, lengths))   # refused: not a batch run
    after = batch_observations("minilm")
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 6, 2, pytest.approx(1 / 3)]


TEXTS = ["free money!!! click here", "see you at the standup", "ok",
         "a noticeably longer message about the quarterly report and the meeting agenda for next week"]


@pytest.mark.parametrize("attention", ["sdpa", "hf"])
def test_packed_batch_equals_the_padded_batch(runner, attention):
    ids, lengths = flat(TEXTS)
    plan = PackingPlan.concat([[3, 1], [0, 2]], 32)
    runner.attention = attention
    try:
        for model, output in (("spam", OUTPUT_PROBS), ("minilm", OUTPUT_EMBEDDING)):
            padded = runner.run(Batch(model, output, ids, lengths))
            packed = runner.run(Batch(model, output, ids, lengths, plan=plan))
            assert abs(packed.values - padded.values).max() <= 1e-4
            assert packed.labels == padded.labels and packed.real_tokens == sum(lengths)
            assert sum(lengths) <= packed.padded_tokens < padded.padded_tokens   # less padding than padded
    finally:
        runner.attention = "sdpa"


def test_packed_batch_stops_between_layers_when_its_deadline_passes(runner):
    ids, lengths = flat(TEXTS[:2])
    runner.clock = SteppingClock()
    try:
        with pytest.raises(DeadlineExceeded, match="before layer 1"):
            runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths, plan=PackingPlan.concat([[0, 1]], 64)),
                       deadline=2.5)
    finally:
        runner.clock = time.monotonic


def test_a_plan_that_misplaces_texts_is_refused(runner):
    ids, lengths = flat(TEXTS[:2])
    with pytest.raises(InvalidArgument, match="exactly once"):
        runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths, plan=PackingPlan.concat([[0]], 64)))
    with pytest.raises(InvalidArgument, match="over its size"):
        runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths, plan=PackingPlan.concat([[0, 1]], 8)))
    with pytest.raises(InvalidArgument, match="not a student group"):
        runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths, student_indices=(0,),
                         plan=PackingPlan.concat([[0, 1]], 64)))


@pytest.fixture(scope="module")
def null_runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """The catalogue `academus prepare` writes (no heads here: minilm and null), the null model alone, on a
    clock at 10 s for the deadline cases."""
    artifacts = tmp_path_factory.mktemp("artifacts")
    assert write_catalogue(artifacts)["null"] == {"kind": "embedding", "null": True, "dim": 384, "max_tokens": 256}
    return ModelRunner(artifacts, ["null"], clock=lambda: 10.0)


def test_the_null_model_answers_zeros_of_the_embeddings_shape_without_the_teacher(null_runner):
    result = null_runner.run(Batch("null", OUTPUT_EMBEDDING, [101, 7, 8, 102, 101, 102], [4, 2]))
    assert result.values.shape == (2, 384) and result.values.dtype == "float32" and not result.values.any()
    assert result.real_tokens == result.padded_tokens == 6 and result.labels == [] and result.student_count == 1
    assert 0 <= result.compute_ms < 50
    assert null_runner._teacher is None   # nothing was loaded to compute with
    assert null_runner.specs["null"] == ModelSpec("null", "embedding", [], 384, 256)


def test_the_null_model_answers_a_packing_plan_unpacked(null_runner):
    ids, lengths = [101, 7, 8, 102, 101, 102, 101, 9, 102], [4, 2, 3]
    result = null_runner.run(Batch("null", OUTPUT_EMBEDDING, ids, lengths, plan=PackingPlan.concat([[0, 2], [1]], 8)),
                             deadline=11.0)
    assert result.values.shape == (3, 384) and not result.values.any() and result.padded_tokens == 9


@pytest.mark.parametrize(("call", "error", "named"), [
    ({"lengths": [5]}, InvalidArgument, "tokens.lengths sum to 5 but tokens.input_ids has 3 ids"),
    ({"output": OUTPUT_PROBS}, InvalidArgument, "is an embedding model"),
    ({"student_indices": [0]}, InvalidArgument, "not a student group"),
    ({"plan": PackingPlan.concat([[0], [0]], 8)}, InvalidArgument, "packing: the plan must place every one"),
    ({"tenants": TenantBatch([None], [])}, InvalidArgument, "adapters set for 'null'"),
    ({"deadline": 5.0}, DeadlineExceeded, "deadline passed before the batch started"),
    ({"model": "minilm"}, NotFound, "not served by this worker"),
])
def test_the_null_model_refuses_what_a_model_refuses(null_runner, call, error, named):
    args = {"model": "null", "output": OUTPUT_EMBEDDING, "input_ids": [101, 7, 102], "lengths": [3]} | call
    run = {name: args.pop(name) for name in ("deadline", "tenants") if name in args}
    with pytest.raises(error, match=named):
        null_runner.run(Batch(**args), **run)


def test_the_null_model_stops_for_a_caller_that_left(null_runner):
    left = threading.Event()
    left.set()
    with pytest.raises(CallerLeft):
        null_runner.run(Batch("null", OUTPUT_EMBEDDING, [101, 102], [2]), left=left)
