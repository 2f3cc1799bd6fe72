"""How far each submodel shape of a user's classifier's shards agrees with the unmodified classifier, at full
precision, on texts given in a file: to compare shards built on different texts (`shard build --model NAME` on the
bundled tasks' texts, or `--data` on the classifier's own) on the same held-out texts.

    python -m academus.loadgen.probes.shape_agreement --artifacts A --model NAME --texts F.jsonl [--limit N]

A shape of depth d and width w runs the d lowest layers on their w most important shards under that shape's head
(`full_plan` of that order, at full precision).
The last line printed is the JSON of the agreements, by "dxw".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from academus.shared.models.shard_store import ShardStore, shape_key, shards_dir
from academus.shared.models.shards import FULL
from academus.shared.models.sti_pipeline import ElasticModel
from academus.shared.models.user_models import open_model
from academus.shared.runtime.config import offline_hub
from academus.shared.state.uploads import parse_texts_jsonl
from academus.shared.training.shards import Evaluator, accuracy, decoded_bank, encoder_base, full_plan, own_task


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--model", required=True, help="a user's sequence classifier with shards")
    p.add_argument("--texts", type=Path, required=True, help='JSON lines {"text": ...}')
    p.add_argument("--limit", type=int, default=0, help="the first N texts (0: all)")
    args = p.parse_args(argv)
    texts = parse_texts_jsonl(args.texts.read_bytes(), str(args.texts))
    texts = texts[:args.limit] if args.limit else texts
    base = encoder_base(args.artifacts, args.model)
    encoder, head, _ = open_model(base.directory)
    tokenizer = base.tokenizer()
    labelled = own_task(args.model, encoder, head, tokenizer, {"test": texts}).test
    gold = torch.tensor([e.label for e in labelled])
    store = ShardStore(shards_dir(args.artifacts, args.model))
    info = store.tasks[args.model]
    evaluator = Evaluator(ElasticModel(store, args.model), decoded_bank(store), tokenizer, texts)
    order = [info.layer_order(k) for k in range(store.geometry.layers)]
    agreement = {shape_key(d, w): round(accuracy(evaluator.probs(full_plan(store.geometry, FULL,
                                                                           [o[:w] for o in order[:d]])), gold)[0], 4)
                 for d in info.depths for w in info.widths}
    print(json.dumps({"model": args.model, "texts": len(texts), "source": str(args.texts),
                      "built_on": store.manifest.extra.get("own_texts", "bundled"), "agreement": agreement}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
