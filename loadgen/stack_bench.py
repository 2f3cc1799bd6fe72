"""The serving stack alone (client -> gateway -> scheduler -> worker), with settings switched between arms,
against the transport floors of three bare hops, in one run.

    python -m academus.loadgen.stack_bench [--model null] [--policy fifo] [--rounds 3] [--requests 1000]
                                           [--callers 64 256] [--duration 10] [--procs 2]
                                           [--arms grpc=ACADEMUS_LOCAL_PLANE=0 ...]
                                           [--out .academus/results/stack]

Each round measures the floors once, then each arm on a fresh mesh (the order alternates between rounds, so
drift of the machine falls on every arm): one worker, one gateway, one scheduler of --policy (`fifo`: one
request a dispatch, the stack's cost a request at any load; `concat`: what `academus up` serves a model
without students), the model --model (`null` answers zeros without computing, so what is measured is the
stack). An arm is `NAME=ENV=VALUE[,ENV=VALUE...]`: settings for every service (MeshOptions.env); by default
`grpc` (every hop a gRPC multiplexed stream, ACADEMUS_LOCAL_PLANE=0) and `local` (the node-local data plane),
the first arm being the one the others are compared with. On each mesh:
1. overhead at low load: --requests sequential single-text requests (after --warmup) with the sync
   `Client`, end-to-end p50/p99 and the per-hop split (`academus.loadgen.overhead`);
2. capacity: for each of --callers, that many closed loops for --duration seconds, spread over --procs
   load-generator processes (uvloop, `AsyncClient(streams=True)`), throughput and p50/p99;
3. during each capacity run, each process's CPU ms and voluntary context switches (all its threads) a
   completed request, from /proc: every mesh service and the load generators; `stack_cpu_ms` sums
   gateway, scheduler and worker;
4. many connections: --connections clients, each on a TCP connection of its own (spread over --procs
   processes), together offering --open-load of the arm's best capacity as a Poisson stream for --duration;
   p50/p99 and the p50 as a multiple of the sequential one (Ray Serve's grew 46x, ray-project/ray#55473).
The floors: three grpc.aio unary hops with no-op handlers (`grpc_floor`) and three hops over Unix sockets
(`uds_floor`), each sequential and with --floor-callers closed loops from this process.
Every figure is also a ratio to the floors, and each arm's to the first arm's, per round and as medians
over the rounds. Writes stack_bench.json (raw figures, medians, command, machine, date, commit),
stack_bench.md (the medians' tables, also printed) and stack_bench.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import uvloop

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from academus.client import Client
from academus.loadgen import grpc_floor, uds_floor
from academus.loadgen.bench import process_cpu_s
from academus.loadgen.overhead import measure, text_of
from academus.loadgen.runner import GatewaySpread, run_closed, send_lateness
from academus.loadgen.runner import run as run_open
from academus.loadgen.schedule import poisson
from academus.loadgen.serving_profile import threads_reading
from academus.loadgen.shares import START_MARGIN_S, split
from academus.loadgen.stats import summary
from academus.loadgen.texts import Sample
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up
from academus.shared.runtime.config import POLICY_NAMES, artifacts_dir
from academus.shared.runtime.heap import freeze_start_up_heap

TOKENS = 16          # a short text: the stack's cost, not the tokenizer's
FLOOR_HOPS = 3       # as the stack's: client -> gateway -> scheduler -> worker
STACK = ("gateway", "scheduler", "worker")
DEFAULT_ARMS = ("grpc=ACADEMUS_LOCAL_PLANE=0", "local=ACADEMUS_LOCAL_PLANE=1")
SETTINGS = ("model", "policy", "rounds", "requests", "warmup", "callers", "duration", "procs", "floor_callers",
            "floor_duration", "connections", "open_load")
TIMEOUT_S = 10.0     # a closed loop's request: generous, the queue stays bounded by the callers
CONNECTIONS_POLL_S = 0.25   # how often the many-connections run counts the gateway's connections (`ss`)


@dataclass(frozen=True)
class Arm:
    name: str
    env: dict[str, str]


def parse_arm(spec: str) -> Arm:
    """`NAME=ENV=VALUE[,ENV=VALUE...]`, or `NAME` alone: the mesh's defaults."""
    name, _, settings = spec.partition("=")
    pairs = [s.partition("=") for s in settings.split(",")] if settings else []
    if not name or any(not key or not sep for key, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"arm {spec!r}: expected NAME=ENV=VALUE[,ENV=VALUE...]")
    return Arm(name, {key: value for key, _, value in pairs})


