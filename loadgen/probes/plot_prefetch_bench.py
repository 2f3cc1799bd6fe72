"""HMI §6.1 pipelined representation retrieval, measured: `minilm-plot` served by one worker under the
`padded` policy with the plot service beside it, once with the scheduler's prefetch off (the worker looks
each batch up itself) and once on (waiting requests are looked up in the plot service meanwhile). The
same Poisson arrivals and texts go to both meshes, one after the other.

    python -m academus.loadgen.probes.plot_prefetch_bench --out .academus/results/plot_prefetch [--rates 20,60]
        [--duration 20] [--corpus general --limit 2000 --lower-layers 3]

The meshes use their own artifacts under --out (a copy of the prepared catalogue and heads plus a root
table built from --corpus and registered as minilm-plot), so the prepared artifacts stay as they are.
Per rate and setting: throughput, latency percentiles and the median worker compute per request; the last
line printed is the summary JSON with the on/off ratios.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import redis

from academus.loadgen.bench import loadgen, write_summary
from academus.shared.cli.mesh import Deployment, MeshOptions, MeshState, down, up
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.keys import Keys


def bench_artifacts(out: Path, corpus: str, limit: int, lower_layers: int) -> Path:
    """A copy of the prepared catalogue and heads plus a root table registered as minilm-plot."""
    from academus.shared.models.model import TeacherEncoder
    from academus.shared.models.plot.layers import SplitBert
    from academus.shared.training.plot_build import BuildOptions, build, corpus_texts
    from academus.shared.training.plot_models import register_embedding

    root = out / "artifacts"
    table = root / "plot" / f"minilm-k{lower_layers}"
    if not (table / "root" / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(artifacts_dir() / "models.json", root / "models.json")
        shutil.copytree(artifacts_dir() / "heads", root / "heads", dirs_exist_ok=True)
        teacher = TeacherEncoder.load()
        build(corpus_texts(corpus, limit=limit), table, BuildOptions(lower_layers=lower_layers),
              layers=SplitBert(teacher.body, lower_layers), corpus={"source": corpus, "limit": limit})
    register_embedding(root, table)
    return root


def prefetch_counts(state: MeshState) -> dict[str, int]:
    client = redis.Redis.from_url(state.redis_url, decode_responses=True)
    keys = Keys(state.key_prefix)
    totals: dict[str, int] = {}
    for scheduler in client.smembers(keys.schedulers()):
        for name, value in client.hgetall(keys.load(scheduler)).items():
            if name.startswith("plot_prefetch_"):
                totals[name] = totals.get(name, 0) + int(value)
    return totals


def run_setting(args: argparse.Namespace, artifacts: Path, prefetch: bool) -> list[dict]:
    run_dir = args.out / f"mesh-prefetch-{'on' if prefetch else 'off'}"
    state = up(MeshOptions(run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=1,
                           worker_threads=args.worker_threads, deployments=[Deployment("padded", "minilm-plot")],
                           env={"ACADEMUS_MODELS": "minilm-plot", "ACADEMUS_PLOT_PREFETCH": str(prefetch).lower(),
                                "ACADEMUS_MAX_BATCH": str(args.max_batch)}))
    rows = []
    try:
        for rate in args.rates:
            report = loadgen(run_dir, args.out / f"prefetch-{'on' if prefetch else 'off'}-{rate:g}", "run",
                             "--model", "minilm-plot", "--schedule", f"poisson:{rate}", "--duration",
                             str(args.duration), "--timeout", str(args.timeout), "--texts", args.texts)
            run = report["runs"][0]
            rows.append({"prefetch": prefetch, "offered_rps": rate, "throughput_rps": run["throughput_rps"],
                         "latency_ms": run["latency_ms"], "compute_ms_p50": run["breakdown_ms"].get("compute"),
                         "queue_ms_p50": run["breakdown_ms"].get("queue"), "errors": run["errors"]})
        rows[-1]["scheduler_counts"] = prefetch_counts(state)
    finally:
        down(run_dir)
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rates", type=lambda s: [float(r) for r in s.split(",")], default=[20.0, 60.0])
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--texts", default="task:sentiment")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--corpus", default="general")
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--lower-layers", type=int, default=3)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    artifacts = bench_artifacts(args.out, args.corpus, args.limit, args.lower_layers)   # up() passes it on
    off, on = run_setting(args, artifacts, False), run_setting(args, artifacts, True)
    ratios = [{"offered_rps": a["offered_rps"],
               "throughput_on_vs_off": round(b["throughput_rps"] / max(a["throughput_rps"], 1e-9), 3),
               "p50_on_vs_off": round(b["latency_ms"]["p50"] / max(a["latency_ms"]["p50"], 1e-9), 3),
               "p95_on_vs_off": round(b["latency_ms"]["p95"] / max(a["latency_ms"]["p95"], 1e-9), 3),
               "compute_on_vs_off": round((b["compute_ms_p50"] or 0) / max(a["compute_ms_p50"] or 0, 1e-9), 3)}
              for a, b in zip(off, on, strict=True)]
    return write_summary(args.out, {"rows": off + on, "ratios": ratios, "corpus": args.corpus, "limit": args.limit,
                                    "lower_layers": args.lower_layers, "duration_s": args.duration})


if __name__ == "__main__":
    raise SystemExit(main())
