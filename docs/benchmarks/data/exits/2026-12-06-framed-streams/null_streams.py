"""What a stream costs the stack, without a model: `Infer` against `InferStream`, each as a gRPC call of its own and as
frames of the client's multiplexed stream (`AsyncClient(streams=True)`), on a fresh mesh serving `null` an arm.

    python null_streams.py ROUNDS SECONDS OUT.json

An arm: 200 sequential calls of one text (their p50), then 64 callers in closed loops for SECONDS (requests a
second, and each process's CPU ms a request, this load generator's included). The order of the arms alternates
between rounds."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from academus.client import AsyncClient
from academus.loadgen.bench import cpu_ms_per_request, service_and_own_cpu_s
from academus.loadgen.overhead import text_of
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

ARMS = ["infer", "infer+framed", "stream", "stream+framed"]


async def one_call(client: AsyncClient, stream: bool, text: str) -> None:
    if stream:
        async for _ in client.infer_stream("null", [text]):
            pass
    else:
        await client.infer("null", [text])


async def measure(state, key: str, arm: str, seconds: float) -> dict:
    stream, framed, text = arm.startswith("stream"), arm.endswith("+framed"), text_of(16)
    async with AsyncClient(state.gateway, api_key=key, streams=framed) as client:
        for _ in range(100):
            await one_call(client, stream, text)
        lat = []
        for _ in range(200):
            t = time.perf_counter()
            await one_call(client, stream, text)
            lat.append(time.perf_counter() - t)
        done, end = 0, time.perf_counter() + seconds

        async def caller() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await one_call(client, stream, text)
                done += 1

        before, start = service_and_own_cpu_s(state), time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(64)))
        took = time.perf_counter() - start
        cpu = cpu_ms_per_request(before, service_and_own_cpu_s(state), done)
    stack = ("gateway", "scheduler", "worker-0", "loadgen")
    return {"arm": arm, "sequential_p50_ms": round(statistics.median(lat) * 1e3, 3), "rps": round(done / took, 1),
            "cpu_ms": {name: cpu[name] for name in stack}}


def one_mesh(arm: str, seconds: float) -> dict:
    run = Path(tempfile.mkdtemp(prefix="null-streams-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, workers=1, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        return asyncio.run(measure(state, (run / ADMIN_KEY_FILE).read_text().strip(), arm, seconds))
    finally:
        down(run)


def main() -> None:
    rounds, seconds, out = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
    results = []
    for r in range(rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            results.append(one_mesh(arm, seconds) | {"round": r})
            print(json.dumps(results[-1]), flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
