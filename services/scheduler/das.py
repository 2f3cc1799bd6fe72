"""Row selection for ConcatBatching (TCB §5): DAS (Alg. 1), slotted DAS (Alg. 2) and the baselines.

Pure functions over a snapshot of waiting items: no gRPC, no asyncio, no clock of their own (`now`
is given). Each call forms the next batch of `rows` rows of `row_length` (L) tokens and sorts every
item into exactly one outcome:

- `rows`: item ids per row, to be packed and run now (`shared/packing.PackingPlan`);
- `expired`: cannot finish by its deadline even if run in this batch (`now + batch_latency > deadline`):
  answer DEADLINE_EXCEEDED, never compute it (TCB excludes such items from N_t);
- `too_long`: longer than L with `oversize="reject"`: answer INVALID_ARGUMENT;
- `waiting`: left for a later batch.

An item longer than L with `oversize="alone"` (the default) is never truncated: it takes a row of its
own, run at its own length (`packing.pack` runs it as a separate pass). For filling it counts as L
tokens, so it fits only an empty row; its utility 1/l is the lowest, so DAS picks it when the queue
allows or its deadline makes it the deadline-aware choice for an empty row.

`batch_latency(rows, row_length)` estimates one batch's run time in seconds (None: zero, only items
already past their deadline expire). It is the same for every batch of a shape (TCB §5.1: fixed B, L).

The queue's wait bound (ours, not TCB's): an item whose `due` (its arrival plus the bound admission
promised it) would pass if it missed this batch goes first, earliest due first, before Alg. 1 fills what
room is left; an item counts the batches that the items due before it fill (`_urgent`). DAS alone prefers
short items: under load it passes a long one over until its deadline, though admission counted on it
starting within the bound (docs/design/admission.md).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Literal

ItemId = Hashable
BatchLatency = Callable[[int, int], float]      # (rows or batch size, row length or padded length) → seconds
Oversize = Literal["alone", "reject"]
# The bucketed baseline's cost without a profiled latency: tokens computed plus a fixed per-batch cost
# worth this many tokens (kernel launches, framework overhead); it is what stops it from running singletons.
BATCH_OVERHEAD_TOKENS = 256


@dataclass(frozen=True)
class WaitingItem:
    """A request waiting for a batch: its token count, deadline and arrival (clock seconds), and when it is
    due to start under the queue's wait bound (inf: no bound)."""

    id: ItemId
    length: int
    deadline: float
    arrival: float
    due: float = math.inf

    @property
    def utility(self) -> float:
        """TCB's v_n = 1 / l_n: short requests are worth more per token of batch space."""
        return 1.0 / self.length


@dataclass(frozen=True)
class Batch:
    """One scheduling decision; every input item is in exactly one of rows, expired, too_long, waiting."""

    rows: list[list[ItemId]]
    expired: list[ItemId]
    too_long: list[ItemId]
    waiting: list[ItemId]
    row_length: int
    slot_size: int | None = None     # z, set by slotted DAS (None: pure ConcatBatching, one slot a row)
    slots: list[list[list[ItemId]]] = field(default_factory=list)   # slotted: row → slots → ids

    def scheduled(self) -> list[ItemId]:
        return [i for row in self.rows for i in row]


@dataclass(frozen=True)
class _Triage:
    live: list[WaitingItem]
    expired: list[ItemId]
    too_long: list[ItemId]


def _triage(items: Iterable[WaitingItem], now: float, row_length: int, estimate: float,
            oversize: Oversize) -> _Triage:
    """Splits off items that miss their deadline even if run now, and oversize items when rejected."""
    live, expired, too_long = [], [], []
    for item in items:
        if item.length < 1:
            raise ValueError(f"item {item.id!r} has length {item.length}; every request has at least one token")
        if item.length > row_length and oversize == "reject":
            too_long.append(item.id)
        elif now + estimate > item.deadline:
            expired.append(item.id)
        else:
            live.append(item)
    return _Triage(live, expired, too_long)


def _estimate(batch_latency: BatchLatency | None, rows: int, length: int) -> float:
    return batch_latency(rows, length) if batch_latency is not None else 0.0


def _check(row_length: int, rows: int) -> None:
    if row_length < 1 or rows < 1:
        raise ValueError(f"row_length={row_length} and rows={rows} must both be at least 1")


