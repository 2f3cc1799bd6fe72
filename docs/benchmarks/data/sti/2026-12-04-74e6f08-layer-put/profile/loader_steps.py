"""Where a shard's load goes in STI's loader, alone and beside the compute: read, check, put, and the rest of the
loop. `python loader_steps.py BITS` (a 6x12 plan at one version through `file`, 40 runs an arm, twice; us a shard).
Written against 8f20361's per-shard loader; from 74e6f08 on, wrap `source.view` instead of `source.read`, and the
put is a layer a call."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from academus.shared.models import shards as shards_module
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.sti_pipeline import ElasticModel, ShardPipeline
from academus.shared.models.sti_planner import HardwareProfile
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shard_plans import planner_for

PROFILE = "docs/benchmarks/data/sti/2026-12-04-cd59cd3-pace/file.json"   # any profile: the plan is fixed below
times: dict[str, list[int]] = {"read": [], "check": [], "put": []}
recording = [False]


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter_ns()
        result = fn(*args, **kwargs)
        if recording[0]:
            times[name].append(time.perf_counter_ns() - started)
        return result
    return wrapper


def main() -> None:
    keep_freed_pages()
    torch.set_num_threads(1)
    bits = int(sys.argv[1])
    store = ShardStore(shards_dir(Path(".academus/gpu/artifacts").resolve(), "minilm"))
    model = ElasticModel(store, "sentiment")
    profile = HardwareProfile.from_json(json.dumps(json.loads(Path(PROFILE).read_text())["profile"]))
    plan = planner_for(store, "sentiment", profile)._uniform("x", 6, 12, bits, 100.0, 32)
    source = io_source("file")
    pipeline = ShardPipeline(model, source)
    source.read = timed("read", source.read)
    store.check = timed("check", store.check)
    shards_module.LayerBuilder.put_stored = timed("put", shards_module.LayerBuilder.put_stored)
    ids, mask = torch.randint(1000, 5000, (1, 32)), torch.ones(1, 32, dtype=torch.long)

    def loader_alone() -> float:
        ready = [threading.Event() for _ in plan.shards]
        return pipeline._load(plan, ready, {}, [], threading.Event(), None) * 1e3

    for _ in range(5):
        pipeline.run(plan, ids, mask)
        loader_alone()
    for arm in ("alone", "beside", "alone", "beside"):
        for values in times.values():
            values.clear()
        recording[0] = True
        totals = [loader_alone() if arm == "alone" else pipeline.run(plan, ids, mask).io_ms for _ in range(40)]
        recording[0] = False
        line = {k: round(statistics.median(v) / 1e3, 1) for k, v in times.items()}
        line["per_shard_total_us"] = round(statistics.median(totals) / len(plan.bits) * 1e3, 1)
        line["loop_rest_us"] = round(line["per_shard_total_us"] - sum(line[k] for k in times), 1)
        print(arm, bits, line, flush=True)
    pipeline.close()


if __name__ == "__main__":
    main()
