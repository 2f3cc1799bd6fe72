"""Does the worker's adapter path hold memory per tenant? Many tenants' adapters, one after another, through the
worker's `AdapterCache` (a 4 MiB budget, a tenant forgotten four tenants later) and `encode_with_adapters` on the
real MiniLM, in this one process; its RSS and the Python objects that grew, every 100 tenants.

    python -m academus.loadgen.probes.adapter_churn_rss [--tenants 800]

The chaos bench's soak sees workers grow under tenant churn with their caches off
(docs/benchmarks/reliability.md); flat here means the growth is outside this path. The last line printed is the
JSON of the readings.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import time

import torch

from academus.loadgen.chaos_bench import rss_mib
from academus.services.worker.adapters import AdapterCache, AdapterKey
from academus.shared.models.adapters import AdapterWeights, encode_with_adapters
from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer

KEPT = 4   # tenants whose adapters stay in the cache before they are forgotten


def object_counts() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


async def churn(tenants: int) -> list[dict]:
    torch.set_num_threads(1)
    encoder = TeacherEncoder.load(teacher_dir()).eval()
    encoded = TeacherTokenizer(teacher_dir(), max_tokens=64).encode(["a fine film", "a dull one, and long"],
                                                                    truncate=True)
    ids, mask, types = pad_batch([e.input_ids for e in encoded], [e.token_type_ids for e in encoded])
    store: dict[AdapterKey, AdapterWeights] = {}
    cache = AdapterCache(lambda key, layers, head: store[key].to_bytes(layers or None, head), budget_bytes=4 << 20)
    readings, first = [], None
    for t in range(tenants + 1):
        key = (f"t{t}", "m", 1)
        store[key] = AdapterWeights.init(["a", "b"], seed=t)
        batch = await cache.acquire([key, None], deadline=time.monotonic() + 10)
        with torch.no_grad():
            await asyncio.to_thread(encode_with_adapters, encoder, ids, mask, types, batch.weights,
                                    layer_ready=batch.layer_ready)
        del store[key]
        if t >= KEPT:
            cache.forget((f"t{t - KEPT}", "m", 1))
        if t % 100 == 0:
            counts = object_counts()
            first = first or counts
            grown = {k: v - first[k] for k, v in counts.most_common() if v - first[k] > 50}
            readings.append({"tenants": t, "rss_mib": rss_mib(os.getpid()), "cached": len(cache._entries),
                             "objects_grown": grown})
            print(json.dumps(readings[-1]), flush=True)
    cache.close()
    return readings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.probes.adapter_churn_rss", description=__doc__)
    p.add_argument("--tenants", type=int, default=800)
    readings = asyncio.run(churn(p.parse_args(argv).tenants))
    print(json.dumps({"readings": readings, "rss_growth_after_first_100_mib":
                      round(readings[-1]["rss_mib"] - readings[min(1, len(readings) - 1)]["rss_mib"], 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
