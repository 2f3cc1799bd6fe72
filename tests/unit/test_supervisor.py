"""The supervisor's restart plan: when a dead process is started again (times passed in, nothing waits); and a
mesh's owner: the supervisor stops the mesh once the process that started it has ended."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from academus.shared.cli.mesh import STATE_FILE, MeshState, ServiceProcess, pid_alive
from academus.shared.cli.supervisor import Backoff, RestartPlan, Supervisor


def crash_loop(plan: RestartPlan, name: str, times: int, start: float = 0.0, up_s: float = 0.0) -> list[float]:
    """The waits before each restart of a process that dies `up_s` after each start, `times` times."""
    now, waits = start, []
    for _ in range(times):
        now += up_s
        waits.append(plan.exited(name, now))
        now += waits[-1]
        assert plan.due(now) == [name]
        plan.restarted(name, now)
    return waits


def test_a_process_that_keeps_dying_waits_twice_as_long_each_time_up_to_the_cap():
    plan = RestartPlan(Backoff(initial_s=0.2, max_s=5.0, reset_after_s=10.0))
    plan.watch("scheduler", 0.0)
    assert crash_loop(plan, "scheduler", 7, up_s=1.0) == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])


def test_a_process_that_stayed_up_long_enough_is_restarted_after_the_shortest_wait_again():
    plan = RestartPlan(Backoff(initial_s=0.2, max_s=5.0, reset_after_s=10.0))
    plan.watch("worker-0", 0.0)
    crash_loop(plan, "worker-0", 4, up_s=1.0)
    assert plan.exited("worker-0", 100.0) == pytest.approx(0.2)


def test_a_dead_process_is_due_only_once_its_wait_has_passed_and_not_again_until_it_dies_again():
    plan = RestartPlan()
    plan.watch("gateway", 0.0)
    plan.watch("redis", 0.0)
    assert plan.due(50.0) == [] and not plan.waiting("gateway")
    plan.exited("gateway", 50.0)
    assert plan.waiting("gateway") and not plan.waiting("redis")
    assert plan.due(50.1) == []
    assert plan.due(50.2) == ["gateway"]
    plan.restarted("gateway", 50.2)
    assert plan.due(60.0) == [] and not plan.waiting("gateway")


def test_a_start_that_failed_counts_as_a_start_and_the_next_try_waits_longer():
    plan = RestartPlan(Backoff(initial_s=0.5, max_s=2.0, reset_after_s=10.0))
    plan.watch("redis", 0.0)
    plan.exited("redis", 20.0)
    plan.restarted("redis", 20.5)     # its start raised: the process is seen dead on the next poll
    assert plan.exited("redis", 20.6) == pytest.approx(1.0)


def test_a_backoff_must_start_above_zero_and_not_above_its_cap():
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial_s=0.0)
    with pytest.raises(ValueError, match="max_s"):
        Backoff(initial_s=6.0, max_s=5.0)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def mesh_of(run_dir: Path, service: subprocess.Popen, owner: int | None) -> Supervisor:
    """A mesh of one stand-in service process (no Redis of its own), as up() leaves it for the supervisor."""
    MeshState(str(run_dir), "redis://127.0.0.1:1", None, "", "acd", owner_pid=owner,
              services=[ServiceProcess("worker-0", service.pid, "127.0.0.1:1", 0, str(run_dir / "w.log"))]).save()
    supervisor = Supervisor(run_dir)
    supervisor.take_over()
    return supervisor


def test_the_supervisor_stops_the_mesh_once_its_owner_has_ended(tmp_path: Path,
                                                                processes: list[subprocess.Popen]) -> None:
    service, owner = sleeper(), sleeper()
    processes += [service, owner]
    supervisor = mesh_of(tmp_path, service, owner.pid)
    supervisor.step(0.0)
    assert not supervisor.stopping and pid_alive(service.pid)
    owner.kill()
    owner.wait()
    supervisor.step(0.1)
    assert supervisor.stopping and supervisor.owner_gone()
    supervisor.stop_mesh()
    assert not pid_alive(service.pid), "the owner's end left the mesh's service running"
    assert not (tmp_path / STATE_FILE).exists()


def test_a_mesh_without_an_owner_is_left_running(tmp_path: Path, processes: list[subprocess.Popen]) -> None:
    service = sleeper()
    processes.append(service)
    supervisor = mesh_of(tmp_path, service, None)
    supervisor.step(0.0)
    assert not supervisor.stopping and not supervisor.owner_gone() and pid_alive(service.pid)
