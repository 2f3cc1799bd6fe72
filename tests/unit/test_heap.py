"""The serving processes' GC: pauses timed per generation, start-up's heap frozen, cycles still reclaimed; and
glibc's freed pages kept for STI's loader."""

from __future__ import annotations

import gc
import subprocess
import sys
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


FAULTS_OF_A_LAYER_BUILT_AGAIN = """
import resource, sys, threading
import numpy as np
if sys.argv[1] == "keep":
    from academus.shared.runtime.heap import keep_freed_pages
    assert keep_freed_pages()
faults = []
def loader():
    for _ in range(4):       # six matrices built on a thread of their own and dropped, as STI's loader does
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        layer = [np.ones(n, np.float32) for n in (147456,) * 4 + (589824,) * 2]
        del layer
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=loader)
thread.start()
thread.join()
print(max(faults[1:]))
"""


def test_freed_pages_kept_serve_the_next_layer_without_faults() -> None:
    """glibc's defaults map each matrix anew, and its 4.5 MB fault in again at every build."""
    def faults(arm: str) -> int:
        out = subprocess.run([sys.executable, "-c", FAULTS_OF_A_LAYER_BUILT_AGAIN, arm], check=True,
                             capture_output=True, text=True)
        return int(out.stdout.strip())

    assert faults("default") > 500
    assert faults("keep") < 50
