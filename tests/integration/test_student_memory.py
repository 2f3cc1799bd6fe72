"""A student group held within a memory budget: its students cut into shards (`academus shard build --model
sentiment-students`), a worker holding only some, a student it lacks served from shards at once and then held
at full precision; placement, eviction, a budget too small and a corrupted shard. Real artifacts (the teacher's
bottom layers as untrained students) and the real dev split."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.services.worker.student_memory import LOADS, STREAMED, StudentMemory
from academus.services.worker.traced import TracedLayer
from academus.shared.models.model import pad_batch
from academus.shared.models.shard_io import FileSource
from academus.shared.models.shard_store import layer_file
from academus.shared.models.student_shards import STUDENT_SHARDS, ElasticStudent, open_student_shards
from academus.shared.models.work import Batch
from academus.shared.runtime.errors import InvalidArgument
from academus.shared.state.artifacts import ArtifactError
from academus.shared.state.catalogue import read_catalogue
from academus.shared.state.groups import groups_from_json, groups_to_json, placed_on
from academus.shared.training.student_artifacts import (
    load_student,
    load_student_group,
    load_student_shell,
    write_student_group,
)
from academus.shared.training.student_shards import build_students
from tests.conftest import small_student_artifacts
from tests.integration.test_student_serving import tokens

MODEL = "sentiment-students"
TEXTS = ["a warm, funny film", "a dull mess", "the cast makes every scene feel new"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    root = small_student_artifacts(tmp_path_factory.mktemp("held-students"), best_k=2)
    summary = build_students(root, MODEL, quick=True)
    assert summary["students"] == 2 and summary["student_layers"] == 2 and summary["geometry"]["layers"] == 4
    assert summary["dev_texts"] == 48
    full, floor = summary["full"], summary["min_bits"]
    for bits, students in summary["each_student_at"].items():   # measured from 6 bits down, until one fails
        assert len(students) == 2
        kept = all(full[key] - s[key] <= 0.01 for s in students for key in ("accuracy", "teacher_agreement"))
        assert kept == (int(bits) >= floor), (bits, floor, students)
    assert int(summary["student_bytes"]["2"]) < int(summary["student_bytes"]["6"]) < int(summary["student_bytes"]["32"])
    return root


@pytest.fixture(scope="module")
def whole(artifacts: Path) -> ModelRunner:
    return ModelRunner(artifacts, [MODEL])


def run(runner: ModelRunner, deadline: float | None = None, **kwargs) -> np.ndarray:
    ids, lengths = tokens(TEXTS)
    return runner.run(Batch(MODEL, OUTPUT_PROBS, ids, lengths, **kwargs), deadline).values


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def held_whole(memory: StudentMemory, *indices: int) -> bool:
    """Exactly these students held, each the group's own full-precision student (a floor of 32 bits also
    reports 32 for one decoded from shards)."""
    with memory._lock:
        held = dict(memory.held)
    return set(held) == set(indices) and not any(isinstance(m, ElasticStudent) for m in held.values())


def memory_of(artifacts: Path, budget: int, load_full=None) -> StudentMemory:
    entry = read_catalogue(artifacts)[MODEL]
    group, weights = load_student_shell(artifacts, "sentiment")
    return StudentMemory(MODEL, group, open_student_shards(artifacts, entry),
                         load_full or (lambda i: load_student(weights, group, i)), budget, FileSource())


def test_the_catalogue_points_at_the_shards_and_full_precision_shards_are_the_student(artifacts: Path) -> None:
    entry = read_catalogue(artifacts)[MODEL]
    assert entry[STUDENT_SHARDS] == f"shards/{MODEL}"
    shards = open_student_shards(artifacts, entry)
    group = load_student_group(artifacts, "sentiment")
    ids, lengths = tokens(TEXTS)
    ends = np.cumsum(lengths)
    padded, mask, types = pad_batch([ids[end - n:end] for n, end in zip(lengths, ends, strict=True)])
    with torch.inference_mode():
        for index in (0, 1):
            own = group.partial(padded, mask, types, [index])
            full = group.partial(padded, mask, types, [index], members={index: shards.load(index, 32, FileSource())})
            low = group.partial(padded, mask, types, [index], members={index: shards.load(index, 2, FileSource())})
            torch.testing.assert_close(full, own, atol=1e-5, rtol=1e-5)
            assert (low - own).abs().max() > 1e-3   # 2 bits is not the student


def test_the_cli_reads_and_verifies_a_groups_shards_and_keeps_profile_and_plan_for_the_teachers(
        artifacts: Path) -> None:
    def shard(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "academus.shared.cli", "shard", *args, "--model", MODEL,
                               "--artifacts", str(artifacts)], capture_output=True, text=True, timeout=300)

    info = json.loads(shard("info").stdout.splitlines()[-1])
    assert info["students"] == 2 and info["student_layers"] == 2 and info["geometry"]["layers"] == 4
    assert info["min_bits"] == info["fidelity"]["min_bits"] and info["tasks"] == {}
    assert json.loads(shard("verify").stdout.splitlines()[-1]) == {
        "directory": str(artifacts / "shards" / MODEL), "files": 25, "ok": True, "shards": 4 * 12 * 6, "row_blocks": 0}
    refused = shard("profile")
    assert refused.returncode == 1 and "profile and plan are for an encoder's shards" in refused.stderr


def test_a_student_not_held_is_served_from_its_shards_at_once_then_held_whole(artifacts: Path,
                                                                               whole: ModelRunner) -> None:
    runner = ModelRunner(artifacts, [MODEL], student_budget_bytes=1 << 30)
    memory = runner.models[MODEL].memory
    assert memory is not None and memory.precision() == {}   # nothing held before it is placed or asked for
    floor = memory.shards.min_bits
    before = LOADS.labels(MODEL, str(floor), "shards")._value.get()
    first = run(runner, student_indices=[1])
    assert LOADS.labels(MODEL, str(floor), "shards")._value.get() == before + 1
    wait_until(lambda: held_whole(memory, 1))
    layer = memory.held[1].encoder.layer[0]   # traced on the loading thread, both mask kinds, before it serves
    assert isinstance(layer.forward, TracedLayer) and len(layer.forward.graphs) == 2
    np.testing.assert_allclose(run(runner, student_indices=[1]), run(whole, student_indices=[1]), atol=1e-6)
    if floor != 32:
        assert np.abs(first - run(whole, student_indices=[1])).max() > 0   # the first answer was the shards'
    served = run(runner, num_students=2)     # student 0 from its shards (or held whole, if loaded already)
    assert served.shape == (3, 2) and np.allclose(served.sum(1), 1)
    wait_until(lambda: held_whole(memory, 0, 1))
    np.testing.assert_allclose(run(runner, num_students=2), run(whole, num_students=2), atol=1e-6)
    assert memory.held_bytes() == memory.shared_bytes + 2 * memory.student_bytes
    memory.close()


def test_a_batch_with_time_to_spare_reads_more_bits_than_the_floor(artifacts: Path, whole: ModelRunner) -> None:
    runner = ModelRunner(artifacts, [MODEL], student_budget_bytes=1 << 30)
    memory = runner.models[MODEL].memory
    floor = memory.shards.min_bits
    loads = {bits: LOADS.labels(MODEL, str(bits), "shards")._value.get() for bits in (floor, 32)}
    run(runner, student_indices=[1], deadline=runner.clock() + 60)   # nothing measured yet: the floor
    assert LOADS.labels(MODEL, str(floor), "shards")._value.get() == loads[floor] + 1
    assert memory.costs.load_ms[floor] > 0 and memory.costs.compute_ms_per_token > 0
    first = run(runner, student_indices=[0], deadline=runner.clock() + 60)   # a minute to spare: every bit
    assert LOADS.labels(MODEL, "32", "shards")._value.get() == loads[32] + 1 + (floor == 32)
    np.testing.assert_allclose(first, run(whole, student_indices=[0]), atol=1e-5)
    memory.close()


def test_the_shards_serve_while_the_full_student_loads(artifacts: Path) -> None:
    release = threading.Event()
    entry_group, weights = load_student_shell(artifacts, "sentiment")

    def slow(index: int):
        release.wait(30)
        return load_student(weights, entry_group, index)

    memory = memory_of(artifacts, 1 << 30, slow)
    try:
        members = memory.members([0])
        assert memory.precision() == {0: memory.shards.min_bits} and members[0].bits == memory.shards.min_bits
        assert memory.members([0])[0] is members[0]      # held: not read again
        release.set()
        wait_until(lambda: held_whole(memory, 0))
    finally:
        release.set()
        memory.close()


def test_the_budget_holds_what_it_can_and_a_batch_past_it_streams(artifacts: Path) -> None:
    probe = memory_of(artifacts, 1 << 30)
    one = probe.shared_bytes + probe.student_bytes
    probe.close()
    with pytest.raises(InvalidArgument, match=f"budget of {one - 1} bytes is below the {one} bytes"):
        memory_of(artifacts, one - 1)
    memory = memory_of(artifacts, one)
    try:
        assert memory.capacity == 1
        memory.members([0])
        memory.members([1])                   # the least recently used one goes
        assert list(memory.precision()) == [1]
        streamed = STREAMED.labels(MODEL)._value.get()
        both = memory.members([0, 1])
        assert set(both) == {0, 1} and STREAMED.labels(MODEL)._value.get() == streamed + 1
        assert len(memory.precision()) == 1 and memory.held_bytes() <= one
    finally:
        memory.close()


def test_placed_students_load_ahead_and_unplaced_ones_go(artifacts: Path) -> None:
    memory = memory_of(artifacts, 1 << 30)
    try:
        memory.place({0})
        wait_until(lambda: held_whole(memory, 0))
        memory.place({1, 7})                  # 7: not a student of this group, ignored
        assert 0 not in memory.precision()
        wait_until(lambda: memory.precision() == {1: 32})
    finally:
        memory.close()
    students, groups = groups_from_json(groups_to_json(2, [[("w1", [0]), ("w2", [1])], [("w2", [0]), ("w1", [1])]]))
    assert students == 2
    assert placed_on(groups, "w1") == {0, 1} and placed_on(groups, "w3") == set()


def test_a_corrupted_shard_is_refused_never_served(artifacts: Path, tmp_path: Path) -> None:
    copy = tmp_path / "artifacts"
    shutil.copytree(artifacts, copy)
    floor = open_student_shards(copy, read_catalogue(copy)[MODEL]).min_bits
    path = copy / "shards" / MODEL / layer_file(2, floor)           # student 1's first layer
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    runner = ModelRunner(copy, [MODEL], student_budget_bytes=1 << 30)
    with pytest.raises(InvalidArgument, match=f"cannot be served: .*{layer_file(2, floor)}: shard 0 of layer 2"):
        run(runner, student_indices=[1])
    runner.models[MODEL].memory.close()


def test_a_modified_group_and_a_model_not_a_group_are_refused(artifacts: Path, tmp_path: Path) -> None:
    copy = tmp_path / "artifacts"
    shutil.copytree(artifacts, copy)
    weights = copy / "students" / "sentiment" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        load_student_shell(copy, "sentiment")
    with pytest.raises(ValueError, match=r"neither minilm, a user.s embedding model nor a student group"):
        build_students(copy, "sentiment")


def test_an_embedding_groups_floor_is_its_cosines_and_a_worker_serves_it_from_its_shards(tmp_path: Path) -> None:
    from academus.services.worker.core import OUTPUT_EMBEDDING
    from academus.shared.models.model import TeacherEncoder
    from academus.shared.models.students import from_teacher
    from academus.shared.training.student_artifacts import write_student_catalogue

    group = from_teacher(TeacherEncoder.load().body, layers=1)
    group.add_student(alpha=0.5)
    group.best_k = 2
    write_student_group(tmp_path, "embedding", group, metrics={})
    write_student_catalogue(tmp_path)
    summary = build_students(tmp_path, "minilm-students", quick=True)
    full, floor = summary["full"], summary["min_bits"]
    assert summary["dev_texts"] == 48 and full["cosine_to_full"] == 1.0 and 0 < full["teacher_cosine"] < 1
    for bits, students in summary["each_student_at"].items():   # from 6 bits down, until one fails
        kept = all(full[key] - s[key] <= 0.01 for s in students for key in full)
        assert kept == (int(bits) >= floor), (bits, floor, students)
    entry = read_catalogue(tmp_path)["minilm-students"]
    assert entry[STUDENT_SHARDS] == "shards/minilm-students" and entry["kind"] == "embedding"
    runner = ModelRunner(tmp_path, ["minilm-students"], student_budget_bytes=1 << 30)
    memory = runner.models["minilm-students"].memory
    spec = runner.specs["minilm-students"]
    assert (spec.pooling, spec.normalized) == ("mean", False)   # each student's mean; this group's sum left as it is
    ids, lengths = tokens(TEXTS)
    batch = Batch("minilm-students", OUTPUT_EMBEDDING, ids, lengths, num_students=2)
    loads = LOADS.labels("minilm-students", str(floor), "shards")._value.get()
    from_shards = runner.run(batch).values                   # nothing measured yet: both students at the floor
    assert LOADS.labels("minilm-students", str(floor), "shards")._value.get() == loads + 2
    wait_until(lambda: held_whole(memory, 0, 1))
    held = ModelRunner(tmp_path, ["minilm-students"]).run(batch).values
    assert not np.allclose(np.linalg.norm(held, axis=1), 1, atol=1e-3)   # not unit length, as the spec says
    np.testing.assert_allclose(runner.run(batch).values, held, atol=1e-5)
    cosines = torch.nn.functional.cosine_similarity(torch.from_numpy(from_shards), torch.from_numpy(held))
    assert cosines.min() > 0.9
    memory.close()


def test_shards_of_an_earlier_distillation_are_refused(artifacts: Path, tmp_path: Path) -> None:
    copy = tmp_path / "artifacts"
    shutil.copytree(artifacts, copy)
    group = load_student_group(copy, "sentiment")
    with torch.no_grad():
        group.alpha[1] = 0.25                     # distilled again: other weights
    write_student_group(copy, "sentiment", group, metrics={})
    entry = read_catalogue(artifacts)[MODEL]      # the shards' entry, as the catalogue had it
    with pytest.raises(ArtifactError, match=r"was cut from student weights .* run `academus shard build --model "
                                            r"sentiment-students` again"):
        open_student_shards(copy, entry)
