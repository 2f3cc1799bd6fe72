"""InferStream as frames of the client's multiplexed stream, against a call of its own: closed loops (8 callers, 10 s)
on a fresh padded sentiment mesh an arm (ramps on), the requests a second and each process's CPU ms a request.

`python closed_loop_framed.py ARTIFACTS ROUNDS OUT [ARM,ARM,...]`. An arm is vanilla (`Infer`), stream-none
(`InferStream` with ACADEMUS_EXIT_POLICY=none: a stream, no ramps) or early (`InferStream`, apparate), each as a
call of its own (`AsyncClient()`) or, with `+framed`, as frames of the client's one multiplexed stream
(`AsyncClient(streams=True)`). The order of the arms alternates between rounds."""

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

KINDS = {"vanilla": ("vanilla", {}), "stream-none": ("early", {"ACADEMUS_EXIT_POLICY": "none"}), "early": ("early", {})}
ARMS = ["vanilla", "vanilla+framed", "stream-none+framed", "early+framed", "early"]


def run(arm: str, texts: list[str], seconds: float, clients: int, artifacts: Path) -> dict:
    name, framed = arm.removesuffix("+framed"), arm.endswith("+framed")
    kind, env = KINDS[name]
    with padded_mesh("sentiment", artifacts, env) as (state, key):

        async def measure() -> dict:
            async with AsyncClient(state.gateway, api_key=key, timeout=60, streams=framed) as client:
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
    arms = sys.argv[4].split(",") if len(sys.argv) > 4 else ARMS
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
