"""InferStream's gateway code, two versions on fresh meshes serving `null`, the order alternating.

    python infer_stream_ab.py ROUNDS REQUESTS OUT.json NAME=PATH NAME=PATH

Each NAME=PATH is a copy of services/gateway/server.py. Before each mesh starts, the arm's copy is put in place (the
services import the checkout); the checkout's own file is put back at the end. On each mesh, from this process:
REQUESTS sequential `infer_stream` calls of one text (the asyncio client), then 64 callers making 10 × REQUESTS
calls in all. For each: the p50, the calls a second (the callers') and the gateway's CPU a call (/proc, every
thread)."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from academus.client import AsyncClient
from academus.loadgen.code_arms import alternating
from academus.loadgen.overhead import text_of
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

GATEWAY = Path(__file__).resolve().parents[5] / "services" / "gateway" / "server.py"
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


async def streamed(client: AsyncClient, text: str) -> float:
    t = time.perf_counter()
    async for _ in client.infer_stream("null", [text]):
        pass
    return time.perf_counter() - t


async def measure(target: str, key: str, gateway_pid: int, requests: int) -> dict:
    text = text_of(16)
    async with AsyncClient(target, api_key=key) as client:
        for _ in range(100):
            await streamed(client, text)
        cpu = cpu_s(gateway_pid)
        lat = [await streamed(client, text) for _ in range(requests)]
        sequential = {"p50_ms": round(statistics.median(lat) * 1e3, 4),
                      "gateway_cpu_ms": round((cpu_s(gateway_pid) - cpu) / requests * 1e3, 4)}
        lat = []

        async def caller(n: int) -> None:
            for _ in range(n):
                lat.append(await streamed(client, text))

        cpu, wall = cpu_s(gateway_pid), time.perf_counter()
        await asyncio.gather(*(caller(10 * requests // 64) for _ in range(64)))
        wall = time.perf_counter() - wall
        loops = {"p50_ms": round(statistics.median(lat) * 1e3, 4), "req_s": round(len(lat) / wall, 1),
                 "gateway_cpu_ms": round((cpu_s(gateway_pid) - cpu) / len(lat) * 1e3, 4)}
    return {"sequential": sequential, "callers_64": loops}


def one_mesh(requests: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="academus-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        pid = next(s.pid for s in state.services if s.name == "gateway")
        return asyncio.run(measure(state.gateway, key, pid, requests))
    finally:
        down(run)


def main() -> None:
    rounds, requests, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    arms = {name: Path(path) for name, path in (a.split("=", 1) for a in sys.argv[4:])}
    results = alternating(rounds, arms, GATEWAY, lambda _: one_mesh(requests))
    out.write_text(json.dumps({"rounds": results, "requests": requests}, indent=1))


if __name__ == "__main__":
    main()
