"""Where the early arm's capacity goes, live: closed loops (8 callers, 10 s) on a fresh mesh an arm (one padded
sentiment deployment, ramps on), and the CPU ms a request of each mesh process and of this load generator.

`python closed_loop_cpu.py ARTIFACTS ROUNDS OUT [ARM,ARM,...]`, arms from ARMS: vanilla (Infer), stream-none
(InferStream with ACADEMUS_EXIT_POLICY=none: a stream, no ramps), early (InferStream, apparate),
early-when-saturated (the same with ACADEMUS_EXITS_WHEN_SATURATED=1: ramps on at any load; from 2026-12-05), and
each of them with `-passive` (OMP_WAIT_POLICY=PASSIVE in the services: torch's OpenMP threads sleep at once instead
of spinning between parallel regions) or `-t1` (the worker's torch at one intra-op thread). `ARM@DIR` runs the
services with PYTHONPATH=DIR (a directory holding an `academus` link to another commit's worktree), to compare
commits in one run. The order of the arms alternates between rounds. From 2026-12-05 each arm also gives the
worker's counts over its loop (`exits_live.worker_counts`: texts released early, batches stood down, batches)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from academus.client import AsyncClient
from academus.loadgen.bench import cpu_ms_per_request, service_and_own_cpu_s
from academus.loadgen.exits_bench import drifting_order
from academus.loadgen.exits_live import one_request, padded_mesh, worker_counts
from academus.shared.training.data import fetch, load_task

BASE = {"vanilla": ("vanilla", {}), "stream-none": ("early", {"ACADEMUS_EXIT_POLICY": "none"}), "early": ("early", {}),
        "early-when-saturated": ("early", {"ACADEMUS_EXITS_WHEN_SATURATED": "1"})}
ARMS = BASE | {f"{name}-passive": (kind, env | {"OMP_WAIT_POLICY": "PASSIVE"}) for name, (kind, env) in BASE.items()} \
    | {f"{name}-t1": (kind, env | {"ACADEMUS_TORCH_THREADS": "1"}) for name, (kind, env) in BASE.items()}


def run(arm: str, texts: list[str], seconds: float, clients: int, artifacts: Path) -> dict:
    name, _, code = arm.partition("@")
    kind, env = ARMS[name]
    with padded_mesh("sentiment", artifacts, env | ({"PYTHONPATH": code} if code else {})) as (state, key):

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

                seen, before, start = worker_counts(state), service_and_own_cpu_s(state), time.perf_counter()
                await asyncio.gather(*(caller(k) for k in range(clients)))
                took = time.perf_counter() - start
                cpu, counts = cpu_ms_per_request(before, service_and_own_cpu_s(state), done), worker_counts(state)
                return {"arm": arm, "rps": round(done / took, 1), "requests": done, "cpu_ms": cpu,
                        **{name: counts[name] - seen[name] for name in counts}}

        return asyncio.run(measure())


def main() -> None:
    artifacts, rounds, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    arms = sys.argv[4].split(",") if len(sys.argv) > 4 else list(BASE)
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