# ---------------------------------------------------------------- /proc


def reading(pid: int) -> dict[str, float]:
    """A process's CPU seconds so far (user + system, its exited threads included) and its voluntary
    context switches, summed over its threads (a process's own status counts its main thread's only)."""
    return {"cpu_s": process_cpu_s(pid),
            "voluntary_switches": threads_reading(pid)["voluntary_ctxt_switches"]}


def per_request(before: dict[str, float], after: dict[str, float], completed: int) -> dict[str, float]:
    """CPU ms and voluntary switches a completed request between two `reading`s."""
    n = max(completed, 1)
    return {"cpu_ms": round((after["cpu_s"] - before["cpu_s"]) * 1e3 / n, 4),
            "voluntary_switches": round((after["voluntary_switches"] - before["voluntary_switches"]) / n, 3)}


# ---------------------------------------------------------------- one mesh


def sequential(state: MeshState, args: argparse.Namespace) -> dict:
    key = (Path(state.run_dir) / ADMIN_KEY_FILE).read_text().strip()
    with Client(state.gateway, api_key=key) as client:
        return measure(client, args.model, TOKENS, args.requests, args.warmup)


async def send_share(run_dir: Path, model: str, callers: int, duration_s: float, start_at: float) -> dict:
    """A load-generator process's share: `callers` closed loops from `start_at` (wall clock), its own
    /proc readings around them."""
    state, key = MeshState.load(run_dir), (run_dir / ADMIN_KEY_FILE).read_text().strip()
    samples = [Sample(text_of(TOKENS))]
    async with GatewaySpread(state.gateways(), key, TIMEOUT_S, streams=True) as spread:
        await spread.next()[1].infer(model, [samples[0].text])   # the stream opened before the start
        await asyncio.sleep(max(0.0, start_at - time.time()))
        late_s, before = time.time() - start_at, reading(os.getpid())
        result = await run_closed(spread, model, callers, samples, TIMEOUT_S, duration_s)
        after = reading(os.getpid())
    return {"pid": os.getpid(), "late_start_s": round(late_s, 3), "duration_s": result.duration_s,
            "latencies_ms": [r.latency_ms for r in result.records if r.code == "OK"],
            "errors": Counter(r.code for r in result.records if r.code != "OK"), "before": before, "after": after}


async def send_open_share(run_dir: Path, model: str, connections: int, rate: float, duration_s: float,
                          start_at: float) -> dict:
    """A load-generator process's share of the many-connections run: `connections` clients, each on a TCP
    connection of its own and each answered once before the start (so all are open), then Poisson arrivals
    at `rate` spread over them in turn."""
    state, key = MeshState.load(run_dir), (run_dir / ADMIN_KEY_FILE).read_text().strip()
    samples = [Sample(text_of(TOKENS))]
    async with GatewaySpread(state.gateways() * connections, key, TIMEOUT_S, streams=True,
                             own_connections=True) as spread:
        # opened with a call no scheduler queues: an Infer met the capacity run's pushback at the gateway
        await asyncio.gather(*(client.list_models() for _, client in spread.clients))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        result = await run_open(spread, model, poisson(rate, duration_s, seed=os.getpid()), samples, TIMEOUT_S,
                           duration_s)
    return {"latencies_ms": [r.latency_ms for r in result.records if r.code == "OK"],
            "errors": Counter(r.code for r in result.records if r.code != "OK"), "duration_s": result.duration_s,
            "send_late_ms": send_lateness(result.records)}


def share_command(run_dir: Path, args: argparse.Namespace, callers: int, start_at: float, result: Path,
                  *extra: str) -> list[str]:
    return [sys.executable, "-m", "academus.loadgen.stack_bench", "--share", str(callers), "--run-dir", str(run_dir),
            "--model", args.model, "--duration", str(args.duration), "--start-at", str(start_at),
            "--result", str(result), *extra]


