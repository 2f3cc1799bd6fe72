"""What one worker adapter-cache miss costs on the CPU (why many tenants slow a CPU node, HMI §6.2): a real
adapter store (in this process, on its own event loop thread) over loopback gRPC and a real Redis, N distinct
adapters put, then fetched through the worker's StoreFetcher and AdapterCache one after the other.

    python -m academus.loadgen.probes.adapter_miss_bench [--adapters 300]

Reports per miss (wall and process CPU, store side included): one miss at a time, and misses in batches
of 16 fetched one Get a piece or one GetMany a layer, or taken from a warmed host tier; and per piece:
the first Get (head + layer 4), a later layer's Get, one Get of the whole file, and parsing a piece. The
last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from academus.loadgen.probes.adapters_bench import perturbed_adapter
from academus.services.worker.adapters import AdapterCache, StoreFetcher
from academus.services.worker.host_tier import HostAdapters
from academus.shared.cli.redis_server import RedisServer
from academus.shared.models.adapters import AdapterWeights
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService
from academus.shared.state.keys import Keys
from academus.shared.training.onboarding import AdapterStoreClient

PREFIX = "miss-bench"


def per_call_ms(count: int, fn: Callable[[int], object]) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for k in range(count):
        fn(k)
    return {"wall_ms": round((time.perf_counter() - wall) / count * 1e3, 3),
            "cpu_ms": round((time.process_time() - cpu) / count * 1e3, 3)}


async def start_store(redis_url: str, data_dir: Path) -> RunningService:
    import os

    from academus.services.adapter_store.server import build

    os.environ.update({"ACADEMUS_REDIS_URL": redis_url, "ACADEMUS_KEY_PREFIX": PREFIX, "ACADEMUS_PORT": "0",
                       "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ADAPTER_DIR": str(data_dir), "ACADEMUS_GRACE_S": "1"})
    service = RunningService(await build())
    await service.start()
    return service


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=300)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    count, tmp = args.adapters, Path(tempfile.mkdtemp(prefix="miss-bench-"))
    redis = RedisServer(tmp / "redis").start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def on_loop(coro):  # the store's own event loop, as a separate process would have
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    service = on_loop(start_store(redis.url, tmp / "adapters"))

    async def put_all() -> None:
        client = AdapterStoreClient(connect(redis.url), Keys(PREFIX))
        for k in range(count):
            await client.put(f"t{k}", "m", perturbed_adapter(["a", "b"], k).to_bytes(), {"base": "minilm"})

    on_loop(put_all())
    fetcher = StoreFetcher(redis.url, Keys(PREFIX))

    def misses(batch: int, fetch_batch: int, host: HostAdapters | None = None) -> dict[str, float]:
        """Every adapter missed once, `batch` of them a request batch (each batch's misses together);
        with `host`, the device cache's misses go to that host tier instead of the store."""
        cache = AdapterCache(host or fetcher, 1 << 30, fetch_batch=fetch_batch)

        version = 1 if host else 0  # the host tier keeps only pinned versions

        async def run() -> None:
            for start in range(0, count, batch):
                keys = [(f"t{k}", "m", version) for k in range(start, min(start + batch, count))]
                acquired = await cache.acquire(keys)
                await asyncio.gather(*(asyncio.wrap_future(e.complete) for e in acquired.entries))

        try:
            spent = per_call_ms(1, lambda _: asyncio.run(run()))
        finally:
            cache.close()
        return {name: round(ms / count, 3) for name, ms in spent.items()}

    try:
        misses(16, 32)   # warm-up: every file read once into the store's file cache, as in steady serving
        result = {"adapters": count, "miss": misses(1, 1),
                  "miss_in_batches_of_16": {"one_get_a_piece": misses(16, 1), "get_many": misses(16, 32)}}
        host = HostAdapters(fetcher.many, 1 << 32)
        host.warm([(f"t{k}", "m", 1) for k in range(count)])
        result["miss_in_batches_of_16"]["host_tier_resident"] = misses(16, 32, host)
        pieces: list[bytes] = []
        result["get_first_piece"] = per_call_ms(count, lambda k: pieces.append(fetcher((f"t{k}", "m", 0), [3], True)))
        result["get_one_layer"] = per_call_ms(count, lambda k: fetcher((f"t{k}", "m", 0), [4], False))
        result["get_whole_file"] = per_call_ms(count, lambda k: fetcher((f"t{k}", "m", 0), [], False))
        result["parse_first_piece"] = per_call_ms(count, lambda k: AdapterWeights.from_bytes(pieces[k]))
    finally:
        fetcher.close()
        on_loop(service.stop())
        redis.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
