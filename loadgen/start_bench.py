"""Service starts with and without the warm launcher (shared/cli/launcher.py): `academus up` to a mesh that
answers, the CPU its processes spent getting there (the mesh's own launcher's included), and a killed worker's
restart by the supervisor until it answers again. Fresh meshes, the arms in turn (the order reversed every other
round), several rounds. Arms: `plain` (`up --no-launcher`), `own` (`up` as it is by default: a launcher of its
own, importing while the light services start) and `shared` (a launcher already warm, named by ACADEMUS_LAUNCHER,
as the test suite's meshes have).

`--standby` (`up --standby`): the worker's standby too, from `up` until it is built (its log's ready event: time
from its start, its CPU) and its proportional set size then; after the kill, the standby takes the worker's place
and a new one is built behind it: that one's time until built and its CPU.

    python -m academus.loadgen.start_bench [--rounds 4] [--workers 1] [--standby] [--out FILE]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from academus.client import Client
from academus.loadgen.bench import process_cpu_s, process_memory_kib, service_cpu_s
from academus.loadgen.stats import summary
from academus.shared.cli.launcher import start_launcher
from academus.shared.cli.mesh import (
    ADMIN_KEY_FILE,
    Deployment,
    MeshOptions,
    MeshState,
    ServiceProcess,
    down,
    up,
)
from academus.shared.cli.standby import READY as STANDBY_READY
from academus.shared.runtime.config import LAUNCHER
from academus.shared.runtime.logs import logged_events

ARMS = ("plain", "own", "shared")


def answered(gateway: str, key: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    with Client(gateway, api_key=key, timeout=30) as client:
        while True:
            try:
                client.infer("sentiment", ["a start"])
                return
            except Exception:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)


def one_round(run_dir: Path, workers: int, launcher: bool, standby: bool = False) -> dict[str, float]:
    began = time.perf_counter()
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, workers=workers, worker_threads=1,
                           deployments=[Deployment("fifo")], launcher=launcher, standby=standby))
    try:
        key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
        answered(state.gateway, key)
        start_s = time.perf_counter() - began
        own = process_cpu_s(state.launcher_pid) if state.launcher_pid else 0.0
        start_cpu_s = own + sum(cpu for name, cpu in service_cpu_s(state).items() if name != "redis")
        worker = next(s for s in state.services if s.service == "worker")
        row = standby_built(run_dir, worker.name, began, "standby_") if standby else {}
        killed = time.perf_counter()
        os.kill(worker.pid, signal.SIGKILL)
        while (again := restarted(run_dir, worker)) is None:
            time.sleep(0.02)
        answered(state.gateway, key)
        restart_s = time.perf_counter() - killed
        if standby:
            row |= standby_built(run_dir, worker.name, killed, "next_standby_")
        return {"start_ms": start_s * 1e3, "start_cpu_ms": start_cpu_s * 1e3, "restart_ms": restart_s * 1e3,
                "restart_cpu_ms": process_cpu_s(again.pid) * 1e3, **row}
    finally:
        down(run_dir)


def standby_built(run_dir: Path, name: str, since: float, prefix: str, timeout_s: float = 180.0) -> dict[str, float]:
    """Once `name`'s standby (the one mesh.json names now) is built (its log's ready event): its time from
    `since`, the CPU its process spent and its proportional set size (MiB)."""
    end = time.monotonic() + timeout_s
    while True:
        proc = MeshState.load(run_dir).service(name)
        ready = [e for e in logged_events(Path(proc.log), STANDBY_READY) if e.get("pid") == proc.standby_pid]
        if ready:
            return {f"{prefix}ready_ms": (time.perf_counter() - since) * 1e3,
                    f"{prefix}cpu_ms": process_cpu_s(proc.standby_pid) * 1e3,
                    f"{prefix}pss_mib": (process_memory_kib(proc.standby_pid, "Pss") or 0) / 1024}
        if time.monotonic() > end:
            raise TimeoutError(f"{name}'s standby not built after {timeout_s} s")
        time.sleep(0.05)


def restarted(run_dir: Path, worker: ServiceProcess) -> ServiceProcess | None:
    now = MeshState.load(run_dir).service(worker.name)
    return now if now.pid != worker.pid else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--standby", action="store_true", help="a standby per worker; its build measured too")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="start-bench-") as tmp:
        launcher = start_launcher(Path(tmp) / "launcher.sock", ready_timeout_s=120)
        try:
            for r in range(args.rounds):
                for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                    if arm == "shared":
                        os.environ[LAUNCHER.name] = str(Path(tmp) / "launcher.sock")
                    else:
                        os.environ.pop(LAUNCHER.name, None)
                    rows[arm].append(one_round(Path(tmp) / f"run-{arm}-{r}", args.workers, arm != "plain",
                                                args.standby))
        finally:
            os.environ.pop(LAUNCHER.name, None)
            launcher.terminate()
    result = {"rounds": args.rounds, "workers": args.workers, "standby": args.standby,
              **{arm: {k: summary([row[k] for row in rows[arm]]) for k in rows[arm][0]} for arm in ARMS}}
    for arm in ARMS[1:]:
        result[f"plain_over_{arm}_p50"] = {k: round(result["plain"][k]["p50"] / result[arm][k]["p50"], 2)
                                           for k in rows["plain"][0]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
