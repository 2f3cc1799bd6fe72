"""The kept loader thread against a thread a run, in one process: `python thread_ab.py SHARDS DEPTH WIDTH RUNS BLOCKS
HELD IO`. Blocks of RUNS runs of a DEPTHxWIDTH plan at 6 bits (one text of 32 tokens; its first HELD layers held),
the arms alternating block by block (a thread a run: `LoaderBuffers.loader_thread` answering None, so that each
`PlanLoads` starts and ends its own). Both arms publish the layers' kept loads. Medians of stall, rest and total."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from academus.shared.models import sti_pipeline
from academus.shared.models.model import ClassifierHead, pad_batch
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore
from academus.shared.models.sti_planner import Plan
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shards import full_plan


def held_plan(shards: str, depth: int, width: int, held: int, io: str, keep_pages: bool
              ) -> tuple[sti_pipeline.ShardPipeline, Plan, torch.Tensor, torch.Tensor]:
    """A pipeline through `io` holding the first `held` layers of a DEPTHxWIDTH plan at 6 bits, the plan, and one
    text of 32 tokens (ids, mask). `keep_pages`: the process keeps its freed pages, as the services do."""
    torch.set_num_threads(1)
    if keep_pages:
        keep_freed_pages()
    store = ShardStore(Path(shards))
    plan = full_plan(store.geometry, 6, [list(range(width))] * depth)
    heads = {(depth, width): ClassifierHead(["a", "b"], store.geometry.hidden)}
    pipeline = sti_pipeline.ShardPipeline(sti_pipeline.ElasticModel(store, "", heads=heads), io_source(io))
    plan.preload = {x for x in plan.bits if x[0] < held}
    pipeline.preload(plan)
    ids, mask, _ = pad_batch([[1000 + i for i in range(32)]])
    return pipeline, plan, ids, mask


def main() -> None:
    depth, width, runs, blocks, held = (int(x) for x in sys.argv[2:7])
    pipeline, plan, ids, mask = held_plan(sys.argv[1], depth, width, held, sys.argv[7], keep_pages=False)
    kept = sti_pipeline.LoaderBuffers.loader_thread
    results: dict[str, list] = {"kept": [], "own": []}
    try:
        for block in range(blocks):
            for name in ("kept", "own") if block % 2 == 0 else ("own", "kept"):
                sti_pipeline.LoaderBuffers.loader_thread = kept if name == "kept" else (lambda self: None)
                results[name] += [pipeline.run(plan, ids, mask) for _ in range(runs)][3:]
    finally:
        pipeline.close()
    median = statistics.median
    for name, done in results.items():
        figures = {k: median(getattr(r, f"{k}_ms") for r in done) for k in ("stall", "rest", "total", "compute")}
        print(name, " ".join(f"{k} {v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
