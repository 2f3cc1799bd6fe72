"""The warm launcher (shared/cli/launcher.py) as a real process on a real Unix socket: what a forked child
gets (environment, log, working directory, session, arguments, exit), that the launcher outlives bad requests,
and that `academus up` without a shared one starts its own, which its supervisor restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from academus.client import Client
from academus.shared.cli.launcher import Launch, launch, launch_piped, wait_ready
from academus.shared.cli.mesh import (
    ADMIN_KEY_FILE,
    MeshState,
    down,
    launcher_socket,
    pid_alive,
    status,
    wait_exit,
    wait_healthy,
)
from academus.shared.runtime.config import LAUNCHER
from academus.shared.runtime.local_plane import socket_dir
from tests.conftest import SuiteLauncher, parent_pid
from tests.e2e.conftest import start_mesh

PROBE = '''
import json, os, sys, time
print(json.dumps({"env": os.environ.get("PROBE_SETTING"), "home": os.environ.get("HOME"), "cwd": os.getcwd(),
                  "argv": sys.argv[1:], "own_session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read(),
                  "name": __name__}), flush=True)
if "--wait" in sys.argv:
    time.sleep(60)
raise SystemExit(3)
'''


@pytest.fixture
def launcher(ready_launcher: SuiteLauncher) -> str:
    """The suite's launcher, listening: every test here leaves it serving."""
    return ready_launcher.socket


def probe_in(directory: Path) -> Launch:
    (directory / "launcher_probe.py").write_text(PROBE)
    return Launch("launcher_probe", args=["--flag", "x y"], env={"PROBE_SETTING": "on", "PATH": os.environ["PATH"]},
                  log=str(directory / "probe.log"), cwd=str(directory))


