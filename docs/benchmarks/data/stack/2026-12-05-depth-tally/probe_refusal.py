"""Why a closed loop of 1,024 callers on `null` met refusals once admission kept up: one more client beside the
callers, printing the refusals it was given.

    python probe_refusal.py

A fresh `concat` mesh; 1,024 closed loops for 10 s over two load-generator processes (stack_bench's runner), and
this process's own client sending a request every 2 ms for 14 s. With `refusal_debug.patch` applied, the
scheduler also writes its admission estimate's parts to /tmp/refusal_debug.txt at each refusal of the wait
bound (`refusals_debug.txt` holds one such run's lines)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

from academus.client import AcademusError, AsyncClient
from academus.loadgen import stack_bench
from academus.loadgen.overhead import text_of
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up


async def probe(target: str, key: str, details: list[str]) -> None:
    async with AsyncClient(target, api_key=key, streams=True) as client:
        end = time.time() + 14
        while time.time() < end:
            try:
                await client.infer("null", [text_of(16)])
            except AcademusError as e:
                details.append(str(e)[:300])
            await asyncio.sleep(0.002)


def main() -> None:
    run = Path(tempfile.mkdtemp(prefix="academus-probe-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    key = (run / ADMIN_KEY_FILE).read_text().strip()
    details: list[str] = []
    try:
        side = threading.Thread(target=lambda: asyncio.run(probe(state.gateway, key, details)))
        side.start()
        cap = stack_bench.capacity(state, argparse.Namespace(model="null", duration=10.0, procs=2), 1024, run)
        side.join()
        print(cap["throughput_rps"], cap.get("errors"))
        print(len(details), *details[:3], *details[-3:], sep="\n")
    finally:
        down(run)


if __name__ == "__main__":
    main()
