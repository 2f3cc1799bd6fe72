"""The heap of a serving process: the cyclic garbage collector's pauses measured and start-up's objects frozen;
and glibc's freed pages kept for reuse (`keep_freed_pages`, set at a process's start).

A worker holds ~400k long-lived objects once torch, transformers and the models are loaded; a full
(generation 2) collection walks every one of them, which took 130-270 ms on this project's 2-core box,
and stalls every request the process is handling. Those objects are never garbage, so once the
service is started they are moved to the permanent generation (`gc.freeze`): later collections walk
only what was allocated while serving. Collections still run, so reference cycles made while serving
are still reclaimed.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import time
from collections.abc import Callable

from prometheus_client import Counter, Histogram

GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

GC_PAUSE = Histogram("academus_gc_pause_seconds", "Cyclic garbage collections: how long each stopped the process",
                     ["service", "generation"], buckets=GC_BUCKETS)
GC_FROZEN = Counter("academus_gc_frozen_objects_total", "Objects moved out of the collector's reach at start-up",
                    ["service"])


class PauseWatch:
    """A `gc.callbacks` entry timing each collection into GC_PAUSE (one per process and service), and into
    `paused_s`, the running total the loop's stall tracer reads (runtime/loop_watch.py)."""

    def __init__(self, service: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.paused_s = 0.0
        self._started = 0.0
        self._pauses = [GC_PAUSE.labels(service, str(g)) for g in range(3)]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
        else:
            took = self.clock() - self._started
            self.paused_s += took
            self._pauses[info["generation"]].observe(took)


_watches: dict[str, PauseWatch] = {}


def paused_s(service: str) -> float:
    """Seconds the collector has stopped the process since `watch_pauses(service)`; 0 before."""
    watch = _watches.get(service)
    return watch.paused_s if watch is not None else 0.0


def watch_pauses(service: str) -> PauseWatch:
    """Times this process's collections for `service`; idempotent (in-process tests start many services)."""
    watch = _watches.get(service)
    if watch is None:
        watch = _watches[service] = PauseWatch(service)
        gc.callbacks.append(watch)
    return watch


def freeze_start_up_heap(service: str) -> int:
    """Collects once, then moves every surviving object to the permanent generation; returns how many
    are frozen now. Called once a service has loaded what it serves, before it is announced: what it
    loaded stays for its lifetime."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    GC_FROZEN.labels(service).inc(frozen)
    return frozen


# glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20      # glibc's largest: bigger blocks are mapped whatever is set
TRIM_THRESHOLD = 256 << 20


@functools.cache
def keep_freed_pages() -> bool:
    """Blocks up to 32 MiB come from the heap, and up to 256 MiB of freed heap stays mapped, for the process's
    life. By default glibc maps a large block anew each time, and the kernel zeroes and faults in its pages, then
    unmaps it (interrupting the other cores) when it is freed: each run's STI layers and a batch's larger
    tensors. On the 2-core machine that cost a full-precision shard's load 0.14 ms of its 0.34, and the teacher
    a tenth of an 8x64 batch (docs/benchmarks/sti.md, scheduling.md). Returns whether glibc took both."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):      # not glibc: its allocator's own policy stands
        return False
