"""A warm launcher: one process that has imported every service's modules and forks each new service process
from itself, so a start skips the imports.

    python -m academus.shared.cli.launcher --socket PATH      (then ACADEMUS_LAUNCHER=PATH for `academus up`)

A worker's start is mostly imports: torch and transformers take about 3.7 s of CPU of the 5 s it takes on this
project's 2-core machine; every other service imports for about 0.4 s. `academus up` starts a launcher of its own
(its socket in the run directory, or the temporary folder where that path is too long for a socket), forks its
workers and every later service from it, and the supervisor restarts what died through it, and the launcher itself
when it dies. Where meshes start again and again on one machine (the test suite, the benches' fresh meshes), one
launcher named by ACADEMUS_LAUNCHER serves them all. The forked child is the same program in the same state as a
fresh one after its imports: it takes the environment, log, working directory and session it is sent, then runs
the service's `__main__`. The `academus` command runs its one-shot commands that import torch (`shard`, `ramps`,
`tenants`, `distill`, ...) the same way, attached: the child gets the caller's stdin, stdout and stderr (passed
over the socket), and its exit status comes back to the caller, which passes SIGINT and SIGTERM on to it. The
supervisor's standbys are forked with a pipe from it as their stdin (`launch_piped`).

The launcher forks before anything in it starts a thread of its own or touches a GPU: a forked CUDA context is
unusable, so it refuses to run once CUDA is initialised. Children are not its to wait for (SIGCHLD is ignored:
the kernel reaps them); whoever started a service watches its pid, as with any process. Code changed on disk
after the launcher started is not seen by its children: restart it after an upgrade. When no launcher listens
at the socket (not ready yet, or dead), services start as plain processes.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

from academus.shared.cli.processes import pid_alive
from academus.shared.runtime.config import replace_environment

try:
    from setproctitle import setproctitle
except ImportError:   # an install from before it was a dependency: `ps` shows the launcher's line
    setproctitle = None

# what the services import at their start: `academus.services.<name>` runs `<name>.server`'s main
PRELOAD = ("academus.services.worker.server", "academus.services.scheduler.server",
           "academus.services.gateway.server", "academus.services.resource_manager.server",
           "academus.services.adapter_store.server", "academus.services.trainer.server",
           "academus.services.plot.server", "academus.shared.cli.main")
READY = "launcher ready"   # its log's first line once it listens
MAX_REQUEST_BYTES = 1 << 20   # a launch's environment and arguments; a real one is a few KiB
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Launch:
    """One process to start: `python -m module *args` with exactly `env`, its output appended to `log`."""

    module: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log: str = os.devnull
    cwd: str = "."
    attached: bool = False   # on the caller's stdin, stdout and stderr, its exit status sent back (run_attached)
    piped: bool = False   # its stdin a pipe from the caller (launch_piped)


def launch(socket_path: str, spec: Launch) -> int | None:
    """Asks the launcher at `socket_path` to start `spec`; its pid, or None when no launcher answers there."""
    if (asked := _ask(socket_path, spec)) is None:
        return None
    asked[0].close()
    return asked[1]


def launch_piped(socket_path: str, spec: Launch) -> tuple[int, BinaryIO] | None:
    """Asks the launcher at `socket_path` to start `spec` with its stdin a pipe from this process: its pid and the
    pipe's write end (the child reads end of file once every copy of it is closed), or None when no launcher
    answers there."""
    read, write = os.pipe()
    try:
        asked = _ask(socket_path, replace(spec, piped=True), [read])
    finally:
        os.close(read)   # the child has its copy
    if asked is None:
        os.close(write)
        return None
    asked[0].close()
    return asked[1], os.fdopen(write, "wb")


def run_attached(socket_path: str, spec: Launch) -> int | None:
    """Runs `spec` forked by the launcher on this process's stdin, stdout and stderr and waits for it: its exit
    status, or None when no launcher answers (nothing ran). SIGINT and SIGTERM are passed on to it."""
    spec = replace(spec, attached=True)
    if (asked := _ask(socket_path, spec, [0, 1, 2])) is None:
        return None
    conn, pid = asked
    passed = {sig: signal.signal(sig, lambda signum, _: _signal(pid, signum))
              for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        conn.settimeout(None)
        line = _read_line(conn)   # sent as it exits
    finally:
        for sig, handler in passed.items():
            signal.signal(sig, handler)
        conn.close()
    try:
        return int(json.loads(line)["exit"])
    except (ValueError, KeyError, TypeError):
        print(f"{spec.module}: ended without an exit status (killed?)", file=sys.stderr)
        return 1


def _ask(socket_path: str, spec: Launch, fds: list[int] | None = None) -> tuple[socket.socket, int] | None:
    """Sends `spec`, with `fds` when given, to the launcher at `socket_path`: the connection, still open, and the
    child's pid; None when no launcher answers there or its fork failed."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(socket_path)
        request = json.dumps(asdict(spec)).encode() + b"\n"
        if fds:
            socket.send_fds(conn, [request], fds)
        else:
            conn.sendall(request)
        pid = json.loads(_read_line(conn) or b"{}").get("pid")
    except (OSError, ValueError):
        pid = None
    if isinstance(pid, int):
        return conn, pid
    conn.close()
    return None


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def start_launcher(socket_path: Path, ready_timeout_s: float = 0.0, log: Path | None = None) -> subprocess.Popen:
    """A launcher process on `socket_path`, its output appended to `log` (default: `launcher.log` beside the
    socket); waits up to `ready_timeout_s` for it to listen (0: not at all, for a caller that starts services
    plain until it does)."""
    log = log or socket_path.with_name("launcher.log")
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "academus.shared.cli.launcher", "--socket", str(socket_path)],
                                stdout=out, stderr=out, start_new_session=True)
    if ready_timeout_s and not wait_ready(proc.pid, log, ready_timeout_s):
        proc.kill()
        raise RuntimeError(f"the launcher did not start: {log.read_text()[-2000:]}")
    return proc


