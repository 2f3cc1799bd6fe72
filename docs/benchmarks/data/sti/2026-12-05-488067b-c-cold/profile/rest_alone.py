"""The run's parts besides its layers (embedding, pooling and head) timed in a loop as the load profile times them:
as it does (one repeated token), then with a row a token, the rows asked for first and the softmax, as a run does.
`python rest_alone.py` from the repository root; medians of 50 calls, ms."""

from __future__ import annotations

from pathlib import Path

import torch

from academus.shared.models.model import ClassifierHead, pad_batch
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.sti_pipeline import ElasticModel
from academus.shared.training.shards import median_ms


def main() -> None:
    torch.set_num_threads(1)
    store = ShardStore(shards_dir(Path(".academus/gpu/artifacts").resolve(), "minilm"))
    model = ElasticModel(store, "", heads={})
    head = ClassifierHead(["a", "b"], store.geometry.hidden)
    for bucket in (16, 32, 64):
        ids, mask, _ = pad_batch([[1996] * bucket])
        distinct = torch.tensor([[1996 + i for i in range(bucket)]])
        with torch.inference_mode():
            hidden = model.embed(ids, mask)
            profiled = median_ms(lambda i=ids, m=mask, h=hidden: (model.embed(i, m), head(model.pool(h, m))), 50)
            run = median_ms(lambda d=distinct, m=mask, h=hidden: (
                model.rows.prefetch(d, model.source), model.embed(d, m),
                torch.softmax(head(model.pool(h, m)), dim=-1)), 50)
        print(bucket, "as profiled", round(profiled, 3), "as a run's", round(run, 3))

if __name__ == "__main__":
    main()
