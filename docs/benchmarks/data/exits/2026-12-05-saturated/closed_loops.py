"""Capacity of early exits when a saturated worker stands its ramps down, live: closed loops (8 callers, 10 s) on
a fresh mesh an arm (one padded sentiment deployment, ramps on), the CPU ms a request of each process, and the
worker's exit counters over the loop.

`python closed_loops.py ARTIFACTS ROUNDS OUT [ARM,ARM,...]`, arms: vanilla (Infer), stream-none (InferStream with
ACADEMUS_EXIT_POLICY=none: a stream, no ramps), early (InferStream, apparate: the default, ramps stood down while
the worker's compute is saturated), early-when-saturated (the same with ACADEMUS_EXITS_WHEN_SATURATED=1: ramps on
whatever the load, as before the stand-down). The order of the arms alternates between rounds."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from academus.client import AsyncClient
from academus.loadgen.bench import cpu_ms_per_request, service_and_own_cpu_s
from academus.loadgen.exits_bench import drifting_order
from academus.loadgen.exits_live import one_request, padded_mesh
from academus.shared.runtime.metrics import scrape
from academus.shared.training.data import fetch, load_task

ARMS = {"vanilla": ("vanilla", {}), "stream-none": ("early", {"ACADEMUS_EXIT_POLICY": "none"}), "early": ("early", {}),
        "early-when-saturated": ("early", {"ACADEMUS_EXITS_WHEN_SATURATED": "1"})}
COUNTERS = ("academus_worker_exits_total", "academus_worker_exits_stood_down_total", "academus_worker_batches_total")


def counters(port: int) -> dict[str, float]:
    """The worker's exit and batch counters, summed over their labels."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for sample in scrape(port):
        if sample.name in out:
            out[sample.name] += sample.value
    return out


def run(arm: str, texts: list[str], seconds: float, clients: int, artifacts: Path) -> dict:
    kind, env = ARMS[arm]
    with padded_mesh("sentiment", artifacts, env) as (state, key):
        port = state.service("worker-0").metrics_port

        async def measure() -> dict:
            async with AsyncClient(state.gateway, api_key=key, timeout=60) as client:
                for text in texts[:32]:
                    await one_request(client, kind, "sentiment", text)
                done, end = 0, time.perf_counter() + seconds

                async def caller(k: int) -> None:
                    nonlocal done
                    i = k
                    while time.perf_counter() < end:
                        await one_request(client, kind, "sentiment", texts[i % len(texts)])
                        done += 1
                        i += clients

                seen, before, start = counters(port), service_and_own_cpu_s(state), time.perf_counter()
                await asyncio.gather(*(caller(k) for k in range(clients)))
                took = time.perf_counter() - start
                cpu = cpu_ms_per_request(before, service_and_own_cpu_s(state), done)
                after = counters(port)
                return {"arm": arm, "rps": round(done / took, 1), "requests": done, "cpu_ms": cpu,
                        **{name.removeprefix("academus_worker_"): after[name] - seen[name] for name in COUNTERS}}

        return asyncio.run(measure())


def main() -> None:
    artifacts, rounds, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    arms = sys.argv[4].split(",") if len(sys.argv) > 4 else list(ARMS)
    test = load_task("sentiment", fetch(None)).test
    results = []
    for r in range(rounds):
        texts = [test[i].text for i in drifting_order("sentiment", test, seed=r)]
        for arm in arms if r % 2 == 0 else arms[::-1]:
            results.append(run(arm, texts, 10.0, 8, artifacts) | {"round": r})
            print(json.dumps(results[-1]), flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
