"""A plan's compute time (its layers, as the run times them) through each source, against the same plan with every
shard held in the preload buffer (no loads): `python compute_by_source.py BITS DEPTH WIDTH RUNS` from the repository
root. One run an arm in turn, the order alternating, the same ids (their rows cached); medians, ms."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "2026-12-05-898b5e1-cold-rows-pace" / "profile"))
from common import pipeline_for

from academus.shared.models.shard_io import io_source
from academus.shared.models.sti_pipeline import ShardPipeline

ARMS = ["held", "file", "cold"]


def main() -> None:
    bits, depth, width, runs = (int(x) for x in sys.argv[1:5])
    _, model, plan, held = pipeline_for(bits, width, "file", depth)
    pipelines = {"held": held, "file": ShardPipeline(model, io_source("file")),
                 "cold": ShardPipeline(model, io_source("cold"))}
    held.hold(dict(plan.bits))
    ids = torch.randint(1000, 29000, (1, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 32, dtype=torch.long)
    out: dict[str, list] = {a: [] for a in ARMS}
    for i in range(runs):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            out[arm].append(pipelines[arm].run(plan, ids, mask))
    for arm in ARMS:
        kept = out[arm][3:]
        print(bits, depth, width, arm, "compute", round(statistics.median(r.compute_ms for r in kept), 3),
              "stall", round(statistics.median(r.stall_ms for r in kept), 3),
              "total", round(statistics.median(r.total_ms for r in kept), 3),
              "io", round(statistics.median(r.io_ms for r in kept), 3), flush=True)
    for p in pipelines.values():
        p.close()


if __name__ == "__main__":
    main()
