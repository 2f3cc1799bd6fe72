"""The HTTP/JSON API against gRPC at capacity on `null` (the stack alone): one fresh `concat` mesh a round, closed
loops of CALLERS callers for 10 s in this process, the order alternating. gRPC through `AsyncClient(streams=True)`
(the SDK's cheapest way, stack_bench's); HTTP `POST /embed` through one aiohttp session, a kept-alive connection a
caller. Per arm: req/s, p50 ms, and each service's CPU ms a request from /proc.
`python http_capacity.py ROUNDS CALLERS OUT.json`."""

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from academus.client import AsyncClient
from academus.loadgen.bench import process_cpu_s
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

TEXT = "a sentence of about sixteen tokens, as the stack bench sends to the null model"
DURATION_S = 10.0


async def loop(callers: int, one) -> tuple[int, list[float]]:
    took: list[float] = []
    end = time.perf_counter() + DURATION_S

    async def caller() -> None:
        while time.perf_counter() < end:
            start = time.perf_counter()
            await one()
            took.append(time.perf_counter() - start)

    await asyncio.gather(*(caller() for _ in range(callers)))
    return len(took), took


async def grpc_arm(state, key: str, callers: int) -> tuple[int, list[float]]:
    async with AsyncClient(state.gateway, api_key=key, streams=True) as client:
        async def one() -> None:
            await client.infer("null", [TEXT], output="embedding")
        await loop(8, one)   # warm-up
        return await loop(callers, one)


async def http_arm(state, key: str, callers: int) -> tuple[int, list[float]]:
    url = f"http://{state.http}/embed"
    body = {"inputs": TEXT, "model": "null", "normalize": False}
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with session.post(url, json=body, headers=headers) as answer:
                await answer.read()
                assert answer.status == 200
        await loop(8, one)
        return await loop(callers, one)


def measure(arm, state, key: str, callers: int) -> dict:
    pids = {s.name: s.pid for s in state.services if s.service in ("gateway", "scheduler", "worker")}
    before = {n: process_cpu_s(p) for n, p in pids.items()}
    started = time.perf_counter()
    count, took = asyncio.run(arm(state, key, callers))
    wall = time.perf_counter() - started - DURATION_S   # less the warm-up loop's
    cpu = {n: 1e3 * (process_cpu_s(p) - before[n]) / count for n, p in pids.items()}
    return {"rps": count / DURATION_S, "p50_ms": 1e3 * statistics.median(took), "cpu_ms": cpu,
            "stack_cpu_ms": sum(cpu.values()), "warmup_s": wall}


def main(rounds: int, callers: int, out: Path) -> None:
    results = []
    for r in range(rounds):
        run = Path(tempfile.mkdtemp(prefix="http-capacity-"))
        state = up(MeshOptions(run_dir=run, gateway_port=0, http_port=0, deployments=[Deployment("concat")],
                               env={"ACADEMUS_MODELS": "null", "ACADEMUS_MAX_QUEUE_WAIT_MS": "0"}))
        try:
            key = (run / ADMIN_KEY_FILE).read_text().strip()
            arms = [("grpc", grpc_arm), ("http", http_arm)]
            order = arms if r % 2 == 0 else arms[::-1]
            found = {name: measure(arm, state, key, callers) for name, arm in order}
        finally:
            down(run)
        found["http_over_grpc_rps"] = found["http"]["rps"] / found["grpc"]["rps"]
        found["http_over_grpc_gateway_cpu"] = found["http"]["cpu_ms"]["gateway"] / found["grpc"]["cpu_ms"]["gateway"]
        print(r, json.dumps(found), flush=True)
        results.append(found)
    out.write_text(json.dumps({"command": sys.argv, "callers": callers, "rounds": results}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
