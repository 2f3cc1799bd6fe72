"""`academus loadgen` / `python -m loadgen`: open-loop stress runs against a running mesh.

    academus loadgen run --model sentiment --schedule poisson:20 --duration 30 --texts task:sentiment
    academus loadgen compare --runs sentiment,spam --schedule bursts:5,40,10,2 --duration 60

Writes report.json (one entry a run) and PNG plots to --out; the last line printed is the report JSON.
`compare` sends the same arrival schedule and texts to each model in turn and prints the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from academus.client import AsyncClient
from academus.loadgen import plots, schedule, texts
from academus.loadgen.runner import RunResult, run
from academus.shared.config import run_dir
from academus.shared.mesh import ADMIN_KEY_FILE, MeshState


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="academus loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("run", "compare"):
        s = sub.add_parser(name)
        if name == "run":
            s.add_argument("--model", required=True)
        else:
            s.add_argument("--runs", required=True, help="comma-separated models, the first is the baseline")
        s.add_argument("--schedule", default="poisson:10", help="poisson:RATE | bursts:BASE,BURST,PERIOD,BURST_S "
                                                                 "| trace:FILE[,SPEED]")
        s.add_argument("--duration", type=float, default=20.0, help="seconds")
        s.add_argument("--texts", default="task:sentiment", help="task:NAME or normal,mean=M,var=V,min=A,max=B")
        s.add_argument("--timeout", type=float, default=5.0, help="each request's deadline (s)")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--out", type=Path, default=Path("loadgen-out"))
        s.add_argument("--gateway", help="host:port (default: the local mesh's)")
        s.add_argument("--key", help="API key (default: the local admin key)")
        s.add_argument("--run-dir", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    models = [args.model] if args.command == "run" else args.runs.split(",")
    arrivals = schedule.parse(args.schedule, args.duration, args.seed)
    samples = texts.parse(args.texts, max(1, len(arrivals)), args.seed)
    gateway, key = target(args)
    results = asyncio.run(run_all(gateway, key, models, arrivals, samples, args))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"schedule": args.schedule, "duration_s": args.duration, "texts": args.texts,
              "runs": [r.report() for r in results]}
    if len(results) > 1:
        report["ratios_vs_first"] = ratios(report["runs"])
    plots.latency_cdf(results, args.out / "latency_cdf.png")
    for i, r in enumerate(results):
        plots.timeline(r, args.out / f"timeline_{i}_{r.model}.png")
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0


def target(args: argparse.Namespace) -> tuple[str, str | None]:
    directory = args.run_dir or run_dir()
    gateway = args.gateway or MeshState.load(directory).gateway
    key = args.key
    if key is None and (directory / ADMIN_KEY_FILE).exists():
        key = (directory / ADMIN_KEY_FILE).read_text().strip()
    return gateway, key


async def run_all(gateway: str, key: str | None, models: list[str], arrivals: list[float],
                  samples: list[texts.Sample], args: argparse.Namespace) -> list[RunResult]:
    results = []
    async with AsyncClient(gateway, api_key=key, timeout=args.timeout) as client:
        for model in models:  # one after the other: runs must not share the machine
            results.append(await run(client, model, arrivals, samples, args.timeout, args.duration))
    return results


def ratios(runs: list[dict]) -> list[dict]:
    base = runs[0]
    out = []
    for r in runs[1:]:
        entry = {"run": f"{r['model']}:{r['policy']}", "vs": f"{base['model']}:{base['policy']}"}
        for q in ("p50", "p95", "p99"):
            if base["latency_ms"].get(q) and r["latency_ms"].get(q):
                entry[f"{q}_ratio"] = round(r["latency_ms"][q] / base["latency_ms"][q], 3)
        if base["throughput_rps"]:
            entry["throughput_ratio"] = round(r["throughput_rps"] / base["throughput_rps"], 3)
        out.append(entry)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
