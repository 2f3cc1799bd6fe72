"""Where the work goes under overload (issue 4 (c)): one deployment alone, an open loop past its capacity.

    python -m academus.loadgen.overload_bench --rate 210 [--model sentiment --policy padded]
        [--out .academus/results/overload]
    python -m academus.loadgen.overload_bench --concurrency 64 --streams --ablate frame_batches ...

Runs twice on the same schedule, each on a fresh mesh: with a setting on (the default) and off (the
ablation). `--ablate drop_doomed` (the default): the scheduler's doomed-job drop, ACADEMUS_DROP_DOOMED.
`--ablate honour_pushback`: the gateway refusing at once, while the scheduler's pushback hint lasts, the
requests for a scheduler that refused for a full queue, ACADEMUS_HONOUR_PUSHBACK. `--ablate gc_freeze`,
`--ablate compute_sched`: see half_load_bench. `--ablate shards`: the deployment split over `--shards`
scheduler processes (2 unless given) against one scheduler; each shard has its own `--queue`.
`--ablate overload_merge`: the student buffer's elements growing to twice max_merge while a full buffer's
worth of samples queues beyond it, against the paper's buffer exactly (ACADEMUS_OVERLOAD_MERGE 0 / 1).
`--ablate max_queue_wait`: the schedulers' wait bound (ACADEMUS_MAX_QUEUE_WAIT_MS 1000, the default) refusing at once
what would wait longer, against each request's deadline alone bounding its wait (0).
`--rounds N` runs the pair N times, the order alternating (machine drift then falls on both), and compares
the arms' mean throughputs.

Reports the load generator's summary, the CPU ms a completed request cost in each process, and the
workers' and scheduler's counters over the run: batches computed, batches stopped between layers once
their last deadline passed (`expired`: compute spent on answers nobody waits for), and jobs the scheduler
dropped unrun, by reason (`doomed`: waited too long for their batch to finish in time), and the RPCs each
of gateway, scheduler and workers answered with an error, by code (a RESOURCE_EXHAUSTED the gateway counts
and the scheduler does not was refused at the edge), and the frames of its multiplexed streams that shared
a message with others (`--ablate frame_batches`: a message each). The last line printed is the summary JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from academus.loadgen.bench import ABLATIONS, loadgen_with_cpu, run_bench, serving_samples
from academus.shared.cli.mesh import Deployment, MeshOptions, down, up

COUNTERS = ("academus_worker_batches_total", "academus_worker_expired_total", "academus_scheduler_dropped_total",
            "academus_rpc_errors_total", "academus_multiplexed_batched_frames_total")


def snapshot(state) -> dict[str, dict[str, float]]:
    return {name: {f"{s.name}{json.dumps(s.labels, sort_keys=True)}": s.value for s in samples}
            for name, samples in serving_samples(state, COUNTERS).items()}


def run(args: argparse.Namespace) -> dict:
    if (args.rate > 0) == (args.concurrency > 0):
        raise SystemExit("overload_bench: give one of --rate (Poisson, > 0) and --concurrency (a closed loop, > 0)")
    if args.ablate == "shards":
        on, off = "sharded", "one_scheduler"
        runs = {on: overload(args, on, {}, max(2, args.shards)), off: overload(args, off, {}, 1)}
        throughput = {arm: [runs[arm]["throughput_rps"]] for arm in (on, off)}
    else:
        setting, (on, on_value), (off, off_value) = ABLATIONS[args.ablate]
        runs, throughput = {}, {on: [], off: []}
        for r in range(args.rounds):
            arms = ((on, on_value), (off, off_value))
            for name, value in arms if r % 2 == 0 else arms[::-1]:
                label = name if args.rounds == 1 else f"{r}-{name}"
                runs[label] = overload(args, label, {setting: value}, args.shards)
                throughput[name].append(runs[label]["throughput_rps"])
    goodput = statistics.mean(throughput[on]) / max(statistics.mean(throughput[off]), 1e-9)
    return runs | {f"goodput_{on.split('_')[0]}_vs_{off.split('_')[0]}": round(goodput, 3)}


def overload(args: argparse.Namespace, name: str, ablation: dict[str, str], shards: int) -> dict:
    run_dir = args.out / f"run-{name}"
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, gateways=args.gateways, workers=args.workers,
                           worker_threads=1,
                           deployments=[Deployment(args.policy, args.model, shards)],
                           env={"ACADEMUS_MODELS": args.model, "ACADEMUS_QUEUE_CAPACITY": str(args.queue)}
                           | ablation))
    try:
        before = snapshot(state)
        schedule = f"closed:{args.concurrency}" if args.concurrency else f"poisson:{args.rate}"
        report = loadgen_with_cpu(state, run_dir, args.out / name, "run", "--model", args.model,
                                  "--policy", args.policy, "--schedule", schedule, "--duration",
                                  str(args.duration), "--texts", f"task:{args.task}", "--timeout", str(args.timeout),
                                  "--procs", str(args.procs), *(["--streams"] if args.streams else []))
        after = snapshot(state)
    finally:
        down(run_dir)
    counted = {name: {k: v - before[name].get(k, 0.0) for k, v in values.items() if v != before[name].get(k, 0.0)}
               for name, values in after.items()}
    keep = ("sent", "completed", "errors", "error_latency_ms", "throughput_rps", "latency_ms", "cpu_ms_per_request")
    return {k: report[k] for k in keep} | {"counters": counted}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.overload_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.0, help="offered requests/s (Poisson)")
    p.add_argument("--concurrency", type=int, default=0,
                   help="instead of --rate: a closed loop of this many callers (the deployment's capacity)")
    p.add_argument("--streams", action="store_true", help="the load generator's requests ride one multiplexed "
                                                          "stream (`academus loadgen --streams`)")
    p.add_argument("--model", default="sentiment")
    p.add_argument("--policy", default="padded")
    p.add_argument("--task", choices=["sentiment", "spam"], default="sentiment", help="where the texts come from")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gateways", type=int, default=1, help="gateway processes on the mesh's port (a GPU node's edge)")
    p.add_argument("--procs", type=int, default=1, help="load-generator processes (a GPU node's rates)")
    p.add_argument("--shards", type=int, default=1, help="scheduler processes, each running its share of the groups")
    p.add_argument("--queue", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1, help="the pair of runs this many times, the order alternating")
    p.add_argument("--ablate", choices=sorted([*ABLATIONS, "shards"]), default="drop_doomed",
                   help="the setting the second run switches off (default: drop_doomed)")
    p.add_argument("--out", type=Path, default=Path(".academus/results/overload"))
    return run_bench(p, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
