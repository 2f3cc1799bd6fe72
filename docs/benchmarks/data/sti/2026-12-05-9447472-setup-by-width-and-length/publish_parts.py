"""Where a cold run's loads' set-up goes: `python publish_parts.py SHARDS_DIR DEPTH WIDTH RUNS` (6 bits, 32 tokens;
the first 5 runs left out). Medians of each call's time, and the run's rest and tail."""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from academus.shared.models import shards as shards_mod
from academus.shared.models import sti_pipeline
from academus.shared.models.model import ClassifierHead, pad_batch
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore
from academus.shared.training.shards import full_plan

SPENT: dict[str, list[float]] = defaultdict(list)
WARM_UP = 5


def timed(owner: Any, name: str) -> None:
    inner: Callable[..., Any] = getattr(owner, name)

    def outer(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[name].append((time.perf_counter() - started) * 1e3)

    setattr(owner, name, outer)


def main() -> None:
    for name in ("_in_file_order", "_stored"):
        timed(sti_pipeline, name)
    timed(shards_mod.LayerResident, "picked")
    timed(sti_pipeline.PlanLoads, "publish")
    timed(shards_mod.LayerBuilder, "weights")
    timed(sti_pipeline.NativeLoads, "__init__")
    torch.set_num_threads(1)
    store = ShardStore(Path(sys.argv[1]))
    depth, width, runs = (int(x) for x in sys.argv[2:5])
    geometry = store.geometry
    plan = full_plan(geometry, 6, [list(range(width))] * depth)
    model = sti_pipeline.ElasticModel(store, "", heads={(depth, width): ClassifierHead(["a", "b"], geometry.hidden)})
    pipeline = sti_pipeline.ShardPipeline(model, io_source("cold"))
    ids, mask, _ = pad_batch([[1000 + i for i in range(32)]])
    try:
        results = [pipeline.run(plan, ids, mask) for _ in range(runs)][WARM_UP:]
    finally:
        pipeline.close()
    print("rest", statistics.median(r.rest_ms for r in results),
          "finish", statistics.median(r.finish_ms for r in results))
    for name, times in SPENT.items():
        per_run = len(times) / runs
        kept = times[int(WARM_UP * per_run):]
        print(f"{name}: {statistics.median(kept):.4f} ms a call, {per_run:.0f} a run: "
              f"{statistics.median(kept) * per_run:.3f} ms a run")


if __name__ == "__main__":
    main()
