"""A standby process imports and builds its service at nice 19, then waits; the supervisor's pool starts, hands
over and stops standbys. Its `go` is tested on a mesh: tests/e2e/test_chaos.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from academus.shared.cli.mesh import (
    HANDOVER_SETTING,
    MeshState,
    ServiceProcess,
    pid_alive,
    standby_ready,
    start_standby,
    wait_exit,
)
from academus.shared.cli.redis_server import free_port
from academus.shared.cli.standby import WAITING_NICE
from academus.shared.cli.supervisor import Standbys, Supervisor
from academus.shared.runtime.config import artifacts_dir, child_env
from academus.shared.runtime.slices import autogroup_nice
from tests.conftest import SuiteLauncher, parent_pid
from tests.e2e.conftest import wait_for

autogroups = pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")


def service(tmp_path: Path, name: str) -> ServiceProcess:
    """A worker's settings that build without a mesh: the null model, and a Redis nobody dials before serving."""
    env = {"ACADEMUS_MODELS": "null", "ACADEMUS_ARTIFACTS": str(artifacts_dir()),
           "ACADEMUS_REDIS_URL": "redis://127.0.0.1:1"}
    return ServiceProcess(name, 0, "127.0.0.1:1", 0, str(tmp_path / f"{name}.log"), env)


def test_a_worker_gets_a_standby_that_builds_then_waits_and_the_pool_stops_it(tmp_path: Path) -> None:
    standbys, worker, store = Standbys(), service(tmp_path, "worker-0"), service(tmp_path, "adapter_store")
    standbys.prepare(store)
    assert store.standby_pid is None   # off the request path: its restart fails no request
    standbys.prepare(worker)
    pid = worker.standby_pid
    assert pid is not None and pid_alive(pid)
    if Path("/proc/self/autogroup").exists():
        wait_for(lambda: autogroup_nice(pid) == WAITING_NICE, 30, "the standby's autogroup at nice 19")
    wait_for(lambda: standby_ready(worker), 180, "the standby's build")   # at nice 19: slow on a busy box
    assert pid_alive(pid), "built, it waits"
    standbys.close()
    assert wait_exit(pid, 10)
    assert "standby_serves" not in Path(worker.log).read_text()


def test_a_mesh_without_standbys_starts_none(tmp_path: Path) -> None:
    worker = service(tmp_path, "worker-0")
    Standbys(enabled=False).prepare(worker)
    assert worker.standby_pid is None and not Path(worker.log).exists()


def test_a_dead_standby_is_not_handed_over(tmp_path: Path) -> None:
    standbys, worker = Standbys(), service(tmp_path, "worker-0")
    standbys.prepare(worker)
    pid = worker.standby_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, "the standby's death")
    assert standbys.take(worker) is None and worker.standby_pid is None   # the supervisor then starts it cold


def test_a_standby_whose_supervisor_left_exits_without_serving(tmp_path: Path) -> None:
    standby = start_standby(service(tmp_path, "worker-0"))
    assert standby.popen is not None, "no launcher named: a child of this process"
    standby.stdin.close()   # end of file, as when the supervisor's process ends
    assert standby.popen.wait(timeout=60) == 0
    assert "standby_serves" not in (tmp_path / "worker-0.log").read_text()


def test_a_standby_forked_from_the_launcher_builds_waits_and_exits_at_end_of_file(
        tmp_path: Path, ready_launcher: SuiteLauncher) -> None:
    standbys, worker = Standbys(launcher=ready_launcher.socket), service(tmp_path, "worker-0")
    standbys.prepare(worker)
    pid = worker.standby_pid
    assert pid is not None and parent_pid(pid) == ready_launcher.pid
    wait_for(lambda: standby_ready(worker), 180, "the forked standby's build")
    assert pid_alive(pid), "built, it waits on the pipe"
    forked = start_standby(service(tmp_path, "worker-1"), ready_launcher.socket)
    assert forked.popen is None and parent_pid(forked.pid) == parent_pid(pid)
    forked.stdin.close()   # the supervisor gone: the pipe's only write end closed
    assert wait_exit(forked.pid, 60)
    standbys.close()
    assert wait_exit(pid, 10)
    assert "standby_serves" not in Path(worker.log).read_text() + (tmp_path / "worker-1.log").read_text()


