"""Issue 4 (a) with one serving setting on and off: the half-load comparison, interleaved on fresh meshes.

    python -m academus.loadgen.half_load_bench --rate 35 --ablate NAME [--rounds 3]
                                               [--duration 30] [--out .academus/results/half_load]

`--ablate gc_freeze`: the services' start-up heap frozen out of the cyclic collector (ACADEMUS_GC_FREEZE
true / false). `compute_sched`: the workers' compute threads under SCHED_IDLE or the default policy
(ACADEMUS_COMPUTE_SCHED idle / normal). `hop_streams`: the gateway's and schedulers' calls riding one
multiplexed stream a peer, or a gRPC call each (ACADEMUS_HOP_STREAMS true / false). `send_ahead`: a busy
student group sent its next element at once, or when it frees (ACADEMUS_SEND_AHEAD true / false).
`hop_slice`: the services' threads on a 0.1 ms EEVDF slice or the kernel's (ACADEMUS_HOP_SLICE_US 100 / 0;
shared/runtime/slices.py); the load generator keeps its own setting in both arms. `max_merge`: the length-aware
buffer's elements hold one sample, or up to four, the default (ACADEMUS_MAX_MERGE 1 / 4). `overload_merge`:
elements growing to twice max_merge while a full buffer's worth queues, or the paper's buffer exactly
(ACADEMUS_OVERLOAD_MERGE 0 / 1). `merge_8`: merges of 8 at every load against 4.
`local_plane`: the hops of one node over its Unix sockets, or every hop on a gRPC stream (ACADEMUS_LOCAL_PLANE
true / false). `trace_ratio`: one request in 100 traced, or every one (ACADEMUS_TRACE_RATIO 0.01 / 1).
`compute_nice`: the workers' processes and autogroups at nice 10, below the gateway's and schedulers', or equal
shares (ACADEMUS_COMPUTE_NICE 10 / 0).
`drop_doomed`, `honour_pushback`: see overload_bench.
`workers`, `instances`: mesh options, not switches: three worker processes (student groups, on CPU) against
student_bench's two; two compute threads a worker against one. `artifacts`: the models of --other-artifacts
(say, students of another width: `academus distill --intermediate-size`) against those of --artifacts.

Each round starts two fresh meshes in turn, one a setting (the order alternates between rounds, so
drift of the machine does not favour one), each serving the padded teacher and the student group as
student_bench does, and sends both the same Poisson schedule: `<task>:padded`, then
`<task>-students:student` (`academus loadgen compare`). --rate is half the padded teacher's capacity, as
in (a) (student_bench measures it). Per round and setting: the (a) ratios (students / teacher at p50,
p95, p99), both runs' latencies and tail breakdowns, and the collections each serving process made
during the runs, by generation: how many, their seconds, and the bucket bound of the longest.
The last line printed is the summary JSON.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from academus.loadgen.bench import ABLATIONS, loadgen, run_bench, serving_samples
from academus.loadgen.student_bench import (
    add_mesh_options,
    group_size,
    latency_ratio,
    run_options,
    set_students,
    start,
)
from academus.shared.cli.mesh import down

# Mesh options compared as the switches are: the option, then (arm, value) tried and (arm, value) as
# student_bench runs it.
MESH_SETTINGS = {"workers": ("workers", ("three_workers", 3), ("two_workers", 2)),
                 "instances": ("instances", ("two_instances", 2), ("one_instance", 1)),
                 "artifacts": ("artifacts",)}   # its arms, --other-artifacts and --artifacts, are given (arms_of)

Pauses = dict[tuple[str, str, str], float]   # (sample name, generation, bucket bound or "") -> value


def pauses(state) -> dict[str, Pauses]:
    """Per serving process, its pause histogram's samples."""
    return {name: {(p.name, p.labels["generation"], p.labels.get("le", "")): p.value for p in samples}
            for name, samples in serving_samples(state, ("academus_gc_pause_seconds",)).items()}