def logged(log: Path, timeout_s: float = 30.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if log.exists() and log.read_text().strip():
            return json.loads(log.read_text().splitlines()[0])
        time.sleep(0.05)
    raise AssertionError(f"{log} stayed empty")


def test_a_child_runs_its_module_with_exactly_what_it_was_sent_and_is_reaped(launcher: str, tmp_path: Path) -> None:
    spec = probe_in(tmp_path)
    pid = launch(launcher, spec)
    assert isinstance(pid, int) and pid != os.getpid()
    assert logged(Path(spec.log)) == {"env": "on", "home": None, "cwd": str(tmp_path), "argv": ["--flag", "x y"],
                                      "own_session": True, "stdin": "", "name": "__main__"}
    assert wait_exit(pid, 10), "an exited child must not linger as a zombie of the launcher"


def test_a_piped_launch_reads_what_the_caller_writes_until_it_closes(launcher: str, tmp_path: Path) -> None:
    spec = probe_in(tmp_path)
    piped = launch_piped(launcher, spec)
    assert piped is not None
    pid, stdin = piped
    stdin.write(b"go\n")
    stdin.close()
    assert logged(Path(spec.log))["stdin"] == "go\n", "its stdin is the pipe, read to its end once the caller closes"
    assert wait_exit(pid, 10)
    assert launch_piped(str(tmp_path / "none.sock"), spec) is None


def test_the_log_is_appended_to_and_each_launch_is_a_new_process(launcher: str, tmp_path: Path) -> None:
    spec = probe_in(tmp_path)
    Path(spec.log).write_text("earlier line\n")
    first = launch(launcher, Launch(spec.module, ["--wait"], spec.env, spec.log, spec.cwd))
    second = launch(launcher, Launch(spec.module, ["--wait"], spec.env, str(tmp_path / "second.log"), spec.cwd))
    try:
        assert first and second and first != second
        assert logged(tmp_path / "second.log")["argv"] == ["--wait"]
        end = time.monotonic() + 30
        while len(Path(spec.log).read_text().splitlines()) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        assert Path(spec.log).read_text().splitlines()[0] == "earlier line"
        assert pid_alive(first) and pid_alive(second)
        shown = Path(f"/proc/{second}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        assert "-m launcher_probe --wait" in shown and "launcher" not in shown.replace("launcher_probe", ""), \
            "ps shows the command it runs, not the launcher's"
    finally:
        for pid in (first, second):
            if pid:
                os.kill(pid, 9)


def test_each_child_draws_its_own_random_numbers(launcher: str, tmp_path: Path) -> None:
    """numpy's and torch's global generators are seeded afresh in each child, not inherited from the launcher."""
    (tmp_path / "draw.py").write_text("import json, numpy, torch\n"
                                      "print(json.dumps([numpy.random.random(), torch.rand(1).item()]), flush=True)\n")
    draws = []
    for n in range(2):
        log = tmp_path / f"draw-{n}.log"
        assert launch(launcher, Launch("draw", env={"PATH": os.environ["PATH"]}, log=str(log), cwd=str(tmp_path)))
        draws.append(logged(log))
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1], draws


def test_bad_requests_are_answered_with_an_error_and_the_launcher_serves_on(launcher: str, tmp_path: Path) -> None:
    for bad in (b"not json\n", b'{"args": []}\n', b"[1, 2]\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(launcher)
            conn.sendall(bad)
            reply = json.loads(conn.makefile("rb").readline())
        assert "error" in reply and "pid" not in reply, (bad, reply)
    spec = probe_in(tmp_path)
    assert launch(launcher, spec) is not None
    assert logged(Path(spec.log))["env"] == "on"


def test_no_launcher_at_the_path_means_none(tmp_path: Path) -> None:
    assert launch(str(tmp_path / "absent.sock"), probe_in(tmp_path)) is None
    assert not Path(tmp_path / "probe.log").exists()


def test_the_socket_is_this_users_alone(launcher: str) -> None:
    assert os.stat(launcher).st_mode & 0o777 == 0o600


def test_a_mesh_forks_its_services_from_the_launcher_and_the_supervisor_restarts_through_it(
        ready_launcher: SuiteLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, launcher_pid = ready_launcher
    monkeypatch.setenv(LAUNCHER.name, path)
    state = start_mesh(tmp_path / "run", supervise=True)
    try:
        assert {parent_pid(s.pid) for s in state.services} == {launcher_pid}
        key = (tmp_path / "run" / ADMIN_KEY_FILE).read_text().strip()
        with Client(state.gateway, api_key=key, timeout=60) as client:
            assert client.infer("sentiment", ["a warm start"]).predictions[0].label in ("fresh", "rotten")
            worker = next(s for s in state.services if s.service == "worker")
            os.kill(worker.pid, signal.SIGKILL)
            end = time.monotonic() + 60
            while time.monotonic() < end and (again := MeshState.load(tmp_path / "run").service(worker.name)).pid \
                    == worker.pid:
                time.sleep(0.1)
            assert again.pid != worker.pid and parent_pid(again.pid) == launcher_pid
            wait_healthy(again.address, 60, again)
            assert client.infer("sentiment", ["served again"]).predictions[0].label in ("fresh", "rotten")
    finally:
        down(tmp_path / "run")
    assert all(wait_exit(s.pid, 5) for s in state.services)



def test_up_without_one_starts_its_own_which_the_supervisor_restarts_and_down_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAUNCHER.name)
    run = tmp_path / "run"
    state = start_mesh(run, supervise=True)
    try:
        own, socket_path = state.launcher_pid, Path(state.launcher)
        assert own and pid_alive(own) and socket_path == run.resolve() / "launcher.sock"
        worker = state.service("worker-0")
        # the workers wait for it (torch); the services after them are forked too
        assert parent_pid(worker.pid) == own and parent_pid(state.service("gateway").pid) == own
        os.kill(own, signal.SIGKILL)
        again = _changed(run, lambda s: s.launcher_pid, own)
        assert again.launcher_pid != own and wait_ready(again.launcher_pid, run / "logs" / "launcher.log", 60)
        reported = status(run)["launcher"]
        assert (reported["health"], reported["restarts"], reported["socket"]) == ("RUNNING", 1, str(socket_path))
        os.kill(worker.pid, signal.SIGKILL)
        restarted = _changed(run, lambda s: s.service(worker.name).pid, worker.pid).service(worker.name)
        assert parent_pid(restarted.pid) == again.launcher_pid   # through the new launcher
        wait_healthy(restarted.address, 60, restarted)
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        with Client(state.gateway, api_key=key, timeout=60) as client:
            assert client.infer("sentiment", ["served again"]).predictions[0].label in ("fresh", "rotten")
    finally:
        stopped = down(run)
    assert "launcher" in stopped and wait_exit(again.launcher_pid, 5) and not socket_path.exists()


def _changed(run: Path, field: Callable[[MeshState], object], old: object, timeout_s: float = 60) -> MeshState:
    """The saved state once `field` of it is no longer `old` (the supervisor restarted something)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = MeshState.load(run)
        if field(state) != old:
            return state
        time.sleep(0.1)
    raise AssertionError(f"still {old} after {timeout_s}s")


def test_a_long_run_directory_puts_the_socket_in_the_temporary_folder(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    assert launcher_socket(tmp_path) == tmp_path.resolve() / "launcher.sock"
    placed = launcher_socket(deep)
    assert placed.parent == socket_dir() and len(str(placed)) <= 100 and os.stat(placed.parent).st_mode & 0o077 == 0


def test_an_attached_run_gets_the_callers_stdio_and_gives_back_its_exit_status(launcher: str, tmp_path: Path) -> None:
    spec = probe_in(tmp_path)
    code = (f"import sys; from academus.shared.cli.launcher import Launch, run_attached; "
            f"sys.exit(run_attached({launcher!r}, Launch({spec.module!r}, {spec.args!r}, {spec.env!r}, "
            f"cwd={spec.cwd!r})))")
    done = subprocess.run([sys.executable, "-c", code], input="fed on stdin", capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stderr
    assert json.loads(done.stdout) == {"env": "on", "home": None, "cwd": str(tmp_path), "argv": ["--flag", "x y"],
                                       "own_session": True, "stdin": "fed on stdin", "name": "__main__"}
    assert not Path(spec.log).exists()   # attached: no log of its own


def test_a_signal_to_the_caller_is_passed_on_and_a_killed_run_has_no_status(launcher: str, tmp_path: Path) -> None:
    spec = probe_in(tmp_path)
    code = (f"import sys; from academus.shared.cli.launcher import Launch, run_attached; "
            f"sys.exit(run_attached({launcher!r}, Launch({spec.module!r}, ['--wait'], {spec.env!r}, "
            f"cwd={spec.cwd!r})))")
    caller = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    probe = json.loads(caller.stdout.readline())   # running: it printed its line
    assert probe["argv"] == ["--wait"]
    caller.send_signal(signal.SIGTERM)
    assert caller.wait(30) == 1
    assert "ended without an exit status" in caller.stderr.read()


def test_the_cli_runs_its_heavy_commands_forked_with_their_output_and_status(ready_launcher: SuiteLauncher,
                                                                             tmp_path: Path) -> None:
    path = ready_launcher.socket
    env = {**os.environ, LAUNCHER.name: path}

    def academus(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", str(tmp_path), *args],
                              env=env, capture_output=True, text=True, timeout=120)

    helped, refused = academus("shard", "--help"), academus("heads", "train", "--no-such-option")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: academus shard")
    assert refused.returncode == 2 and "required: --model" in refused.stderr
    launched = Path(path).with_name("launcher.log").read_text()
    assert "academus.shared.cli --run-dir" in launched and "heads train --no-such-option" in launched
    assert academus("status").returncode == 1   # a light command runs here: no mesh, said at once
    assert " status" not in launched.split("heads train")[-1]
    # no ACADEMUS_LAUNCHER: the launcher of the mesh running from the run directory
    env.pop(LAUNCHER.name)
    MeshState(str(tmp_path), "redis://127.0.0.1:1", None, "", "acd", launcher=path).save()
    assert academus("heads", "train", "--from-the-mesh").returncode == 2
    assert "heads train --from-the-mesh" in Path(path).with_name("launcher.log").read_text()
