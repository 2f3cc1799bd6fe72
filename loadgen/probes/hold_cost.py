"""What the gateway's core spends holding requests for a restarting scheduler (SchedulerDirectory._hold).

    python -m academus.loadgen.probes.hold_cost [--requests 370] [--hold-s 2.0] [--rounds 2]

A real redis-server lists one scheduler, which answered a request of the model and then refuses connections,
as a killed one does until its replacement listens. `--requests` requests of that model arrive at once (two
seconds of a scheduler killed at twice the capacity) and are held until their deadline, `--hold-s` away. The
probe reports the process's CPU seconds and the registry reads it made meanwhile. The last line printed is the
summary JSON. Compare two commits by putting a worktree of the other first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from academus.services.gateway.core import SchedulerDirectory
from academus.shared.cli.redis_server import RedisServer
from academus.shared.runtime.errors import Unavailable, Unreachable
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys

MODEL = "spam"


async def hold_round(url: str, requests: int, hold_s: float) -> dict[str, float]:
    keys, redis = Keys(), connect(url)
    await redis.flushall()
    await redis.sadd(keys.schedulers(), "r0")
    await redis.hset(keys.scheduler("r0"), mapping={"address": "r:0", "policy": "padded", "models": MODEL})
    directory = SchedulerDirectory(redis, keys)
    await directory.refresh()
    refusing = False

    async def send(address: str) -> str:
        if refusing:
            raise Unreachable(f"{address}: connection refused")
        return address

    await directory.route(MODEL, "", time.monotonic() + 5, send)   # served: what fails now is held
    refusing = True

    async def reads() -> int:
        return (await redis.info("commandstats")).get("cmdstat_smembers", {}).get("calls", 0)

    reads_before, cpu_before, started = await reads(), time.process_time(), time.monotonic()
    outcomes = await asyncio.gather(*(directory.route(MODEL, "", started + hold_s, send) for _ in range(requests)),
                                    return_exceptions=True)
    cpu_s, wall_s = time.process_time() - cpu_before, time.monotonic() - started
    registry_reads = await reads() - reads_before
    await redis.aclose()
    return {"cpu_s": round(cpu_s, 3), "wall_s": round(wall_s, 3), "registry_reads": registry_reads,
            "answered_unavailable": sum(isinstance(o, Unavailable) for o in outcomes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=370)
    p.add_argument("--hold-s", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as data:
        server = RedisServer(Path(data)).start()
        try:
            rounds = [asyncio.run(hold_round(server.url, args.requests, args.hold_s)) for _ in range(args.rounds)]
        finally:
            server.stop()
    for r in rounds:
        print(f"{args.requests} held {args.hold_s:g} s: cpu {r['cpu_s']} s, wall {r['wall_s']} s, "
              f"registry reads {r['registry_reads']}, answered UNAVAILABLE {r['answered_unavailable']}")
    print(json.dumps({"requests": args.requests, "hold_s": args.hold_s, "rounds": rounds}))


if __name__ == "__main__":
    main()
