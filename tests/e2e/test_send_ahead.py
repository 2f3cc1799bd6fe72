"""The opt-in serving settings on the real mesh. ACADEMUS_SEND_AHEAD: busy student groups are sent their
next element while they run one, every request is answered, and a worker killed with an element queued
behind its running one loses no request. ACADEMUS_HOP_SLICE_US: every service thread runs on the short
slice, the workers' compute threads on the kernel's. ACADEMUS_COMPUTE_NICE: the workers yield the CPU to the
control plane, their autogroups and every thread niced, the gateway's and scheduler's not."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from academus.client import AcademusError
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up, wait_exit
from academus.shared.runtime.slices import autogroup_nice, process_slices_ns, thread_ids, thread_slice_ns
from academus.shared.state.keys import Keys
from tests.conftest import NO_WAIT_BOUND, small_student_artifacts
from tests.e2e.conftest import metric, service
from tests.e2e.test_student_parallelism import MODEL, TEXT, burst, table, wait_for
from tests.unit.test_slices import kernel_slice_ns

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    artifacts: Path = small_student_artifacts(tmp_path_factory.mktemp("ahead-artifacts"), best_k=1)
    run_dir = tmp_path_factory.mktemp("ahead-run")
    state = up(MeshOptions(
        run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=2, worker_threads=1, instances=1,
        deployments=[Deployment("student", MODEL)],
        env={"ACADEMUS_MODELS": MODEL, "ACADEMUS_SEND_AHEAD": "true", "ACADEMUS_ADAPT_WINDOW_S": "600",
             "ACADEMUS_QUEUE_CAPACITY": "200", "ACADEMUS_GRACE_S": "10", "ACADEMUS_HOP_SLICE_US": "100",
             "ACADEMUS_COMPUTE_NICE": "5", **NO_WAIT_BOUND}))   # a burst on a slow machine is queued, not refused
    state.key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
    r = redis.Redis.from_url(state.redis_url, decode_responses=True)
    r.set(Keys(state.key_prefix).students(MODEL), 1)  # two one-student groups, one on each worker
    wait_for(lambda: table(state).get("students") == 1 and len(table(state)["groups"]) == 2, what="S = 1")
    yield state
    down(run_dir)


def sent_ahead(state) -> float:
    return metric(service(state, "scheduler").metrics_port, "academus_scheduler_sent_ahead_total")


def test_busy_groups_are_sent_their_next_element_and_every_request_is_answered(mesh):
    answers = asyncio.run(burst(mesh, 24, " ".join([TEXT] * 3), timeout=60))
    assert not [a for a in answers if isinstance(a, AcademusError)]
    assert {a.metadata.worker_id for a in answers} == {"worker-0", "worker-1"}
    wait_for(lambda: sent_ahead(mesh) >= 1, what="elements sent ahead to busy groups")


@pytest.mark.skipif(thread_slice_ns() is None, reason="the kernel shows no se.slice")
def test_the_services_threads_run_on_the_hop_slice_and_the_compute_threads_on_the_kernels(mesh):
    """Asked for in each service's main thread before any other starts; a compute thread resets its own."""
    assert not [a for a in asyncio.run(burst(mesh, 8, TEXT, timeout=60)) if isinstance(a, AcademusError)]
    kernel = kernel_slice_ns()
    slices = {s.name: Counter(process_slices_ns(s.pid)) for s in mesh.services}
    for name, seen in slices.items():
        if name.startswith("worker"):
            assert seen.pop(kernel, 0) >= 1, f"{name}: its compute thread on the kernel's slice: {slices}"
        assert set(seen) == {100_000}, f"{name}: every other thread on 0.1 ms: {slices}"


def niceness(pid: int) -> tuple[int, set[int]]:
    """A process's autogroup nice value and its threads' nice values."""
    return autogroup_nice(pid), {os.getpriority(os.PRIO_PROCESS, tid) for tid in thread_ids(pid)}


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_the_workers_yield_the_cpu_to_the_gateway_and_scheduler(mesh):
    """Each service runs in a session, so an autogroup, of its own; the workers' threads started after the
    setting (compute, torch's) inherit it."""
    assert not [a for a in asyncio.run(burst(mesh, 8, TEXT, timeout=60)) if isinstance(a, AcademusError)]
    seen = {s.name: niceness(s.pid) for s in mesh.services}
    assert seen == {name: (5, {5}) if name.startswith("worker") else (0, {0}) for name in seen}
    assert {"worker-0", "worker-1", "gateway", "scheduler"} <= set(seen)


def test_a_worker_killed_with_an_element_sent_ahead_loses_no_request(mesh):
    workers = [s for s in mesh.services if s.name.startswith("worker-")]
    before = sent_ahead(mesh)

    def queued_behind() -> object | None:  # a worker running one call with another waiting behind it
        return next((w for w in workers if metric(w.metrics_port, "academus_rpc_in_flight", service="worker",
                                                  method="Run") >= 2), None)

    async def kill_under_load():
        pending = asyncio.create_task(burst(mesh, 80, " ".join([TEXT] * 4), timeout=60))  # all at once
        end, victim = time.monotonic() + 30, None
        while time.monotonic() < end and (victim := await asyncio.to_thread(queued_behind)) is None:
            await asyncio.sleep(0.005)
        assert victim is not None, "no worker held an element sent ahead"
        os.kill(victim.pid, signal.SIGKILL)
        return victim, await pending

    victim, answers = asyncio.run(kill_under_load())
    assert wait_exit(victim.pid, 10)
    assert not [a.code for a in answers if isinstance(a, AcademusError)]
    survivor = next(w.name for w in workers if w is not victim)
    assert {a.metadata.worker_id for a in answers if a.metadata.attempts > 1} == {survivor}
    assert any(a.metadata.attempts > 1 for a in answers)
    wait_for(lambda: sent_ahead(mesh) > before, what="the gauge to count this burst's elements sent ahead")