def _fit(item: WaitingItem, row_length: int) -> int:
    """Tokens an item takes in a row: an oversize item takes the whole row (it runs alone)."""
    return min(item.length, row_length)


class _Row:
    """A row being filled greedily."""

    def __init__(self, row_length: int) -> None:
        self.items: list[WaitingItem] = []
        self.free = row_length
        self.row_length = row_length

    # `fill` and `fill_shortest` take `_fit` inline: under overload a decision offers its rows up to a few thousand
    # items, and two calls an offer were most of the rows' time.
    def fill(self, candidates: Iterable[WaitingItem], taken: set[ItemId], shortest: int = 1) -> None:
        """First fit: every candidate not yet taken goes in when it still fits. None needs fewer than `shortest`
        tokens, so a row with less room left stops there rather than offering itself to the rest of a long list
        (under overload nearly the whole queue is due)."""
        free, length, items = self.free, self.row_length, self.items
        for item in candidates:
            if free < shortest:
                break
            need = item.length if item.length < length else length
            if need <= free and item.id not in taken:
                items.append(item)
                taken.add(item.id)
                free -= need
        self.free = free

    def fill_shortest(self, ranked: Iterable[WaitingItem], taken: set[ItemId]) -> None:
        """`fill` over candidates shortest first (`_by_utility`): past the first that does not fit, none does,
        so a row stops there rather than offering itself to the rest of a long queue."""
        free, length, items = self.free, self.row_length, self.items
        for item in ranked:
            if item.id not in taken:
                need = item.length if item.length < length else length
                if need > free:
                    break
                items.append(item)
                taken.add(item.id)
                free -= need
        self.free = free


_UTILITY_ORDER = attrgetter("length", "deadline", "arrival")


def _by_utility(items: Iterable[WaitingItem]) -> list[WaitingItem]:
    """Utility non-increasing (shortest first); ties to the earlier deadline, then the earlier arrival."""
    return sorted(items, key=_UTILITY_ORDER)


BISECT_UNDER = 1 / 32   # a row that placed fewer than this share of the queue takes them out by bisection


def _drop(ranked: list[WaitingItem], placed: list[WaitingItem], taken: set[ItemId]) -> None:
    """Takes placed items (in `taken`) out of a `_by_utility` queue, in place. Under overload a row places a few of
    a thousand, and filtering the whole queue for each row took a sixth of the decision: those go by bisection. A
    row that places a good share of a short queue costs less as one filter pass."""
    if len(placed) >= BISECT_UNDER * len(ranked):
        ranked[:] = [n for n in ranked if n.id not in taken]
        return
    for item in placed:
        at = bisect_left(ranked, _UTILITY_ORDER(item), key=_UTILITY_ORDER)
        while ranked[at] is not item:   # past the items equal to it in the order
            at += 1
        del ranked[at]


def _by_deadline(items: Iterable[WaitingItem]) -> list[WaitingItem]:
    """Line 12's order: the earlier deadline first, then the shorter, then the earlier arrival."""
    return sorted(items, key=attrgetter("deadline", "length", "arrival"))


DEADLINE_ORDER_AFTER = 64   # a deadline-aware set this large is read from the decision's one deadline order


class _DeadlineOrder:
    """The decision's live items in line 12's order, sorted once, when a row first needs it. Under overload
    nearly the whole queue is deadline-aware in every row, and sorting it again for each row took most of a
    decision (about 3.4 ms with 1,024 waiting). A row reads the order until it is full. A small set is still
    sorted on its own: that costs less than the whole queue's sort when little is deadline-aware."""

    def __init__(self, queue: list[WaitingItem], taken: set[ItemId]) -> None:
        self.queue = queue            # the decision's whole queue in `_by_utility`'s order
        self.taken = taken            # the decision's: what earlier rows hold
        self._order: list[WaitingItem] | None = None

    def of(self, ranked: list[WaitingItem], p: int, end: int, least: float) -> Iterable[WaitingItem]:
        """The deadline-aware set, `ranked[p:end]`, in line 12's order. It is every item the decision has not
        placed, outside the row's utility-dominant `ranked[:p]`, whose utility is at least `least`: so a large
        one is read off the whole order."""
        if end - p < DEADLINE_ORDER_AFTER:
            return _by_deadline(ranked[p:end])
        if self._order is None:   # a stable sort of the ranked queue by deadline alone: ties stay shortest first,
            # then earliest arrival; with one deadline for all it is already in order, and the sort costs O(n)
            self._order = sorted(self.queue, key=attrgetter("deadline"))
        taken, dominant = self.taken, {n.id for n in ranked[:p]}
        return (n for n in self._order if n.utility >= least and n.id not in taken and n.id not in dominant)


