"""DAS (TCB Alg. 1), slotted DAS (Alg. 2) and the baseline row fills: examples and properties."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import pairwise

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from academus.services.scheduler import das
from academus.services.scheduler.das import (
    Batch,
    WaitingItem,
    bucketed_batches,
    das_rows,
    edf_rows,
    fcfs_rows,
    first_fit_slots,
    padded_cost,
    sjf_rows,
    slot_size,
    slotted_das_rows,
)

ROW_FILLS = [das_rows, slotted_das_rows, fcfs_rows, sjf_rows, edf_rows]


def make_items(lengths: list[int], deadlines: list[float] | None = None) -> list[WaitingItem]:
    """Items 0..n-1 arriving in order, with the given deadlines (default: far away)."""
    deadlines = deadlines or [100.0] * len(lengths)
    return [WaitingItem(i, n, d, float(i)) for i, (n, d) in enumerate(zip(lengths, deadlines, strict=True))]


def row_tokens(batch: Batch, lengths: dict, row: list) -> int:
    return sum(lengths[i] for i in row)


def test_everything_fits_one_row_goes_in_it() -> None:
    batch = das_rows(make_items([5, 7, 3]), now=0.0, row_length=20, rows=4)
    assert [sorted(r) for r in batch.rows] == [[0, 1, 2]]
    assert batch.waiting == batch.expired == batch.too_long == []


def test_das_row_takes_dominant_prefix_then_earliest_deadlines() -> None:
    # Shortest first: 2, 3, 4, 5, 6 fit L=20 (s = 5), so p = ⌊0.5·5⌋ = 2: items 2 and 3 (lengths 2, 3).
    # Mean utility (1/2 + 1/3)/2 ≈ 0.417, q·v̄ ≈ 0.208: the deadline-aware set is lengths ≤ 4 — only 4.
    # Then the rest by utility: 5 (total 14), 6 (20). Item 9 (len 9) has the nearest deadline but low utility.
    lengths = [5, 6, 2, 3, 9, 4]
    deadlines = [50.0, 50.0, 50.0, 50.0, 1.0, 50.0]
    batch = das_rows(make_items(lengths, deadlines), now=0.0, row_length=20, rows=1)
    assert batch.rows == [[2, 3, 5, 0, 1]]
    assert batch.waiting == [4]


def test_deadline_aware_set_prefers_the_urgent_over_the_short() -> None:
    # Ranked 3, 4, 5, 6, 8 (s = 2 for L = 10 → p = 1: the 3). v̄ = 1/3, q·v̄ = 1/6: lengths ≤ 6 qualify.
    # Among them the 6 has the nearest deadline, so it goes before the 4 and the 5; nothing else fits.
    batch = das_rows(make_items([3, 4, 5, 6, 8], [9.0, 9.0, 9.0, 1.0, 9.0]), now=0.0, row_length=10, rows=1)
    assert batch.rows == [[0, 3]]
    assert sorted(batch.waiting) == [1, 2, 4]


def fifty_ms_a_batch(rows: int, length: int) -> float:
    return 0.05


@pytest.mark.parametrize("fill", [das_rows, slotted_das_rows])
def test_a_long_item_due_under_the_wait_bound_goes_before_shorter_ones(fill: Callable[..., Batch]) -> None:
    """DAS prefers short items, so a long one waits while short ones keep coming. Once its due time (arrival
    plus the queue's wait bound) falls before the batch after this one could start, it goes first."""
    items = [WaitingItem(0, 30, 100.0, 0.0, due=1.0)]
    items += [WaitingItem(k, 6, 100.0, 0.5 + k / 100, due=1.5 + k / 100) for k in range(1, 8)]
    before = fill(items, now=0.9, row_length=32, rows=1, batch_latency=fifty_ms_a_batch)
    assert 0 in before.waiting and len(before.scheduled()) == 5     # five shorts: 30 of the 32 tokens
    due = fill(items, now=0.96, row_length=32, rows=1, batch_latency=fifty_ms_a_batch)
    assert due.rows == [[0]]                                         # 0.96 + 0.05 is past its due 1.0
    unbounded = [WaitingItem(n.id, n.length, n.deadline, n.arrival) for n in items]
    assert 0 in fill(unbounded, now=0.96, row_length=32, rows=1, batch_latency=fifty_ms_a_batch).waiting


@pytest.mark.parametrize("fill", [das_rows, slotted_das_rows])
@pytest.mark.parametrize("lanes", [1, 2])
def test_long_items_coming_due_together_each_start_by_their_due(fill: Callable[..., Batch], lanes: int) -> None:
    """Long items passed over while the queue grew come due 10 ms apart, and a row holds one of them. Each
    went first only when due before the next batch: the third then waited behind the first two, past its due.
    Counting the batches that the items due before it fill, each starts by its due. A batch starts every
    50 ms on each of `lanes` groups."""
    longs = [WaitingItem(k, 30, 100.0, k / 100, due=1.0 + k / 100) for k in range(4)]
    shorts = [WaitingItem(10 + k, 6, 100.0, 0.5 + k / 100, due=1.5 + k / 100) for k in range(20)]
    waiting, now, started = longs + shorts, 0.8, {}
    while any(n.id < 10 for n in waiting):
        batch = fill(waiting, now=now, row_length=32, rows=1, batch_latency=fifty_ms_a_batch, lanes=lanes)
        started |= dict.fromkeys(batch.scheduled(), now)
        waiting = [n for n in waiting if n.id not in started]
        now = round(now + 0.05 / lanes, 6)
    assert all(started[n.id] <= n.due for n in longs), {n.id: started[n.id] for n in longs}
    assert started[0] > 0.8        # not before it had to: shorts ran first


def test_due_items_go_earliest_due_first_as_far_as_the_rows_hold() -> None:
    dues = [5.0, 1.0, 4.0, 2.0, 3.0, 0.0]        # equal lengths: without dues, arrival order (ids 0-3)
    items = [WaitingItem(k, 16, 100.0, float(k), due=due) for k, due in enumerate(dues)]
    batch = das_rows(items, now=10.0, row_length=32, rows=2)
    assert batch.rows == [[5, 1], [3, 4]] and sorted(batch.waiting) == [0, 2]


def test_rows_are_filled_one_after_another() -> None:
    batch = das_rows(make_items([6] * 5), now=0.0, row_length=12, rows=2)
    assert [len(r) for r in batch.rows] == [2, 2]
    assert len(batch.waiting) == 1


def test_items_that_cannot_meet_their_deadline_expire_and_are_not_scheduled() -> None:
    items = make_items([4, 4, 4], [10.0, 10.4, 11.0])
    batch = das_rows(items, now=10.0, row_length=32, rows=1, batch_latency=lambda rows, length: 0.5)
    assert batch.expired == [0, 1]
    assert batch.rows == [[2]]


def test_without_latency_only_past_deadlines_expire() -> None:
    batch = das_rows(make_items([4, 4], [9.0, 10.0]), now=10.0, row_length=32, rows=1)
    assert batch.expired == [0] and batch.rows == [[1]]


def test_oversize_item_runs_alone_or_is_rejected() -> None:
    items = make_items([40, 5, 6])
    alone = das_rows(items, now=0.0, row_length=32, rows=2)
    assert sorted(map(sorted, alone.rows)) == [[0], [1, 2]]
    rejected = das_rows(items, now=0.0, row_length=32, rows=2, oversize="reject")
    assert rejected.too_long == [0] and rejected.rows == [[1, 2]]


def test_oversize_item_never_shares_a_row() -> None:
    batch = das_rows(make_items([40, 5, 6], [1.0, 9.0, 9.0]), now=0.0, row_length=32, rows=1)
    assert batch.rows in ([[0]], [[1, 2]])


def test_eta_and_q_must_sum_to_one() -> None:
    with pytest.raises(ValueError, match="η \\+ q = 1"):
        das_rows(make_items([3, 30]), now=0.0, row_length=32, rows=1, eta=0.5, q=0.6)


def test_slot_size_is_the_longest_dominant_widened_to_divide_the_row() -> None:
    assert slot_size([10, 30, 20], 128) == 32     # 128 // 30 = 4 slots → z = 32
    assert slot_size([37], 128) == 42             # 3 slots of 42 instead of 3 of 37
    assert slot_size([100], 128) == 128           # one slot: pure ConcatBatching
    assert slot_size([], 128) == 128


def test_first_fit_slots_sends_back_what_fits_nowhere() -> None:
    slots, left = first_fit_slots(make_items([30, 30, 30, 50]), slots=2, size=50)
    assert [[n.id for n in s] for s in slots] == [[0], [1]]
    assert [n.id for n in left] == [2, 3]


def test_slotted_das_slot_size_comes_from_the_dominant_prefix() -> None:
    # DAS row: 9, 10 (dominant, p = 2), then 11, 12, 14 (deadline-aware); 60 does not fit.
    # z = 10 widened to 64 // 6 = 10: six slots of 10; only the dominant two fit, the rest wait (Alg. 2).
    lengths = [10, 12, 14, 9, 11, 60]
    batch = slotted_das_rows(make_items(lengths), now=0.0, row_length=64, rows=1)
    assert batch.slot_size == 10
    assert batch.slots == [[[3], [0]]] and batch.rows == [[3, 0]]
    assert sorted(batch.waiting) == [1, 2, 4, 5]


def test_slotted_das_packs_several_requests_a_slot() -> None:
    # s = 7 (2+2+4+5+5+5+5 = 28 ≤ 32), p = 3: dominant 2, 2, 4 → z = 4 (8 slots); the two 2s share one.
    lengths = [2, 2, 4, 5, 5, 5, 5, 5]
    batch = slotted_das_rows(make_items(lengths), now=0.0, row_length=32, rows=1)
    assert batch.slot_size == 4
    assert batch.slots == [[[0, 1], [2]]]
    assert batch.waiting == [3, 4, 5, 6, 7]


def test_baselines_order_rows_by_their_priority() -> None:
    items = make_items([8, 2, 5], [3.0, 2.0, 1.0])
    assert fcfs_rows(items, now=0.0, row_length=10, rows=1).rows == [[0, 1]]
    assert sjf_rows(items, now=0.0, row_length=10, rows=1).rows == [[1, 2]]
    assert edf_rows(items, now=0.0, row_length=10, rows=1).rows == [[2, 1]]


def test_bucketed_batches_group_similar_lengths() -> None:
    lengths = [5, 90, 6, 88, 7, 91]
    buckets = bucketed_batches(make_items(lengths), now=0.0, max_batch=4)
    assert sorted(map(sorted, buckets.batches)) == [[0, 2, 4], [1, 3, 5]]


def test_bucketed_batches_respect_the_batch_limit_and_merge_when_padding_is_cheap() -> None:
    buckets = bucketed_batches(make_items([10, 11, 12, 13, 14]), now=0.0, max_batch=2)
    assert all(len(b) <= 2 for b in buckets.batches)
    assert sorted(i for b in buckets.batches for i in b) == [0, 1, 2, 3, 4]
    one = bucketed_batches(make_items([10, 11, 12]), now=0.0, max_batch=8)
    assert len(one.batches) == 1                   # padding 3 tokens is cheaper than a second batch
    assert padded_cost(3, 12) < 2 * padded_cost(1, 10)


def test_bucketed_batches_most_urgent_first_and_expiry() -> None:
    items = make_items([5, 90, 6], [9.0, 2.0, 0.5])
    buckets = bucketed_batches(items, now=1.0, max_batch=4, batch_latency=lambda size, length: size * length / 1e3)
    assert buckets.expired == [2]
    assert buckets.batches[0] == [1]


# Properties: every row fill, random queues.
item_lists = st.lists(
    st.tuples(st.integers(1, 160), st.floats(0.0, 5.0), st.floats(0.0, 3.0), st.none() | st.floats(0.0, 3.0)),
    min_size=0, max_size=40)


def build(raw: list[tuple[int, float, float, float | None]]) -> list[WaitingItem]:
    """Items of (length, deadline slack, arrival, wait bound or None)."""
    return [WaitingItem(i, n, arrival + slack, arrival, math.inf if bound is None else arrival + bound)
            for i, (n, slack, arrival, bound) in enumerate(raw)]


@settings(max_examples=25, deadline=None)
@given(raw=item_lists, rows=st.integers(1, 6), row_length=st.sampled_from([16, 64, 128]),
       now=st.floats(0.0, 4.0), latency=st.floats(0.0, 1.0), oversize=st.sampled_from(["alone", "reject"]),
       fill=st.sampled_from(ROW_FILLS))
def test_row_fill_properties(raw, rows: int, row_length: int, now: float, latency: float, oversize: str,
                             fill: Callable[..., Batch]) -> None:
    items = build(raw)
    by_id = {n.id: n for n in items}
    batch = fill(items, now, row_length, rows, batch_latency=lambda r, length: latency, oversize=oversize)
    scheduled = batch.scheduled()
    assert len(scheduled) == len(set(scheduled)), "an item sits in two rows"
    outcomes = scheduled + batch.expired + batch.too_long + batch.waiting
    assert sorted(outcomes) == sorted(by_id), "every item is scheduled, expired, too long or waiting, once"
    assert len(batch.rows) <= rows and all(batch.rows)
    for row in batch.rows:
        total = sum(by_id[i].length for i in row)
        assert total <= row_length or len(row) == 1, "only a lone oversize item may exceed L"
    assert all(now + latency > by_id[i].deadline for i in batch.expired), "expired only by the estimate"
    assert all(now + latency <= by_id[i].deadline for i in scheduled)
    assert all(by_id[i].length > row_length for i in batch.too_long)
    if oversize == "reject":
        assert all(by_id[i].length <= row_length for i in scheduled)


@settings(max_examples=25, deadline=None)
@given(raw=item_lists, rows=st.integers(1, 6), row_length=st.sampled_from([16, 64, 128]))
def test_das_is_work_conserving(raw, rows: int, row_length: int) -> None:
    """No waiting item fits the free space of any row, and no row is left unused while items wait."""
    items = build(raw)
    by_id = {n.id: n for n in items}
    batch = das_rows(items, 0.0, row_length, rows)
    if batch.waiting:
        assert len(batch.rows) == rows
    for row in batch.rows:
        free = row_length - sum(min(by_id[i].length, row_length) for i in row)
        assert all(min(by_id[i].length, row_length) > free for i in batch.waiting)


@settings(max_examples=25, deadline=None)
@given(raw=item_lists, rows=st.integers(1, 6), row_length=st.sampled_from([16, 64, 128]), now=st.floats(0.0, 6.0))
def test_due_items_that_fit_one_row_all_run(raw, rows: int, row_length: int, now: float) -> None:
    items = build(raw)
    due = [n for n in items if n.due < now <= n.deadline]    # no latency: the next batch could start now
    assume(sum(min(n.length, row_length) for n in due) <= row_length)
    assert {n.id for n in due} <= set(das_rows(items, now, row_length, rows).scheduled())


@settings(max_examples=50, deadline=None)
@given(raw=item_lists, rows=st.integers(1, 6), row_length=st.sampled_from([16, 64, 128]), now=st.floats(0.0, 4.0),
       fill=st.sampled_from([das_rows, slotted_das_rows]))
def test_the_deadline_aware_set_read_off_the_decisions_order_decides_as_sorted_per_row(
        raw, rows: int, row_length: int, now: float, fill: Callable[..., Batch]) -> None:
    """Line 12 reads a large deadline-aware set off one deadline order of the decision's queue (from
    DEADLINE_ORDER_AFTER items): the rows are those of sorting each row's set on its own."""
    items, decided, kept = build(raw), {}, das.DEADLINE_ORDER_AFTER
    try:
        for after in (1, 10**9):     # every set read off the order; every set sorted on its own
            das.DEADLINE_ORDER_AFTER = after
            decided[after] = fill(items, now, row_length, rows, batch_latency=lambda r, length: 0.01)
    finally:
        das.DEADLINE_ORDER_AFTER = kept
    assert decided[1] == decided[10**9]


def test_a_crowd_of_deadline_aware_items_fills_rows_in_deadline_order() -> None:
    """100 items of one length, the last to arrive the first due, nothing near its wait bound: every one is
    deadline-aware, far past DEADLINE_ORDER_AFTER, and the rows take them earliest deadline first."""
    deadlines = [5.0 - 0.01 * i for i in range(100)]
    batch = das_rows(make_items([16] * 100, deadlines), 0.0, 64, 3)
    assert batch.rows == [[99, 98, 97, 96], [95, 94, 93, 92], [91, 90, 89, 88]]


@settings(max_examples=25, deadline=None)
@given(raw=item_lists, rows=st.integers(1, 6), row_length=st.sampled_from([16, 64, 128]))
def test_slotted_das_properties(raw, rows: int, row_length: int) -> None:
    items = build(raw)
    by_id = {n.id: n for n in items}
    batch = slotted_das_rows(items, 0.0, row_length, rows)
    z = batch.slot_size
    assert z is not None and 1 <= z <= row_length
    pure = das_rows(items, 0.0, row_length, rows)
    assert set(batch.scheduled()) <= set(pure.scheduled()), "slots only choose among DAS's candidates"
    for row, slots in zip(batch.rows, batch.slots, strict=True):
        assert row == [i for slot in slots for i in slot] and all(slots)
        if len(row) == 1 and by_id[row[0]].length > row_length:
            continue                                   # a lone oversize item keeps its own row
        assert len(slots) <= row_length // z
        assert all(sum(by_id[i].length for i in slot) <= z for slot in slots)


@settings(max_examples=25, deadline=None)
@given(raw=item_lists, max_batch=st.integers(1, 16), latency=st.floats(0.0, 1.0), now=st.floats(0.0, 4.0))
def test_bucketed_batches_properties(raw, max_batch: int, latency: float, now: float) -> None:
    items = build(raw)
    by_id = {n.id: n for n in items}
    buckets = bucketed_batches(items, now, max_batch, batch_latency=lambda size, length: latency)
    placed = [i for b in buckets.batches for i in b]
    assert sorted(placed + buckets.expired) == sorted(by_id)
    assert all(1 <= len(b) <= max_batch for b in buckets.batches)
    # Sorted buckets never interleave: each batch covers a contiguous range of lengths.
    spans = sorted((min(by_id[i].length for i in b), max(by_id[i].length for i in b)) for b in buckets.batches)
    assert all(a[1] <= b[0] for a, b in pairwise(spans))
    assert all(now + latency > by_id[i].deadline for i in buckets.expired)


@pytest.mark.parametrize("fill", [das_rows, slotted_das_rows])
def test_items_alike_but_for_their_id_are_each_placed_once(fill: Callable[..., Batch]) -> None:
    """A placed item leaves the ranked queue by bisection on its order's key, then by identity among its equals:
    in a queue of equals every row must still take items no other row took."""
    items = [WaitingItem(k, 8, 10.0, 0.0, 0.5) for k in range(60)] + [WaitingItem(60 + k, 8, 10.0, 0.0)
                                                                       for k in range(60)]
    batch = fill(items, 1.0, 32, 6)
    scheduled = batch.scheduled()
    assert len(scheduled) == 24 and len(set(scheduled)) == 24
    assert set(scheduled) == set(range(24)), "the due ones first, in arrival order among equals"
    assert sorted(scheduled + batch.waiting) == list(range(120))
