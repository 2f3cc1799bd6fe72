"""Early exits on the live mesh (Apparate): vanilla `Infer` against `InferStream`, at half the teacher's capacity.

`python -m academus.loadgen.exits_live --task spam [--rounds 3] [--duration 30] [--out FILE]`

Each round starts a fresh mesh per arm (one padded deployment, `--exit-policy`, apparate by default), the order of
the arms alternating between rounds. First each arm's capacity: closed loop, `--clients` callers for `--capacity-s`
seconds. Then the same Poisson schedule for both arms, at half of vanilla's capacity (of the first round; `--rate`
sets it), one text a request from the task's test split in the replay bench's drifting order. Per request: the time
to its first result (the ramp's, or the final one) and to the final result; vanilla's are one and the same. Each
arm's `final_split_mean_ms` says where the final results' time went on average, from their metadata
(`analysis.components`: the network, each service's own time, the scheduler's queue, the model's compute);
`final_tail_split_mean_ms` the same over its slowest 5 %. Every request's times are kept (`first_ms`, `final_ms`).
The summary's latency ratios are early / vanilla over every round's requests pooled, with each round's own ratio
beside them (`round_ratios`); capacity is the median of the rounds' ratios; agreement is each released result's
label against the final one of the same request, over the whole run. `capacity_cpu_ms`: each process's CPU ms a
request during the capacity loop (the mesh's services and this load generator), the median of the rounds'. Each
arm's `worker_counts` over its open loop: texts released early, batches run without ramps because the worker's
compute was saturated, and batches. The summary is the last line printed. `--from FILE` prints the summary of a run
written with `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from academus.client import AsyncClient, Metadata
from academus.loadgen.analysis import tail_breakdown
from academus.loadgen.bench import cpu_ms_per_request, service_and_own_cpu_s
from academus.loadgen.exits_bench import drifting_order
from academus.loadgen.runner import Record
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up
from academus.shared.models.exits import APPARATE, POLICIES
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.runtime.metrics import scrape
from academus.shared.training.data import fetch, load_task

ARMS = ("vanilla", "early")
WORKER_COUNTS = ("exits", "exits_stood_down", "batches")   # academus_worker_<name>_total


async def one_request(client: AsyncClient, arm: str, model: str, text: str) -> tuple[float, float, bool, Metadata]:
    """(seconds to the first result, to the final one, whether the first agreed with the final, the final
    result's metadata)."""
    start = time.perf_counter()
    if arm == "vanilla":
        result = await client.infer(model, [text], timeout=30)
        took = time.perf_counter() - start
        return took, took, True, result.metadata
    first_at, first_label = None, None
    async for result in client.infer_stream(model, [text], timeout=30):
        p = result.predictions[0]
        if first_at is None:
            first_at, first_label = time.perf_counter() - start, p.label
        if p.final:
            return first_at, time.perf_counter() - start, p.label == first_label, result.metadata
    raise RuntimeError("the stream ended without a final result")


async def capacity(client: AsyncClient, arm: str, model: str, texts: list[str], clients: int, seconds: float,
                   state: MeshState) -> tuple[float, dict[str, float]]:
    """Requests a second with `clients` callers in a closed loop, and the CPU ms a request of each mesh process
    and of this load generator: on a machine whose cores the model shares with the stack, every process's CPU
    is taken from the model's, so this says where a capacity ratio below 1 went."""
    done, end = 0, time.perf_counter() + seconds
    before = service_and_own_cpu_s(state)

    async def caller(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < end:
            await one_request(client, arm, model, texts[i % len(texts)])
            done += 1
            i += clients

    start = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(clients)))
    took = time.perf_counter() - start
    return done / took, cpu_ms_per_request(before, service_and_own_cpu_s(state), done)