def capacity(state: MeshState, args: argparse.Namespace, callers: int, out: Path) -> dict:
    """`callers` closed loops over --procs processes; the stack's /proc readings from their common start
    to their end (the services idle after the last answer)."""
    start_at = time.time() + START_MARGIN_S
    shares = [s.concurrency for s in split([], [], args.procs, callers)]   # fewer callers than procs: fewer procs
    results = [out / f"share-{callers}-{k}.json" for k in range(len(shares))]
    children = [subprocess.Popen(share_command(Path(state.run_dir), args, n, start_at, path))
                for n, path in zip(shares, results, strict=True)]
    time.sleep(max(0.0, start_at - time.time()))
    before = {s.name: reading(s.pid) for s in state.services}
    if any([child.wait() for child in children]):   # a list: wait for every one
        raise RuntimeError(f"a load generator of {callers} callers failed: see its output above")
    after = {s.name: reading(s.pid) for s in state.services}
    return {"callers": callers} | merge_shares([json.loads(p.read_text()) for p in results], before, after)


def many_connections(state: MeshState, args: argparse.Namespace, rate: float, out: Path) -> dict:
    """--connections open at once offering `rate` req/s; the gateway's established connections counted until all
    are seen open (the most at once), so the figure says how many were really open. Each count runs `ss`, which
    would otherwise take a share of the cores the run measures."""
    shares = [s.concurrency for s in split([], [], args.procs, args.connections)]
    start_at = time.time() + START_MARGIN_S + args.connections / 100   # each share opens its connections first
    results = [out / f"open-{k}.json" for k in range(len(shares))]
    children = [subprocess.Popen(share_command(Path(state.run_dir), args, n, start_at, path, "--rate",
                                               str(rate / len(shares))))
                for n, path in zip(shares, results, strict=True)]
    established = 0   # the most seen at once: the spawned processes open theirs late on a loaded machine
    while established < args.connections and any(child.poll() is None for child in children):
        established = max(established, gateway_connections(state.gateway))
        time.sleep(CONNECTIONS_POLL_S)
    if any([child.wait() for child in children]):
        raise RuntimeError("a load generator of the many-connections run failed: see its output above")
    parts = [json.loads(p.read_text()) for p in results]
    latencies = [x for p in parts for x in p["latencies_ms"]]
    return {"connections": args.connections, "established": established, "offered_rps": round(rate, 1),
            "completed": len(latencies), "errors": dict(sum((Counter(p["errors"]) for p in parts), Counter())),
            "latency_ms": summary(latencies), "send_late_ms": [p["send_late_ms"] for p in parts]}


def gateway_connections(address: str) -> int:
    """TCP connections established to the gateway's port (from the kernel's table, both ends on this host)."""
    port = address.rsplit(":", 1)[1]
    done = subprocess.run(["ss", "-tnH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                          text=True)
    return len(done.stdout.splitlines()) if done.returncode == 0 else -1


def merge_shares(parts: list[dict], before: dict[str, dict], after: dict[str, dict]) -> dict:
    """The shares' answers as one run, each process's CPU and switches a completed request."""
    latencies = [x for p in parts for x in p["latencies_ms"]]
    completed = len(latencies)
    processes = {name: per_request(before[name], after[name], completed) for name in before}
    processes |= {f"loadgen-{k}": per_request(p["before"], p["after"], completed) for k, p in enumerate(parts)}
    stack = [v for name, v in processes.items() if name.startswith(STACK)]
    return {"completed": completed, "errors": dict(sum((Counter(p["errors"]) for p in parts), Counter())),
            "throughput_rps": round(completed / max(p["duration_s"] for p in parts), 1),
            "latency_ms": summary(latencies), "late_start_s": max(p["late_start_s"] for p in parts),
            "processes": processes, "stack_cpu_ms": round(sum(v["cpu_ms"] for v in stack), 4),
            "stack_voluntary_switches": round(sum(v["voluntary_switches"] for v in stack), 3)}


def one_arm(args: argparse.Namespace, round_: int, arm: Arm) -> dict:
    run_dir = args.out / f"run-{round_}-{arm.name}"
    policy = arm.env.get("ACADEMUS_POLICY", args.policy)   # an arm may set its own
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, deployments=[Deployment(policy)],
                           env={"ACADEMUS_MODELS": args.model} | arm.env))
    try:
        measured = {"sequential": sequential(state, args),
                    "capacity": {str(c): capacity(state, args, c, run_dir) for c in args.callers}}
        if args.connections:
            best = max(c["throughput_rps"] for c in measured["capacity"].values())
            measured["connections"] = many_connections(state, args, args.open_load * best, run_dir)
        return measured
    finally:
        down(run_dir)


