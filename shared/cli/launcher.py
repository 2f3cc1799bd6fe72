"""A warm launcher: one process that has imported every service's modules and forks each new service process
from itself, so a start skips the imports.

    python -m academus.shared.cli.launcher --socket PATH      (then ACADEMUS_LAUNCHER=PATH for `academus up`)

A worker's start is mostly imports: torch and transformers take about 3.7 s of CPU of the 5 s it takes on this
project's 2-core machine; every other service imports for about 0.4 s. Where meshes start again and again on
one machine (the test suite, the benches' fresh meshes a round and arm, a supervisor restarting what died),
`academus up` and the supervisor ask the launcher named by ACADEMUS_LAUNCHER instead of executing Python
afresh. The forked child is the same program in the same state as a fresh one after its imports: it takes the
environment, log, working directory and session it is sent, then runs the service's `__main__`.

The launcher forks before anything in it starts a thread of its own or touches a GPU: a forked CUDA context is
unusable, so it refuses to run once CUDA is initialised. Children are not its to wait for (SIGCHLD is ignored:
the kernel reaps them); whoever started a service watches its pid, as with any process. Code changed on disk
after the launcher started is not seen by its children: restart it after an upgrade. When ACADEMUS_LAUNCHER
names no live launcher, services start as plain processes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from academus.shared.runtime.config import LAUNCHER, replace_environment

# what the services import at their start: `academus.services.<name>` runs `<name>.server`'s main
PRELOAD = ("academus.services.worker.server", "academus.services.scheduler.server",
           "academus.services.gateway.server", "academus.services.resource_manager.server",
           "academus.services.adapter_store.server", "academus.services.trainer.server",
           "academus.services.plot.server")
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


def launch(socket_path: str, spec: Launch) -> int | None:
    """Asks the launcher at `socket_path` to start `spec`; its pid, or None when no launcher answers there."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(CONNECT_TIMEOUT_S)
            conn.connect(socket_path)
            conn.sendall(json.dumps(asdict(spec)).encode() + b"\n")
            reply = json.loads(_read_line(conn) or b"{}")
    except (OSError, ValueError):
        return None
    return reply.get("pid") if isinstance(reply.get("pid"), int) else None


def launched(spec: Launch) -> int | None:
    """`spec` started by the launcher ACADEMUS_LAUNCHER names; None: none is set or it did not answer."""
    path = LAUNCHER.get()
    return launch(path, spec) if path else None


def serve(socket_path: str, preload: tuple[str, ...] = PRELOAD) -> Launch:
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
    print(f"launcher ready at {path} (pid {os.getpid()})", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            spec = _received(conn)
            if spec is None:
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:   # out of memory or processes: this launch fails, the launcher serves on
                reply = {"error": f"fork: {e}"}
            else:
                if pid == 0:
                    listener.close()
                    return spec
                reply = {"pid": pid}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")


def run(spec: Launch) -> None:
    """In the forked child: becomes the process `spec` describes, then runs its module as `python -m` would."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # its own children it waits for itself
    os.setsid()   # a session of its own, as `academus up` gives each service
    _redirect(spec.log)
    replace_environment(spec.env)
    os.chdir(spec.cwd)
    sys.path[0] = os.getcwd()   # `python -m` puts its working directory first
    sys.argv = [spec.module, *spec.args]
    runpy.run_module(spec.module, run_name="__main__", alter_sys=True)


def _received(conn: socket.socket) -> Launch | None:
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        raw = json.loads(_read_line(conn))
        return Launch(module=str(raw["module"]), args=[str(a) for a in raw.get("args", [])],
                      env={str(k): str(v) for k, v in raw.get("env", {}).items()},
                      log=str(raw.get("log", os.devnull)), cwd=str(raw.get("cwd", ".")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        return None


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


def _redirect(log: str) -> None:
    """stdout and stderr appended to `log`, stdin from /dev/null: what `academus up` gives a service."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)


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
