"""A layer's compute (a pass through the model, as the profile times it) alone, and beside a loader loading whole
layers without pause, as a thread of the same process or as a process of its own, at full precision or 6 bits.
`python compute_beside.py`: ratios to alone, then the time alone in ms a layer."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from pathlib import Path

import torch

from academus.shared.models.model import pad_batch
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.shards import FULL
from academus.shared.models.sti_pipeline import ElasticModel
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shards import _layer_ms


def setup() -> tuple[ShardStore, ElasticModel]:
    keep_freed_pages()
    torch.set_num_threads(1)
    store = ShardStore(shards_dir(Path(".academus/gpu/artifacts").resolve(), "minilm"))
    return store, ElasticModel(store, "", heads={})


def loader(stop: threading.Event, bits: int, started: threading.Event | None = None) -> None:
    store, model = setup()
    source, layers, k = io_source("file"), store.geometry.layers, 0
    if started is not None:
        started.set()
    while not stop.is_set():
        store.load_layer(source, k % layers, list(range(store.geometry.heads)), bits, model.residents[k % layers])
        k += 1


def beside(arm: str, measure) -> float:
    bits = FULL if arm.endswith("32") else 6
    if arm.startswith("thread"):
        stop = threading.Event()
        worker = threading.Thread(target=loader, args=(stop, bits))
        worker.start()
        time.sleep(0.5)
    else:
        context = mp.get_context("fork")
        stop, started = context.Event(), context.Event()
        worker = context.Process(target=loader, args=(stop, bits, started))
        worker.start()
        started.wait(30)
        time.sleep(0.3)
    try:
        return measure()
    finally:
        stop.set()
        worker.join()


def main() -> None:
    store, model = setup()
    geometry = store.geometry
    weights = [[store.decode(k, s, FULL, store.read_stored(k, s, FULL)) for s in range(geometry.heads)]
               for k in range(geometry.layers)]
    ids, mask, _ = pad_batch([[1996] * 32])
    for round_ in range(2):
        with torch.inference_mode():
            hidden = model.embed(ids, mask)
            for width in (3, 12):
                def measure(width: int = width, hidden: torch.Tensor = hidden) -> float:
                    return _layer_ms(model, weights, width, hidden, mask, 40)

                out = {"alone": measure()}
                for arm in ("thread32", "proc32", "thread6", "proc6"):
                    out[arm] = beside(arm, measure)
                print(round_, 32, width, {k: round(v / out["alone"], 2) for k, v in out.items()},
                      round(out["alone"], 3), flush=True)


if __name__ == "__main__":
    main()
