"""The MPS path on a GPU node (issue 4, Student Parallelism App. B.4), checked on the node itself:

    python -m academus.loadgen.probes.mps_check [--instances 4] [--rate 200] [--duration 20]
        [--out .academus/results/mps_check]

Starts the mesh for `<task>-students` (student policy) and `<task>-2l` (padded) with --instances worker
processes a GPU, then reads back, from the system rather than from the mesh's own plan:
- what the resource manager did about MPS (its `mps` log event: start | running | missing | skip);
- the MPS control daemon's servers and the client PIDs each serves (`get_server_list`,
  `get_client_list PID`), and which of the workers are among those clients;
- each worker's CUDA_VISIBLE_DEVICES and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE from /proc/PID/environ, and
  the device it registered in Redis;
- nvidia-smi's compute processes.
Then one `academus loadgen compare` of the two deployments at --rate (Poisson), the group size set to
--students (a group spans the workers, eq. 6): absolute GPU latencies.
With no GPU every MPS field says so and the comparison runs on CPU workers.
The last line printed is the summary JSON (`mps.workers_under_mps` lists the workers MPS serves).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import redis

from academus.loadgen.bench import loadgen, run_bench
from academus.loadgen.student_bench import add_mesh_options, group_size, run_options, set_students
from academus.shared.cli.mesh import Deployment, MeshOptions, MeshState, down, up
from academus.shared.runtime.gpu import mps_control
from academus.shared.runtime.logs import logged_events
from academus.shared.state.keys import Keys

PINNING = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "ACADEMUS_DEVICE")


def pids(text: str) -> list[int]:
    """The PIDs in a control-daemon answer: one a line (or space-separated), other words skipped."""
    return [int(word) for word in text.split() if word.isdigit()]


def mps_servers() -> dict[int, list[int]]:
    """Each MPS server's PID and the client PIDs it serves."""
    return {server: pids(mps_control(f"get_client_list {server}") or "")
            for server in pids(mps_control("get_server_list") or "")}


def process_env(pid: int, names: tuple[str, ...] = PINNING) -> dict[str, str]:
    """The named variables from a running process's environment (what it was really started with)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs if k in names}


def gpu_processes() -> list[str]:
    """nvidia-smi's compute processes, one CSV line each ([] without nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    done = subprocess.run([smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=30)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def mps_report(state: MeshState, model: str) -> dict:
    """What MPS and the pinning look like for this mesh's workers (and those serving `model`), read from
    the node."""
    workers = {s.name: s.pid for s in state.services if s.name.startswith("worker")}
    servers = mps_servers()
    clients = {pid for served in servers.values() for pid in served}
    manager = next(s for s in state.services if s.name == "resource_manager")
    keys, client = Keys(state.key_prefix), redis.Redis.from_url(state.redis_url, decode_responses=True)
    registered = {w: client.hget(keys.worker(w), "device") for w in client.smembers(keys.placement(model))}
    return {
        "resource_manager_action": [e.get("action") for e in logged_events(Path(manager.log), "mps")],
        "servers": {str(k): v for k, v in servers.items()},
        "workers": {name: {"pid": pid, "under_mps": pid in clients, "env": process_env(pid)}
                    for name, pid in sorted(workers.items())},
        "workers_under_mps": sorted(name for name, pid in workers.items() if pid in clients),
        "registered_devices": dict(sorted(registered.items())),
        "gpu_processes": gpu_processes(),
    }


def run(args: argparse.Namespace) -> dict:
    task, run_dir = args.task, args.out / "run"
    students, single = f"{task}-students", f"{task}-2l"
    state = up(MeshOptions(
        run_dir=run_dir, artifacts=args.artifacts, gateway_port=0, gateways=args.gateways, workers=args.workers,
        worker_threads=args.worker_threads, instances=args.instances,
        deployments=[Deployment("student", students), Deployment("padded", single)],
        env={"ACADEMUS_MODELS": f"{students},{single}", "ACADEMUS_MPS": args.mps,
             "ACADEMUS_QUEUE_CAPACITY": str(args.queue)}))
    try:
        set_students(state, students, group_size(state, args))
        report = mps_report(state, students)
        compared = loadgen(run_dir, args.out / "compare", "compare", "--runs",
                           f"{students}:student,{single}:padded", "--schedule", f"poisson:{args.rate}",
                           *run_options(args))
    finally:
        down(run_dir)
    runs = {f"{r['model']}:{r['policy']}": {"latency_ms": r["latency_ms"], "throughput_rps": r["throughput_rps"],
                                           "student_number": r.get("student_number"), "errors": r.get("errors")}
            for r in compared["runs"]}
    return {"mps": report, "rate_rps": args.rate, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="academus.loadgen.probes.mps_check", description=__doc__.split("\n")[0])
    add_mesh_options(p)   # --instances: worker processes a GPU; --workers: CPU workers where there is none
    p.set_defaults(instances=4, students=4, duration=20.0)   # every student of the group, spread over 4
    p.add_argument("--mps", choices=["auto", "off"], default="auto")
    p.add_argument("--rate", type=float, default=200.0, help="Poisson requests/s of the comparison")
    p.add_argument("--out", type=Path, default=Path(".academus/results/mps_check"))
    return run_bench(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