def _less_useful(item: WaitingItem) -> float:
    """The ranked queue's bisection key: rising along it (utility falls)."""
    return -item.utility


def _das_row(ranked: list[WaitingItem], row: _Row, eta: float, q: float,
             order: _DeadlineOrder) -> tuple[list[WaitingItem], int]:
    """One row of Alg. 1 in what `row` has left, among `ranked` (`_by_utility`): the row's items and p (its
    utility-dominant prefix size, counting the items it already held: they were placed first, as the most
    urgent). `order` gives line 12's order."""
    taken: set[ItemId] = set()
    held = len(row.items)
    s = _prefix_fitting(ranked, row.row_length, row.free)            # line 8
    if s == len(ranked):                                             # line 4: everything fits
        row.fill_shortest(ranked, taken)
        return row.items, len(row.items)     # no selection: the whole row counts as utility-dominant
    p = max(1, math.floor(eta * s))                                  # line 9: p = η·s, at least one
    row.fill(ranked[:p], taken)                                      # line 10: utility-dominant set
    least = q * (sum(n.utility for n in ranked[:p]) / p)   # q times the prefix's mean utility
    # line 11: utility at least q·mean; utility falls along `ranked`, so these are ranked[p:end]
    end = bisect_right(ranked, -least, lo=p, key=_less_useful)
    if end > p:                                                      # line 12; the shortest is the first
        row.fill(order.of(ranked, p, end, least), taken, _fit(ranked[p], row.row_length))
    row.fill_shortest(ranked, taken)                                 # line 14: the rest, utility order
    return row.items, held + p


def _prefix_fitting(ranked: Sequence[WaitingItem], row_length: int, space: int) -> int:
    """s: how many of the first items in `ranked` fit `space` tokens of a row together."""
    used = 0
    for s, item in enumerate(ranked):
        used += _fit(item, row_length)
        if used > space:
            return s
    return len(ranked)


def _urgent(live: list[WaitingItem], row_length: int, rows: int, start_by: float,
            start_every: float) -> list[WaitingItem]:
    """The items that go first, earliest due first: every one up to the last that would start past its due if
    it missed this batch. The next batch can start at `start_by`, and one more every `start_every` seconds
    after it (groups side by side). Alone, an item goes first when it is due before `start_by`. Behind others
    due before it, it counts the batches their rows fill too, so a crowd coming due together starts within
    the bound rather than queueing past it among itself (passed over while the queue grew, then all due).
    Rows are counted filling one at a time (next fit): never fewer than the batches' first fit fills."""
    by_due = sorted((n for n in live if n.due < math.inf), key=attrgetter("due", "arrival"))
    filled, free, last = 0, 0, 0
    for k, item in enumerate(by_due, 1):
        need = item.length if item.length < row_length else row_length   # `_fit`, inline: a loop over the queue
        if need > free:
            filled, free = filled + 1, row_length
        free -= need
        if item.due < start_by + (filled - 1) // rows * start_every:
            last = k
    return by_due[:last]


def _das(live: list[WaitingItem], row_length: int, rows: int, eta: float, q: float,
         start_by: float = math.inf, start_every: float = 0.0) -> tuple[list[list[WaitingItem]], list[int]]:
    """Alg. 1 over every row: rows of items and each row's p. The urgent items (`_urgent`) are placed first,
    earliest due first, first fit over the rows."""
    if not (0 < eta < 1 and 0 < q < 1 and math.isclose(eta + q, 1.0)):
        raise ValueError(f"DAS needs η, q in (0, 1) with η + q = 1 (TCB §5.2), got eta={eta}, q={q}")
    overdue = _urgent(live, row_length, rows, start_by, start_every)
    shortest = min(min((n.length for n in overdue), default=1), row_length)   # the least `_fit`
    taken: set[ItemId] = set()
    ranked, filled, prefixes = _by_utility(live), [], []    # sorted once: what is placed leaves it (`_drop`)
    order = _DeadlineOrder(list(ranked), taken)
    for _ in range(rows):
        row = _Row(row_length)
        row.fill(overdue, taken, shortest)
        _drop(ranked, row.items, taken)     # a new row holds only the urgent items just placed
        if not row.items and not ranked:
            break
        held = len(row.items)
        items, p = _das_row(ranked, row, eta, q, order)
        taken.update(n.id for n in items)   # in place: the deadline order reads the same set
        _drop(ranked, items[held:], taken)
        filled.append(items)
        prefixes.append(p)
    return filled, prefixes


