"""`academus loadgen` / `python -m loadgen`: open-loop stress runs (or a closed-loop capacity run) against a mesh.

    academus loadgen run --model sentiment --policy fifo --schedule poisson:20 --duration 30 --texts task:sentiment
    academus loadgen compare --runs spam:student,spam:fifo --schedule tweet:20 --duration 60 --texts task:spam
    academus loadgen trace --kind tweet --duration 300 --mean-rps 20 --seed 1 --out tweet.trace
    academus loadgen breakdown --traces .academus/run/traces.jsonl

`--procs N` sends each run's load from N processes (one Python process sends about 1000 req/s). The report's
`send_late_ms` says how far behind its schedule the open loop sent; past 10 ms at p99 a warning says the
run measured the generator too.
`--streams` sends every request of a process as a frame of one multiplexed stream (`AsyncClient(streams=True)`)
instead of a gRPC call each. `--gateway http://HOST:PORT[/ROUTE]` sends HTTP/JSON instead: to the HTTP port of
Academus (`academus up --http-port`), or of text-embeddings-inference or infinity to compare with
(loadgen/http_target.py). Against a mesh of several gateways (`academus up --gateways G`) each process
sends its requests to them in turn, each on its own connection (`by_gateway` in the report).

`--query TEXT` makes each request the pair (TEXT, its text): a reranker's query and passage, for a cross-encoder
(`academus models add --pairs`) or an embedding model's cosine similarity; over HTTP, to `/rerank` as its query and
texts, or to `/predict` and TEI's root as `[text, text_pair]`.
`--early-exit` (or a run `MODEL+early-exit` of `compare`) asks each request to be answered as soon as its text
has a result, from the first exit ramp confident of it (Apparate; `academus ramps train`): the latency is the time to
that answer, and the report's `exits` counts the answers each layer released (0: the full model).
`academus loadgen compare --runs spam,spam+early-exit` measures what early exits gain on one schedule. Measure them
with an open loop below capacity: a worker whose compute is saturated (as a closed loop keeps it) stands its ramps
down, and every answer is the full model's.

`run` and `compare` write report.json (one entry a run) and PNG plots to --out; the last line printed
is the report JSON. `compare` sends the same arrival schedule and texts to each MODEL[:POLICY] in turn
(the policy picks the deployment running it) and prints ratios against the first. `trace` writes a
replayable tweet-like trace (`--schedule trace:FILE[,SPEED]`); `breakdown` prints per-hop span
durations from the JSON-lines trace file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from academus.loadgen import analysis, plots, schedule, texts
from academus.loadgen.analysis import RunSpec, agreement, parse_runs, ratios, report_label
from academus.loadgen.http_target import is_http, is_openai
from academus.loadgen.runner import GatewaySpread, RunResult, send_load
from academus.loadgen.shares import run_in_processes
from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshState
from academus.shared.runtime.config import CommonConfig, load, run_dir
from academus.shared.runtime.heap import freeze_start_up_heap
from academus.shared.runtime.slices import set_process_slice

__all__ = ["main", "parser", "ratios"]

SCHEDULES = ("poisson:RATE | bursts:BASE,BURST,PERIOD,BURST_S | tweet:MEAN_RATE | trace:FILE[,SPEED] | "
             "closed:N (N callers, each sending when its last is answered: capacity)")
CLOSED_LOOP_TEXTS = 4096  # texts cycled by a closed loop, which has no schedule to size them
BEHIND_SCHEDULE_MS = 10.0  # sends later than this (p99): the generator's own loop was saturated


def add_load_options(s: argparse.ArgumentParser) -> None:
    s.add_argument("--schedule", default="poisson:10", help=SCHEDULES)
    s.add_argument("--duration", type=float, default=20.0, help="seconds")
    s.add_argument("--texts", default="task:sentiment", help="task:NAME or normal,mean=M,var=V,min=A,max=B")
    s.add_argument("--length-dist", help="normal,mean=M,var=V,min=A,max=B: synthetic token lengths "
                                         "(overrides --texts)")
    s.add_argument("--timeout", type=float, default=5.0, help="each request's deadline (s)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--procs", type=int, default=1, help="load-generator processes sharing each run's load "
                                                        "(one sends about 1000 req/s; see loadgen/shares.py)")
    s.add_argument("--streams", action="store_true", help="requests ride one multiplexed stream a process")
    s.add_argument("--query", type=query_text,
                   help="each request is the pair (QUERY, its text): a reranker's query and passage, scored by a "
                        "cross-encoder or by an embedding model's cosine similarity")
    s.add_argument("--early-exit", action="store_true",
                   help="each request asks for early exits (answered once its text has a result, from an exit ramp "
                        "where one is confident); the report counts the texts each layer released")
    s.add_argument("--out", type=Path, default=Path(".academus/results/loadgen"))
    s.add_argument("--gateway", help="host:port[,host:port...]: requests go to each in turn (default: the local "
                                     "mesh's gateways); http://HOST:PORT[/ROUTE]: HTTP/JSON, to TEI's root or that "
                                     "route (/embed, /predict, /v1/embeddings), of Academus or of another server")
    s.add_argument("--key", help="API key (default: the local admin key)")
    s.add_argument("--run-dir", type=Path, default=None)


def query_text(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("the query is empty: give the text each request's text is paired with")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="academus loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("run", help="one open-loop run")
    s.add_argument("--model", required=True)
    s.add_argument("--policy", default="", help="route to the deployment running this policy (default: any)")
    add_load_options(s)
    s = sub.add_parser("compare", help="the same load to several MODEL[:POLICY], one after the other")
    s.add_argument("--runs", required=True, help="comma-separated MODEL[:POLICY][+early-exit], the first is the "
                                                 "baseline (+early-exit: that run asks for early exits)")
    add_load_options(s)
    s = sub.add_parser("trace", help="write a synthetic arrival trace, one timestamp a line")
    s.add_argument("--kind", choices=["tweet"], default="tweet")
    s.add_argument("--duration", type=float, required=True, help="seconds")
    s.add_argument("--mean-rps", type=float, required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("breakdown", help="per-hop median span durations from a JSON-lines trace file")
    s.add_argument("--traces", type=Path, nargs="+", help="default: $ACADEMUS_TRACE_FILE or RUN_DIR/traces.jsonl")
    s.add_argument("--run-dir", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "trace":
        return cmd_trace(args)
    if args.command == "breakdown":
        return cmd_breakdown(args)
    return cmd_load(args)


def cmd_load(args: argparse.Namespace) -> int:
    runs = ([RunSpec(args.model, args.policy, args.early_exit)] if args.command == "run"
            else parse_runs(args.runs, args.early_exit))
    concurrency = schedule.closed_concurrency(args.schedule)
    arrivals = [] if concurrency else schedule.parse(args.schedule, args.duration, args.seed)
    text_spec = args.length_dist or args.texts
    samples = texts.parse(text_spec, CLOSED_LOOP_TEXTS if concurrency else max(1, len(arrivals)), args.seed)
    if args.query is not None:
        samples = texts.paired(samples, args.query)
    gateways, key = target(args)
    if args.query is not None and any(is_http(g) and is_openai(g) for g in gateways):
        print("--query: OpenAI's embeddings route takes no text pairs; send them to /rerank, /predict or TEI's root",
              file=sys.stderr)
        return 2
    freeze_start_up_heap("loadgen")   # the client's own GC pauses would count as server latency
    set_process_slice(hop_slice_us())   # ... and so would its threads' waits behind a forward pass
    if args.procs > 1:
        results = [run_in_processes(gateways, key, run.model, run.policy, arrivals, samples, args.procs, args.timeout,
                                    args.duration, concurrency, args.streams, run.early_exit) for run in runs]
    else:
        results = asyncio.run(run_all(gateways, key, runs, arrivals, samples, args, concurrency))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"schedule": args.schedule, "duration_s": args.duration, "texts": text_spec, "query": args.query,
              "timeout_s": args.timeout, "client_streams": args.streams, "runs": [r.report() for r in results]}
    if len(results) > 1:
        report["ratios_vs_first"] = ratios(report["runs"])
        for entry, result in zip(report["ratios_vs_first"], results[1:], strict=True):
            if (agreed := agreement(results[0].records, result.records)) is not None:
                entry["answers"] = agreed
    write_plots(results, args.out)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    for line in summary_lines(report):
        print(line)
    print(json.dumps(report))
    return 0


def hop_slice_us() -> int:
    """ACADEMUS_HOP_SLICE_US, the one service setting the load generator shares: the other ACADEMUS_*
    variables of its environment (a service's port, say) are not its own, and a bad one must not stop it."""
    name = "ACADEMUS_HOP_SLICE_US"
    return load(CommonConfig, {name: os.environ[name]} if name in os.environ else {}).hop_slice_us


def write_plots(results: list[RunResult], out: Path) -> None:
    plots.latency_cdf(results, out / "latency_cdf.png")
    for i, r in enumerate(results):
        label = RunSpec(r.model, r.requested_policy, r.early_exit).label
        plots.timeline(r, out / f"timeline_{i}_{label.replace(':', '_').replace('+', '_')}.png")


def summary_lines(report: dict) -> list[str]:
    lines = []
    for r in report["runs"]:
        lat = r["latency_ms"]
        lines.append(f"{report_label(r):<24} sent {r['sent']} completed {r['completed']} "
                     f"errors {r['errors'] or 0}  p50 {lat.get('p50')} p95 {lat.get('p95')} p99 {lat.get('p99')} ms  "
                     f"{r['throughput_rps']} req/s  utility {r['utility']} ({r['utility_per_s']}/s)")
        if exits := r.get("exits"):
            layers = ", ".join(f"layer {k}: {n}" for k, n in exits["exit_layers"].items() if k != "0")
            lines.append(f"  released early: {exits['released_early']} of the answers ({layers or 'none'})")
        if (late := r.get("send_late_ms")) and late["p99"] > BEHIND_SCHEDULE_MS:
            lines.append(f"  the load generator fell behind its schedule (sends p99 {late['p99']} ms late): "
                         f"this run measured it too; spread the load with --procs")
    for ratio in report.get("ratios_vs_first", []):
        parts = "  ".join(f"{k.removesuffix('_ratio')} x{v}" for k, v in ratio.items() if k.endswith("_ratio"))
        lines.append(f"{ratio['run']} vs {ratio['vs']}: {parts}")
        if answers := ratio.get("answers"):
            lines.append(f"  answers agreeing with {ratio['vs']}'s for the same texts: {answers['agreement']} "
                         f"of {answers['compared']}")
    return lines


def target(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The gateways to send to and the API key."""
    directory = args.run_dir or run_dir()
    gateways = args.gateway.split(",") if args.gateway else MeshState.load(directory).gateways()
    key = args.key
    if key is None and (directory / ADMIN_KEY_FILE).exists():
        key = (directory / ADMIN_KEY_FILE).read_text().strip()
    return gateways, key


async def run_all(gateways: list[str], key: str | None, runs: list[RunSpec], arrivals: list[float],
                  samples: list[texts.Sample], args: argparse.Namespace,
                  concurrency: int | None = None) -> list[RunResult]:
    """Each run in turn (runs must not share the machine): open loop on `arrivals`, or a closed loop
    of `concurrency` callers."""
    results = []
    async with GatewaySpread(gateways, key, args.timeout, args.streams) as client:
        for run in runs:
            results.append(await send_load(client, run.model, run.policy, arrivals, samples, args.timeout,
                                           args.duration, concurrency, run.early_exit))
    return results


def cmd_trace(args: argparse.Namespace) -> int:
    shape = schedule.tweet_shape(args.mean_rps, args.duration, args.seed)
    times = schedule.tweet(args.mean_rps, args.duration, args.seed)
    bursts = [{"start_s": round(b.start_s, 3), "length_s": round(b.length_s, 3), "factor": round(b.factor, 2)}
              for b in shape.bursts]
    header = (f"tweet trace: duration {args.duration} s, mean {args.mean_rps} req/s, seed {args.seed}\n"
              f"bursts: {json.dumps(bursts)}")
    schedule.write_trace(times, args.out, header)
    trough, peak = shape.diurnal_range()
    print(json.dumps({"path": str(args.out), "kind": args.kind, "requests": len(times),
                      "mean_rps": round(len(times) / args.duration, 3), "trough_rps": round(trough, 3),
                      "peak_rps": round(peak, 3), "bursts": bursts}))
    return 0


def cmd_breakdown(args: argparse.Namespace) -> int:
    from academus.shared.runtime.tracing import read_traces

    default = os.environ.get("ACADEMUS_TRACE_FILE") or (args.run_dir or run_dir()) / "traces.jsonl"
    paths = args.traces or [Path(default)]
    spans = [s for trace in read_traces(paths).values() for s in trace]
    if not spans:
        print(f"no spans in {', '.join(map(str, paths))}", file=sys.stderr)
        return 1
    result = analysis.span_breakdown(spans)
    for row in result["spans"]:
        print(f"{row['service']:<28} {row['kind']:<7} {row['name']:<44} n={row['count']:<6} "
              f"p50 {row['p50_ms']:8.3f} ms  p95 {row['p95_ms']:8.3f} ms")
    for row in result["hops"]:
        print(f"hop {row['from']} -> {row['to']} {row['name']}: wire p50 {row['p50_ms']:.3f} ms (n={row['count']})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
