"""A serving process's event loop watched. Everything a service does runs on one loop, so whatever holds it up
(a long callback, a collection, the process waiting for a core) delays every call it has in hand: a refusal at
the gateway's edge costs no hop, yet can take as long as the longest hold-up.

- `watch_lag`: a timer every LAG_PERIOD_S, its lateness into `academus_event_loop_lag_seconds`. Any hold-up of a
  period or more delays one of them, so the histogram's top buckets count the hold-ups; it costs ten wake-ups a
  second.
- `StallTracer` (setting `loop_stall_ms`, off by default): a thread that samples the loop thread's Python stack
  while the loop has not run for longer than that, and logs each hold-up as a `loop_stall` event: how long,
  the collector's share of it, the loop thread's CPU time in it, and the stacks it saw most. A hold-up with
  little CPU time is a wait: for a core, or for the hypervisor. The thread cannot sample during a collection (it
  holds the GIL); a stack ending in the loop runner means the loop was in C (uvloop's poll, gRPC's completion
  callbacks) or the process had no core.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import NamedTuple

from prometheus_client import Counter, Histogram

from academus.shared.runtime.heap import paused_s
from academus.shared.runtime.logs import log_event

LAG_PERIOD_S = 0.1
LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
STACK_FRAMES = 12        # innermost frames kept a sample: enough to name the caller of what held the loop
STACKS_LOGGED = 3        # the most seen stacks a stall's event names

LOOP_LAG = Histogram("academus_event_loop_lag_seconds", "How late a timer of the service's event loop fired",
                     ["service"], buckets=LAG_BUCKETS)
LOOP_STALLS = Counter("academus_event_loop_stalls_total", "Hold-ups of the event loop past `loop_stall_ms` "
                      "(counted where the stall tracer runs)", ["service"])


async def watch_lag(service: str, period_s: float = LAG_PERIOD_S,
                    clock: Callable[[], float] = time.perf_counter) -> None:
    """Observes, for ever, how late a `period_s` sleep of this loop ends."""
    lag = LOOP_LAG.labels(service)
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        lag.observe(max(clock() - due, 0.0))


def stack_of(frame: FrameType | None) -> tuple[str, ...]:
    """A frame's innermost STACK_FRAMES as `file:line function`, innermost first."""
    out: list[str] = []
    while frame is not None and len(out) < STACK_FRAMES:
        code = frame.f_code
        out.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(out)


class Beat(NamedTuple):
    """The loop ran: when, the collector's seconds so far, and the loop thread's CPU seconds so far."""

    at: float
    paused: float
    cpu: float


@dataclass
class Stall:
    """One hold-up as the tracer saw it: the loop's last beat before it (a `Beat`), and the stacks sampled since."""

    since: Beat
    stacks: Tally = field(default_factory=Tally)

    def report(self, ended: Beat) -> dict:
        """`ms`: from the loop's last beat before the stall to its first after (beats are `threshold / 2` apart);
        `collector_ms`: the collections between them; `cpu_ms`: the loop thread's CPU time between them."""
        seen = sum(self.stacks.values())
        return {"ms": round((ended.at - self.since.at) * 1e3, 1),
                "collector_ms": round((ended.paused - self.since.paused) * 1e3, 1),
                "cpu_ms": round((ended.cpu - self.since.cpu) * 1e3, 1), "samples": seen,
                "stacks": [{"share": round(n / seen, 2), "frames": list(s)}
                           for s, n in self.stacks.most_common(STACKS_LOGGED)]}


class StallTracer:
    """The loop beats every `threshold_s / 2`; a thread checks the beat every `sample_s`. Past `threshold_s`
    without one, it samples the loop thread's stack each check until the loop beats again, then logs the
    stall (from the thread, so the loop pays nothing for it)."""

    def __init__(self, service: str, threshold_s: float, sample_s: float = 0.002,
                 clock: Callable[[], float] = time.perf_counter,
                 paused: Callable[[], float] | None = None,
                 cpu: Callable[[], float] = time.thread_time,
                 report: Callable[[dict], None] | None = None) -> None:
        self.service = service
        self.threshold_s = threshold_s
        self.sample_s = sample_s
        self.clock = clock
        self.paused = paused or (lambda: paused_s(service))   # the service's own watch: each collection timed once
        self.cpu = cpu
        self.report = report or self._log
        self.beat = Beat(clock(), self.paused(), cpu())   # one tuple: the thread reads one beat's figures together
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stalls = LOOP_STALLS.labels(service)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """From the loop's thread: beats begin, and the sampling thread."""
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._on_beat()
        self._thread = threading.Thread(target=self._run, name=f"{self.service}-stall-tracer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _on_beat(self) -> None:
        self.beat = Beat(self.clock(), self.paused(), self.cpu())
        if not self._stop.is_set() and self._loop is not None:
            self._loop.call_later(self.threshold_s / 2, self._on_beat)

    def _run(self) -> None:
        stall: Stall | None = None
        while not self._stop.wait(self.sample_s):
            stall = self.check(stall)

    def check(self, stall: Stall | None) -> Stall | None:
        """One look at the beat: a stall begun or going on gets the loop's stack; one ended is reported."""
        beat = self.beat
        if stall is not None and stall.since != beat:   # the loop ran again: held from its last beat to this one
            self._stalls.inc()
            self.report(stall.report(beat))
            stall = None
        if self.clock() - beat.at > self.threshold_s:
            stall = stall or Stall(beat)
            stall.stacks[stack_of(sys._current_frames().get(self._loop_thread))] += 1
        return stall

    def _log(self, stall: dict) -> None:
        log_event("loop_stall", service=self.service, threshold_ms=round(self.threshold_s * 1e3, 1), **stall)
