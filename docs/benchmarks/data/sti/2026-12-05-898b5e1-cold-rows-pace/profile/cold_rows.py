"""Rows read cold: alone, and inside a run. `python cold_rows.py BITS WIDTH` from the repository root."""

from __future__ import annotations

import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import pipeline_for


def main() -> None:
    bits, width = int(sys.argv[1]), int(sys.argv[2])
    store, model, plan, pipeline = pipeline_for(bits, width, "cold")
    read, rows_ms = model.rows.read, []

    def timed(ids: torch.Tensor, source: object) -> torch.Tensor:
        started = time.perf_counter()
        rows = read(ids, source)
        rows_ms.append((time.perf_counter() - started) * 1e3)
        return rows

    model.rows.read = timed
    mask = torch.ones(1, 32, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    alone, in_run, totals = [], [], []
    for i in range(30):                           # new ids each run: most rows not in the rows' cache
        ids = torch.randint(1000, 29000, (1, 32), generator=generator)
        if i % 2 == 0:
            pipeline.source.before_run(store.paths())
            timed(ids, pipeline.source)
            alone.append(rows_ms.pop())
        else:
            totals.append(pipeline.run(plan, ids, mask).total_ms)
            in_run.append(rows_ms.pop())
    pipeline.close()
    print(bits, width, "rows alone", round(statistics.median(alone), 2), "rows in run",
          round(statistics.median(in_run), 2), "run total", round(statistics.median(totals), 2), "max",
          round(max(totals), 1))


if __name__ == "__main__":
    main()