def collections(before: Pauses, after: Pauses) -> dict[str, dict[str, float]]:
    """By generation, what happened between two readings: collections, their total ms, and the bound
    (ms) of the lowest bucket that holds every one of them (the longest pause is at most that)."""
    def delta(name: str, gen: str, le: str = "") -> float:
        return after.get((name, gen, le), 0.0) - before.get((name, gen, le), 0.0)

    out = {}
    for gen in sorted({g for _, g, _ in after}):
        count = delta("academus_gc_pause_seconds_count", gen)
        if not count:
            continue
        bounds = sorted((le for name, g, le in after if g == gen and le not in ("", "+Inf")), key=float)
        longest = next((float(le) for le in bounds if delta("academus_gc_pause_seconds_bucket", gen, le) == count),
                       float("inf"))
        out[gen] = {"count": count, "total_ms": round(delta("academus_gc_pause_seconds_sum", gen) * 1e3, 2),
                    "longest_le_ms": longest * 1e3}
    return out


def one_arm(args: argparse.Namespace, round_: int, name: str, env: dict[str, str]) -> dict:
    run_dir = args.out / f"run-{round_}-{name}"
    state = start(args, run_dir, 120.0, env)
    try:
        students = f"{args.task}-students"
        set_students(state, students, group_size(state, args))
        before = pauses(state)
        report = loadgen(run_dir, args.out / f"{round_}-{name}", "compare", "--runs",
                         f"{args.task}:padded,{students}:student", "--schedule", f"poisson:{args.rate}",
                         *run_options(args), "--seed", str(round_))
        after = pauses(state)
    finally:
        down(run_dir)
    teacher, group = report["runs"]
    return {"a_ratios": {q: latency_ratio(group, teacher, q) for q in ("p50", "p95", "p99")},
            "teacher_ms": teacher["latency_ms"], "students_ms": group["latency_ms"],
            "tail_breakdown_ms": {"teacher": teacher["tail_breakdown_ms"], "students": group["tail_breakdown_ms"]},
            "completed": {"teacher": teacher["completed"], "students": group["completed"]},
            "collections": {proc: collections(before.get(proc, {}), after[proc]) for proc in after}}


def arm_setting(args: argparse.Namespace, value) -> tuple[argparse.Namespace, dict[str, str]]:
    """One arm's mesh options and environment: the switch's variable set, or the mesh option changed."""
    if args.ablate in MESH_SETTINGS:
        return argparse.Namespace(**vars(args) | {MESH_SETTINGS[args.ablate][0]: value}), {}
    return args, {ABLATIONS[args.ablate][0]: value}


def arms_of(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(arm, value) for the setting compared; `artifacts` takes its two directories from the options."""
    _, *arms = (ABLATIONS | MESH_SETTINGS)[args.ablate]
    if args.ablate == "artifacts":
        if args.other_artifacts is None:
            raise SystemExit("--ablate artifacts compares two model sets: name the other with --other-artifacts DIR")
        return [("other_artifacts", args.other_artifacts), ("artifacts", args.artifacts)]
    return arms


def run(args: argparse.Namespace) -> dict:
    arms = arms_of(args)
    rounds = []
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        row = {}
        for name, value in order:
            arm_args, env = arm_setting(args, value)
            row[name] = one_arm(arm_args, r, name, env)
        rounds.append(row)
    quantiles = ("p50", "p95", "p99")
    mean = {name: {q: round(statistics.mean(v for rd in rounds if (v := rd[name]["a_ratios"][q]) is not None), 3)
                   for q in quantiles} for name, _ in arms}
    return {"ablate": args.ablate, "arms": {name: str(value) for name, value in arms}, "rate": args.rate,
            "duration_s": args.duration, "rounds": rounds, "mean_a_ratios": mean}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.half_load_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, required=True, help="offered requests/s: half the teacher's capacity")
    p.add_argument("--ablate", choices=sorted(ABLATIONS | MESH_SETTINGS), required=True,
                   help="the setting switched off (or the mesh option changed) in one arm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--other-artifacts", type=Path, default=None, help="--ablate artifacts: the other arm's models")
    add_mesh_options(p)
    p.add_argument("--out", type=Path, default=Path(".academus/results/half_load"))
    return run_bench(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
