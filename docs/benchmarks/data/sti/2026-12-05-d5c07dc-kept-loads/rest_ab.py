"""A run's rest, the loads' set-up in it, with the code before and after: `python rest_ab.py SHARDS OLD DEPTH WIDTH
RUNS ROUNDS HELD IO OUT` (OLD: a directory holding the old `academus` package; HELD: the plan's first layers held in
the preload buffer; IO: the source). Each round runs one process an arm, the order alternating; a process runs a
DEPTHxWIDTH plan at 6 bits on one text of 32 tokens, RUNS runs, the first 80 left out, and prints the medians of its
rest, its tail, its total, its stalls and the loads' set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

WARM_UP = 80   # a process's first second of runs: in some processes the loads ran 4 times slower (diag2.py)

CHILD = r"""
import json, statistics, sys, time
from pathlib import Path
import torch
from academus.shared.models import sti_pipeline
from academus.shared.models.model import ClassifierHead, pad_batch
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore
from academus.shared.training.shards import full_plan

spent = []
init = sti_pipeline.NativeLoads.__init__
def timed(self, *args, **kwargs):
    started = time.perf_counter()
    init(self, *args, **kwargs)
    spent.append((time.perf_counter() - started) * 1e3)
sti_pipeline.NativeLoads.__init__ = timed
torch.set_num_threads(1)
shards, depth, width, runs, warm, held = sys.argv[1], *(int(x) for x in sys.argv[2:7])
io = sys.argv[7]
store = ShardStore(Path(shards))
plan = full_plan(store.geometry, 6, [list(range(width))] * depth)
model = sti_pipeline.ElasticModel(store, "", heads={(depth, width): ClassifierHead(["a", "b"], store.geometry.hidden)})
pipeline = sti_pipeline.ShardPipeline(model, io_source(io))
plan.preload = {x for x in plan.bits if x[0] < held}
pipeline.preload(plan)
ids, mask, _ = pad_batch([[1000 + i for i in range(32)]])
try:
    results = [pipeline.run(plan, ids, mask) for _ in range(runs)][warm:]
finally:
    pipeline.close()
median = statistics.median
print(json.dumps({"rest_ms": median(r.rest_ms for r in results), "finish_ms": median(r.finish_ms for r in results),
                  "total_ms": median(r.total_ms for r in results), "setup_ms": median(spent[warm:]),
                  "stall_ms": median(r.stall_ms for r in results)}))
"""


def arm(old: str | None, shards: str, depth: int, width: int, runs: int, held: int, io: str) -> dict[str, float]:
    env = dict(os.environ)
    if old:
        env["PYTHONPATH"] = old
    args = [shards, *(str(x) for x in (depth, width, runs, WARM_UP, held)), io]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    shards, old = sys.argv[1], sys.argv[2]
    depth, width, runs, rounds, held = (int(x) for x in sys.argv[3:8])
    io, out = sys.argv[8], Path(sys.argv[9])
    rows = []
    for r in range(rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        figures = {name: arm(old if name == "old" else None, shards, depth, width, runs, held, io) for name in order}
        rows.append({"round": r, "order": order, **figures})
        o, n = figures["old"], figures["new"]
        print(f"round {r} ({order[0]} first): " + "; ".join(
            f"{k} {o[k]:.3f} -> {n[k]:.3f} ({n[k] / o[k]:.2f})" for k in o), flush=True)
        time.sleep(1)
    out.write_text(json.dumps({"argv": sys.argv[1:], "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
