"""The local mesh's supervisor: restarts a service process, or the mesh's own Redis or launcher, that dies.

    python -m academus.shared.cli.supervisor --run-dir DIR      (started by `academus up`, stopped by `down`)

It takes the processes over from `up()` by recording its pid in mesh.json, then polls their pids. One that
has died is started again with the settings it had (the same ports, id and registration, so the gateway's
public port and every address in Redis stay the same) after a backoff that doubles from 0.2 s to 5 s and
starts again at 0.2 s for a process that had stayed up 10 s. Each restart is logged (logs/supervisor.log)
and counted in mesh.json (`academus status` shows the counts). While the mesh's warm launcher listens
(shared/cli/launcher.py), a service starts again forked from it, skipping its imports; else as a plain process.
`academus down` stops the supervisor before the services, so nothing it stops is restarted. With
`up --standby` it keeps a standby process per worker, scheduler and gateway (shared/cli/standby.py), built and
waiting: a dead one's replacement is its standby, told to go, and a new standby starts behind it. A SIGTERM'd
scheduler or gateway asks for its standby before it drains, and the standby goes while it still runs
(shared/runtime/handover.py). A mesh with an owner (the process that called `up()`, unless `academus up
--detach`) is stopped when that process ends, however it ended: a bench killed
before its own `down` would otherwise leave a whole mesh running, and this supervisor restarting it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from academus.shared.cli.mesh import (
    MeshState,
    ServiceProcess,
    Standby,
    down,
    pid_alive,
    restart_redis,
    start_own_launcher,
    start_process,
    start_standby,
)
from academus.shared.cli.standby import SERVICES
from academus.shared.runtime.logs import log_event, setup_logging

REDIS = "redis"
OWN_LAUNCHER = "launcher"


@dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.2
    max_s: float = 5.0
    reset_after_s: float = 10.0   # a process up this long before it died is restarted after initial_s again

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"backoff: need 0 < initial_s ({self.initial_s}) <= max_s ({self.max_s})")


@dataclass
class _Watched:
    started_at: float
    delay_s: float
    due_at: float | None = None   # set while dead: when to start it again


@dataclass
class RestartPlan:
    """When to restart each watched process: no processes and no clock of its own (times are passed in),
    so the backoff is tested without waiting."""

    backoff: Backoff = field(default_factory=Backoff)
    _watched: dict[str, _Watched] = field(default_factory=dict)

    def watch(self, name: str, now: float) -> None:
        self._watched[name] = _Watched(now, self.backoff.initial_s)

    def started(self, name: str, now: float) -> None:
        """A start at `now`: watched from here on, with the backoff it had if it was watched already."""
        if name in self._watched:
            self.restarted(name, now)
        else:
            self.watch(name, now)

    def waiting(self, name: str) -> bool:
        """Dead and already given a restart time."""
        return self._watched[name].due_at is not None

    def exited(self, name: str, now: float) -> float:
        """It was seen dead at `now`: schedules its restart; returns the wait."""
        w = self._watched[name]
        if now - w.started_at >= self.backoff.reset_after_s:
            w.delay_s = self.backoff.initial_s
        wait = w.delay_s
        w.due_at = now + wait
        w.delay_s = min(w.delay_s * 2, self.backoff.max_s)
        return wait

    def due(self, now: float) -> list[str]:
        return [name for name, w in self._watched.items() if w.due_at is not None and w.due_at <= now]

    def restarted(self, name: str, now: float) -> None:
        """A start was tried at `now` (a failed one too: its process is then seen dead, and waits longer)."""
        w = self._watched[name]
        w.started_at, w.due_at = now, None


class Standbys:
    """A standby process per service that can have one (none where `enabled` is off), started with its
    settings; this process holds their stdin, so they exit when it does."""

    def __init__(self, enabled: bool = True, launcher: str = "") -> None:
        self.services = SERVICES if enabled else ()
        self.launcher = launcher   # the warm launcher's socket they are forked from, when it listens
        self._waiting: dict[str, Standby] = {}

    def prepare(self, proc: ServiceProcess) -> None:
        """A new standby for `proc`, its pid recorded on it, offered for a handover where `proc` can ask."""
        proc.standby_pid = None
        if proc.service in self.services:
            standby = self._waiting[proc.name] = start_standby(proc, self.launcher)
            proc.standby_pid = standby.pid
            if proc.handover:
                proc.handover.offer()

    def lost(self, proc: ServiceProcess) -> bool:
        """Whether `proc`'s standby died while it waited (its pid is then cleared)."""
        standby = self._waiting.get(proc.name)
        if standby is None or standby.alive():
            return False
        del self._waiting[proc.name]
        proc.standby_pid = None
        return True

    def take(self, proc: ServiceProcess) -> int | None:
        """`proc`'s standby told to go: its pid, None where it has none alive (then a cold start)."""
        standby = self._waiting.pop(proc.name, None)
        proc.standby_pid = None
        if standby is None or not standby.alive() or not standby.go():
            return None
        return standby.pid

    def close(self, procs: Iterable[ServiceProcess] = ()) -> None:
        """Stops every standby; a process stopping now drains without one."""
        for proc in procs:
            if proc.handover:
                proc.handover.withdraw()
        for standby in self._waiting.values():
            standby.stop()
        self._waiting.clear()


