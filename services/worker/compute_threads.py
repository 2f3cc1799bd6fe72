"""The compute threads' Linux scheduling policy (WorkerConfig.compute_sched).

On a CPU node a forward pass shares the cores with every serving thread of the node: the event loops
and gRPC threads of gateway, scheduler and workers, whose work for a request is a few short bursts, one
a hop. Under the fair scheduler a thread that wakes on a core held by a compute thread may wait for
that thread's slice (EEVDF lets the running task reach parity first): once a hop, on every request.
A SCHED_IDLE compute thread is preempted by any other thread at once, so a hop never waits behind a
forward pass, and the forward pass still has the core whenever nothing else wants it. Its process's
CPU share against other processes is unchanged where each service runs in its own autogroup or cgroup
(`academus up` starts each in its own session; Kubernetes, each in its own container): that share is
WorkerConfig.compute_nice's (`yield_cpu_to_serving`). On a GPU the
compute threads mostly wait for the device, and the policy changes little.

The default is `normal`: on this project's 2-core box `idle` bought 0-6 % of the students' latency at
half load and 3 % of goodput at 3x overload (loadgen/half_load_bench, overload_bench --ablate
compute_sched; docs/benchmarks/scheduling.md), inside the noise between runs, while where autogroups are off
and services
share one cgroup a front end saturating the cores would starve SCHED_IDLE compute outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch
from prometheus_client import Gauge

from academus.shared.runtime.logs import log_event
from academus.shared.runtime.slices import owns_autogroup, reset_slice, set_autogroup_nice, thread_ids

T = TypeVar("T")
POLICIES = {"idle": "SCHED_IDLE", "batch": "SCHED_BATCH", "normal": "SCHED_OTHER"}


def policy_of_this_thread() -> str:
    """The calling thread's policy, by its config name ("normal" where the OS cannot say)."""
    if not hasattr(os, "sched_getscheduler"):
        return "normal"
    current = os.sched_getscheduler(0)
    return next((name for name, const in POLICIES.items() if getattr(os, const, None) == current), "normal")


def apply_compute_policy(name: str) -> str:
    """Sets the calling thread's policy (pid 0 is this thread on Linux); returns the one now in force:
    "normal" where the OS has no such policy."""
    policy = getattr(os, POLICIES[name], None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return "normal"
    os.sched_setscheduler(0, policy, os.sched_param(0))
    return policy_of_this_thread()


def yield_cpu_to_serving(nice: int) -> dict[str, int | None]:
    """The worker's CPU share below the control plane's (WorkerConfig.compute_nice): the nice value of this process's
    autogroup, and of each of its threads. `academus up` starts each service in a session of its own, and so
    in an autogroup of its own, whose nice value sets its share against the others'; a thread's own nice value
    counts only against threads of its group (a container's cgroup, where autogroups do not apply). The
    autogroup's is set only by a session leader: in a terminal's session it would slow the terminal too.
    Raising a nice value needs no privilege. Returns what is in force (None: the OS has no such knob)."""
    if nice <= 0 or not Path("/proc/self/task").is_dir():   # off, or not Linux
        return {"autogroup": None, "threads": None}
    return {"autogroup": set_autogroup_nice(nice), "threads": min(_nice_thread(tid, nice) for tid in thread_ids())}


def _nice_thread(tid: int, nice: int) -> int:
    """The thread's nice value raised to `nice` (never lowered: that would need a privilege); the value now."""
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:   # the thread ended meanwhile
        return nice


def start_compute_thread(sched: str, device: torch.device) -> None:
    """A compute thread's initializer: the kernel's default slice (it inherited the serving threads'
    short one, shared/runtime/slices.py), its scheduling policy and, on a GPU, a CUDA stream of its own.
    PyTorch's current stream is per thread, so the instances of one worker overlap on the device instead
    of queueing on the default stream (under MPS, worker processes overlap anyway)."""
    reset_slice()
    apply_compute_policy(sched)
    if device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device))


class ComputePool:
    """`instances` compute threads fed from one queue. A batch's hand-off is one `put` and, back, one
    `call_soon_threadsafe`: `run_in_executor` adds a concurrent Future, its lock and condition and a chained
    callback each way, about 25 µs of the worker's CPU a batch (docs/design/hops.md). The threads are daemons:
    a batch still running when the process exits is the caller's to retry (the scheduler does). Each thread
    counts the seconds it spent on batches (`busy_s`)."""

    def __init__(self, instances: int, sched: str, device: torch.device) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        lanes = max(1, instances)
        self._busy = [0.0] * lanes      # a thread's finished batches' seconds
        self._since = [0.0] * lanes     # when its running batch began; 0: none runs
        self.threads = [threading.Thread(target=self._work, args=(k, sched, device), name=f"compute-{k}",
                                         daemon=True) for k in range(lanes)]
        for thread in self.threads:
            thread.start()

    @property
    def lanes(self) -> int:
        return len(self.threads)

    def busy_s(self, now: float | None = None) -> float:
        """Seconds the threads have spent on batches, the running ones' so far included."""
        now = time.monotonic() if now is None else now
        return sum(self._busy) + sum(now - since for since in self._since if since)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a compute thread, awaited on the calling event loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((fn, args, loop, future))
        return await future

    def shutdown(self) -> None:
        """The threads leave once the batches queued before this have run."""
        for _ in self.threads:
            self._queue.put(None)

    def _work(self, lane: int, sched: str, device: torch.device) -> None:
        start_compute_thread(sched, device)
        while (task := self._queue.get()) is not None:
            fn, args, loop, future = task
            self._since[lane] = began = time.monotonic()
            try:
                outcome = (fn(*args), None)
            except BaseException as e:   # the caller's to see, whatever it is
                outcome = (None, e)
            self._busy[lane] += time.monotonic() - began
            self._since[lane] = 0.0
            with contextlib.suppress(RuntimeError):   # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, *outcome)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.cancelled():   # the caller left; the batch ran (or stopped) anyway
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


