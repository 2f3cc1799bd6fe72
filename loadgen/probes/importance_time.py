"""How long STI's importance profile (§5.2) takes: each upgraded plan run whole, one plan a call, against the
upgrades run from the base plan's states entering their layer (`Evaluator.upgrades`, what `shard build` runs),
on a bundled task's dev texts of a built artifact, the arms alternating.

    python -m academus.loadgen.probes.importance_time --artifacts A [--model minilm] [--task sentiment]
        [--texts 500] [--rounds 2]

Both arms must give the same probabilities (checked); the last line printed is the JSON of the timings.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from academus.loadgen.code_arms import round_orders
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.shards import BITS, FULL
from academus.shared.models.sti_pipeline import ElasticModel
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.training.data import fetch, load_task
from academus.shared.training.prepare import subsample
from academus.shared.training.shards import Evaluator, decoded_bank, encoder_base, full_plan


def whole(evaluator: Evaluator, layers: int, heads: int) -> list[torch.Tensor]:
    """Each upgrade as its own plan, run from the embeddings up."""
    out = []
    for k in range(layers):
        for s in range(heads):
            plan = full_plan(evaluator.model.store.geometry, BITS[0])
            plan.bits[(k, s)] = FULL
            out.append(evaluator.probs(plan))
    return out


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--model", default="minilm")
    p.add_argument("--task", default="sentiment")
    p.add_argument("--texts", type=int, default=500, help="dev texts (the build's: 500 for sentiment)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    artifacts = args.artifacts or artifacts_dir()
    store = ShardStore(shards_dir(artifacts, args.model))
    geometry = store.geometry
    dev = subsample(load_task(args.task, fetch(None)).validation, args.texts)
    evaluator = Evaluator(ElasticModel(store, args.task), decoded_bank(store),
                          encoder_base(artifacts, args.model).tokenizer(), [e.text for e in dev])
    arms = {"whole": lambda: whole(evaluator, geometry.layers, geometry.heads),
            "upgrades": lambda: [probs for _, _, probs in evaluator.upgrades(full_plan(geometry, BITS[0]), FULL)]}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    answers: dict[str, list[torch.Tensor]] = {}
    for r, order in enumerate(round_orders(args.rounds, list(arms))):
        for name in order:
            started = time.perf_counter()
            answers[name] = arms[name]()
            seconds[name].append(round(time.perf_counter() - started, 2))
            print(f"round {r} {name}: {seconds[name][-1]} s", flush=True)
    same = all(torch.equal(a, b) for a, b in zip(answers["whole"], answers["upgrades"], strict=True))
    ratio = [round(u / w, 3) for u, w in zip(seconds["upgrades"], seconds["whole"], strict=True)]
    print(json.dumps({"model": args.model, "task": args.task, "texts": len(dev), "plans": len(answers["whole"]),
                      "seconds": seconds, "ratio_upgrades_to_whole": ratio, "same_probabilities": same,
                      "threads": torch.get_num_threads()}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
