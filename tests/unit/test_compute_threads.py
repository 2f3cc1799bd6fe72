"""The workers' compute threads run under the configured Linux policy; the serving threads do not."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from academus.services.worker.compute_threads import (
    ComputePool,
    ComputeSaturation,
    YieldWhenSaturated,
    apply_compute_policy,
    policy_of_this_thread,
)
from academus.services.worker.server import EXITS_STOOD_DOWN, WorkerServicer
from academus.shared.runtime import config as cfg
from academus.shared.runtime.slices import autogroup_nice

CPU_RUNNER = SimpleNamespace(device=torch.device("cpu"))
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread policies are Linux's")


def on_compute(servicer: WorkerServicer, fn, times: int = 1) -> list:
    """`fn()` run `times` at once on the servicer's compute threads."""
    async def run() -> list:
        return list(await asyncio.gather(*(servicer.compute.run(fn) for _ in range(times))))

    return asyncio.run(run())


def in_new_thread(fn, *args):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


@linux
@pytest.mark.parametrize("name", ["idle", "batch", "normal"])
def test_the_policy_is_set_on_the_calling_thread_only(name: str) -> None:
    assert in_new_thread(apply_compute_policy, name) == name
    assert policy_of_this_thread() == "normal", "the rest of the process keeps the default policy"


@linux
def test_the_servicers_compute_threads_take_the_configured_policy() -> None:
    servicer = WorkerServicer(runner=CPU_RUNNER, worker_id="w", instances=2, compute_sched="idle")
    assert set(on_compute(servicer, policy_of_this_thread, times=4)) == {"idle"}
    old = servicer.compute.threads
    servicer.resize(1)   # the resource manager's answer: the new threads keep the policy
    assert on_compute(servicer, policy_of_this_thread) == ["idle"] and len(servicer.compute.threads) == 1
    for thread in old:   # the old pool's threads leave once their queue is drained
        thread.join(timeout=10)
        assert not thread.is_alive()
    assert on_compute(WorkerServicer(CPU_RUNNER, "w"), policy_of_this_thread) == ["normal"]


async def test_the_pool_returns_results_raises_errors_and_survives_a_caller_that_left() -> None:
    pool = ComputePool(1, "normal", torch.device("cpu"))
    assert await pool.run(sum, [1, 2, 3]) == 6
    with pytest.raises(ZeroDivisionError):
        await pool.run(lambda: 1 / 0)
    started, release = threading.Event(), threading.Event()
    waiting = asyncio.ensure_future(pool.run(lambda: started.set() or release.wait(10)))
    await asyncio.to_thread(started.wait, 10)
    waiting.cancel()             # the caller left while its batch ran: the answer has nowhere to go
    release.set()
    assert await pool.run(threading.current_thread) in pool.threads   # the thread serves the next batch
    pool.shutdown()


NICE_PROBE = """
import json, os, threading
from academus.services.worker.compute_threads import yield_cpu_to_serving
from academus.shared.runtime.slices import autogroup_nice
release = threading.Event()
early = threading.Thread(target=release.wait)
early.start()
in_force = yield_cpu_to_serving(7)
later = []
late = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
late.start(); late.join()
print(json.dumps({"in_force": in_force, "early": os.getpriority(os.PRIO_PROCESS, early.native_id),
                  "later": later[0], "autogroup": autogroup_nice()}))
release.set()
"""


def nice_probe(new_session: bool) -> dict:
    """The probe in a process of its own: a nice value, once raised, cannot be lowered back."""
    done = subprocess.run([sys.executable, "-c", NICE_PROBE], capture_output=True, text=True, check=True,
                          start_new_session=new_session)
    return json.loads(done.stdout)


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_a_worker_in_a_session_of_its_own_yields_the_cpu_with_its_autogroup_and_every_thread() -> None:
    seen = nice_probe(new_session=True)
    assert seen["in_force"] == {"autogroup": 7, "threads": 7}
    assert (seen["early"], seen["later"], seen["autogroup"]) == (7, 7, 7)


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_a_worker_in_a_shared_session_leaves_the_sessions_autogroup_alone() -> None:
    """Started from a terminal, it must not slow the terminal's other processes. The session's group may be
    the root one (in a container, say), whose nice value the kernel does not show."""
    ours = autogroup_nice()
    seen = nice_probe(new_session=False)
    assert seen["in_force"] == {"autogroup": None, "threads": 7}
    assert (seen["early"], seen["later"], seen["autogroup"]) == (7, 7, ours)


