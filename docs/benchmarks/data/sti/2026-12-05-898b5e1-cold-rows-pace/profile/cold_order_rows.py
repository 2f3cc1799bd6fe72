"""The rows read after the loads start (fceb7ee), before them, or asked for first and read after: one run an arm in
turn, cold, new ids each run. `python cold_order_rows.py BITS WIDTH RUNS` from the repository root."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import pipeline_for

ARMS = ["as-is", "rows-first", "asked-first"]


def main() -> None:
    bits, width, runs = (int(x) for x in sys.argv[1:4])
    store, model, plan, pipeline = pipeline_for(bits, width, "cold")
    rows, source = model.rows, pipeline.source

    def ask(ids: torch.Tensor) -> None:
        wanted = sorted(set(ids.reshape(-1).tolist()) - set(rows._slots))
        for block in sorted({r // rows.block_rows for r in wanted}):
            offset, length = rows.block_span(block)
            os.posix_fadvise(source.descriptor(rows.path), offset, length, os.POSIX_FADV_WILLNEED)

    def run(arm: str, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
        source.before_run(store.paths())
        started = time.perf_counter()
        if arm == "rows-first":
            read = rows.read(ids, source)
            loads = pipeline._start(plan)
        else:
            if arm == "asked-first":
                ask(ids)
            loads = pipeline._start(plan)
            read = rows.read(ids, source)
        rows_ms = (time.perf_counter() - started) * 1e3
        hidden = model.embed_rows(read)
        bias = model.position_bias(hidden)
        for k in range(plan.depth):
            hidden = model.layer(hidden, mask, k, loads.wait(k), bias)
            loads.done(k)
        model.finish(hidden, mask, plan.depth, plan.width)
        loads.finish()
        return rows_ms, (time.perf_counter() - started) * 1e3

    mask = torch.ones(1, 32, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    out: dict[str, list[tuple[float, float]]] = {a: [] for a in ARMS}
    with torch.inference_mode():
        for i in range(runs):
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                out[arm].append(run(arm, torch.randint(1000, 29000, (1, 32), generator=generator), mask))
    pipeline.close()
    for arm in ARMS:
        kept = out[arm][2:]
        totals = sorted(x[1] for x in kept)
        print(bits, width, arm, "rows+start ms", round(statistics.median(x[0] for x in kept), 2), "total p50",
              round(statistics.median(totals), 2), "p95", round(totals[int(0.95 * len(totals))], 2))


if __name__ == "__main__":
    main()
