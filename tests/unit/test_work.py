"""The request's core shape end to end (`shared/models/work.py`) and its one conversion to and from the wire
(`work_wire.py`): items merged into a batch, a batch over the wire and back, answers as float32 bytes, split and
combined. (The whole path through real services: tests/e2e/test_serving.py.)"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from academus.services.scheduler.core import Group, Job, Member
from academus.services.scheduler.policies import BatchPlan, Piece
from academus.services.scheduler.sender import batch_of, combine, flat_plan
from academus.shared.models.work import (
    EMBEDDING,
    FINISH_L2,
    FINISH_SOFTMAX,
    LABEL,
    AdapterRef,
    Batch,
    BatchMeta,
    BatchOutput,
    PackingPlan,
    PlotStates,
    ShardRun,
    WorkItem,
)
from academus.shared.models.work_wire import (
    batch_from_pb,
    batch_to_pb,
    item_from_pb,
    matrix_from_pb,
    matrix_to_pb,
    merge_floats,
    output_from_pb,
    output_to_pb,
)
from academus.shared.runtime.errors import InvalidArgument
from academus.v1 import inference_pb2, scheduler_pb2, tensors_pb2

ACME = AdapterRef("acme", "support", 2, "legal")


def item(name: str, lengths: list[int], **fields) -> WorkItem:
    ids = [100 + k for k in range(sum(lengths))]
    return WorkItem("minilm", EMBEDDING, ids, lengths, request_id=name, **fields)


def job(work: WorkItem) -> Job:
    return Job(model=work.model, payload=work, num_texts=len(work.lengths), num_tokens=len(work.input_ids),
               deadline=10.0, enqueued_at=0.0, lengths=tuple(work.lengths))


def test_items_merge_back_to_back_and_only_a_tenants_texts_run_its_adapter():
    a, b = item("a", [2, 3]), item("b", [1], adapter=ACME, token_type_ids=[1], early_exit=True)
    batch = Batch.of([a, b])
    assert batch.batch_id == "a,b" and batch.lengths == [2, 3, 1] and batch.input_ids == [*a.input_ids, *b.input_ids]
    assert batch.adapters == (None, None, ACME)            # a's texts share the batch with no adapter
    assert batch.token_type_ids == [0] * 5 + [1] and batch.early_exit
    assert Batch.of([a]).adapters == () and Batch.of([a]).input_ids is a.input_ids   # one item: no copy
    assert [list(t) for t in batch.texts()] == [a.input_ids[:2], a.input_ids[2:], b.input_ids]


def test_a_batch_crosses_the_wire_whole():
    plan = PackingPlan.slotted([[[0, 2], [1]]], 16, 8)
    states = PlotStates(np.arange(12, dtype=np.float32).reshape(6, 2), np.array([2, 3, 1]), "minilm", 3)
    sent = Batch("minilm-plot", LABEL, [1, 2, 3, 4, 5, 6], [2, 3, 1], [0, 0, 1, 1, 1, 0], (None, ACME, None), 2,
                 (0, 1), plan, states, True, "x,y")
    got = batch_from_pb(batch_to_pb(sent))
    assert got.plot_states.states.tolist() == states.states.tolist() and got.plot_states.lengths.tolist() == [2, 3, 1]
    assert (got.plot_states.model, got.plot_states.lower_layers) == ("minilm", 3)
    assert got == replace(sent, plot_states=got.plot_states)   # every other field as sent


def test_a_bad_plan_or_states_on_the_wire_is_refused_naming_the_field():
    request = batch_to_pb(Batch("m", LABEL, [1, 2], [2], plan=PackingPlan.concat([[0]], 4)))
    request.packing.row_length = 0
    with pytest.raises(InvalidArgument, match=r"packing\.row_length=0"):
        batch_from_pb(request)
    request = batch_to_pb(Batch("m", LABEL, [1, 2], [2], plot_states=PlotStates(np.zeros((2, 4), np.float32),
                                                                            np.array([2]), "minilm", 3)))
    request.plot_states.lengths[:] = [1]
    with pytest.raises(InvalidArgument, match=r"plot_states.lengths \[1\] do not match tokens.lengths \[2\]"):
        batch_from_pb(request)


def test_a_matrix_travels_as_float32_bytes_and_the_older_repeated_field_is_still_read():
    values = np.array([[0.25, -1.5, 3.0], [7.0, 0.0, 1e-3]], dtype=np.float32)
    wire = matrix_to_pb(values)
    assert not wire.values and len(wire.data) == values.nbytes
    assert matrix_from_pb(tensors_pb2.Matrix.FromString(wire.SerializeToString())).tolist() == values.tolist()
    older = tensors_pb2.Matrix(values=values.ravel().tolist(), rows=2, dim=3)
    assert matrix_from_pb(older).tolist() == values.tolist()
    with pytest.raises(InvalidArgument, match="values holds 6 floats, not rows x dim = 3 x 3"):
        matrix_from_pb(tensors_pb2.Matrix(data=wire.data, rows=3, dim=3))


@pytest.mark.parametrize("dim", [0, 1, 31, 32, 384, 768, 40_000])
def test_floats_merged_through_the_wire_form_make_the_message_the_repeated_field_filled_from_a_list_does(dim: int):
    values = np.random.default_rng(dim).normal(size=dim).astype(np.float32)
    values[: min(dim, 3)] = [np.inf, -0.0, np.nan][: min(dim, 3)]   # every bit pattern travels as it is
    merged = inference_pb2.Prediction(label="x", num_tokens=7)
    merge_floats(merged, "embedding", values)
    filled = inference_pb2.Prediction(label="x", num_tokens=7, embedding=values.tolist())
    assert merged.SerializeToString() == filled.SerializeToString()
    assert np.asarray(merged.embedding, np.float32).tobytes() == values.tobytes()
    assert merged.label == "x" and merged.num_tokens == 7


def test_an_answer_crosses_the_wire_with_its_metadata_and_the_schedulers_fields():
    meta = BatchMeta(4, 2, "w1", 3.5, 4.0, 40, 30, True, ShardRun(4, 9, 3.5, 1.0, 0.2, 1000, "file"))
    sent = BatchOutput(np.eye(2, dtype=np.float32), ["neg", "pos"], meta, FINISH_SOFTMAX, (1, 3), 2)
    wire = output_to_pb(sent, LABEL, policy="concat", attempts=2)
    assert (wire.output, wire.metadata.policy, wire.metadata.attempts) == (inference_pb2.OUTPUT_LABEL, "concat", 2)
    got = output_from_pb(tensors_pb2.ModelOutput.FromString(wire.SerializeToString()))
    assert got.values.tolist() == sent.values.tolist()
    assert (got.labels, got.meta, got.finish, got.rows, got.exit_layer) == (
        ["neg", "pos"], meta, FINISH_SOFTMAX, (1, 3), 2)


def test_a_schedule_request_becomes_a_work_item():
    request = scheduler_pb2.ScheduleRequest(request_id="r", model="minilm", output=inference_pb2.OUTPUT_SCORE,
                                            tokens=tensors_pb2.TokenBatch(input_ids=[1, 2, 3], lengths=[1, 2]),
                                            adapter=tensors_pb2.AdapterRef(tenant="acme", name="support", version=2,
                                                                           domain="legal"))
    assert item_from_pb(request, 3, True) == WorkItem("minilm", "score", [1, 2, 3], [1, 2], [], ACME, 3, True, "r")


def test_the_plan_over_jobs_becomes_the_merged_order_without_the_jobs_dropped():
    a, b, c = job(item("a", [5, 6])), job(item("b", [30])), job(item("c", [4]))
    plan = BatchPlan((((Piece(a, (0, 1)),), (Piece(b, (0,)),)), ((Piece(c, (0,)),),)), 40, 20)
    assert flat_plan(plan, [a, c]) == PackingPlan((((0, 1),), ((2,),)), 40, 20)
    a.plan = b.plan = c.plan = plan                        # as the concat policy leaves it on each job
    assert batch_of([a, c]).plan == PackingPlan((((0, 1),), ((2,),)), 40, 20)


def test_the_answer_splits_into_the_jobs_rows_and_a_group_combines_its_members_shares():
    whole = BatchOutput(np.arange(6, dtype=np.float32).reshape(3, 2), ["x", "y"])
    first, second = whole.split([2, 1])
    assert first.values.tolist() == [[0, 1], [2, 3]] and second.values.tolist() == [[4, 5]]
    group = Group("g#0", frozenset({"m"}), (Member("w0", (0,)), Member("w1", (1,))), students=2)
    shares = [BatchOutput(np.array([[1.0, 0.0]], np.float32), meta=BatchMeta(compute_ms=m), finish=f)
              for m, f in ((2.0, FINISH_SOFTMAX), (5.0, FINISH_SOFTMAX))]
    combined = combine(shares, group)
    assert combined.values.ravel().tolist() == pytest.approx([np.e ** 2 / (np.e ** 2 + 1), 1 / (np.e ** 2 + 1)])
    assert (combined.meta.student_count, combined.meta.compute_ms, combined.finish) == (2, 5.0, "")
    embeddings = [BatchOutput(np.array([[3.0, 0.0]], np.float32), finish=FINISH_L2),
                  BatchOutput(np.array([[0.0, 4.0]], np.float32), finish=FINISH_L2)]
    assert combine(embeddings, group).values.ravel().tolist() == pytest.approx([0.6, 0.8])
