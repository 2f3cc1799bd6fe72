"""Packed (ConcatBatching) execution equals running each request alone, for the real teacher and a student group."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from academus.shared.models.model import ClassifierHead, TeacherEncoder, mean_pool
from academus.shared.models.packing import (
    PackingPlan,
    additive_mask,
    block_mask,
    encode_packed,
    pack,
    segment_mean,
)
from academus.shared.models.students import StudentGroup, from_teacher

TOLERANCE = 1e-4       # fp32, max abs difference
ATTENTIONS = ("hf", "sdpa")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Many small forwards: extra intra-op threads only contend on a shared machine (restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def teacher() -> TeacherEncoder:
    return TeacherEncoder.load()


@pytest.fixture(scope="module")
def group(teacher: TeacherEncoder) -> StudentGroup:
    """Two different 2-layer students over the teacher's embeddings, α = (1, 0.6)."""
    torch.manual_seed(0)
    group = from_teacher(teacher.body, 2, labels=["a", "b", "c"])
    second = group.add_student(alpha=0.6)
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return group.eval()


@pytest.fixture(scope="module")
def head() -> ClassifierHead:
    torch.manual_seed(1)
    return ClassifierHead(["neg", "neu", "pos"]).eval()


def make_requests(lengths: list[int], seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """[CLS] random ids [SEP] of each length, with a sentence-pair style type split."""
    rng = random.Random(seed)
    seqs = [[101] + [rng.randrange(1000, 30000) for _ in range(n - 2)] + [102] for n in lengths]
    types = [[0] * (n - (cut := rng.randrange(0, n // 2 + 1))) + [1] * cut for n in lengths]
    return seqs, types


def alone(model, seqs: list[list[int]], types: list[list[int]], **kwargs) -> torch.Tensor:
    """The reference: each request as its own batch of one, no padding."""
    outs = [model(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long), torch.tensor([t]), **kwargs)
            for s, t in zip(seqs, types, strict=True)]
    return torch.cat(outs)


def first_fit_plan(lengths: list[int], row_length: int, slot_size: int) -> PackingPlan:
    """Requests in order into the first slot with room; one longer than a slot gets a row of its own."""
    rows: list[list[list[int]]] = []
    free: list[list[int]] = []
    for i, n in enumerate(lengths):
        if n > slot_size:
            rows.append([[i]])
            free.append([0])
            continue
        spot = next(((r, s) for r, row in enumerate(free) for s, f in enumerate(row) if f >= n), None)
        if spot is None:
            rows.append([[] for _ in range(row_length // slot_size)])
            free.append([slot_size] * (row_length // slot_size))
            spot = (len(rows) - 1, 0)
        rows[spot[0]][spot[1]].append(i)
        free[spot[0]][spot[1]] -= n
    return PackingPlan(tuple(tuple(tuple(s) for s in row) for row in rows), row_length, slot_size)


def test_positions_restart_and_segments_follow_the_plan() -> None:
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    batch = pack(seqs, PackingPlan.concat([[0, 1], [2]], row_length=8), [[0, 0, 1], [0, 1], [0, 0, 0, 1]])
    (inputs,) = batch.passes
    assert inputs.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert inputs.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert inputs.token_type_ids.tolist() == [[0, 0, 1, 0, 1], [0, 0, 0, 1, 0]]
    assert inputs.segments.tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]]
    assert inputs.requests.tolist() == [0, 1, 2] and inputs.lengths.tolist() == [3, 2, 4]
    assert batch.real_tokens == 9 and batch.computed_tokens == 10


def test_mask_is_block_diagonal_and_padding_only_sees_padding() -> None:
    segments = torch.tensor([[0, 0, 1, -1]])
    allowed = block_mask(segments)[0, 0]
    assert allowed.tolist() == [[True, True, False, False], [True, True, False, False],
                                [False, False, True, False], [False, False, False, True]]
    additive = additive_mask(segments, torch.float32)[0, 0]
    assert additive[0, 1] == 0 and additive[0, 2] == torch.finfo(torch.float32).min


def test_segment_mean_is_mean_pool_per_request() -> None:
    hidden = torch.randn(2, 5, 4)
    segments = torch.tensor([[0, 0, 0, 1, 1], [2, 2, -1, -1, -1]])
    pooled = segment_mean(hidden, segments, torch.tensor([3, 2, 2]))
    ones = torch.ones(1, 3)
    assert torch.allclose(pooled[0], mean_pool(hidden[:1, :3], ones)[0], atol=1e-6)
    assert torch.allclose(pooled[2], hidden[1, :2].mean(0), atol=1e-6)


def test_plan_errors_name_the_problem() -> None:
    seqs = [[1] * 5, [1] * 6, [1] * 20]
    with pytest.raises(ValueError, match="exactly once"):
        pack(seqs, PackingPlan.concat([[0, 1]], 16))
    with pytest.raises(ValueError, match="over its size"):
        pack(seqs, PackingPlan.concat([[0, 1, 2]], 16))
    with pytest.raises(ValueError, match="over the slot size"):
        pack(seqs, PackingPlan.concat([[0, 1], [2]], 16), allow_oversize=False)
    with pytest.raises(ValueError, match="slots"):
        PackingPlan.slotted([[[0], [1], [2]]], row_length=16, slot_size=8)


def test_oversize_request_runs_alone_at_its_own_length() -> None:
    seqs = [[1] * 5, [1] * 6, [1] * 20]
    batch = pack(seqs, PackingPlan.concat([[0, 1], [2]], 16))
    assert [p.input_ids.shape for p in batch.passes] == [torch.Size([1, 11]), torch.Size([1, 20])]
    assert batch.passes[1].requests.tolist() == [2]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(3, 100), min_size=1, max_size=10), seed=st.integers(0, 2**16),
       row_length=st.sampled_from([64, 128, 256]), slot_fraction=st.floats(0.2, 1.0))
def test_packed_teacher_equals_each_request_alone(teacher, head, lengths, seed, row_length, slot_fraction) -> None:
    seqs, types = make_requests(lengths, seed)
    slot = max(1, int(row_length * slot_fraction))
    with torch.inference_mode():
        expected = alone(teacher, seqs, types)
        for plan in (first_fit_plan(lengths, row_length, row_length), first_fit_plan(lengths, row_length, slot)):
            batch = pack(seqs, plan, types)
            for attention in ATTENTIONS:
                got = encode_packed(teacher, batch, attention)
                assert (got - expected).abs().max() <= TOLERANCE, (attention, plan)
                assert (head(got) - head(expected)).abs().max() <= TOLERANCE


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(3, 100), min_size=1, max_size=10), seed=st.integers(0, 2**16),
       row_length=st.sampled_from([64, 128]), slot_fraction=st.floats(0.2, 1.0), students=st.sampled_from([1, 2]),
       normalize=st.booleans())
def test_packed_student_group_equals_each_request_alone(group, lengths, seed, row_length, slot_fraction,
                                                        students, normalize) -> None:
    seqs, types = make_requests(lengths, seed)
    group.normalize = normalize
    slot = max(1, int(row_length * slot_fraction))
    with torch.inference_mode():
        expected = alone(group, seqs, types, num_students=students)
        for plan in (first_fit_plan(lengths, row_length, row_length), first_fit_plan(lengths, row_length, slot)):
            batch = pack(seqs, plan, types)
            for attention in ATTENTIONS:
                got = encode_packed(group, batch, attention, num_students=students)
                assert (got - expected).abs().max() <= TOLERANCE, (attention, plan)
                assert (group.head(got) - group.head(expected)).abs().max() <= TOLERANCE
    group.normalize = False


def test_the_two_students_differ(group) -> None:
    """Guards the group test: with identical students, Σ α·S could hide a student being skipped."""
    seqs, types = make_requests([12, 30], seed=3)
    batch = pack(seqs, PackingPlan.concat([[0, 1]], 64), types)
    with torch.inference_mode():
        one = encode_packed(group, batch, num_students=1)
        two = encode_packed(group, batch, num_students=2)
    assert (two - 1.6 * one).abs().max() > 1e-3


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_bare_bert_model_gives_the_unnormalised_mean_pool(teacher, attention) -> None:
    seqs, types = make_requests([7, 40, 19], seed=5)
    batch = pack(seqs, PackingPlan.concat([[0, 1, 2]], 128), types)
    with torch.inference_mode():
        got = encode_packed(teacher.body, batch, attention)
        expected = torch.cat([mean_pool(teacher.body(input_ids=torch.tensor([s]),
                                                     token_type_ids=torch.tensor([t])).last_hidden_state,
                                        torch.ones(1, len(s))) for s, t in zip(seqs, types, strict=True)])
    assert (got - expected).abs().max() <= TOLERANCE


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_before_layer_runs_before_every_layer_and_can_stop_the_batch(group, attention) -> None:
    seqs, types = make_requests([10, 20], seed=7)
    batch = pack(seqs, PackingPlan.concat([[0, 1]], 64), types)
    calls: list[int] = []
    with torch.inference_mode():
        encode_packed(group, batch, attention, num_students=2, before_layer=calls.append)
    assert calls == [0, 1, 0, 1]

    def stop(layer: int) -> None:
        raise TimeoutError(f"deadline before layer {layer}")

    with pytest.raises(TimeoutError, match="layer 0"), torch.inference_mode():
        encode_packed(group, batch, attention, num_students=2, before_layer=stop)


def test_unknown_model_is_refused() -> None:
    batch = pack([[1, 2]], PackingPlan.concat([[0]], 8))
    with pytest.raises(TypeError, match="cannot run Linear packed"):
        encode_packed(torch.nn.Linear(2, 2), batch)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_member_share_equals_the_padded_partial_and_shares_add_up(group, attention) -> None:
    """A group member's packed share equals `StudentGroup.partial`; the members' shares sum to the group."""
    seqs, types = make_requests([9, 33, 17], seed=11)
    batch = pack(seqs, PackingPlan.concat([[0, 2], [1]], 64), types)
    with torch.inference_mode():
        shares = [encode_packed(group, batch, attention, student_indices=[i]) for i in (0, 1)]
        whole = encode_packed(group, batch, attention, num_students=2)
        expected = torch.cat([group.partial(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long),
                                            torch.tensor([t]), [1]) for s, t in zip(seqs, types, strict=True)])
    assert (shares[1] - expected).abs().max() <= TOLERANCE
    assert (shares[0] + shares[1] - whole).abs().max() <= TOLERANCE
    with pytest.raises(ValueError, match=r"within 0\.\.1"):
        encode_packed(group, batch, attention, student_indices=[2])
