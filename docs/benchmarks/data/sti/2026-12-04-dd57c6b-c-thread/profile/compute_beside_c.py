"""A pass through the model alone, beside a Python loader thread (one C call a layer), beside the C loader's own
thread, and beside a loader process, loading 6-bit or full-precision layers without pause; ratios to alone, then the
time alone in ms a layer. `python compute_beside_c.py ROUNDS` from the repository root."""
from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time

import torch

sys.path.insert(0, "docs/benchmarks/data/sti/2026-12-04-74e6f08-layer-put/profile")
from compute_beside import loader, setup

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


def beside(arm: str, measure) -> float:
    bits = FULL if arm.endswith("32") else 6
    if arm.startswith("proc"):
        context = mp.get_context("fork")
        stop, started = context.Event(), context.Event()
        worker = context.Process(target=loader, args=(stop, bits, started))
        worker.start()
        started.wait(30)
        time.sleep(0.3)
    else:
        stop = threading.Event()
        worker = threading.Thread(target=c_loader if arm.startswith("cthread") else loader, args=(stop, bits))
        worker.start()
        time.sleep(0.5)
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
    arms = ["thread6", "cthread6", "proc6", "thread32", "cthread32", "proc32"]
    for round_ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        with torch.inference_mode():
            hidden = model.embed(ids, mask)
            for width in (3, 12):
                def measure(width: int = width, hidden: torch.Tensor = hidden) -> float:
                    return _layer_ms(model, weights, width, hidden, mask, 40)

                out = {"alone": measure()}
                for arm in (arms if round_ % 2 == 0 else arms[::-1]):
                    out[arm] = beside(arm, measure)
                print(round_, 32, width, {k: round(v / out["alone"], 2) for k, v in out.items()},
                      round(out["alone"], 3), flush=True)


if __name__ == "__main__":
    main()
