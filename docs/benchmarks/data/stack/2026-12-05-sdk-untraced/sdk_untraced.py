"""What the SDK's tracing costs a process with no tracer provider, against the same calls without it.

    python sdk_untraced.py ROUNDS REQUESTS OUT.json

A fresh `concat` mesh serving `null` a round. On it, in this process (no tracer provider set), the order of the
arms alternating between rounds:
- the blocking client, REQUESTS sequential single-text calls: through OpenTelemetry's client interceptor (what
  every call took before the SDK skipped it without a provider) and through the plain stub (what it takes now);
- the asyncio client on a multiplexed stream, 64 callers, 10 × REQUESTS calls in all: each frame's CLIENT span from
  the process's proxy provider (before) and none (now).
Each arm's p50 and this process's CPU a call (time.process_time)."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from opentelemetry import trace

from academus.client import AsyncClient, Client
from academus.loadgen.overhead import text_of
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up
from academus.shared.runtime.tracing import tracer_configured


def blocking(client: Client, stub, requests: int) -> dict:
    client._plain = client._traced = stub   # the arm's stub for every call
    text, lat = text_of(16), []
    cpu = time.process_time()
    for _ in range(requests):
        t = time.perf_counter()
        client.infer("null", [text])
        lat.append(time.perf_counter() - t)
    return {"p50_ms": round(statistics.median(lat) * 1e3, 4),
            "cpu_ms": round((time.process_time() - cpu) / requests * 1e3, 4)}


async def streams(target: str, key: str, traced: bool, requests: int, callers: int = 64) -> dict:
    async with AsyncClient(target, api_key=key, streams=True) as client:
        channel = client._stub.Infer.channel
        channel.tracer = trace.get_tracer_provider().get_tracer("academus.grpc") if traced else None
        text, lat = text_of(16), []
        for _ in range(50):
            await client.infer("null", [text])

        async def caller(n: int) -> None:
            for _ in range(n):
                t = time.perf_counter()
                await client.infer("null", [text])
                lat.append(time.perf_counter() - t)

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(caller(requests // callers) for _ in range(callers)))
        wall = time.perf_counter() - wall
        done = len(lat)
        return {"p50_ms": round(statistics.median(lat) * 1e3, 4), "req_s": round(done / wall, 1),
                "cpu_ms": round((time.process_time() - cpu) / done * 1e3, 4)}


def one_round(r: int, requests: int, out: Path) -> dict:
    run = Path(tempfile.mkdtemp(prefix="academus-sdk-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        order = ("traced", "plain") if r % 2 == 0 else ("plain", "traced")
        figures: dict = {"order": list(order), "blocking": {}, "streams": {}}
        with Client(state.gateway, api_key=key) as client:
            stubs = {"traced": client._traced, "plain": client._plain}
            blocking(client, stubs["plain"], 300)   # warm
            for arm in order:
                figures["blocking"][arm] = blocking(client, stubs[arm], requests)
        for arm in order:
            figures["streams"][arm] = asyncio.run(streams(state.gateway, key, arm == "traced", 10 * requests))
        return figures
    finally:
        down(run)


def main() -> None:
    rounds, requests, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    assert not tracer_configured(), "the comparison is for a process without a tracer provider"
    results = []
    for r in range(rounds):
        results.append(one_round(r, requests, out))
        print(json.dumps(results[-1]), flush=True)
    out.write_text(json.dumps({"rounds": results, "requests": requests}, indent=1))


if __name__ == "__main__":
    main()