def floors(args: argparse.Namespace) -> dict:
    """Three bare hops: grpc.aio unary calls, and Unix sockets."""
    return {"grpc": grpc_floor.chain(FLOOR_HOPS, 0.0, args.requests, callers=args.floor_callers,
                                     duration_s=args.floor_duration),
            "uds": uds_floor.chain(FLOOR_HOPS, args.requests, args.floor_callers, args.floor_duration)}


# ---------------------------------------------------------------- figures


def capacity_figures(cap: dict) -> dict[str, float]:
    """One closed-loop run's headline figures, keyed by its callers."""
    c = cap["callers"]
    out = {f"rps@{c}": cap["throughput_rps"], f"p50_ms@{c}": cap["latency_ms"]["p50"],
           f"p99_ms@{c}": cap["latency_ms"]["p99"]}
    if "stack_cpu_ms" in cap:
        out |= {f"stack_cpu_ms@{c}": cap["stack_cpu_ms"], f"stack_switches@{c}": cap["stack_voluntary_switches"]}
    return out


def headline(latency_ms: dict, capacities: list[dict], connections: dict | None = None) -> dict[str, float]:
    out = {"p50_ms": latency_ms["p50"], "p99_ms": latency_ms["p99"]}
    for cap in capacities:
        out |= capacity_figures(cap)
    if connections:
        n, open_ms = connections["connections"], connections["latency_ms"]
        out |= {f"open_p50_ms@{n}": open_ms["p50"], f"open_p99_ms@{n}": open_ms["p99"],
                f"open_p50_x@{n}": ratio(open_ms["p50"], latency_ms["p50"])}
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def floor_ratios(arm: dict[str, float], floors_: dict[str, dict[str, float]], floor_callers: int) -> dict:
    """An arm's latencies and capacities as multiples of each floor's (sequential; capacity at its callers)."""
    out = {}
    for name, floor in floors_.items():
        for key, value in arm.items():
            base = "rps" if key.startswith("rps@") else key if key in ("p50_ms", "p99_ms") else None
            if base is not None:
                out[f"{key} / {name} floor"] = ratio(value, floor[f"rps@{floor_callers}" if base == "rps" else key])
    return out


def versus(arm: dict[str, float], base: dict[str, float]) -> dict[str, float | None]:
    return {key: ratio(arm.get(key), value) for key, value in base.items()}


def round_figures(raw: dict, arms: list[Arm], floor_callers: int) -> dict:
    """A round's headline figures, ratios to the floors and to the first arm."""
    floors_ = {name: headline(f["latency_ms"], [f["capacity"]]) for name, f in raw["floors"].items()}
    measured = raw["arms"]
    heads = {a.name: headline(measured[a.name]["sequential"]["e2e_ms"], list(measured[a.name]["capacity"].values()),
                              measured[a.name].get("connections")) for a in arms}
    base = arms[0].name
    return {"floor_headline": floors_, "headline": heads,
            "floor_ratios": {name: floor_ratios(h, floors_, floor_callers) for name, h in heads.items()},
            "versus": {f"{a.name}/{base}": versus(heads[a.name], heads[base]) for a in arms[1:]}}