class Supervisor:
    """Polls the mesh's pids and restarts the dead as the plan says, saving each new pid and count."""

    def __init__(self, run_dir: Path, backoff: Backoff | None = None, poll_s: float = 0.1) -> None:
        self.run_dir, self.poll_s = run_dir, poll_s
        self.plan = RestartPlan(backoff or Backoff())
        self.stopping = False
        self.state = MeshState.load(run_dir)
        self.standbys = Standbys(self.state.standby, self.state.launcher)
        self.standby_plan = RestartPlan(self.plan.backoff)   # a standby that keeps dying waits longer each time
        self.draining: dict[int, str] = {}   # pid: name of a process that handed its place over and drains

    def take_over(self) -> None:
        """Records this process as the mesh's supervisor: `up()` returns once it reads this."""
        now = time.monotonic()
        for name in self.pids():
            self.plan.watch(name, now)
        for proc in self.state.services:
            self._prepare(proc, now)
        self.state.supervisor_pid = os.getpid()
        self.state.save()
        log_event("supervising", processes=sorted(self.pids()))

    def pids(self) -> dict[str, int]:
        own = {REDIS: self.state.redis_pid} if self.state.redis_pid else {}
        own |= {OWN_LAUNCHER: self.state.launcher_pid} if self.state.launcher_pid else {}
        return own | {s.name: s.pid for s in self.state.services}

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        self.take_over()
        while not self.stopping:
            try:
                self.step(time.monotonic())
            except Exception as e:   # e.g. mesh.json not writable: keep watching, the next step tries again
                log_event("step_failed", logging.ERROR, error=repr(e))
            time.sleep(self.poll_s)
        self.standbys.close(self.state.services)
        if self.owner_gone():
            self.stop_mesh()
        log_event("stopped")

    def stop(self, *_: object) -> None:
        self.stopping = True

    def owner_gone(self) -> bool:
        owner = self.state.owner_pid
        return owner is not None and not pid_alive(owner)

    def stop_mesh(self) -> None:
        """Stops every process of the mesh, as `academus down` does, once this supervisor no longer watches."""
        log_event("owner_gone", logging.WARNING, owner=self.state.owner_pid)
        self.state.supervisor_pid = None   # `down` would otherwise wait for this process to stop
        self.state.save()
        down(self.run_dir)

    def step(self, now: float) -> None:
        if self.owner_gone():
            self.stopping = True
            return
        self._watch_standbys(now)
        for proc in self.state.services:
            if proc.handover and proc.handover.claim():
                self.hand_over(proc, now)
        for pid, name in list(self.draining.items()):
            if not pid_alive(pid):   # reaped
                log_event("drained", process=name, pid=pid)
                del self.draining[pid]
        for name, pid in self.pids().items():
            if not self.plan.waiting(name) and not pid_alive(pid):
                log_event("exited", logging.WARNING, process=name, pid=pid,
                          restart_in_s=round(self.plan.exited(name, now), 3))
        for name in sorted(self.plan.due(now), key=lambda n: n != REDIS):   # Redis first: the others need it
            if self.stopping:
                return
            self.restart(name)

    def restart(self, name: str) -> None:
        self.plan.restarted(name, time.monotonic())
        try:
            pid, from_standby = self._start(name)
        except Exception as e:   # a start that fails is retried after a longer wait, as a crash would be
            log_event("restart_failed", logging.ERROR, process=name, error=repr(e))
            return
        self.state.save()
        log_event("restarted", process=name, pid=pid, from_standby=from_standby)

    def hand_over(self, proc: ServiceProcess, now: float) -> None:
        """`proc`, stopping, asked for its standby: the standby goes and `proc` drains meanwhile; a new standby
        starts behind. With its standby dead, `proc` is told to go on stopping: it is restarted once it exits."""
        old = proc.pid
        standby = self.standbys.take(proc)
        if standby is None:
            proc.handover.withdraw()
            log_event("handover_refused", logging.WARNING, process=proc.name, pid=old, reason="no standby alive")
            return
        self.draining[old] = proc.name
        self.plan.restarted(proc.name, now)
        self._replace(proc, standby, now)
        self.state.save()
        log_event("handed_over", process=proc.name, pid=standby, draining=old)

    def _replace(self, proc: ServiceProcess, pid: int, now: float) -> None:
        """`pid` is `proc` from now on, a restart; a new standby starts behind it, as another may follow."""
        proc.pid = pid
        proc.restarts += 1
        self._prepare(proc, now)

    def _prepare(self, proc: ServiceProcess, now: float) -> None:
        self.standbys.prepare(proc)
        if proc.standby_pid:
            self.standby_plan.started(proc.name, now)

    def _watch_standbys(self, now: float) -> None:
        """A standby that died while it waited is started again, after the backoff a process gets."""
        due = self.standby_plan.due(now)   # one seen dead now is due later: its wait has just begun
        for proc in self.state.services:
            if self.standbys.lost(proc):
                log_event("standby_exited", logging.WARNING, process=proc.name,
                          restart_in_s=round(self.standby_plan.exited(proc.name, now), 3))
            elif proc.name in due:
                self._prepare(proc, now)
                self.state.save()

    def _start(self, name: str) -> tuple[int, bool]:
        """The new pid, and whether it was a standby's."""
        if name == REDIS:
            self.state.redis_pid = restart_redis(self.state)
            self.state.redis_restarts += 1
            return self.state.redis_pid, False
        if name == OWN_LAUNCHER:   # until it listens again, what dies restarts plain
            self.state.launcher_pid = start_own_launcher(self.state)
            self.state.launcher_restarts += 1
            return self.state.launcher_pid, False
        proc = self.state.service(name)
        standby = self.standbys.take(proc)
        self._replace(proc, standby or start_process(proc, self.state.launcher), time.monotonic())
        return proc.pid, standby is not None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.shared.cli.supervisor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, required=True, help="the mesh's run directory (mesh.json)")
    args = p.parse_args(argv)
    setup_logging("supervisor")
    Supervisor(args.run_dir).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
