"""STI on an accelerator: the prepared device check (falls back to the CPU where there is none).

`python -m academus.loadgen.sti_device [--out DIR] [--repeats 50]`

1. Compute against width: one elastic layer of the shard artifact at widths 3, 6, 9 and 12 (shards a layer),
   one text and a batch of 8, lengths 32 and 128. The paper finds a GPU nearly flat in width (12 shards 0.7 %
   slower than 3), so its planner picks wide, shallow submodels there; a CPU is proportional.
2. Shards streamed from pinned host memory: each stored version held in page-locked host memory, copied to
   the device on a side stream and decoded there (the pair-table decoder, in torch); per shard and version,
   the time to a usable layer's worth, against one layer's compute.

Times are CUDA-event medians on a GPU, perf_counter medians on a CPU. Prints a JSON summary as the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from academus.shared.models.model import pad_batch
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.shards import FULL, WORD_PAD, LayerWeights, ShardGeometry, ShardWeights, groups
from academus.shared.models.sti_pipeline import ElasticModel
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.training.shards import median_ms


def decode_on_device(blob: torch.Tensor, bits: int, n: int, pair_table: torch.Tensor, outliers: int) -> torch.Tensor:
    """`decode_shard` in torch, on the blob's device: the same words, pairs and table."""
    if bits == FULL:
        return blob[: 4 * n].view(torch.float32)     # offset 0: aligned
    m = groups(n)
    starts = torch.arange(m, device=blob.device)[:, None] * bits + torch.arange(8, device=blob.device)
    bytes8 = blob[starts].to(torch.int64)                               # [m, 8]: the word at byte i * bits
    words = (bytes8 << (8 * torch.arange(8, device=blob.device))).sum(dim=1)
    shifts = 2 * bits * torch.arange(4, device=blob.device)
    pairs = (words[:, None] >> shifts) & ((1 << (2 * bits)) - 1)
    values = pair_table[pairs].reshape(-1)[:n]
    if outliers:
        start = m * bits + WORD_PAD
        where = blob[start: start + 4 * outliers].clone().view(torch.int32).to(torch.int64)   # clone: aligned
        values = values.clone()
        values[where] = blob[start + 4 * outliers: start + 8 * outliers].clone().view(torch.float32)
    return values


def timer(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    def cuda_ms(fn: Callable[[], Any], repeats: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    return cuda_ms if device.type == "cuda" else median_ms


def compute_against_width(model: ElasticModel, store: ShardStore, device: torch.device, repeats: int
                          ) -> list[dict[str, Any]]:
    geometry = store.geometry
    weights = [store.decode(0, s, FULL, store.read_stored(0, s, FULL)) for s in range(geometry.heads)]
    weights = [ShardWeights(*(t.to(device) for t in (w.query, w.key, w.value, w.output, w.ffn_in, w.ffn_out)))
               for w in weights]
    measure = timer(device)
    rows = []
    with torch.inference_mode():
        for rows_n in (1, 8):
            for length in (32, 128):
                ids, mask, _ = pad_batch([[1996] * length] * rows_n)
                ids, mask = ids.to(device), mask.to(device)
                hidden = model.embed(ids, mask)
                for width in sorted({max(1, geometry.heads * q // 4) for q in range(1, 5)}):
                    layer = LayerWeights.assemble(list(range(width)), weights[:width], model.residents[0], geometry)
                    ms = measure(lambda w=layer, h=hidden, m=mask: model.layer(h, m, 0, w), repeats)
                    rows.append({"texts": rows_n, "length": length, "width": width, "layer_ms": round(ms, 4)})
    return rows


def streamed_shards(store: ShardStore, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """Per version: one layer's shards from (pinned) host memory to decoded weights on the device."""
    geometry: ShardGeometry = store.geometry
    measure = timer(device)
    pin = device.type == "cuda"
    side = torch.cuda.Stream() if pin else None
    rows = []
    for bits in store.versions:
        blobs = []
        for s in range(geometry.heads):
            host = torch.frombuffer(bytearray(store.read_stored(0, s, bits)), dtype=torch.uint8)
            blobs.append(host.pin_memory() if pin else host)
        table = None if bits == FULL else torch.from_numpy(store.pair_tables[(0, bits)]).to(device)

        def layer(blobs: list[torch.Tensor] = blobs, bits: int = bits, table: torch.Tensor | None = table) -> None:
            if side is not None:
                with torch.cuda.stream(side):
                    for s, blob in enumerate(blobs):
                        decode_on_device(blob.to(device, non_blocking=True), bits, geometry.params, table,
                                         store.entry(0, s, bits).outliers)
                torch.cuda.current_stream().wait_stream(side)
            else:
                for s, blob in enumerate(blobs):
                    decode_on_device(blob, bits, geometry.params, table, store.entry(0, s, bits).outliers)

        ms = measure(layer, repeats)
        rows.append({"bits": bits, "layer_load_ms": round(ms, 4), "shard_bytes": store.shard_bytes(0, 0, bits)})
    return rows


def check_decoder(store: ShardStore, device: torch.device) -> float:
    """The device decoder against the numpy one on every version of one shard: the largest difference."""
    worst = 0.0
    for bits in store.versions:
        blob = store.read_stored(2, 5, bits)
        expected = store.decode(2, 5, bits, blob)
        table = None if bits == FULL else torch.from_numpy(store.pair_tables[(2, bits)]).to(device)
        got = decode_on_device(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device), bits,
                               store.geometry.params, table, store.entry(2, 5, bits).outliers)
        flat = torch.cat([t.reshape(-1) for t in (expected.query, expected.key, expected.value, expected.output,
                                                  expected.ffn_in, expected.ffn_out)])
        worst = max(worst, (got.cpu() - flat).abs().max().item())
    return worst


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="sti_device", description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--model", default="minilm")
    p.add_argument("--task", default="sentiment")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    keep_freed_pages()    # as a worker does
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = ShardStore(shards_dir(args.artifacts or artifacts_dir(), args.model))
    model = ElasticModel(store, args.task).to(device)
    model.residents = [store.layer_resident(k) for k in range(store.geometry.layers)]
    for resident in model.residents:
        for name, value in vars(resident).items():
            object.__setattr__(resident, name, value.to(device))
    widths = compute_against_width(model, store, device, args.repeats)
    streamed = streamed_shards(store, device, args.repeats)
    summary = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "decoder_max_abs_diff": check_decoder(store, device), "compute_against_width": widths,
               "streamed_layer": streamed}
    one = [r for r in widths if r["texts"] == 1 and r["length"] == 32]
    summary["width_12_over_3"] = round(one[-1]["layer_ms"] / one[0]["layer_ms"], 3)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"device-{device.type}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
