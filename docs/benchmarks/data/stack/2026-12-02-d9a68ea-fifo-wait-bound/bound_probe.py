"""A `fifo` mesh serving `null` under closed-loop callers that ask again at once when refused, with the queue's
wait bound (the default, 1 s) and without it (ACADEMUS_MAX_QUEUE_WAIT_MS=0); fresh meshes, the order alternating.

    python docs/benchmarks/data/stack/2026-12-02-d9a68ea-fifo-wait-bound/bound_probe.py --callers 256 --rounds 3 \
        --out probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections import Counter
from pathlib import Path

import redis

from academus.loadgen.overhead import text_of
from academus.loadgen.runner import GatewaySpread, run_closed
from academus.loadgen.texts import Sample
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up
from academus.shared.state.keys import Keys

ARMS = {"bound": {}, "no_bound": {"ACADEMUS_MAX_QUEUE_WAIT_MS": "0"}}


def one_run(callers: int, seconds: float, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        state = up(MeshOptions(run_dir=run_dir, gateway_port=0, deployments=[Deployment("fifo")],
                               env={"ACADEMUS_MODELS": "null"} | env))
        key = (run_dir / ADMIN_KEY_FILE).read_text().strip()

        async def load():
            async with GatewaySpread(state.gateways(), key, 10.0, streams=True) as spread:
                await spread.next()[1].infer("null", ["warm"])
                return await run_closed(spread, "null", callers, [Sample(text_of(16))], 10.0, seconds)

        try:
            result = asyncio.run(load())
            timing = redis.Redis.from_url(state.redis_url, decode_responses=True).hgetall(
                Keys(state.key_prefix).timing("fifo", "null"))
        finally:
            down(run_dir)
    codes = Counter(r.code for r in result.records)
    return {"ok_rps": round(codes["OK"] / result.duration_s, 1), "codes": dict(codes),
            "service_ms": round(float(timing.get("service_s", "nan")) * 1e3, 3),
            "refusal_example": next((r.details for r in result.records if r.code != "OK"), None)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--callers", type=int, default=256)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rounds = []
    for r in range(args.rounds):
        order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
        rounds.append({arm: one_run(args.callers, args.seconds, ARMS[arm]) for arm in order})
        print(json.dumps(rounds[-1]), flush=True)
    args.out.write_text(json.dumps({"callers": args.callers, "seconds": args.seconds, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