def _batch(triage: _Triage, rows: list[list[WaitingItem]], row_length: int) -> Batch:
    scheduled = {n.id for row in rows for n in row}
    return Batch(rows=[[n.id for n in row] for row in rows], expired=triage.expired, too_long=triage.too_long,
                 waiting=[n.id for n in triage.live if n.id not in scheduled], row_length=row_length)


def das_rows(items: Iterable[WaitingItem], now: float, row_length: int, rows: int, eta: float = 0.5,
             q: float = 0.5, batch_latency: BatchLatency | None = None, oversize: Oversize = "alone",
             lanes: int = 1) -> Batch:
    """TCB Alg. 1 (DAS) for pure ConcatBatching: each row takes, among the items still waiting, the
    utility-dominant prefix (first ⌊η·s⌋ by utility, s = how many shortest fit a row), then the
    deadline-aware set (utility ≥ q·mean utility of that prefix) by earliest deadline, then the rest
    by utility, each first-fit. η + q = 1; η = q = 1/2 gives the 1/5-competitive bound (Thm. 5.1). Items due
    under the wait bound go first (`_urgent`); `lanes` groups run batches side by side."""
    _check(row_length, rows)
    estimate = _estimate(batch_latency, rows, row_length)
    triage = _triage(items, now, row_length, estimate, oversize)
    filled, _ = _das(triage.live, row_length, rows, eta, q, now + estimate, estimate / max(1, lanes))
    return _batch(triage, filled, row_length)


def slot_size(dominant_lengths: Iterable[int], row_length: int) -> int:
    """Alg. 2, line 4: z = the longest utility-dominant request (so none of them is discarded), capped
    at L, then widened to L // ⌊L/z⌋: the same number of slots a row, with no row tokens left unused."""
    longest = min(max(dominant_lengths, default=row_length), row_length)
    return row_length // (row_length // longest)


def first_fit_slots(items: Sequence[WaitingItem], slots: int, size: int) -> tuple[list[list[WaitingItem]],
                                                                                   list[WaitingItem]]:
    """Alg. 2, line 7: items, in order, into the first of `slots` slots of `size` tokens with room.
    Returns the non-empty slots and the items that found none (longer than z, or no room left)."""
    free, placed, left = [size] * slots, [[] for _ in range(slots)], []
    for item in items:
        target = next((k for k in range(slots) if free[k] >= item.length), None)
        if target is None:
            left.append(item)
            continue
        placed[target].append(item)
        free[target] -= item.length
    return [slot for slot in placed if slot], left


def slotted_das_rows(items: Iterable[WaitingItem], now: float, row_length: int, rows: int, eta: float = 0.5,
                     q: float = 0.5, batch_latency: BatchLatency | None = None,
                     oversize: Oversize = "alone", lanes: int = 1) -> Batch:
    """TCB Alg. 2: DAS chooses each row's candidates; z comes from the union of the rows'
    utility-dominant prefixes (`slot_size`); each row's candidates go first-fit into its L // z slots.
    Candidates that fit no slot (longer than z, or no room) go back to waiting; a lone oversize item
    keeps a row of its own as a single slot. The latency estimate is the pure batch's (slots only speed it up)."""
    _check(row_length, rows)
    estimate = _estimate(batch_latency, rows, row_length)
    triage = _triage(items, now, row_length, estimate, oversize)
    filled, prefixes = _das(triage.live, row_length, rows, eta, q, now + estimate, estimate / max(1, lanes))
    dominant = [n.length for row, p in zip(filled, prefixes, strict=True) for n in row[:p] if n.length <= row_length]
    z = slot_size(dominant, row_length)
    row_slots = [_slot_row(row, row_length, z) for row in filled]
    row_slots = [slots for slots in row_slots if slots]
    batch = _batch(triage, [[n for slot in slots for n in slot] for slots in row_slots], row_length)
    return replace(batch, slot_size=z, slots=[[[n.id for n in slot] for slot in slots] for slots in row_slots])


