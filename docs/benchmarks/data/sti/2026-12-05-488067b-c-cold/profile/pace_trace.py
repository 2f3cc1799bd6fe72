"""Paced runs traced: STI's plan at T = 0.75 (1 MiB preload, 32 tokens, sentiment's test texts) through an IO source,
on a profile measured first, 60 runs; each check of the pace (layer, ms elapsed, the run's mean layer so far, cut)
for the slowest runs. `python pace_trace.py cold` from the repository root."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from academus.loadgen import sti_bench
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.sti_pipeline import ElasticModel, ShardPipeline
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shard_plans import planner_for


def main() -> None:
    keep_freed_pages()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    artifacts = Path(".academus/gpu/artifacts").resolve()
    store = ShardStore(shards_dir(artifacts, "minilm"))
    profile = sti_bench.measure_profile(store, sys.argv[1])
    planner = planner_for(store, "sentiment", profile)
    target = 0.75 * (store.geometry.layers * profile.layer_ms(12, 32) + profile.overhead_ms[32])
    plan = planner.plan(target, 32, 1 << 20)
    pace = planner.pace(plan, 32)
    print("T", round(target, 2), "plan", plan.depth, plan.width, pace)
    pipeline = ShardPipeline(ElasticModel(store, "sentiment"), io_source(sys.argv[1]))
    pipeline.preload(plan)
    trace: list[tuple[int, float, float, bool]] = []
    cut = ShardPipeline._cut

    def traced(pace: object, layer: int, started: float, compute_s: float) -> bool:
        stops = cut(pace, layer, started, compute_s)
        trace.append((layer, round((time.perf_counter() - started) * 1e3, 2),
                      round(compute_s * 1e3 / layer, 2) if layer else 0.0, stops))
        return stops

    ShardPipeline._cut = staticmethod(traced)
    tokenizer = sti_bench.encoder_base(artifacts, "minilm").tokenizer()
    texts = [e.text for e in sti_bench.task_data(artifacts, "minilm", "sentiment", store).test[:64]]
    batches = [sti_bench.request_batch(tokenizer, t, 32) for t in texts]
    runs = []
    for i in range(60):
        trace.clear()
        ids, mask, types = batches[i % len(batches)]
        result = pipeline.run(plan, ids, mask, types, pace=pace)
        runs.append((result.total_ms, result.depth, result.compute_ms, result.stall_ms, list(trace)))
    pipeline.close()
    totals = sorted(r[0] for r in runs)
    print("runs past the bound", sum(t > pace.bound_ms for t in totals), "of", len(runs), "p95",
          round(totals[int(0.95 * len(totals)) - 1], 2), "bound", round(pace.bound_ms, 2))
    for total, depth, compute, stall, checks in sorted(runs, key=lambda r: -r[0])[:4]:
        print(round(total, 2), "depth", depth, "compute", round(compute, 2), "stall", round(stall, 2), checks)


if __name__ == "__main__":
    main()
