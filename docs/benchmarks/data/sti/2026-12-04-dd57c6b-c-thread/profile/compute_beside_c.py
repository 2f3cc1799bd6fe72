"""A pass through the model alone, beside a Python loader thread (one C call a layer), beside the C loader's own
thread, and beside a loader process, loading 6-bit or full-precision layers without pause; ratios to alone, then the
time alone in ms a layer. `python compute_beside_c.py ROUNDS` from the repository root."""
from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

import torch

sys.path.insert(0, "docs/benchmarks/data/sti/2026-12-04-74e6f08-layer-put/profile")
import compute_beside
from compute_beside import setup

from academus.shared.models.model import pad_batch
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_native import PlanLoads
from academus.shared.models.shards import FULL, LayerBuilder
from academus.shared.training.shards import _layer_ms

BATCH = 100   # layers a PlanLoads


def c_loader(stop: threading.Event, bits: int) -> None:
    store, model = setup()
    source, geometry = io_source("file"), store.geometry
    shards = list(range(geometry.heads))
    buffers = [LayerBuilder(shards, model.residents[k], geometry) for k in range(geometry.layers)]
    stored = []
    for k in range(geometry.layers):
        entries = [store.entry(k, s, bits) for s in shards]
        stored.append(([source.mapping(store.files[e.file])[1] + e.offset for e in entries],
                       [e.length for e in entries], [bits] * len(shards),
                       [store.pair_addresses.get((k, bits), 0)] * len(shards), [e.outliers for e in entries],
                       [e.crc32 for e in entries]))
    while not stop.is_set():
        loads = PlanLoads(BATCH, 0)
        for j in range(BATCH):
            loads.publish(buffers[j % geometry.layers].native, shards, *stored[j % geometry.layers])
        loads.wait(BATCH - 1)
        loads.finish()


def beside(arm: str, measure: Callable[[], float]) -> float:
    """compute_beside.py's arms; `cthread*` is its thread arm with the C loader's thread for the loader."""
    python_loader = compute_beside.loader
    if arm.startswith("cthread"):
        compute_beside.loader = c_loader
    try:
        return compute_beside.beside(arm.removeprefix("c"), measure)
    finally:
        compute_beside.loader = python_loader


def main() -> None:
    store, model = setup()
    weights = [[store.decode(k, s, FULL, store.read_stored(k, s, FULL)) for s in range(store.geometry.heads)]
               for k in range(store.geometry.layers)]
    ids, mask, _ = pad_batch([[1996] * 32])
    arms = ["thread6", "cthread6", "proc6", "thread32", "cthread32", "proc32"]
    with torch.inference_mode():
        hidden = model.embed(ids, mask)
        for round_ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
            for width in (3, 12):
                measure = functools.partial(_layer_ms, model, weights, width, hidden, mask, 40)
                alone = measure()
                ratios = {arm: round(beside(arm, measure) / alone, 2)
                          for arm in (arms if round_ % 2 == 0 else arms[::-1])}
                print(round_, 32, width, {"alone": 1.0, **ratios}, round(alone, 3), flush=True)


if __name__ == "__main__":
    main()
