"""ConcatBatching + DAS benchmarks (issue 5): one local mesh, every policy a deployment over the same worker.

    python -m academus.loadgen.concat_bench --out .academus/results/concat [--duration 12] [--rate 200] [--timeout 2]

Deployments (all serving the teacher models): padded, concat (DAS), concat-slotted, bucketed, and the
row-fill baselines concat-fcfs, concat-sjf, concat-edf. Each step is one `academus loadgen compare`
(the same Poisson arrivals and texts to each run, one run after the other), its report under --out:

1. `var20`, `var100`: lengths normal(mean 20, var V, 3..100) at --rate (above every policy's capacity,
   so `throughput_rps` is the maximum throughput): padded, concat, concat-slotted, bucketed.
2. `selection`: DAS vs FCFS, SJF, EDF row fill on the same engine, variance 100, --rate.
3. `email`: SpamAssassin emails (`task:spam`, long-tailed lengths) on a second mesh with L = 256, at
   --email-rate with --email-timeout.
   With --sweep R1,R2,..., variance 100 at each of those Poisson rates too (`sweep_var100` in the summary).
4. DAS overhead: each concat scheduler's time in row selection over the time its batches took
   (send → answer), from its load report in Redis (TCB: <= 2 %).

The last line printed is the summary JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import redis

from academus.loadgen.bench import loadgen, run_bench
from academus.shared.cli.mesh import Deployment, MeshOptions, MeshState, down, up
from academus.shared.state.keys import Keys

SIZE_POLICIES = ["padded", "concat", "concat-slotted", "bucketed"]
SELECTION_POLICIES = ["concat", "concat-fcfs", "concat-sjf", "concat-edf"]
DEPLOYMENTS = [*SIZE_POLICIES, "concat-fcfs", "concat-sjf", "concat-edf"]


def start(run_dir: Path, args: argparse.Namespace, models: str, row_length: int) -> MeshState:
    return up(MeshOptions(
        run_dir=run_dir, gateway_port=0, workers=1, worker_threads=args.worker_threads,
        deployments=[Deployment(p, models) for p in DEPLOYMENTS],
        env={"ACADEMUS_MODELS": models, "ACADEMUS_QUEUE_CAPACITY": str(args.queue),
             "ACADEMUS_CONCAT_ROW_LENGTH": str(row_length), "ACADEMUS_CONCAT_ROWS": str(args.rows),
             "ACADEMUS_MAX_BATCH": str(args.max_batch)}))


def compare(run_dir: Path, out: Path, model: str, policies: list[str], texts: str, args: argparse.Namespace,
            rate: float, timeout: float) -> dict:
    runs = ",".join(f"{model}:{p}" for p in policies)
    return loadgen(run_dir, out, "compare", "--runs", runs, "--schedule", f"poisson:{rate}",
                   "--duration", str(args.duration), "--timeout", str(timeout), "--texts", texts)


def overheads(state: MeshState) -> dict[str, dict]:
    """Per concat/bucketed scheduler: row selection time over batch time, from its load hash."""
    client, keys = redis.Redis.from_url(state.redis_url, decode_responses=True), Keys(state.key_prefix)
    out = {}
    for index, policy in enumerate(DEPLOYMENTS):
        load = client.hgetall(keys.load(f"scheduler-{index}"))
        if "select_ms" not in load or not float(load["batches"]):
            continue
        select, batch, batches = float(load["select_ms"]), float(load["batch_ms"]), int(float(load["batches"]))
        out[policy] = {"batches": batches, "select_ms_per_batch": round(select / max(batches, 1), 3),
                       "batch_ms_per_batch": round(batch / max(batches, 1), 2),
                       "share": round(select / batch, 4) if batch else None,
                       "token_us": round(float(load["token_us"]), 2)}
    return out


def run(args: argparse.Namespace) -> dict:
    out, results = args.out, {}
    run_dir = out / "run"
    state = start(run_dir, args, "minilm", 128)
    try:
        for variance in (20, 100):
            dist = f"normal,mean=20,var={variance},min=3,max=100"
            results[f"var{variance}"] = compare(run_dir, out / f"var{variance}", "minilm", SIZE_POLICIES, dist, args,
                                                args.rate, args.timeout)
        dist = "normal,mean=20,var=100,min=3,max=100"
        for rate in args.sweep:  # TCB §6.2: Poisson arrivals swept over rates
            results[f"sweep{rate:g}"] = compare(run_dir, out / f"sweep{rate:g}", "minilm", SIZE_POLICIES, dist, args,
                                                rate, args.timeout)
        results["selection"] = compare(run_dir, out / "selection", "minilm", SELECTION_POLICIES, dist, args,
                                       args.rate, args.timeout)
        results["overhead"] = overheads(state)
    finally:
        down(run_dir)
    if args.email:
        run_dir = out / "run-email"
        state = start(run_dir, args, "spam", 256)
        try:
            results["email"] = compare(run_dir, out / "email", "spam", SIZE_POLICIES, "task:spam", args,
                                       args.email_rate, args.email_timeout)
            results["overhead_email"] = overheads(state)
        finally:
            down(run_dir)
    return summarise(results)


def _runs(report: dict) -> dict[str, dict]:
    return {r["requested_policy"]: r for r in report["runs"]}


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _figures(report: dict) -> dict[str, dict]:
    return {p: {"throughput_rps": r["throughput_rps"], "utility": r["utility"], "completed": r["completed"],
                "errors": r["errors"], "p50_ms": r["latency_ms"].get("p50"), "p95_ms": r["latency_ms"].get("p95")}
            for p, r in _runs(report).items()}


def summarise(results: dict) -> dict:
    summary: dict = {}
    for step in ("var20", "var100", "email"):
        if step not in results:
            continue
        runs = _runs(results[step])
        base = runs["padded"]
        summary[step] = {"figures": _figures(results[step]),
                         "throughput_vs_padded": {p: _ratio(r["throughput_rps"], base["throughput_rps"])
                                                  for p, r in runs.items()},
                         "utility_vs_padded": {p: _ratio(r["utility"], base["utility"]) for p, r in runs.items()}}
    summary["sweep_var100"] = {step.removeprefix("sweep"): _figures(report) for step, report in results.items()
                               if step.startswith("sweep")}
    runs = _runs(results["selection"])
    das = runs["concat"]
    summary["selection"] = {"figures": _figures(results["selection"]),
                            "das_utility_vs": {p: _ratio(das["utility"], r["utility"]) for p, r in runs.items()},
                            "das_throughput_vs": {p: _ratio(das["throughput_rps"], r["throughput_rps"])
                                                  for p, r in runs.items()}}
    summary["overhead"] = results["overhead"]
    if "overhead_email" in results:
        summary["overhead_email"] = results["overhead_email"]
    summary["targets"] = {"var100_concat_throughput_vs_padded": ">= 1.5", "das_overhead_share": "<= 0.02"}
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.concat_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(".academus/results/concat"))
    p.add_argument("--duration", type=float, default=12.0)
    p.add_argument("--rate", type=float, default=200.0, help="offered Poisson rate (req/s), above capacity")
    p.add_argument("--sweep", type=lambda v: [float(x) for x in v.split(",") if x], default=[],
                   help="comma-separated Poisson rates for a variance-100 sweep of every size policy")
    p.add_argument("--timeout", type=float, default=2.0, help="each request's deadline (s)")
    p.add_argument("--rows", type=int, default=4, help="concat rows a batch (L = 128; 256 for emails)")
    p.add_argument("--max-batch", type=int, default=16, help="padded / bucketed batch size")
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--queue", type=int, default=1024)
    p.add_argument("--email-rate", type=float, default=30.0, help="offered rate for the email step (longer texts)")
    p.add_argument("--email-timeout", type=float, default=5.0)
    p.add_argument("--no-email", dest="email", action="store_false")
    return run_bench(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
