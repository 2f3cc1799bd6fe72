"""One line a sweep of a `loader_ab.py` run: STI's shapes and shards, the whole model's accuracy, stall shares,
p95 over T and the bench's figures. `python summarize.py OUT_DIR` (the summary.txt files here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def shapes(rows: list[dict]) -> str:
    return " ".join(f'{r["depth"]}x{r["width"]}' for r in rows)


def shards(rows: list[dict]) -> int:
    return sum(r["depth"] * r["width"] for r in rows)


def line(run: Path) -> str:
    summary = json.loads(next(run.glob("*.json")).read_text()) if not (run / "file.json").exists() else \
        json.loads((run / "file.json").read_text())
    fig, rows = summary["figures"], summary["results"][0]["rows"]
    arm = {name: [r for r in rows if r["arm"] == name] for name in ("sti-4096k", "sti-0", "stdpl-32", "preload-32")}
    sti = arm["sti-4096k"]
    parts = [run.name, f"| sti {shapes(sti)} shards {shards(sti)} acc {[r['accuracy'] for r in sti]}",
             f"| sti-0 {shapes(arm['sti-0'])}", f"| whole {[r['accuracy'] for r in arm['preload-32']]}",
             f"| stdpl32 shards {shards(arm['stdpl-32'])} stall32 {round(fig['stdpl32_stall_share_mean'], 2)}",
             f"| sti stall max {round(fig['sti_stall_share_max'], 2)}",
             f"p95/T max {round(fig['sti_p95_over_target_max'], 2)}",
             f"| vs whole {fig['sti_minus_whole_model_pp_at_T>=0.75']}",
             f"over stdpl32 {fig['sti_over_stdpl-32_pp']} stdpl6 {fig['sti_over_stdpl-6_pp']}",
             f"l&e {fig['sti_over_load&exec_pp']} stdpl2 {fig['sti_over_stdpl-2_pp']}",
             f"preload {fig['preload_over_none_pp']} imp {fig['importance_over_random_pp']}",
             f"bytes {fig['held_bytes_whole_over_sti']} {fig['held_bytes_6bit_over_sti']}",
             f"load32 {round(summary['profile']['load_ms']['32'], 3)}"]
    return " ".join(parts)


if __name__ == "__main__":
    for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
        print(line(run))
