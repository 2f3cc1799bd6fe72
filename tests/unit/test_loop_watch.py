"""The event loop watched: its timers' lateness measured, and its hold-ups traced to the code that held it."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable

from prometheus_client import REGISTRY

from academus.shared.runtime.heap import paused_s, watch_pauses
from academus.shared.runtime.loop_watch import Beat, StallTracer, stack_of, watch_lag


def sample(name: str, service: str, le: str = "") -> float:
    labels = {"service": service} | ({"le": le} if le else {})
    return REGISTRY.get_sample_value(name, labels) or 0.0


def hold_the_loop(seconds: float) -> None:
    """Python code that keeps the loop's thread busy, as a long callback would."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_held_loop_shows_as_a_late_timer() -> None:
    async def main() -> None:
        watching = asyncio.create_task(watch_lag("lag-test", period_s=0.02))
        await asyncio.sleep(0.05)
        hold_the_loop(0.15)
        await asyncio.sleep(0.05)
        watching.cancel()

    asyncio.run(main())
    timers = sample("academus_event_loop_lag_seconds_count", "lag-test")
    on_time = sample("academus_event_loop_lag_seconds_bucket", "lag-test", "0.1")
    assert timers >= 3
    assert timers - on_time >= 1   # the timer due during the hold fired 0.1 s late or more


class Beats:
    """A clock the test moves, and the reports a tracer makes."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reports: list[dict] = []


def test_a_stall_is_sampled_while_it_lasts_and_reported_once_the_loop_beats() -> None:
    beats = Beats()
    tracer = StallTracer("stall-fake", threshold_s=0.05, clock=lambda: beats.now, report=beats.reports.append)
    tracer._loop_thread = threading.get_ident()   # its samples are this thread's stack
    tracer.beat = Beat(1.0, 2.0, 5.0)
    beats.now = 1.04
    assert tracer.check(None) is None   # within the threshold: no stall
    stall = None
    for now in (1.06, 1.08, 1.10):
        beats.now = now
        stall = tracer.check(stall)
    assert stall is not None and sum(stall.stacks.values()) == 3 and not beats.reports
    beats.now = 1.12
    tracer.beat = Beat(1.12, 2.07, 5.08)   # the loop ran again: a collection of 70 ms, 80 ms of its CPU
    assert tracer.check(stall) is None
    [report] = beats.reports
    assert report["ms"] == 120.0 and report["collector_ms"] == 70.0 and report["cpu_ms"] == 80.0
    assert report["samples"] == 3
    assert report["stacks"][0]["share"] == 1.0
    assert "test_loop_watch.py" in report["stacks"][0]["frames"][1]   # the frame below check(): this test


def test_a_new_stall_right_after_one_is_reported_apart() -> None:
    beats = Beats()
    tracer = StallTracer("stall-fake-2", threshold_s=0.05, clock=lambda: beats.now, report=beats.reports.append)
    tracer._loop_thread = threading.get_ident()
    tracer.beat, beats.now = Beat(0.0, 0.0, 0.0), 0.2
    stall = tracer.check(None)
    tracer.beat, beats.now = Beat(0.3, 0.0, 0.0), 0.5   # the loop beat once, then stalled again before the next look
    stall = tracer.check(stall)
    assert [r["ms"] for r in beats.reports] == [300.0]
    assert stall is not None and stall.since == Beat(0.3, 0.0, 0.0)


def stalls_while(service: str, hold: Callable[[], None]) -> list[dict]:
    """The stalls a 30 ms tracer on a real loop reports while `hold()` runs on the loop."""
    reports: list[dict] = []

    async def main() -> None:
        tracer = StallTracer(service, threshold_s=0.03, report=reports.append)
        tracer.start(asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        hold()
        await asyncio.sleep(0.1)   # the loop beats again, and the thread reports
        tracer.stop()

    asyncio.run(main())
    return reports


def test_the_tracer_names_the_code_that_held_a_real_loop() -> None:
    before = sample("academus_event_loop_stalls_total", "stall-real")
    reports = stalls_while("stall-real", lambda: hold_the_loop(0.3))
    held = [r for r in reports if any("hold_the_loop" in s["frames"][0] for s in r["stacks"])]
    assert held, reports
    longest = max(held, key=lambda r: r["ms"])
    assert longest["ms"] >= 270   # the beats around the hold are 0.3 s apart or more
    assert longest["cpu_ms"] >= 50   # the loop's thread spun through it (a core shared with a busy machine)
    assert sample("academus_event_loop_stalls_total", "stall-real") - before == len(reports)


def test_a_collection_during_a_stall_is_its_share() -> None:
    def collect() -> None:
        with_garbage = [[object() for _ in range(50)] for _ in range(20_000)]   # a million objects to walk
        started = paused_s("stall-gc")
        while paused_s("stall-gc") - started < 0.05:   # collections until they stopped the loop 50 ms
            gc.collect()
        del with_garbage

    watch_pauses("stall-gc")
    reports = stalls_while("stall-gc", collect)
    assert any(r["collector_ms"] >= 40 for r in reports), reports


def test_a_stack_is_its_innermost_frames_first() -> None:
    def inner():
        import sys
        return stack_of(sys._getframe())

    frames = inner()
    assert frames[0].startswith("unit/test_loop_watch.py:") and frames[0].endswith(" inner")
    assert frames[1].endswith(" test_a_stack_is_its_innermost_frames_first")