async def open_loop(client: AsyncClient, arm: str, model: str, texts: list[str], rate: float, duration: float,
                    seed: int) -> dict[str, Any]:
    """The Poisson schedule of `seed` at `rate`, every request's times."""
    rng = random.Random(seed)
    gaps, at = [], 0.0
    while at < duration:
        at += rng.expovariate(rate)
        gaps.append(at)
    start = time.perf_counter()
    tasks = []
    for i, when in enumerate(gaps):
        await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
        tasks.append(asyncio.ensure_future(one_request(client, arm, model, texts[i % len(texts)])))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    ok = [r for r in results if not isinstance(r, BaseException)]
    first, final = np.array([r[0] for r in ok]) * 1e3, np.array([r[1] for r in ok]) * 1e3
    answers = [Record(0.0, float(ms), "OK", meta=r[3]) for ms, r in zip(final, ok, strict=True)]
    return {"arm": arm, "sent": len(results), "answered": len(ok), "agreement": float(np.mean([r[2] for r in ok])),
            "first_p25_ms": float(np.percentile(first, 25)), "first_p50_ms": float(np.median(first)),
            "final_p50_ms": float(np.median(final)), "final_p99_ms": float(np.percentile(final, 99)),
            "final_split_mean_ms": tail_breakdown(answers, 0), "final_tail_split_mean_ms": tail_breakdown(answers, 95),
            "batch_size_mean": float(np.mean([r[3].batch_size for r in ok])),
            "first_ms": [round(float(x), 1) for x in first], "final_ms": [round(float(x), 1) for x in final]}


def worker_counts(state: MeshState) -> dict[str, float]:
    """The mesh's workers' WORKER_COUNTS now, each summed over the workers and its labels."""
    out = dict.fromkeys(WORKER_COUNTS, 0.0)
    for service in state.services:
        if service.service == "worker":
            for sample in scrape(service.metrics_port):
                name = sample.name.removeprefix("academus_worker_").removesuffix("_total")
                if name in out and sample.name.endswith("_total"):
                    out[name] += sample.value
    return out


@contextlib.contextmanager
def padded_mesh(task: str, artifacts: Path | None, env: dict[str, str]) -> Iterator[tuple[MeshState, str]]:
    """A fresh mesh of one worker serving `task` in padded batches, `env` over every service's settings (a
    PYTHONPATH runs another commit's code): its state and administrator key; stopped on leaving."""
    with tempfile.TemporaryDirectory(prefix="exits-live-") as tmp:
        run_dir = Path(tmp)
        state = up(MeshOptions(run_dir=run_dir, artifacts=artifacts or artifacts_dir(), gateway_port=0, workers=1,
                               deployments=[Deployment("padded", task)], env=env))
        try:
            yield state, (run_dir / ADMIN_KEY_FILE).read_text().strip()
        finally:
            down(run_dir)


def run_arm(arm: str, task: str, texts: list[str], rate: float | None, args: argparse.Namespace,
            seed: int) -> dict[str, Any]:
    """A fresh mesh for one arm: its capacity, then (given a rate) its open-loop run."""
    with padded_mesh(task, args.artifacts, {"ACADEMUS_EXIT_POLICY": args.exit_policy}) as (state, key):

        async def measure() -> dict[str, Any]:
            async with AsyncClient(state.gateway, api_key=key, timeout=60, streams=args.streams) as client:
                for text in texts[:16]:   # warm-up: traced graphs, channels
                    await one_request(client, arm, task, text)
                cap, cpu = await capacity(client, arm, task, texts, args.clients, args.capacity_s, state)
                before = worker_counts(state)
                run = await open_loop(client, arm, task, texts, rate or cap / 2, args.duration, seed)
                after = worker_counts(state)
                return run | {"capacity_rps": cap, "capacity_cpu_ms": cpu, "rate": rate or cap / 2,
                              "worker_counts": {name: after[name] - before[name] for name in WORKER_COUNTS}}

        return asyncio.run(measure())


LATENCY_RATIOS = {"first_p50_ratio": ("first_ms", 50), "first_p25_ratio": ("first_ms", 25),
                  "final_p99_ratio": ("final_ms", 99)}