def wait_ready(pid: int, log: Path, timeout_s: float) -> bool:
    """Whether the launcher `pid`, logging to `log`, listens within `timeout_s` (False: it exited or is late)."""
    end = time.monotonic() + timeout_s
    while not (log.exists() and any(line.startswith(READY) and line.endswith(f"(pid {pid})")
                                    for line in log.read_text().splitlines())):
        if not pid_alive(pid) or time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def serve(socket_path: str, preload: tuple[str, ...] = PRELOAD) -> Child:
    """Imports `preload`, then forks a child for each launch asked for on the socket. Returns only in a child,
    with what it is to run; the launcher itself loops until it is killed."""
    for module in preload:
        importlib.import_module(module)
    _refuse_cuda()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # the kernel reaps the children: none becomes a zombie
    path = Path(socket_path)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)   # created 0600: a launch runs code with the environment it is sent, this user's alone
    try:
        listener.bind(str(path))
    finally:
        os.umask(mask)
    listener.listen(64)
    print(f"{READY} at {path} (pid {os.getpid()})", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            spec, fds = _received(conn)
            pid = _fork(conn, spec) if spec is not None else None
            if pid == 0:
                listener.close()
                return Child(spec, fds, conn.detach() if spec.attached else None)
        for fd in fds:   # the child has its own copies
            os.close(fd)


def _fork(conn: socket.socket, spec: Launch) -> int | None:
    """Forks for `spec`: 0 in the child; in the launcher, the child's pid (None when the fork failed), told to the
    caller."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as e:   # out of memory or processes: this launch fails, the launcher serves on
        reply: dict[str, object] = {"error": f"fork: {e}"}
        pid = None
    else:
        if pid == 0:
            return 0
        reply = {"pid": pid}
        print(f"launched {pid}: {spec.module} {' '.join(spec.args)}", flush=True)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(reply).encode() + b"\n")
    return pid


@dataclass(frozen=True)
class Child:
    """What a forked child is to become: the launch, the caller's stdio when attached, and the connection its
    exit status goes back on (a file descriptor; None when detached)."""

    spec: Launch
    stdio: list[int]
    report: int | None


_exit_status = [0]   # the attached command's status, set as it exits and sent back last


def run(child: Child) -> None:
    """In the forked child: becomes the process the launch describes, then runs its module as `python -m`
    would."""
    spec = child.spec
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # its own children it waits for itself
    os.setsid()   # a session of its own, as `academus up` gives each service
    if child.report is not None and len(child.stdio) == 3:
        for target, fd in enumerate(child.stdio):
            if fd != target:   # a launcher started with a closed stdio descriptor may receive it as its number
                os.dup2(fd, target)
                os.close(fd)
        atexit.register(_report_exit, socket.socket(fileno=child.report))
    else:
        _redirect(spec.log, child.stdio[0] if spec.piped else None)
    _reopen_stdio()
    if setproctitle is not None:   # `ps` shows the command a plain process would have, not the launcher's; before
        # the environment changes, as it finds the room for the title where the process's environment began
        setproctitle(" ".join([sys.executable, "-m", spec.module, *spec.args]))
    replace_environment(spec.env)
    _fresh_random_state()
    os.chdir(spec.cwd)
    sys.path[0] = os.getcwd()   # `python -m` puts its working directory first
    sys.argv = [spec.module, *spec.args]
    try:
        runpy.run_module(spec.module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        _exit_status[0] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except BaseException:
        _exit_status[0] = 1
        raise


def _fresh_random_state() -> None:
    """Seeds numpy's and torch's global generators from the OS, as a fresh process's are: forked, every child
    would draw the launcher's sequence, the same in each (Python's `random` reseeds itself after a fork)."""
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed()
    if (torch := sys.modules.get("torch")) is not None:
        torch.seed()


def _report_exit(conn: socket.socket) -> None:
    """The last of the exit handlers registered before the command ran: its output flushed, then its status."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
        conn.sendall(json.dumps({"exit": _exit_status[0]}).encode() + b"\n")


