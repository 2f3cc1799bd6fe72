"""One line a sweep of this `loader_ab.py` run: the profile's loads, STI's shapes and versions, its accuracy against
the whole model (4 and 1 MiB buffers) and the baselines, stall shares, p95 over T plain and paced.
`python summarize.py OUT_DIR` (summary.txt here)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def line(run: Path) -> str:
    summary = json.loads(next(p for p in run.glob("*.json") if p.name != "accuracy_cache.json").read_text())
    result, fig, profile = summary["results"][0], summary["figures"], summary["profile"]
    by = {(r["target_x"], r["arm"]): r for r in result["rows"]}
    targets = sorted({x for x, _ in by})
    sti = [by[(x, "sti-4096k")] for x in targets]

    def vs_whole(arm: str) -> float:
        return round(100 * statistics.mean(by[(x, arm)]["accuracy"] - by[(x, "preload-32")]["accuracy"]
                                           for x in targets if x >= 0.75), 2)

    loads = {b: round(profile["load_ms"][b], 3) for b in ("6", "32")}
    return " ".join([
        f"{run.name} | loads ms {loads} | whole model's compute {result['full_model_ms']} ms",
        f"| sti {' '.join(str(r['depth']) + 'x' + str(r['width']) + '@' + str(r['mean_bits']) for r in sti)}",
        f"shards {sum(r['depth'] * r['width'] for r in sti)} acc {[r['accuracy'] for r in sti]}",
        f"| vs whole: 4 MiB {vs_whole('sti-4096k')} 1 MiB {vs_whole('sti-1024k')} none {vs_whole('sti-0')} pp",
        f"| over l&e {fig['sti_over_load&exec_pp']} stdpl32 {fig['sti_over_stdpl-32_pp']}",
        f"stdpl2 {fig['sti_over_stdpl-2_pp']} stdpl6 {fig['sti_over_stdpl-6_pp']}",
        f"preload {fig['preload_over_none_pp']} importance {fig['importance_over_random_pp']}",
        f"| stall {[round(r['stall_share'], 2) for r in sti]} stdpl32 mean {round(fig['stdpl32_stall_share_mean'], 2)}",
        f"| p95/T {[r['p95_over_target'] for r in sti]} paced max {fig.get('paced_p95_over_target_max')}"])


if __name__ == "__main__":
    for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
        print(line(run))
