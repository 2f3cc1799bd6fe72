"""One line a sweep of a `loader_ab.py` run of the compute profile's change: the whole model's profiled compute,
how long the whole model held in memory ran against it, STI's shapes, accuracy against the whole model, stall
and p95 over T. `python summarize.py OUT_DIR` (the summary.txt files here)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def line(run: Path) -> str:
    summary = json.loads(next(run.glob("*.json")).read_text()) if not (run / "file.json").exists() else \
        json.loads((run / "file.json").read_text())
    result = summary["results"][0]
    fig, rows = summary["figures"], result["rows"]
    arm = {name: [r for r in rows if r["arm"] == name] for name in ("sti-4096k", "preload-32")}
    whole = [r for r in arm["preload-32"] if r["depth"] * r["width"] == 72]   # the whole model's cells
    sti = arm["sti-4096k"]
    run_over_compute = round(statistics.median(r["p50_ms"] for r in whole) / result["full_model_ms"], 2)
    p50_over_t = [round(r["p50_ms"] / r["target_ms"], 2) for r in sti]
    return " ".join([
        f"{run.name} | whole model's compute {result['full_model_ms']} ms",
        f"| whole model run: p50 / its compute {run_over_compute}",
        f"| sti {' '.join(str(r['depth']) + 'x' + str(r['width']) for r in sti)} acc {[r['accuracy'] for r in sti]}",
        f"| vs whole {fig['sti_minus_whole_model_pp_at_T>=0.75']} pp",
        f"| sti p50/T {p50_over_t} p95/T max {round(fig['sti_p95_over_target_max'], 2)}",
        f"| stall max {round(fig['sti_stall_share_max'], 2)}"])


if __name__ == "__main__":
    for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
        print(line(run))
