"""The embedding rows' cache before and after, in one process, the arms alternating a round:
`python rows_ab.py SHARDS_DIR OLD_EMBEDDING_ROWS_PY ROUNDS OUT.json`
(OLD_EMBEDDING_ROWS_PY: `git show d2fd9dd:shared/models/embedding_rows.py`).

1. per call, µs (medians of 300): a batch whose rows are all cached, read and asked for (prefetch) through a cold
   source, at 1×32, 1×128 and 8×64 tokens; and a batch of 8×64 ids drawn from 6,000 rows into a 4 MB cache (2,730
   rows), misses read through a mapped source;
2. in runs: a cold 6×9 plan at 6 bits on 32 tokens whose rows are cached, 60 runs (10 left out): the run's rest
   and total, ms (medians)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from academus.shared.models import embedding_rows
from academus.shared.models.model import ClassifierHead, pad_batch
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore
from academus.shared.models.sti_pipeline import ElasticModel, ShardPipeline
from academus.shared.training.shards import full_plan


def old_class(path: str) -> type:
    spec = importlib.util.spec_from_file_location("old_embedding_rows", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EmbeddingRows


def per_call_us(fn: Any, repeats: int = 300) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def calls(rows: Any) -> dict[str, float]:
    cold, mapped = io_source("cold"), io_source("file")
    out = {}
    try:
        for shape in ((1, 32), (1, 128), (8, 64)):
            ids = torch.randint(1000, 3000, shape, generator=torch.Generator().manual_seed(1))
            rows.read(ids, cold)
            out[f"cached read {shape[0]}x{shape[1]}"] = per_call_us(lambda ids=ids: rows.read(ids, cold))
            out[f"cached prefetch {shape[0]}x{shape[1]}"] = per_call_us(lambda ids=ids: rows.prefetch(ids, cold))
        g = torch.Generator().manual_seed(2)
        out["8x64 of 6,000 rows, misses read"] = per_call_us(
            lambda: rows.read(torch.randint(1000, 7000, (8, 64), generator=g), mapped))
    finally:
        cold.close()
        mapped.close()
    return out


def in_runs(store: ShardStore, rows: Any) -> dict[str, float]:
    geometry = store.geometry
    plan = full_plan(geometry, 6, [list(range(9))] * 6)
    model = ElasticModel(store, "", heads={(6, 9): ClassifierHead(["a", "b"], geometry.hidden)})
    model.rows = rows
    pipeline = ShardPipeline(model, io_source("cold"))
    ids, mask, _ = pad_batch([[1000 + i for i in range(32)]])
    try:
        results = [pipeline.run(plan, ids, mask) for _ in range(60)][10:]
    finally:
        pipeline.close()
    return {"rest_ms": round(statistics.median(r.rest_ms for r in results), 3),
            "total_ms": round(statistics.median(r.total_ms for r in results), 3)}


def main() -> None:
    torch.set_num_threads(1)
    store = ShardStore(Path(sys.argv[1]))
    meta = store.manifest.extra["embedding_rows"]
    classes = {"lists": old_class(sys.argv[2]), "arrays": embedding_rows.EmbeddingRows}
    rounds, out = int(sys.argv[3]), Path(sys.argv[4])
    results = []
    for r in range(rounds):
        for arm in (list(classes) if r % 2 == 0 else list(classes)[::-1]):
            rows = classes[arm](store.directory, meta)
            row = {"round": r, "arm": arm, **calls(rows), **in_runs(store, classes[arm](store.directory, meta))}
            results.append(row)
            print(json.dumps(row), flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