def medians(dicts: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Each key's median over the dicts (rounds), its missing and None values left out."""
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    values = {k: [d[k] for d in dicts if d.get(k) is not None] for k in keys}
    return {k: round(statistics.median(v), 3) if v else None for k, v in values.items()}


def median_figures(rounds: list[dict]) -> dict:
    """For each section of the rounds' figures, each entry's medians over the rounds."""
    return {section: {name: medians([r[section][name] for r in rounds]) for name in rounds[0][section]}
            for section in ("floor_headline", "headline", "floor_ratios", "versus")}


# ---------------------------------------------------------------- output


# the tables' column order; open_*: the many-connections run, its p50 also as a multiple (x) of the sequential
METRICS = ("rps", "p50_ms", "p99_ms", "stack_cpu_ms", "stack_switches", "open_p50_ms", "open_p99_ms", "open_p50_x")


def column_order(key: str) -> tuple:
    """Sequential figures first, then each metric at every number of callers, side by side."""
    figure, _, against = key.partition(" / ")
    metric, _, callers = figure.partition("@")
    return bool(callers), METRICS.index(metric), int(callers or 0), against


def columns_of(rows: dict[str, dict]) -> list[str]:
    return sorted({k for row in rows.values() for k in row}, key=column_order)


def table(rows: dict[str, dict[str, float | None]], columns: list[str]) -> list[str]:
    """A markdown table: a row per entry, a column per key ("" where a row has none)."""
    def cell(v: float | None) -> str:
        return "" if v is None else f"{v:g}"

    return ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|",
            *(f"| {name} | " + " | ".join(cell(row.get(c)) for c in columns) + " |" for name, row in rows.items())]


def markdown(summary_: dict) -> str:
    m, s = summary_["medians"], summary_["settings"]
    heads = m["headline"] | {f"{n} floor ({FLOOR_HOPS} hops)": h for n, h in m["floor_headline"].items()}
    lines = [f"# Serving stack: {s['model']}, medians over {s['rounds']} round{'s' * (s['rounds'] != 1)}", "",
             "Latency (ms; sequential, then at N callers), req/s at N callers, stack (gateway + scheduler + worker) "
             "CPU ms and voluntary switches a request.", "", *table(heads, columns_of(heads)), "",
             f"## Ratios to the floors (medians of the rounds'; capacity against the floors' {s['floor_callers']} "
             "callers)", "", *table(m["floor_ratios"], columns_of(m["floor_ratios"]))]
    if m["versus"]:
        lines += ["", "## Arm against arm (medians of the rounds' ratios)", "", *table(m["versus"], columns_of(heads))]
    return "\n".join(lines) + "\n"


def plot(summary_: dict, path: Path) -> Path:
    """Median sequential p50 and capacity per arm (range over rounds as error bars), floors as lines."""
    m, rounds = summary_["medians"], summary_["rounds"]
    names, callers = list(m["headline"]), summary_["settings"]["callers"]
    fig, (lat, cap) = plt.subplots(1, 2, figsize=(11, 5.5))
    bars(lat, names, [("p50_ms", "sequential p50")], m, rounds)
    bars(cap, names, [(f"rps@{c}", f"{c} callers") for c in callers], m, rounds)
    floor_key = f"rps@{summary_['settings']['floor_callers']}"
    for ax, key in ((lat, "p50_ms"), (cap, floor_key)):
        for (name, floor), style in zip(m["floor_headline"].items(), ("--", ":"), strict=False):
            ax.axhline(floor[key], color="k", linestyle=style, label=f"{name} floor ({floor[key]:g})")
        ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)   # clear of the bars
    lat.set(ylabel="ms", title="end-to-end p50, one request at a time")
    cap.set(ylabel="req/s", title=f"capacity (floors: {floor_key.removeprefix('rps@')} callers)")
    fig.suptitle(f"{summary_['settings']['model']}: medians over {len(rounds)} round{'s' * (len(rounds) != 1)}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def bars(ax, names: list[str], keys: list[tuple[str, str]], m: dict, rounds: list[dict]) -> None:
    """Grouped bars, a group an arm and a bar a key, each the median with the rounds' range."""
    width = 0.8 / len(keys)
    for k, (key, label) in enumerate(keys):
        xs = [i + (k - (len(keys) - 1) / 2) * width for i in range(len(names))]
        mid = [m["headline"][n][key] for n in names]
        spread = [[r["headline"][n][key] for r in rounds] for n in names]
        err = [[v - min(s) for v, s in zip(mid, spread, strict=True)],
               [max(s) - v for v, s in zip(mid, spread, strict=True)]]
        ax.bar_label(ax.bar(xs, mid, width, yerr=err, capsize=3, label=label), fmt="%g", fontsize=7)
    ax.set_xticks(range(len(names)), names)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": model, "kernel": platform.release(),
            "python": platform.python_version()}