SATURATED = 0.9     # a pool busy this share of its lanes' time or more: the worker's compute is saturated
RELIEVED = 0.7      # every pool below this: it no longer is
SATURATION_PERIOD_S = 1.0
SATURATED_GAUGE = Gauge("academus_worker_compute_saturated", "1 while the worker's busiest compute pool is busy "
                        "90 % of its lanes' time or more, until every pool is under 70 %; 0 otherwise")
YIELDING = Gauge("academus_worker_saturation_yield", "The nice value the worker's autogroup holds because its compute "
                 "is saturated (saturated_nice); 0 while it is not")


class ComputeSaturation:
    """Whether the worker's compute is saturated: its busiest pool busy SATURATED of its lanes' time or more since
    the last look, until every pool is under RELIEVED. A saturated worker runs batches back to back, so whatever
    else it spends on a batch comes out of its capacity; what it gives up then follows this (`YieldWhenSaturated`,
    the exit ramps)."""

    def __init__(self, pools: Callable[[], Iterable[ComputePool]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = pools
        self.clock = clock
        self.saturated = False
        self.switches = 0
        self._last: dict[int, tuple[float, float]] = {}   # id(pool) -> (when, its busy seconds then)

    def busiest_share(self) -> float | None:
        """The busiest pool's share of its lanes' time since the last look (None: no pool seen twice)."""
        now, shares, last = self.clock(), [], {}
        for pool in self.pools():
            busy = pool.busy_s(now)
            seen = self._last.get(id(pool))
            if seen is not None and now > seen[0]:
                shares.append((busy - seen[1]) / ((now - seen[0]) * pool.lanes))
            last[id(pool)] = (now, busy)
        self._last = last
        return max(shares, default=None)

    def tick(self) -> bool:
        """One look; whether the compute is saturated now."""
        share = self.busiest_share()
        if share is not None:
            saturated = share >= SATURATED or (self.saturated and share >= RELIEVED)
            if saturated != self.saturated:
                self.saturated, self.switches = saturated, self.switches + 1
                SATURATED_GAUGE.set(int(saturated))
                log_event("compute_saturated", saturated=saturated, busiest_share=round(share, 3))
        return self.saturated

    async def run(self, yielding: YieldWhenSaturated | None = None,
                  period_s: float = SATURATION_PERIOD_S) -> None:
        """Looks every `period_s`, for ever, and has `yielding` follow each look."""
        while True:
            saturated = self.tick()
            if yielding is not None:
                yielding.follow(saturated)
            await asyncio.sleep(period_s)


class YieldWhenSaturated:
    """The worker's autogroup at `nice` while its compute is saturated (`ComputeSaturation`), back at `floor` (the
    fixed `compute_nice`, 0 by default) once it is not (WorkerConfig.saturated_nice). A saturated worker's compute
    threads are always runnable, and its autogroup takes its equal share of the cores whatever the control plane
    waits for: at twice the capacity the gateway's loop waited for a core up to 0.13 s at a time, and refused late
    (docs/benchmarks/reliability.md). Below saturation the compute threads sleep between batches and the shares
    stay equal, so a half-loaded node's forward passes are not preempted more (the cost that keeps a fixed
    `compute_nice` an opt-in). Only the autogroup moves: a thread's nice value, once raised, would need a
    privilege to come back down."""

    def __init__(self, nice: int, floor: int = 0, set_nice: Callable[[int], int | None] = set_autogroup_nice) -> None:
        self.nice = nice
        self.floor = floor   # the fixed `compute_nice`: what it comes back to
        self.set_nice = set_nice
        self.yielding = False
        self.switches = 0

    @classmethod
    def where_possible(cls, nice: int, floor: int = 0) -> YieldWhenSaturated | None:
        """None where nothing would move: `nice` not above `floor`, or the process has no autogroup of its own (not
        Linux, autogroups off, or not a session leader)."""
        return cls(nice, floor) if nice > floor and owns_autogroup() else None

    def follow(self, saturated: bool) -> bool:
        """The autogroup moved to where `saturated` wants it; whether it yields now. A write the kernel refuses (it
        takes one a tenth of a second, machine-wide) is tried again at the next look."""
        if saturated != self.yielding:
            target = self.nice if saturated else self.floor
            if self.set_nice(target) == target:
                self.yielding, self.switches = saturated, self.switches + 1
                YIELDING.set(target if saturated else 0)
                log_event("saturation_yield", yielding=saturated)
        return self.yielding
