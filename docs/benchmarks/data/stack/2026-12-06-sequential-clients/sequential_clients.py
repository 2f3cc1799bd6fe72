"""The sequential p50 on `null` by client: the blocking `Client` (a gRPC call each, stack_bench's), `AsyncClient` (a
gRPC call each) and `AsyncClient(streams=True)` (a frame of one multiplexed stream each), for `Infer` and, framed,
`InferStream`. A fresh `concat` mesh an arm, REQUESTS sequential single-text calls after 200 to warm up, ROUNDS
rounds, the order alternating. `python sequential_clients.py ROUNDS REQUESTS OUT.json`."""

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from academus.client import AsyncClient, Client
from academus.loadgen.overhead import text_of
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

ARMS = ["blocking", "asyncio", "asyncio-framed", "asyncio-framed-stream"]


def blocking(target: str, key: str, requests: int) -> list[float]:
    text, took = text_of(16), []
    with Client(target, api_key=key) as client:
        for i in range(200 + requests):
            start = time.perf_counter()
            client.infer("null", [text])
            if i >= 200:
                took.append(time.perf_counter() - start)
    return took


async def asynchronous(target: str, key: str, requests: int, framed: bool, stream: bool) -> list[float]:
    text, took = text_of(16), []
    async with AsyncClient(target, api_key=key, streams=framed) as client:
        for i in range(200 + requests):
            start = time.perf_counter()
            if stream:
                async for _ in client.infer_stream("null", [text]):
                    pass
            else:
                await client.infer("null", [text])
            if i >= 200:
                took.append(time.perf_counter() - start)
    return took


def one_mesh(arm: str, requests: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="seq-clients-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, workers=1, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        took = blocking(state.gateway, key, requests) if arm == "blocking" else asyncio.run(
            asynchronous(state.gateway, key, requests, arm.startswith("asyncio-framed"), arm.endswith("stream")))
    finally:
        down(run)
    return {"arm": arm, "p50_ms": round(statistics.median(took) * 1e3, 3),
            "p99_ms": round(float(np.percentile(took, 99)) * 1e3, 3)}


def main() -> None:
    rounds, requests, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    results = []
    for r in range(rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            results.append(one_mesh(arm, requests) | {"round": r})
            print(json.dumps(results[-1]), flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
