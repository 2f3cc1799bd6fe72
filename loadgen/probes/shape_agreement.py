"""How far each submodel shape of a user's classifier's shards agrees with the unmodified classifier, at full
precision, on texts given in a file: to compare shards built on different texts (`shard build --model NAME` on the
bundled tasks' texts, or `--data` on the classifier's own) on the same held-out texts.

    python -m academus.loadgen.probes.shape_agreement --artifacts A --model NAME --texts F.jsonl [--limit N]

A shape of depth d and width w runs the d lowest layers on their w most important shards under that shape's head
(`full_plan` of that order, at full precision).
The last line printed is the JSON of the agreements, by "dxw".
"""

from __future__ import annotations

import json

import torch

from academus.loadgen.probes import texts_probe_args
from academus.shared.models.shard_store import ShardStore, shape_key, shards_dir
from academus.shared.models.shards import FULL
from academus.shared.models.sti_pipeline import ElasticModel
from academus.shared.models.user_models import open_model
from academus.shared.training.shards import Evaluator, decoded_bank, encoder_base, full_plan, own_task


def shape_predictions(store: ShardStore, task: str, evaluator: Evaluator) -> dict[str, torch.Tensor]:
    """Each shape's predicted labels at full precision, by "dxw": the d lowest layers on their w first shards in
    the task's order, under that shape's head."""
    info = store.tasks[task]
    order = [info.layer_order(k) for k in range(store.geometry.layers)]
    return {shape_key(d, w): evaluator.probs(full_plan(store.geometry, FULL, [o[:w] for o in order[:d]])).argmax(1)
            for d in info.depths for w in info.widths}


def agreement_with(predictions: dict[str, torch.Tensor], labels: torch.Tensor) -> dict[str, float]:
    return {shape: round(float((p == labels).float().mean()), 4) for shape, p in predictions.items()}


def main(argv: list[str] | None = None) -> int:
    args, texts = texts_probe_args(__doc__, "a user's sequence classifier with shards", argv)
    base = encoder_base(args.artifacts, args.model)
    encoder, head, _ = open_model(base.directory)
    tokenizer = base.tokenizer()
    labelled = own_task(args.model, encoder, head, tokenizer, {"test": texts}).test
    gold = torch.tensor([e.label for e in labelled])
    store = ShardStore(shards_dir(args.artifacts, args.model))
    evaluator = Evaluator(ElasticModel(store, args.model), decoded_bank(store), tokenizer, texts)
    agreement = agreement_with(shape_predictions(store, args.model, evaluator), gold)
    print(json.dumps({"model": args.model, "texts": len(texts), "source": str(args.texts),
                      "built_on": store.manifest.extra.get("own_texts", "bundled"), "agreement": agreement}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
