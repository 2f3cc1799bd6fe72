"""A layer's compute beside a loader thread that only calls the C put: a layer's 12 six-bit shards a call (x1), or 4
or 20 layers' worth a call (x4, x20). The same work, fewer GIL round trips. `python handoffs.py`: ratios to alone,
then alone in ms a layer (32 tokens)."""

from __future__ import annotations

import threading
import time

import torch
from compute_beside import setup

from academus.shared.models.model import pad_batch
from academus.shared.models.shards import FULL, LayerBuilder
from academus.shared.training.shards import _layer_ms


def main() -> None:
    store, model = setup()
    geometry = store.geometry
    weights = [[store.decode(k, s, FULL, store.read_stored(k, s, FULL)) for s in range(geometry.heads)]
               for k in range(geometry.layers)]
    shards = list(range(geometry.heads))
    blobs = [store.read_stored(0, s, 6) for s in shards]
    entries = [store.entry(0, s, 6) for s in shards]
    tables = [store.pair_tables[(0, 6)]] * len(shards)

    def put_calls(stop: threading.Event, repeat: int) -> None:
        built = LayerBuilder(shards, model.residents[0], geometry)
        n = len(shards) * repeat
        args = (list(range(len(shards))) * repeat, blobs * repeat, [6] * n, tables * repeat,
                [e.outliers for e in entries] * repeat, [e.crc32 for e in entries] * repeat)
        while not stop.is_set():
            built.put_stored(*args)

    ids, mask, _ = pad_batch([[1996] * 32])
    for round_ in range(2):
        with torch.inference_mode():
            hidden = model.embed(ids, mask)
            for width in (3, 12):
                out = {"alone": _layer_ms(model, weights, width, hidden, mask, 60)}
                for repeat in (1, 4, 20):
                    stop = threading.Event()
                    worker = threading.Thread(target=put_calls, args=(stop, repeat))
                    worker.start()
                    time.sleep(0.2)
                    out[f"x{repeat}"] = _layer_ms(model, weights, width, hidden, mask, 60)
                    stop.set()
                    worker.join()
                print(round_, width, {k: round(v / out["alone"], 2) for k, v in out.items()}, round(out["alone"], 3),
                      flush=True)


if __name__ == "__main__":
    main()
