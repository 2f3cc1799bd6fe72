"""What reading word embeddings by row costs a batch (`shared/models/embedding_rows.py`) against a gather from the
table held whole, on the bundled tasks' test splits as the gateway tokenizes them, for row caches of several sizes.

    python -m academus.loadgen.probes.embedding_rows [--model minilm] [--artifacts DIR] [--cache-mb 2 4 8]
        [--texts 1 8]

For each cache size, task and batch size: one pass over the split in batches to warm the cache, then a timed
pass: ms a batch (rows read through a file source, the page cache warm), the share of a batch's distinct rows found
cached, and the same batches gathered from the table in memory. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from academus.shared.models.embedding_rows import EmbeddingRows
from academus.shared.models.model import pad_batch
from academus.shared.models.shard_io import FileSource
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import EncoderBase
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.training.data import fetch, load_task
from academus.shared.training.shards import encoder_base


def timed(batches: list[torch.Tensor], read) -> float:
    started = time.perf_counter()
    for ids in batches:
        read(ids)
    return (time.perf_counter() - started) / len(batches) * 1e3


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="minilm")
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--cache-mb", type=float, nargs="+", default=[2, 4, 8])
    p.add_argument("--texts", type=int, nargs="+", default=[1, 8])
    p.add_argument("--tasks", nargs="+", default=["sentiment", "spam"])
    args = p.parse_args(argv)
    artifacts = args.artifacts or artifacts_dir()
    store = ShardStore(shards_dir(artifacts, args.model))
    base: EncoderBase | None = encoder_base(artifacts, args.model)
    tokenizer: TeacherTokenizer = base.tokenizer()
    source = FileSource()
    table = EmbeddingRows(store.directory, store.manifest.extra["embedding_rows"], 1 << 40).read(
        torch.arange(store.rows.rows), source)
    rows_out = []
    for task in args.tasks:
        encoded = tokenizer.encode([e.text for e in load_task(task, fetch()).test])
        for size in args.texts:
            batches = [pad_batch([e.input_ids for e in encoded[i:i + size]])[0] for i in range(0, len(encoded), size)]
            dense = timed(batches, lambda ids: table[ids])
            for mb in args.cache_mb:
                rows = EmbeddingRows(store.directory, store.manifest.extra["embedding_rows"], int(mb * (1 << 20)))
                timed(batches, lambda ids, r=rows: r.read(ids, source))
                rows.hits = rows.misses = 0
                ms = timed(batches, lambda ids, r=rows: r.read(ids, source))
                rows_out.append({"task": task, "texts": size, "cache_mb": mb, "ms_a_batch": round(ms, 4),
                                 "hit_share": round(rows.hits / max(1, rows.hits + rows.misses), 4),
                                 "dense_ms_a_batch": round(dense, 4)})
    source.close()
    print(json.dumps({"model": args.model, "rows": rows_out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
