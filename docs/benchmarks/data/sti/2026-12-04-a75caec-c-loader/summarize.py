"""One line a sweep of a `loader_ab.py` run of the C loader and the kept heap: the profile's loads, STI's shapes
and versions, its accuracy against the whole model and the baselines, stall shares and p95 over T.
`python summarize.py OUT_DIR` (the summary.txt files here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def line(run: Path) -> str:
    summary = json.loads(next(p for p in run.glob("*.json") if p.name != "accuracy_cache.json").read_text())
    result, fig, profile = summary["results"][0], summary["figures"], summary["profile"]
    rows = result["rows"]
    sti = [r for r in rows if r["arm"] == "sti-4096k"]
    loads = {b: round(profile["load_ms"][b], 3) for b in ("6", "32")}
    return " ".join([
        f"{run.name} | loads ms {loads} | whole model's compute {result['full_model_ms']} ms",
        f"| sti {' '.join(str(r['depth']) + 'x' + str(r['width']) + '@' + str(r['mean_bits']) for r in sti)}",
        f"shards {sum(r['depth'] * r['width'] for r in sti)} acc {[r['accuracy'] for r in sti]}",
        f"| vs whole {fig['sti_minus_whole_model_pp_at_T>=0.75']} pp",
        f"over l&e {fig['sti_over_load&exec_pp']} stdpl32 {fig['sti_over_stdpl-32_pp']}",
        f"stdpl2 {fig['sti_over_stdpl-2_pp']} stdpl6 {fig['sti_over_stdpl-6_pp']}",
        f"preload {fig['preload_over_none_pp']} importance {fig['importance_over_random_pp']}",
        f"| stall max {round(fig['sti_stall_share_max'], 2)} stdpl32 mean {round(fig['stdpl32_stall_share_mean'], 2)}",
        f"| p95/T max {round(fig['sti_p95_over_target_max'], 2)}"])


if __name__ == "__main__":
    for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
        print(line(run))