def _reopen_stdio() -> None:
    """New stdio objects on the new descriptors, buffered as a new process's would be (line by line only on a
    terminal): the launcher's were set up for its own."""
    sys.stdin = os.fdopen(0, "r", closefd=False)
    sys.stdout = os.fdopen(1, "w", buffering=1 if os.isatty(1) else -1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False, errors="backslashreplace")


def _received(conn: socket.socket) -> tuple[Launch | None, list[int]]:
    """The launch asked for, and the descriptors sent with it (an attached one's stdio)."""
    fds: list[int] = []
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        first, fds, _, _ = socket.recv_fds(conn, 65536, 3)
        raw = json.loads(first if first.endswith(b"\n") or not first else first + _read_line(conn))
        return Launch(module=str(raw["module"]), args=[str(a) for a in raw.get("args", [])],
                      env={str(k): str(v) for k, v in raw.get("env", {}).items()},
                      log=str(raw.get("log", os.devnull)), cwd=str(raw.get("cwd", ".")),
                      attached=bool(raw.get("attached", False)) and len(fds) == 3,
                      piped=bool(raw.get("piped", False)) and len(fds) == 1), fds
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        return None, fds


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"a launch must be under {MAX_REQUEST_BYTES} bytes")
    return data


def _redirect(log: str, stdin: int | None = None) -> None:
    """stdout and stderr appended to `log`, stdin from `stdin` (a piped launch's) or /dev/null: what `academus up`
    gives a service, or a standby."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    source = os.open(os.devnull, os.O_RDONLY) if stdin is None else stdin
    for target, fd in ((0, source), (1, out), (2, out)):
        if fd != target:
            os.dup2(fd, target)
    for fd in {out, source} - {0, 1, 2}:
        os.close(fd)


def _refuse_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise SystemExit("launcher: CUDA was initialised by an import; a forked child could not use it")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m academus.shared.cli.launcher", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", required=True, help="the Unix socket to listen on (ACADEMUS_LAUNCHER names it)")
    run(serve(p.parse_args(argv).socket))


if __name__ == "__main__":
    main()