def git_commit() -> dict:
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


# ---------------------------------------------------------------- entry


def check_model(model: str) -> None:
    catalogue = artifacts_dir() / "models.json"
    if model not in json.loads(catalogue.read_text()):
        raise SystemExit(f"stack_bench: no model {model!r} in {catalogue} (`academus prepare` writes it)")


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    rounds = []
    for r in range(args.rounds):
        order = args.arms if r % 2 == 0 else args.arms[::-1]
        raw = {"order": [a.name for a in order], "floors": floors(args),
               "arms": {a.name: one_arm(args, r, a) for a in order}}
        rounds.append(raw | round_figures(raw, args.arms, args.floor_callers))
    return {"command": ["python", "-m", "academus.loadgen.stack_bench", *argv], "date": started,
            "git": git_commit(), "machine": machine(),
            "settings": {k: getattr(args, k) for k in SETTINGS} | {"arms": {a.name: a.env for a in args.arms},
                                                                   "tokens": TOKENS, "floor_hops": FLOOR_HOPS},
            "rounds": rounds, "medians": median_figures(rounds)}


def write(summary_: dict, out: Path) -> None:
    (out / "stack_bench.json").write_text(json.dumps(summary_, indent=2))
    text = markdown(summary_)
    (out / "stack_bench.md").write_text(text)
    plot(summary_, out / "stack_bench.png")
    print(text)
    print(f"wrote {out / 'stack_bench.json'}, .md, .png")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.stack_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="null")
    p.add_argument("--policy", default="fifo", choices=POLICY_NAMES,
                   help="the one scheduler's dispatch policy (an arm's ACADEMUS_POLICY overrides it)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=1000, help="sequential requests (and each floor's)")
    p.add_argument("--warmup", type=int, default=100, help="sequential requests before those measured")
    p.add_argument("--callers", type=int, nargs="+", default=[64, 256], help="closed loops of each capacity run")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of each capacity run")
    p.add_argument("--procs", type=int, default=2, help="load-generator processes sharing the callers")
    p.add_argument("--floor-callers", type=int, default=64, help="closed loops of the floors' capacity runs")
    p.add_argument("--floor-duration", type=float, default=5.0, help="seconds of the floors' capacity runs")
    p.add_argument("--connections", type=int, default=512, help="client connections of the many-connections run "
                                                                 "(0: none)")
    p.add_argument("--open-load", type=float, default=0.5, help="their offered load, a share of the best capacity")
    p.add_argument("--arms", type=parse_arm, nargs="+", default=[parse_arm(a) for a in DEFAULT_ARMS],
                   help="NAME=ENV=VALUE[,ENV=VALUE...]: each arm's settings for every service; the first is the "
                        "baseline")
    p.add_argument("--out", type=Path, default=Path(".academus/results/stack"))
    for hidden in ("--share", "--run-dir", "--start-at", "--result", "--rate"):   # a load-generator process's
        p.add_argument(hidden, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.share:
        freeze_start_up_heap("loadgen")   # its own collections would count as the stack's latency
        share = uvloop.run(send_open_share(Path(args.run_dir), args.model, int(args.share), float(args.rate),
                                           args.duration, float(args.start_at)) if args.rate else
                           send_share(Path(args.run_dir), args.model, int(args.share), args.duration,
                                      float(args.start_at)))
        Path(args.result).write_text(json.dumps(share))
        return 0
    if len({a.name for a in args.arms}) != len(args.arms):
        raise SystemExit("stack_bench: arm names must differ")
    check_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    write(run(args, sys.argv[1:] if argv is None else argv), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
