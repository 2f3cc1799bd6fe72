"""Each submodel shape of an encoder's shards on a bundled task's whole test split, at full precision: its accuracy
on the gold labels and its agreement with the whole model. To compare the teacher's shards with those of the
teacher trained at every width (`academus shard adapt`), shape by shape.

    python -m academus.loadgen.probes.shape_accuracy --artifacts A --model minilm|NAME --task sentiment

The last line printed is JSON: accuracy and agreement by "dxw" (depth × width).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from academus.loadgen.probes.shape_agreement import agreement_with, shape_predictions
from academus.shared.models.shard_store import ShardStore, shape_key, shards_dir
from academus.shared.models.sti_pipeline import ElasticModel
from academus.shared.runtime.config import offline_hub
from academus.shared.training.data import load_task
from academus.shared.training.shards import Evaluator, decoded_bank, encoder_base


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--model", default="minilm", help="minilm or a user's embedding model with shards")
    p.add_argument("--task", required=True, help="a bundled task the shards were built for")
    args = p.parse_args(argv)
    store = ShardStore(shards_dir(args.artifacts, args.model))
    data = load_task(args.task)
    texts = [e.text for e in data.test]
    evaluator = Evaluator(ElasticModel(store, args.task), decoded_bank(store),
                          encoder_base(args.artifacts, args.model).tokenizer(), texts)
    gold = torch.tensor([e.label for e in data.test])
    predictions = shape_predictions(store, args.task, evaluator)   # each shape run once, scored twice
    accuracy = agreement_with(predictions, gold)
    whole = shape_key(store.geometry.layers, store.geometry.heads)
    print(json.dumps({"model": args.model, "task": args.task, "texts": len(texts), "accuracy": accuracy,
                      "agreement": agreement_with(predictions, predictions[whole]), "whole": accuracy[whole]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
