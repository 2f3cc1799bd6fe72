"""Where a run's time goes besides its layers and its waits: `python run_parts.py BITS DEPTH WIDTH RUNS IO` from the
repository root. One plan shape at one version, the same ids each run (their rows cached); medians, ms, of the
run's total, compute and stall, and of each part timed on the compute thread."""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "2026-12-05-898b5e1-cold-rows-pace" / "profile"))
from common import pipeline_for

from academus.shared.models import sti_pipeline

PARTS: dict[str, list[float]] = defaultdict(list)


def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = f(*args, **kwargs)
        PARTS[name].append((time.perf_counter() - started) * 1e3)
        return result

    return wrapper


def main() -> None:
    bits, depth, width, runs = (int(x) for x in sys.argv[1:5])
    _, model, plan, pipeline = pipeline_for(bits, width, sys.argv[5], depth)
    model.rows.prefetch = timed("rows asked for", model.rows.prefetch)
    model.rows.read = timed("rows read (in the stall)", model.rows.read)
    model.embed_rows = timed("embedding", model.embed_rows)
    model.finish = timed("pooling and head", model.finish)
    pipeline._start = timed("loads started (publishing)", pipeline._start)
    pipeline.source.before_run = timed("before the run (not in its total)", pipeline.source.before_run)
    for cls in (sti_pipeline.NativeLoads, sti_pipeline.ThreadLoads):
        cls.finish = timed("loads finished", cls.finish)
    ids = torch.randint(1000, 29000, (1, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 32, dtype=torch.long)
    results = [pipeline.run(plan, ids, mask) for _ in range(runs)][3:]
    print(*sys.argv[1:], "total", round(statistics.median(r.total_ms for r in results), 3), "compute",
          round(statistics.median(r.compute_ms for r in results), 3), "stall",
          round(statistics.median(r.stall_ms for r in results), 3))
    for name, times in PARTS.items():
        print("  ", name, round(statistics.median(times[3:]), 3))
    pipeline.close()


if __name__ == "__main__":
    main()