def _slot_row(row: list[WaitingItem], row_length: int, z: int) -> list[list[WaitingItem]]:
    if len(row) == 1 and row[0].length > row_length:     # a lone oversize item: its own row and slot
        return [row]
    slots, _ = first_fit_slots(row, row_length // z, z)
    return slots


def _ordered_rows(items: Iterable[WaitingItem], now: float, row_length: int, rows: int,
                  batch_latency: BatchLatency | None, oversize: Oversize,
                  order: Callable[[WaitingItem], tuple]) -> Batch:
    """The baselines: rows filled one after the other, first fit, in a fixed priority order."""
    _check(row_length, rows)
    triage = _triage(items, now, row_length, _estimate(batch_latency, rows, row_length), oversize)
    ranked, taken, filled = sorted(triage.live, key=order), set(), []
    for _ in range(rows):
        if len(taken) == len(ranked):
            break
        row = _Row(row_length)
        row.fill(ranked, taken)
        filled.append(row.items)
    return _batch(triage, filled, row_length)


def fcfs_rows(items: Iterable[WaitingItem], now: float, row_length: int, rows: int,
              batch_latency: BatchLatency | None = None, oversize: Oversize = "alone") -> Batch:
    """First come, first served (TCB §6.2.2's FCFS-TCB): arrival order, first fit."""
    return _ordered_rows(items, now, row_length, rows, batch_latency, oversize, lambda n: (n.arrival, n.deadline))


def sjf_rows(items: Iterable[WaitingItem], now: float, row_length: int, rows: int,
             batch_latency: BatchLatency | None = None, oversize: Oversize = "alone") -> Batch:
    """Shortest job first (SJF-TCB): length order, first fit."""
    return _ordered_rows(items, now, row_length, rows, batch_latency, oversize,
                         lambda n: (n.length, n.arrival))


def edf_rows(items: Iterable[WaitingItem], now: float, row_length: int, rows: int,
             batch_latency: BatchLatency | None = None, oversize: Oversize = "alone") -> Batch:
    """Earliest deadline first (TCB's DEF-TCB): deadline order, first fit."""
    return _ordered_rows(items, now, row_length, rows, batch_latency, oversize,
                         lambda n: (n.deadline, n.arrival))


@dataclass(frozen=True)
class Buckets:
    """Length-bucketed padded batches, most urgent first; each is padded to its longest item."""

    batches: list[list[ItemId]]
    expired: list[ItemId]


def padded_cost(size: int, longest: int) -> float:
    """Default cost of one padded batch, in token units: computed tokens plus a fixed per-batch cost."""
    return BATCH_OVERHEAD_TOKENS + size * longest


def bucketed_batches(items: Iterable[WaitingItem], now: float, max_batch: int,
                     batch_latency: BatchLatency | None = None) -> Buckets:
    """TurboBatching-like baseline (TurboTransformers' DP batching): sort by length, then split the
    sorted queue into contiguous batches of at most `max_batch` that minimise Σ cost(size, longest),
    cost = `batch_latency` (a profiled table) or `padded_cost`. Similar lengths share a batch and pad
    only to the longest of their bucket. An item expires when even the costliest of these batches would
    end past its deadline."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be at least 1")
    ranked = _by_utility(items)
    cost = batch_latency or padded_cost
    worst = _estimate(batch_latency, max_batch, ranked[-1].length) if ranked else 0.0
    live = [n for n in ranked if now + worst <= n.deadline]
    expired = [n.id for n in ranked if now + worst > n.deadline]
    groups = _split_min_cost([n.length for n in live], max_batch, cost)
    batches = [live[a:b] for a, b in groups]
    batches.sort(key=lambda batch: min(n.deadline for n in batch))
    return Buckets([[n.id for n in batch] for batch in batches], expired)


def _split_min_cost(lengths: Sequence[int], max_batch: int, cost: BatchLatency) -> list[tuple[int, int]]:
    """DP over sorted lengths: best[i] = min over j of best[j] + cost(i - j, lengths[i-1]); O(n·max_batch)."""
    best, cut = [0.0] + [math.inf] * len(lengths), [0] * (len(lengths) + 1)
    for i in range(1, len(lengths) + 1):
        for j in range(max(0, i - max_batch), i):
            total = best[j] + cost(i - j, lengths[i - 1])
            if total < best[i]:
                best[i], cut[i] = total, j
    groups, i = [], len(lengths)
    while i > 0:
        groups.append((cut[i], i))
        i = cut[i]
    return groups[::-1]
