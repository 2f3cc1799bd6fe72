"""Student parallelism benchmarks (issue 4): one local mesh, every run against the same schedules.

    python -m academus.loadgen.student_bench --out .academus/results/student [--duration 30] [--workers 2]

Deployments: `student` for `<task>-students`, `padded` for the teacher `<task>` and the single 2-layer
baseline `<task>-2l`. Steps, each an `academus loadgen` invocation whose report lands under --out:

0. capacity: the padded teacher, then the student group (its number adapting), each under a closed loop
   of --concurrency callers (`closed:N`: perf_analyzer's concurrency mode). The teacher's completed
   rate is C; the CPU ms a completed request costs in each process (workers: model compute; the rest:
   serving) says what bounds a capacity ratio. (An open loop past capacity measured the backlog, not
   the teacher: requests expiring in the queue and the load generator's own growing CPU gave 53.9 req/s,
   while the same teacher then completed 91.4 req/s inside the bursts.)
1. (a)+(b), --rounds times (each round its own seed; the ratios are the rounds' median): Poisson at 0.5·C:
   `<task>:padded`, `<task>-students:student` (S = --students, default the
   best-pruned k the resource manager starts from), `<task>-2l:padded`.
2. (c): on/off bursts to 3·C (base 0.5·C): `<task>:padded` vs `<task>-students:student`, the student
   number adapting (the quiet window is shortened to --window seconds so it shows within the run), sent
   by at least one load-generator process per 800 req/s of the peak (more than --procs where it needs).
3. (d): the latency breakdown from the recorded traces and from response metadata.

The last line printed is the summary JSON (ratios and the targets they are held against).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import redis

from academus.loadgen.bench import loadgen, loadgen_with_cpu, run_bench
from academus.shared.cli.mesh import Deployment, MeshOptions, down, up
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.keys import Keys

SENDS_A_PROCESS = 800   # req/s one load-generator process keeps to its schedule (it spends ~1 ms a request)


def set_students(state, model: str, number: int) -> None:
    redis.Redis.from_url(state.redis_url, decode_responses=True).set(Keys(state.key_prefix).students(model), number)


def teacher_name(args: argparse.Namespace) -> str:
    """The served teacher: --teacher (a head on a user's model, whose students are `<teacher>-students`), else
    the task's head on the bundled teacher."""
    return args.teacher or args.task


def start(args: argparse.Namespace, run_dir: Path, window_s: float, env: dict[str, str] | None = None):
    task = teacher_name(args)
    return up(MeshOptions(
        run_dir=run_dir, artifacts=args.artifacts, gateway_port=0, gateways=args.gateways, workers=args.workers,
        worker_threads=args.worker_threads, instances=args.instances,
        deployments=[Deployment("student", f"{task}-students", args.shards),
                     Deployment("padded", f"{task},{task}-2l", args.shards)],
        env={"ACADEMUS_MODELS": f"{task},{task}-students,{task}-2l", "ACADEMUS_ADAPT_WINDOW_S": str(window_s),
             "ACADEMUS_QUEUE_CAPACITY": str(args.queue)} | (env or {})))


def run_options(args: argparse.Namespace, timeout_s: float | None = None, procs: int = 0) -> list[str]:
    """The loadgen options every run of these benches shares: its length, the task's texts, the timeout,
    the load generator's processes (`procs`, else --procs) and whether their requests ride multiplexed
    streams."""
    return ["--duration", str(args.duration), "--texts", f"task:{args.task}",
            "--timeout", str(args.timeout if timeout_s is None else timeout_s), "--procs", str(procs or args.procs),
            *(["--streams"] if args.streams else [])]


def burst_procs(procs: int, peak_rps: float) -> int:
    """Load-generator processes for a peak rate: --procs, or more where each would send more than
    SENDS_A_PROCESS a second (on an H200, four sending 5643 req/s fell 26 ms behind at p99, eight kept
    to the schedule: `send_late_ms`, docs/benchmarks/students.md)."""
    return max(procs, math.ceil(peak_rps / SENDS_A_PROCESS))


def group_size(state, args: argparse.Namespace) -> int:
    spec = redis.Redis.from_url(state.redis_url, decode_responses=True).hget(Keys(state.key_prefix).models(),
                                                                              f"{teacher_name(args)}-students")
    return start_students(json.loads(spec), args.students)


def start_students(spec: dict, wanted: int) -> int:
    """`wanted`, capped at the group's M; 0: the deployment's own start, the best-pruned k (where the
    resource manager starts a student model)."""
    return min(wanted or spec.get("default_students") or spec["max_students"], spec["max_students"])


def run(args: argparse.Namespace) -> dict:
    """Phase 1 (capacity, (a), (b), (d)) keeps the paper's 120 s quiet window, so the group size stays
    as set; phase 2 ((c)) shortens it to --window so the student number visibly adapts within a run.
    With --teacher-capacity, phase 1 is skipped and only (c) is reported."""
    period = args.duration / 2
    if args.teacher_capacity:
        return burst_fields(bursts(args, args.teacher_capacity), period)
    capacities, halves, traces = half_load(args)
    return summarise(capacities, halves, bursts(args, capacities[0]["throughput_rps"]), traces, period)


def half_load(args: argparse.Namespace) -> tuple[list[dict], list[dict], dict]:
    """Phase 1: both capacities, then --rounds half-load comparisons, then the traces' breakdown."""
    task, out = teacher_name(args), args.out
    students, single = f"{task}-students", f"{task}-2l"
    state = start(args, out / "run", 120.0)
    try:
        set_students(state, students, group_size(state, args))
        capacities = [loadgen_with_cpu(state, out / "run", out / f"capacity_{policy}", "run", "--model", model,
                                       "--policy", policy, "--schedule", f"closed:{args.concurrency}",
                                       *run_options(args, timeout_s=60))
                      for model, policy in ((task, "padded"), (students, "student"))]
        capacity = capacities[0]["throughput_rps"]
        halves = []
        for r in range(args.rounds):
            set_students(state, students, group_size(state, args))
            halves.append(loadgen(out / "run", out / ("half_load" if r == 0 else f"half_load_{r}"), "compare",
                                  "--runs", f"{task}:padded,{students}:student,{single}:padded",
                                  "--schedule", f"poisson:{0.5 * capacity:.2f}", *run_options(args),
                                  "--seed", str(r)))
        traces = subprocess.run([sys.executable, "-m", "academus.loadgen", "breakdown", "--run-dir",
                                 str(out / "run")], capture_output=True, text=True, check=True)
    finally:
        down(out / "run")
    return capacities, halves, json.loads(traces.stdout.strip().splitlines()[-1])


def bursts(args: argparse.Namespace, capacity: float) -> dict:
    """Phase 2: on/off bursts to 3 × the teacher's capacity, the teacher, then the student group, from as
    many load-generator processes as the peak needs (`burst_procs`)."""
    task, out, period = teacher_name(args), args.out, args.duration / 2
    state = start(args, out / "run-bursts", args.window)
    try:
        set_students(state, f"{task}-students", group_size(state, args))
        schedule = f"bursts:{0.5 * capacity:.2f},{3 * capacity:.2f},{period},{period / 2}"
        runs = f"{task}:padded,{task}-students:student"
        return loadgen(out / "run-bursts", out / "bursts", "compare", "--runs", runs, "--schedule", schedule,
                       *run_options(args, procs=burst_procs(args.procs, 3 * capacity)))
    finally:
        down(out / "run-bursts")


def in_burst_rps(run: dict, period: float) -> float:
    """Completed per second over the timeline's bins inside the bursts (the first half of each period)."""
    bins = [b for b in run.get("timeline", []) if b["t"] % period < period / 2 and b["t"] < 2 * period]
    return round(sum(b["completed"] for b in bins) / len(bins), 3) if bins else 0.0


def summarise(capacities: list[dict], halves: list[dict], bursts: dict, traces: dict, period: float) -> dict:
    """(a) and (b) are the medians over the half-load rounds of each round's ratio (the teacher's p95
    alone moved 82-164 ms between rounds of one invocation); breakdowns and accuracy from round 0."""
    half = halves[0]
    rounds = [dict(zip(("teacher", "students", "single"), h["runs"], strict=True)) for h in halves]

    def median_ratio(run: str, base: str, q: str) -> float | None:
        values = [v for v in (latency_ratio(r[run], r[base], q) for r in rounds) if v is not None]
        return round(statistics.median(values), 3) if values else None

    c_teacher, c_group = (r["throughput_rps"] for r in capacities)
    return {
        "teacher_capacity_rps": c_teacher, "students_capacity_rps": c_group,
        "capacity_students_vs_teacher": round(c_group / max(c_teacher, 1e-9), 3),
        "capacity_student_number": capacities[1].get("student_number"),
        "capacity_cpu_ms_per_request": {r["model"]: r["cpu_ms_per_request"] for r in capacities},
        "a_p95_students_vs_teacher": median_ratio("students", "teacher", "p95"), "a_target": "<= 0.25",
        "a_p50_students_vs_teacher": median_ratio("students", "teacher", "p50"),
        "b_p50_students_vs_single_2l": median_ratio("students", "single", "p50"), "b_target": "<= 0.7",
        "b_p95_students_vs_single_2l": median_ratio("students", "single", "p95"),
        "half_load_rounds": [{name: {"p50": r[name]["latency_ms"].get("p50"), "p95": r[name]["latency_ms"].get("p95")}
                              for name in r} | {"a_p95": latency_ratio(r["students"], r["teacher"], "p95")}
                             for r in rounds],
    } | burst_fields(bursts, period) | {
        "accuracy": {r["model"] + ":" + r["policy"]: r.get("accuracy") for r in half["runs"]},
        "d_breakdown_ms": {f"{r['model']}:{r['policy']}": r.get("breakdown_ms") for r in half["runs"]},
        "d_tail_breakdown_ms": {f"{r['model']}:{r['policy']}": r.get("tail_breakdown_ms") for r in half["runs"]},
        "d_trace_breakdown": traces,
    }


def burst_fields(bursts: dict, period: float) -> dict:
    """(c): throughput students / teacher over the whole run and inside the bursts, the p95 ratio, and the
    student numbers the answers used."""
    b_teacher, b_group = bursts["runs"]
    inside = {"teacher": in_burst_rps(b_teacher, period), "students": in_burst_rps(b_group, period)}
    return {
        "c_throughput_students_vs_teacher": round(b_group["throughput_rps"] / max(b_teacher["throughput_rps"], 1e-9),
                                                  3),
        "c_target": ">= 3 (in the bursts)",
        "c_in_burst_rps": inside,
        "c_in_burst_throughput_students_vs_teacher": round(inside["students"] / max(inside["teacher"], 1e-9), 3),
        "c_p95_students_vs_teacher": latency_ratio(b_group, b_teacher, "p95"),
        "c_student_number": b_group.get("student_number"),
        "c_send_late_ms": {"teacher": b_teacher.get("send_late_ms"), "students": b_group.get("send_late_ms")},
    }


def latency_ratio(run: dict, base: dict, q: str) -> float | None:
    a, b = run["latency_ms"].get(q), base["latency_ms"].get(q)
    return round(a / b, 3) if a and b else None


def add_mesh_options(p: argparse.ArgumentParser) -> None:
    """What `start`, `group_size` and the half-load runs read: the mesh, the task, each run's length."""
    p.add_argument("--task", choices=["sentiment", "spam"], default="sentiment")
    p.add_argument("--teacher", default="", help="a head on a model you added (e.g. mpnet-sentiment, trained on "
                   "--task), whose students `academus distill --model` made; default: the bundled teacher's --task")
    p.add_argument("--artifacts", type=Path, default=artifacts_dir(),
                   help="the models served (default ACADEMUS_ARTIFACTS)")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--instances", type=int, default=1)
    p.add_argument("--students", type=int, default=0, help="the group size S at the start of each run, capped "
                                                           "at M (default: the best-pruned k, where the "
                                                           "resource manager starts)")
    p.add_argument("--queue", type=int, default=256)
    p.add_argument("--procs", type=int, default=1, help="load-generator processes a run (a GPU node's rates)")
    p.add_argument("--gateways", type=int, default=1, help="gateway processes on the mesh's port (`academus up "
                                                          "--gateways`: an edge that keeps up on a GPU node)")
    p.add_argument("--shards", type=int, default=1, help="scheduler processes a deployment, each running its share "
                                                        "of the groups (`--deployment POLICY=MODELS/SHARDS`)")
    p.add_argument("--streams", action="store_true", help="the load generator's requests ride one multiplexed "
                                                          "stream a process (`academus loadgen --streams`)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.student_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".academus/results/student"))
    add_mesh_options(p)
    p.add_argument("--concurrency", type=int, default=64, help="callers of the closed-loop capacity runs")
    p.add_argument("--window", type=float, default=5.0, help="quiet window before a student is added back (s)")
    p.add_argument("--rounds", type=int, default=1, help="half-load comparisons ((a), (b)); ratios: their median")
    p.add_argument("--teacher-capacity", type=float, default=0.0,
                   help="req/s: skip phase 1 and run only (c)'s bursts against this capacity")
    return run_bench(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