def summarize(task: str, rate: float, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Early / vanilla. A percentile is taken over the rounds' requests pooled: both arms of a round run the
    same schedule, so the pool weighs the rounds alike for both. One round's p99 rests on its slowest 1 %
    (about 15 requests in a 60 s round), and between rounds vanilla's own p99 varied 1.9x: a median of a few
    rounds' ratios carries that noise. Each round's ratio is kept beside it."""
    def pooled(arm: str, key: str, q: float) -> float:
        return float(np.percentile(np.concatenate([r[arm][key] for r in rounds]), q))

    per_round = {name: [round(float(np.percentile(r["early"][key], q) / np.percentile(r["vanilla"][key], q)), 4)
                        for r in rounds] for name, (key, q) in LATENCY_RATIOS.items()}
    per_round["capacity_ratio"] = [round(r["early"]["capacity_rps"] / r["vanilla"]["capacity_rps"], 4) for r in rounds]
    answered = sum(r["early"]["answered"] for r in rounds)
    agreeing = sum(r["early"]["agreement"] * r["early"]["answered"] for r in rounds)
    return {"task": task, "rate": rate, "rounds": len(rounds),
            **{name: round(pooled("early", key, q) / pooled("vanilla", key, q), 4)
               for name, (key, q) in LATENCY_RATIOS.items()},
            "capacity_ratio": round(statistics.median(per_round["capacity_ratio"]), 4),
            "early_agreement": round(agreeing / answered, 4),
            "round_ratios": per_round, **capacity_cpu(rounds)}


def capacity_cpu(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each arm's CPU ms a request at capacity, per process, the median of the rounds' (nothing for runs saved
    before the bench measured it)."""
    if not all("capacity_cpu_ms" in r[arm] for r in rounds for arm in ARMS):
        return {}
    return {"capacity_cpu_ms": {arm: {name: round(statistics.median(r[arm]["capacity_cpu_ms"][name] for r in rounds), 3)
                                      for name in rounds[0][arm]["capacity_cpu_ms"]} for arm in ARMS}}


def rounds_json(summary: dict[str, Any], rounds: list[dict[str, Any]]) -> str:
    """The run as JSON with one round a line: each arm keeps every request's times, which one number a line
    (`indent`) would spread over tens of thousands of lines."""
    return (f'{{"summary": {json.dumps(summary)},\n "rounds": [\n'
            + ",\n".join(json.dumps(r) for r in rounds) + "\n]}\n")


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.exits_live", description=__doc__.split("\n")[0])
    p.add_argument("--task", default="spam", choices=("spam", "sentiment"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--capacity-s", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rate", type=float, default=None,
                   help="requests a second (default: half of vanilla's capacity in the first round); to compare runs")
    p.add_argument("--exit-policy", default=APPARATE, choices=POLICIES,
                   help="the workers' exit policy; `none` makes the early arm a stream without ramps: what the "
                        "streaming path alone costs")
    p.add_argument("--streams", action="store_true",
                   help="both arms' calls ride the client's one multiplexed stream (`AsyncClient(streams=True)`), "
                        "InferStream's too; default: a gRPC call each")
    p.add_argument("--from", dest="saved", type=Path, default=None, help="summarize a run written with --out")
    args = p.parse_args(argv)
    if args.saved is not None:
        saved = json.loads(args.saved.read_text())
        print(json.dumps(summarize(saved["summary"]["task"], saved["summary"]["rate"], saved["rounds"])))
        return 0
    test = load_task(args.task, fetch(None)).test
    rounds, rate = [], args.rate
    for r in range(args.rounds):
        texts = [test[i].text for i in drifting_order(args.task, test, seed=r)]
        arms = {}
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):   # round 0 starts with vanilla: its half capacity
            arms[arm] = run_arm(arm, args.task, texts, rate, args, seed=r)
            rate = rate or arms[arm]["rate"]
        rounds.append(arms)
        print(json.dumps({"round": r, **arms}), flush=True)
    summary = summarize(args.task, rate, rounds) | {"exit_policy": args.exit_policy, "streams": args.streams}
    if args.out:
        args.out.write_text(rounds_json(summary, rounds))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
