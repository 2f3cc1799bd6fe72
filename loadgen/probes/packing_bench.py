"""Padded vs packed (ConcatBatching) execution of the teacher: ms per batch and tokens/s, as JSON.

    python -m academus.loadgen.probes.packing_bench [--threads 1] [--batch-sizes 16,64,128] [--row-length 128]

Every variant runs the same requests (lengths from normal(mean 20, var 20) and normal(mean 20, var 100),
rounded and clipped to 3..100, as TCB §6.2) and its time includes building the input tensors:

- `padded`: `model.pad_batch` to the longest + the HF model with its 2-D mask (the classic batcher);
- `packed_hf` / `packed_sdpa`: rows of L tokens filled first-fit decreasing, HF layers with the 4-D
  block mask / our own padding-free layers with SDPA (`shared/models/packing.py`);
- `slotted_hf` / `slotted_sdpa`: the same rows cut into slots of z (TCB Alg. 2's rule applied to the
  whole batch, `das.slot_size`, so every request fits a slot).

`grid_tokens` counts the token positions of the [batch, width] grid (real + padding); the `_sdpa` variants
run the token-wise parts (projections, FFN) on the real tokens only. `max_abs_diff` checks each
variant's embeddings against the padded ones (all should be ~1e-7).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from academus.services.scheduler.das import slot_size
from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.packing import PackingPlan, encode_packed, pack

DISTRIBUTIONS = {"normal(20,var20)": 20.0, "normal(20,var100)": 100.0}
MEAN_LENGTH, MIN_LENGTH, MAX_LENGTH = 20.0, 3, 100


def sample_lengths(count: int, variance: float, rng: random.Random) -> list[int]:
    return [min(MAX_LENGTH, max(MIN_LENGTH, round(rng.gauss(MEAN_LENGTH, variance ** 0.5)))) for _ in range(count)]


def make_sequences(lengths: Sequence[int], rng: random.Random) -> list[list[int]]:
    return [[101] + [rng.randrange(1000, 30000) for _ in range(n - 2)] + [102] for n in lengths]


def first_fit_decreasing(lengths: Sequence[int], row_length: int, slot: int) -> PackingPlan:
    """Longest first into the first slot with room; rows of row_length // slot slots."""
    per_row = row_length // slot
    slots: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, f in enumerate(free) if f >= lengths[i]), None)
        if k is None:
            slots.append([])
            free.append(slot)
            k = len(slots) - 1
        slots[k].append(i)
        free[k] -= lengths[i]
    rows = [slots[r:r + per_row] for r in range(0, len(slots), per_row)]
    return PackingPlan.slotted(rows, row_length, slot)


def median_ms(run: Callable[[], torch.Tensor], repeats: int) -> float:
    run()                                       # warm-up: allocator, kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def variants(model: TeacherEncoder, seqs: list[list[int]], row_length: int) -> dict[str, tuple[Callable, int]]:
    """name → (run, token positions of its [batch, width] grid)."""
    lengths = [len(s) for s in seqs]
    z = slot_size(lengths, row_length)
    plans = {"packed": first_fit_decreasing(lengths, row_length, row_length),
             "slotted": first_fit_decreasing(lengths, row_length, z)}

    def padded() -> torch.Tensor:
        ids, mask, types = pad_batch(seqs)
        return model(ids, mask, types)

    out: dict[str, tuple[Callable, int]] = {"padded": (padded, len(seqs) * max(lengths))}
    for kind, plan in plans.items():
        computed = pack(seqs, plan).computed_tokens
        for attention in ("hf", "sdpa"):
            out[f"{kind}_{attention}"] = (lambda p=plan, a=attention: encode_packed(model, pack(seqs, p), a),
                                          computed)
    return out


def bench_case(model: TeacherEncoder, seqs: list[list[int]], row_length: int, repeats: int) -> dict:
    real = sum(len(s) for s in seqs)
    lengths = [len(s) for s in seqs]
    result: dict = {"requests": len(seqs), "real_tokens": real, "longest": max(lengths),
                    "slot_size": slot_size(lengths, row_length), "variants": {}}
    reference = None
    for name, (run, computed) in variants(model, seqs, row_length).items():
        with torch.inference_mode():
            values = run()
            reference = values if reference is None else reference
            ms = median_ms(run, repeats)
        result["variants"][name] = {"ms": round(ms, 2), "tokens_per_s": round(real / ms * 1e3),
                                    "grid_tokens": computed,
                                    "max_abs_diff": float((values - reference).abs().max())}
    padded_ms = result["variants"]["padded"]["ms"]
    for stats in result["variants"].values():
        stats["speedup_vs_padded"] = round(padded_ms / stats["ms"], 2)
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch-sizes", default="16,64,128", help="requests a batch, comma-separated")
    parser.add_argument("--row-length", type=int, default=128, help="L, tokens a packed row")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = TeacherEncoder.load()
    rng = random.Random(args.seed)
    cases = []
    for name, variance in DISTRIBUTIONS.items():
        for size in (int(b) for b in args.batch_sizes.split(",")):
            seqs = make_sequences(sample_lengths(size, variance, rng), rng)
            cases.append({"lengths": name, **bench_case(model, seqs, args.row_length, args.repeats)})
    print(json.dumps({"model": "all-MiniLM-L6-v2 (teacher)", "threads": args.threads, "row_length": args.row_length,
                      "device": "cpu", "torch": torch.__version__, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
