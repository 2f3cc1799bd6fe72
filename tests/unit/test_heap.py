"""The serving processes' GC: pauses timed per generation, start-up's heap frozen, cycles still reclaimed."""

from __future__ import annotations

import gc
import weakref

import pytest
from prometheus_client import REGISTRY

from academus.shared.runtime.heap import PauseWatch, freeze_start_up_heap, watch_pauses


def pause_count(service: str, generation: int) -> tuple[float, float]:
    """(seconds, collections) the histogram holds for one generation."""
    labels = {"service": service, "generation": str(generation)}
    return tuple(REGISTRY.get_sample_value(f"academus_gc_pause_seconds_{part}", labels) or 0.0
                 for part in ("sum", "count"))


class Node:
    """An object that can sit in a reference cycle and be watched for collection."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()   # the rest of the test process collects as usual


def test_a_pause_is_timed_into_its_generation() -> None:
    now = iter([10.0, 10.25])
    watch = PauseWatch("heap-fake", clock=lambda: next(now))
    watch("start", {"generation": 2})
    watch("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    total, count = pause_count("heap-fake", 2)
    assert (total, count) == (0.25, 1)
    assert pause_count("heap-fake", 0) == (0, 0)


def test_real_collections_are_watched_once_per_service() -> None:
    watch = watch_pauses("heap-real")
    assert watch_pauses("heap-real") is watch and gc.callbacks.count(watch) == 1
    try:
        before = pause_count("heap-real", 1)[1]
        gc.collect(1)
        gc.collect(1)
        assert pause_count("heap-real", 1)[1] == before + 2
    finally:
        gc.callbacks.remove(watch)


def test_frozen_objects_leave_the_collectors_walk_and_new_cycles_are_still_reclaimed(unfrozen) -> None:
    kept = [Node() for _ in range(1000)]
    frozen = freeze_start_up_heap("heap-freeze")
    # a frozen object freed since (by a thread an earlier test left behind) leaves the count: it can only drop
    assert frozen >= len(kept) and frozen - 100 <= gc.get_freeze_count() <= frozen
    assert REGISTRY.get_sample_value("academus_gc_frozen_objects_total", {"service": "heap-freeze"}) == frozen
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(node) in tracked for node in kept)

    a, b = Node(), Node()          # a cycle made while serving: only the collector can free it
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
