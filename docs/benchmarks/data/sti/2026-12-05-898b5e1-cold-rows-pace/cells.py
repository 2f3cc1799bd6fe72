"""Per target, for each sweep of a loader A/B (`python cells.py SWEEPS_DIR`): STI's (4 MiB) p50 over T, p95 over T,
its paced arm's p95 over T and share cut short, and STI's IO time over the plan's."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path


def main() -> None:
    for run in sorted(glob.glob(f"{sys.argv[1]}/*-*/")):
        rows = json.loads(Path(glob.glob(run + "*.json")[0]).read_text())["results"][0]["rows"]
        by = {(r["target_x"], r["arm"]): r for r in rows}
        targets = sorted({r["target_x"] for r in rows})
        sti = [by[(t, "sti-4096k")] for t in targets]
        paced = [by[(t, "sti-4096k-paced")] for t in targets]
        print(os.path.basename(run.rstrip("/")),
              "sti p50/T", [round(r["p50_ms"] / r["target_ms"], 2) for r in sti],
              "p95/T", [r["p95_over_target"] for r in sti],
              "paced p95/T", [r["p95_over_target"] for r in paced],
              "paced cut", [r["cut_short"] for r in paced],
              "io/plan", [round(r["io_ms"] / r["planned_io_ms"], 2) for r in sti])


if __name__ == "__main__":
    main()
