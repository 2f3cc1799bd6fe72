"""The adaptive controller live: one fresh mesh serving a task's teacher with its ramps (padded, `apparate`),
early-exit streams in a closed loop for `--capacity-s` seconds, then the drifting order at half that capacity
(`--rate` sets it) for `--duration` seconds; then the worker's `academus ramps status` (active ramps, their
measured costs, the tunings and changes with their reasons) and the open loop's figures, as one JSON.

python live_ramps_status.py --task sentiment --artifacts A [--duration 60] [--capacity-s 10] > status.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from academus.client import AsyncClient
from academus.loadgen.exits_bench import drifting_order
from academus.loadgen.exits_live import capacity, one_request, open_loop
from academus.shared.cli.main import ramp_status
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys
from academus.shared.training.data import fetch, load_task


async def status(state) -> dict:
    redis = connect(state.redis_url)
    try:
        return await ramp_status(redis, Keys(state.key_prefix))
    finally:
        await redis.aclose()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="sentiment")
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--capacity-s", type=float, default=10)
    parser.add_argument("--rate", type=float)
    args = parser.parse_args()
    test = load_task(args.task, fetch(None)).test
    texts = [test[i].text for i in drifting_order(args.task, test, seed=0)]
    with tempfile.TemporaryDirectory(prefix="ramps-status-") as tmp:
        run_dir = Path(tmp)
        state = up(MeshOptions(run_dir=run_dir, artifacts=args.artifacts, gateway_port=0, workers=1,
                               deployments=[Deployment("padded", args.task)]))
        try:
            key = (run_dir / ADMIN_KEY_FILE).read_text().strip()

            async def measure() -> dict:
                async with AsyncClient(state.gateway, api_key=key, timeout=60) as client:
                    for text in texts[:16]:
                        await one_request(client, "early", args.task, text)
                    cap = await capacity(client, "early", args.task, texts, 16, args.capacity_s)
                    after_capacity = await status(state)
                    run = await open_loop(client, "early", args.task, texts, args.rate or cap / 2, args.duration, 0)
                    return {"capacity_rps": cap, "rate": args.rate or cap / 2,
                            "open_loop": {k: v for k, v in run.items() if not isinstance(v, list)},
                            "status_after_capacity": after_capacity, "status_after_open_loop": await status(state)}

            print(json.dumps(asyncio.run(measure()), indent=1))
        finally:
            down(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