def test_equal_shares_are_the_default_and_a_nice_value_is_checked() -> None:
    assert cfg.load(cfg.WorkerConfig, env={}).compute_nice == 0
    assert cfg.load(cfg.WorkerConfig, env={"ACADEMUS_COMPUTE_NICE": "10"}).compute_nice == 10
    with pytest.raises(cfg.ConfigError, match=re.escape("ACADEMUS_COMPUTE_NICE=-5 must be in 0..19")):
        cfg.load(cfg.WorkerConfig, env={"ACADEMUS_COMPUTE_NICE": "-5"})


def test_normal_is_the_default_and_an_unknown_policy_is_refused() -> None:
    assert cfg.load(cfg.WorkerConfig, env={}).compute_sched == "normal"
    with pytest.raises(cfg.ConfigError, match=re.escape("ACADEMUS_COMPUTE_SCHED='fifo' must be idle|batch|normal")):
        cfg.load(cfg.WorkerConfig, env={"ACADEMUS_COMPUTE_SCHED": "fifo"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_each_compute_thread_has_its_own_stream() -> None:
    servicer = WorkerServicer(SimpleNamespace(device=torch.device("cuda:0")), "w", instances=2)
    barrier = threading.Barrier(2)

    def stream_of_this_thread() -> int:
        barrier.wait(timeout=10)   # both threads alive at once: two distinct executor threads
        return torch.cuda.current_stream().cuda_stream

    streams = set(on_compute(servicer, stream_of_this_thread, times=2))
    assert len(streams) == 2 and torch.cuda.default_stream().cuda_stream not in streams


@pytest.mark.parametrize("own_lane", [True, False])
async def test_a_student_groups_batch_does_not_wait_behind_a_whole_models_on_its_own_lane(own_lane: bool) -> None:
    """A worker in a teacher's deployment and a student deployment gets a batch of each at once: with the
    student lane, the students' batch runs while the teacher's holds its thread; on one queue (the ablation)
    it waits for it. Models the worker does not serve go to the whole models' lane."""
    runner = SimpleNamespace(device=torch.device("cpu"), models={"sentiment": SimpleNamespace(max_students=0),
                                                                 "sentiment-students": SimpleNamespace(max_students=2)})
    servicer = WorkerServicer(runner, "w", instances=1, student_lane=own_lane)
    teacher, students = SimpleNamespace(model="sentiment"), SimpleNamespace(model="sentiment-students")
    assert servicer._lane(SimpleNamespace(model="unknown")) is servicer._lane(teacher) is servicer.compute
    assert (servicer._lane(students) is servicer.compute) is not own_lane
    started, release = threading.Event(), threading.Event()
    long_batch = asyncio.ensure_future(servicer._lane(teacher).run(lambda: started.set() or release.wait(10)))
    await asyncio.to_thread(started.wait, 10)
    short_batch = asyncio.ensure_future(servicer._lane(students).run(threading.current_thread))
    done, _ = await asyncio.wait([short_batch], timeout=1.0)
    assert bool(done) is own_lane
    release.set()
    assert await long_batch is True
    assert await short_batch in servicer.student_compute.threads
    servicer.resize(2)   # the resource manager's answer: both lanes take the new count
    assert len(servicer.compute.threads) == len(servicer.student_compute.threads) == 2
    assert (servicer.student_compute is servicer.compute) is not own_lane


def test_a_pool_counts_its_threads_busy_seconds_the_running_batch_included() -> None:
    pool = ComputePool(2, "normal", torch.device("cpu"))
    started, release = threading.Event(), threading.Event()

    async def main() -> None:
        running = asyncio.ensure_future(pool.run(lambda: started.set() or release.wait(10)))
        await asyncio.to_thread(started.wait, 10)
        since = max(pool._since)
        assert pool.lanes == 2 and pool.busy_s(since + 0.5) == pytest.approx(0.5)   # one lane, half a second in
        release.set()
        await running

    asyncio.run(main())
    assert pool.busy_s() == pytest.approx(sum(pool._busy)) and pool.busy_s() > 0   # finished: its own seconds
    pool.shutdown()


class FakePool:
    """A pool whose busy seconds the test sets."""

    def __init__(self, lanes: int) -> None:
        self.lanes, self.busy = lanes, 0.0

    def busy_s(self, now: float) -> float:
        return self.busy


def test_the_compute_is_saturated_past_its_mark_and_relieved_below_the_lower_one() -> None:
    clock, pool, other = [0.0], FakePool(2), FakePool(1)
    saturation = ComputeSaturation(lambda: [pool, other], clock=lambda: clock[0])

    def look(seconds: float, busy: float) -> bool:   # `busy` of the 2-lane pool's lane-seconds in `seconds`
        clock[0] += seconds
        pool.busy += busy
        return saturation.tick()

    assert not saturation.tick()            # the first look only notes where the pools stand
    assert not look(1.0, 1.6)               # 80 % of its lanes: not saturated
    assert look(1.0, 1.9)                   # 95 %: saturated
    assert look(1.0, 1.5)                   # 75 %: still over the relief mark
    assert not look(1.0, 1.2)               # 60 %: relieved
    assert saturation.switches == 2


def test_a_saturated_worker_yields_and_comes_back_to_its_floor() -> None:
    writes: list[int] = []
    yielding = YieldWhenSaturated(10, floor=2, set_nice=lambda n: writes.append(n) or n)
    assert [yielding.follow(s) for s in (False, True, True, False)] == [False, True, True, False]
    assert writes == [10, 2] and yielding.switches == 2     # back at the floor, the fixed compute_nice


def test_a_refused_write_is_tried_again_at_the_next_look() -> None:
    answers = [None, 10]
    yielding = YieldWhenSaturated(10, set_nice=lambda n: answers.pop(0))
    for expected in (False, True):          # the kernel takes one write a tenth of a second, machine-wide
        assert yielding.follow(True) is expected


def test_nothing_yields_where_the_nice_value_would_not_move() -> None:
    assert YieldWhenSaturated.where_possible(0) is None
    assert YieldWhenSaturated.where_possible(3, floor=3) is None


SATURATION_PROBE = """
import asyncio, json, time, torch
from academus.services.worker.compute_threads import ComputePool, ComputeSaturation, YieldWhenSaturated
from academus.shared.runtime.slices import autogroup_nice

def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass

async def main():
    pool = ComputePool(1, "normal", torch.device("cpu"))
    saturation, yielding = ComputeSaturation(lambda: [pool]), YieldWhenSaturated(10)
    seen = [autogroup_nice()]
    saturation.tick()
    running = asyncio.ensure_future(pool.run(spin, 0.8))
    await asyncio.sleep(0.3)
    yielding.follow(saturation.tick())
    seen.append(autogroup_nice())
    await running
    await asyncio.sleep(0.5)
    yielding.follow(saturation.tick())
    seen.append(autogroup_nice())
    print(json.dumps(seen))

asyncio.run(main())
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_a_worker_yields_its_autogroup_while_its_compute_is_saturated_and_takes_it_back() -> None:
    """In a session of its own, as `academus up` starts it: the kernel's autogroup moves to 10 and back to 0."""
    done = subprocess.run([sys.executable, "-c", SATURATION_PROBE], capture_output=True, text=True, check=True,
                          start_new_session=True)
    assert json.loads(done.stdout) == [0, 10, 0]


def test_a_saturated_worker_yields_by_default_and_the_value_is_checked() -> None:
    assert cfg.load(cfg.WorkerConfig, env={}).saturated_nice == 10
    with pytest.raises(cfg.ConfigError, match=re.escape("ACADEMUS_SATURATED_NICE=20 must be in 0..19")):
        cfg.load(cfg.WorkerConfig, env={"ACADEMUS_SATURATED_NICE": "20"})


async def test_a_saturated_worker_runs_batches_that_ask_for_early_exits_without_ramps() -> None:
    """Early answers go to a call that asked for them and can take them, unless the compute is saturated; with
    `exits_when_saturated` they go on regardless."""
    sent: list = []
    call = SimpleNamespace(send_partial=sent.append)
    batch = SimpleNamespace(early_exit=True, model="spam", output="probs")
    runner = SimpleNamespace(device=torch.device("cpu"), runs_ramps=lambda model: model == "spam")
    for exits_when_saturated, gated in ((False, True), (True, False)):
        servicer = WorkerServicer(runner, "w", exits_when_saturated=exits_when_saturated)
        assert servicer._releaser(batch, call) is not None
        assert servicer._releaser(SimpleNamespace(early_exit=False), call) is None
        servicer.saturation.saturated = True
        stood_down = EXITS_STOOD_DOWN.labels("spam")._value.get()
        assert (servicer._releaser(batch, call) is None) is gated
        assert EXITS_STOOD_DOWN.labels("spam")._value.get() == stood_down + gated
        servicer.saturation.saturated = False
        assert servicer._releaser(batch, call) is not None
