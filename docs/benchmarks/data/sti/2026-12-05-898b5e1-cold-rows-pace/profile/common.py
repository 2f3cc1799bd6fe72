"""What the three scripts share: the full MiniLM shards, the sentiment model on them, and one plan shape at one version
(6 layers deep unless said) through an IO source. Run from the repository root."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.sti_pipeline import ElasticModel, ShardPipeline
from academus.shared.models.sti_planner import HardwareProfile, Plan
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shard_plans import planner_for

PROFILE = "docs/benchmarks/data/sti/2026-12-04-cd59cd3-pace/file.json"   # any profile: the plan is fixed


def pipeline_for(bits: int, width: int, io: str, depth: int = 6
                 ) -> tuple[ShardStore, ElasticModel, Plan, ShardPipeline]:
    keep_freed_pages()
    torch.set_num_threads(1)
    store = ShardStore(shards_dir(Path(".academus/gpu/artifacts").resolve(), "minilm"))
    model = ElasticModel(store, "sentiment")
    profile = HardwareProfile.from_json(json.dumps(json.loads(Path(PROFILE).read_text())["profile"]))
    plan = planner_for(store, "sentiment", profile)._uniform("x", depth, width, bits, 100.0, 32)
    return store, model, plan, ShardPipeline(model, io_source(io))
