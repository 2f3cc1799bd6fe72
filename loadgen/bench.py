"""What the benchmark scripts share: one `academus loadgen` run in a subprocess, and the summary file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def loadgen(run_dir: Path, out: Path, *args: str) -> dict:
    """One `academus loadgen` run in a subprocess (its own event loop and CPU accounting); its report."""
    command = [sys.executable, "-m", "academus.loadgen", *args, "--run-dir", str(run_dir), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_summary(out: Path, summary: dict) -> int:
    """summary.json under `out`, and the summary as the last line printed."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0
