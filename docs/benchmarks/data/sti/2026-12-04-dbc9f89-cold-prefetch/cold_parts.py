"""Where a cold run's time goes: one plan shape at one version through `cold`, 40 runs of 32 token ids (the first 5
not counted); the median ms of the embedding rows' read (on the compute thread) and of the run's total, IO, stall
and compute. `python cold_parts.py BITS WIDTH SPREAD` from the repository root: ids drawn from 1000..1000+SPREAD
(10: every run's rows in the rows' cache after the first; 19000: most read from the disk)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.sti_pipeline import ElasticModel, ShardPipeline
from academus.shared.models.sti_planner import HardwareProfile
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shard_plans import planner_for

PROFILE = "docs/benchmarks/data/sti/2026-12-04-cd59cd3-pace/file.json"   # any profile: the plan is fixed below


def main() -> None:
    keep_freed_pages()
    torch.set_num_threads(1)
    bits, width, spread = (int(x) for x in sys.argv[1:4])
    store = ShardStore(shards_dir(Path(".academus/gpu/artifacts").resolve(), "minilm"))
    model = ElasticModel(store, "sentiment")
    profile = HardwareProfile.from_json(json.dumps(json.loads(Path(PROFILE).read_text())["profile"]))
    plan = planner_for(store, "sentiment", profile)._uniform("x", 6, width, bits, 100.0, 32)
    pipeline = ShardPipeline(model, io_source("cold"))
    rows_ms: list[float] = []
    read = model.rows.read

    def timed(ids: torch.Tensor, source: object) -> torch.Tensor:
        started = time.perf_counter()
        rows = read(ids, source)
        rows_ms.append((time.perf_counter() - started) * 1e3)
        return rows

    model.rows.read = timed
    mask = torch.ones(1, 32, dtype=torch.long)
    results = [pipeline.run(plan, torch.randint(1000, 1000 + spread, (1, 32)), mask) for _ in range(40)]
    pipeline.close()
    line = {f: round(statistics.median(getattr(r, f) for r in results[5:]), 3)
            for f in ("total_ms", "io_ms", "stall_ms", "compute_ms")}
    print(bits, width, spread, "rows", round(statistics.median(rows_ms[5:]), 3), line, flush=True)


if __name__ == "__main__":
    main()
