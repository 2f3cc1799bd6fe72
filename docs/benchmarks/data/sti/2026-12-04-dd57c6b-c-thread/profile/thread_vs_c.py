"""The C loader's own thread against a Python loader thread (one C call a layer), in one process, arms alternating:
a plan of one shape at one version through `file`, median ms of a run's total, compute, stall and the loader's busy
time. `LOOKAHEAD=N python thread_vs_c.py BITS TOKENS RUNS ROUNDS [DEPTH WIDTH]` from the repository root (N: the
working buffer in layers, 0 for no bound; default 0)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

from academus.shared.models import sti_pipeline
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.sti_pipeline import ElasticModel, ShardPipeline
from academus.shared.models.sti_planner import HardwareProfile
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shard_plans import planner_for

PROFILE = "docs/benchmarks/data/sti/2026-12-04-cd59cd3-pace/file.json"   # any profile: the plan is fixed below
NATIVE = sti_pipeline.NATIVE


def main() -> None:
    keep_freed_pages()
    torch.set_num_threads(1)
    bits, tokens, runs, rounds = (int(x) for x in sys.argv[1:5])
    depth, width = (int(x) for x in (sys.argv[5:7] or (6, 12)))
    store = ShardStore(shards_dir(Path(".academus/gpu/artifacts").resolve(), "minilm"))
    model = ElasticModel(store, "sentiment")
    profile = HardwareProfile.from_json(json.dumps(json.loads(Path(PROFILE).read_text())["profile"]))
    plan = planner_for(store, "sentiment", profile)._uniform("x", depth, width, bits, 100.0, tokens)
    pipeline = ShardPipeline(model, io_source("file"), lookahead=int(os.environ.get("LOOKAHEAD", "0")))
    ids, mask = torch.randint(1000, 5000, (1, tokens)), torch.ones(1, tokens, dtype=torch.long)
    arms = {"python-thread": None, "c-thread": NATIVE}
    for native in arms.values():    # warm both
        sti_pipeline.NATIVE = native
        for _ in range(5):
            pipeline.run(plan, ids, mask)
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for arm in order:
            sti_pipeline.NATIVE = arms[arm]
            results = [pipeline.run(plan, ids, mask) for _ in range(runs)]
            line = {f: round(statistics.median(getattr(x, f) for x in results), 3)
                    for f in ("total_ms", "compute_ms", "stall_ms", "io_ms")}
            print(json.dumps({"round": r, "arm": arm, "bits": bits, "tokens": tokens, "shape": [depth, width],
                              **line}), flush=True)
    pipeline.close()


if __name__ == "__main__":
    main()
