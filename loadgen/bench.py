"""What the benchmark scripts share: one `academus loadgen` run in a subprocess, the CPU the mesh spends,
and the summary file."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from prometheus_client.samples import Sample

from academus.shared.cli.mesh import MeshState
from academus.shared.runtime.metrics import scrape

# The settings a benchmark can switch off in one of its two arms (`--ablate NAME`): the variable, then
# (arm name, value) with the setting on (the default, but for compute_sched and hop_slice) and off.
ABLATIONS = {
    "drop_doomed": ("ACADEMUS_DROP_DOOMED", ("drop_doomed", "true"), ("keep_doomed", "false")),
    "honour_pushback": ("ACADEMUS_HONOUR_PUSHBACK", ("honour_pushback", "true"), ("ignore_pushback", "false")),
    "gc_freeze": ("ACADEMUS_GC_FREEZE", ("frozen", "true"), ("unfrozen", "false")),
    "keep_freed_pages": ("ACADEMUS_KEEP_FREED_PAGES", ("pages_kept", "true"), ("pages_returned", "false")),
    "compute_sched": ("ACADEMUS_COMPUTE_SCHED", ("idle", "idle"), ("normal", "normal")),  # idle: opt-in
    "hop_streams": ("ACADEMUS_HOP_STREAMS", ("streams", "true"), ("unary_calls", "false")),
    "send_ahead": ("ACADEMUS_SEND_AHEAD", ("ahead", "true"), ("on_free", "false")),
    "hop_slice": ("ACADEMUS_HOP_SLICE_US", ("short_slice", "100"), ("kernel_slice", "0")),  # short: opt-in
    "compute_nice": ("ACADEMUS_COMPUTE_NICE", ("workers_nice_10", "10"), ("equal_shares", "0")),  # 10: opt-in
    "saturated_nice": ("ACADEMUS_SATURATED_NICE", ("yield_when_saturated", "10"), ("equal_shares", "0")),
    "max_merge": ("ACADEMUS_MAX_MERGE", ("one_a_element", "1"), ("merge_4", "4")),   # 4: the default
    "merge_8": ("ACADEMUS_MAX_MERGE", ("merge_8", "8"), ("merge_4", "4")),   # elements twice the default's
    "overload_merge": ("ACADEMUS_OVERLOAD_MERGE", ("overload_merge", "0"), ("paper_buffer", "1")),  # 1: max_merge
    "frame_batches": ("ACADEMUS_FRAME_BATCHES", ("batches", "true"), ("one_a_message", "false")),
    "local_plane": ("ACADEMUS_LOCAL_PLANE", ("local_plane", "true"), ("grpc_streams", "false")),
    "trace_ratio": ("ACADEMUS_TRACE_RATIO", ("one_in_100", "0.01"), ("every_request", "1")),
    "max_queue_wait": ("ACADEMUS_MAX_QUEUE_WAIT_MS", ("wait_bound", "1000"), ("deadline_bound", "0")),
}


def loadgen_command(run_dir: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "academus.loadgen", *args, "--run-dir", str(run_dir), "--out", str(out)]


def loadgen(run_dir: Path, out: Path, *args: str) -> dict:
    """One `academus loadgen` run in a subprocess (its own event loop and CPU accounting); its report."""
    done = subprocess.run(loadgen_command(run_dir, out, *args), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def serving_samples(state: MeshState, prefixes: tuple[str, ...]) -> dict[str, list[Sample]]:
    """The /metrics samples whose names start with one of `prefixes`, per serving process of the mesh
    (workers, schedulers, gateway)."""
    return {s.name: [p for p in scrape(s.metrics_port) if p.name.startswith(prefixes)] for s in state.services
            if s.name.startswith(("worker", "scheduler", "gateway"))}


def write_summary(out: Path, summary: dict) -> int:
    """summary.json under `out`, and the summary as the last line printed."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


def run_bench(parser: argparse.ArgumentParser, run: Callable[[argparse.Namespace], dict],
              argv: list[str] | None) -> int:
    """A bench's entry point: parse (the parser has --out), run, write the summary under --out."""
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return write_summary(args.out, run(args))


def stat_cpu_s(stat: str) -> float:
    """CPU seconds (user + system) in a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat line."""
    fields = stat.rsplit(")", 1)[1].split()   # the command name, in parentheses, may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int | str) -> float:
    """CPU seconds (user + system) process `pid` ("self": this one) has used so far."""
    return stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())


def process_memory_kib(pid: int, field: str = "VmRSS") -> int | None:
    """A process's memory from /proc, KiB: VmRSS (its status) or Pss (smaps_rollup: each shared page split
    among the processes sharing it, as a forked one's are); None when it is gone or a zombie."""
    try:
        for line in Path(f"/proc/{pid}/{'smaps_rollup' if field == 'Pss' else 'status'}").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def service_cpu_s(state: MeshState) -> dict[str, float]:
    """CPU seconds (user + system) each mesh process has used so far, Redis included."""
    pids = {s.name: s.pid for s in state.services} | ({"redis": state.redis_pid} if state.redis_pid else {})
    return {name: process_cpu_s(pid) for name, pid in pids.items()}


def service_and_own_cpu_s(state: MeshState) -> dict[str, float]:
    """`service_cpu_s`, and this process's own CPU seconds as `loadgen`: for a load generator run in process."""
    return service_cpu_s(state) | {"loadgen": process_cpu_s("self")}


def loadgen_with_cpu(state: MeshState, run_dir: Path, out: Path, *args: str) -> dict:
    """`loadgen` for a single run, its report's run entry with the CPU ms a completed request cost in
    each mesh process and in the load generator itself (`loadgen`)."""
    before, client_before = service_cpu_s(state), _children_cpu_s()
    run = loadgen(run_dir, out, *args)["runs"][0]
    after, client_after = service_cpu_s(state), _children_cpu_s()
    run["cpu_ms_per_request"] = cpu_ms_per_request(before | {"loadgen": client_before},
                                                   after | {"loadgen": client_after}, run["completed"])
    return run


def cpu_ms_per_request(before: dict[str, float], after: dict[str, float], completed: int) -> dict[str, float]:
    """CPU ms each process spent a completed request between two `service_cpu_s` readings."""
    return {name: round((after[name] - before[name]) * 1e3 / max(completed, 1), 2) for name in before}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
