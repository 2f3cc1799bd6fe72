"""A layer's 12 shards read through `cold` (the files' pages dropped first) in their files' order against a shuffled
order, 12 layers an arm, alternating: median ms a shard. `python cold_order.py` from the repository root."""

import random
import statistics
import time
from pathlib import Path

from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, shards_dir

store = ShardStore(shards_dir(Path(".academus/gpu/artifacts").resolve(), "minilm"))
src = io_source("cold")
rng = random.Random(0)
for bits in (6, 32):
    res = {"index": [], "shuffled": []}
    for r in range(24):
        k = r % 6
        order = list(range(12))
        arm = "index" if r % 2 == 0 else "shuffled"
        if arm == "shuffled":
            rng.shuffle(order)
        src.before_run(store.paths())
        t = time.perf_counter()
        for s in order:
            src.read(*store.span(k, s, bits))
        res[arm].append((time.perf_counter() - t) * 1e3 / 12)
    print(bits, {a: round(statistics.median(v), 3) for a, v in res.items()})