def test_a_service_without_standbys_is_refused_by_name() -> None:
    done = subprocess.run([sys.executable, "-m", "academus.shared.cli.standby", "adapter_store"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "invalid choice: 'adapter_store'" in done.stderr


@autogroups
def test_a_standby_in_a_terminals_session_leaves_its_autogroup_alone(tmp_path: Path) -> None:
    """Only its own session's group is lowered: a terminal's other processes keep their share."""
    seen = service(tmp_path, "worker-0")
    with open(seen.log, "ab") as out:
        standby = subprocess.Popen([sys.executable, "-m", "academus.shared.cli.standby", "worker"],
                                   stdin=subprocess.PIPE, stdout=out, stderr=out, env=child_env(seen.env))
    ours, seen.standby_pid = autogroup_nice(), standby.pid
    try:
        wait_for(lambda: standby_ready(seen), 180, "the standby's build")   # its group set long before
        assert autogroup_nice(standby.pid) == ours
    finally:
        standby.send_signal(signal.SIGKILL)
        standby.wait()


def supervised_gateway(tmp_path: Path) -> tuple[Supervisor, subprocess.Popen]:
    """A supervisor over one gateway with a standby; the gateway's stand-in is a sleeping process (what the
    supervisor watches is its pid). The standby, told to go, serves on a port of its own."""
    stand_in = subprocess.Popen(["sleep", "120"])
    env = {"ACADEMUS_REDIS_URL": "redis://127.0.0.1:1", "ACADEMUS_ARTIFACTS": str(artifacts_dir()),
           "ACADEMUS_PORT": str(free_port()), HANDOVER_SETTING: str(tmp_path / "handover" / "gateway")}
    proc = ServiceProcess("gateway", stand_in.pid, "127.0.0.1:1", 0, str(tmp_path / "gateway.log"), env)
    MeshState(str(tmp_path), "redis://127.0.0.1:1", None, "127.0.0.1:1", "acd", [proc], standby=True).save()
    supervisor = Supervisor(tmp_path)
    supervisor.take_over()
    return supervisor, stand_in


def stop_all(supervisor: Supervisor, stand_in: subprocess.Popen) -> None:
    supervisor.standbys.close(supervisor.state.services)
    for pid in {s.pid for s in supervisor.state.services} - {stand_in.pid}:   # a standby that went
        os.kill(pid, signal.SIGKILL)
    stand_in.kill()
    stand_in.wait()


def test_a_stopping_service_hands_its_place_to_its_standby_and_drains_meanwhile(tmp_path: Path) -> None:
    supervisor, stand_in = supervised_gateway(tmp_path)
    try:
        gateway = supervisor.state.services[0]
        standby, asked = gateway.standby_pid, gateway.handover
        wait_for(lambda: standby_ready(gateway), 120, "the standby's build")
        assert asked.ask()   # what a SIGTERM'd service does once deregistered
        supervisor.step(time.monotonic())
        assert (gateway.pid, gateway.restarts) == (standby, 1)
        assert supervisor.draining == {stand_in.pid: "gateway"} and pid_alive(stand_in.pid)   # not restarted
        assert gateway.standby_pid not in (None, standby), "a new standby behind the one that went"
        assert MeshState.load(tmp_path).services[0].pid == standby
        wait_for(lambda: asyncio.run(asked.taken(0.0)), 60, "the standby serving, which the stopping one awaits")
        assert asked.ready.exists(), "the new standby is offered for the next stop"
        stand_in.kill()
        stand_in.wait()
        supervisor.step(time.monotonic())
        assert supervisor.draining == {}
    finally:
        stop_all(supervisor, stand_in)


def test_a_standby_that_died_waiting_is_started_again_and_a_stop_meanwhile_goes_on_without_it(tmp_path: Path) -> None:
    supervisor, stand_in = supervised_gateway(tmp_path)
    try:
        gateway = supervisor.state.services[0]
        dead = gateway.standby_pid
        os.kill(dead, signal.SIGKILL)
        wait_for(lambda: not pid_alive(dead), 10, "the standby's death")
        assert gateway.handover.ask()
        now = time.monotonic()
        supervisor.step(now)
        assert gateway.pid == stand_in.pid and gateway.restarts == 0, "no standby to hand over to"
        assert asyncio.run(gateway.handover.taken(0.0)), "told to go on stopping"
        assert gateway.standby_pid is None
        supervisor.step(now + supervisor.plan.backoff.initial_s)
        assert gateway.standby_pid not in (None, dead) and pid_alive(gateway.standby_pid)
    finally:
        stop_all(supervisor, stand_in)
