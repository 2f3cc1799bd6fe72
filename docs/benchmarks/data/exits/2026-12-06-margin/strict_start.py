"""Spam's replay, the adaptive arm started from stricter thresholds: tuned on the ramps' evidence at a stricter
constraint than 99 %, in place of the thresholds tuned once (the manifest's static ones, the code's start). Released
share, agreement, share of 256-text windows at >= 99 %, the first result's p50 and p25 over vanilla's, 3 rounds.

    python strict_start.py ARTIFACTS"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import academus.loadgen.exits_bench as exits_bench
from academus.loadgen.exits_bench import load_replay
from academus.shared.models.exits import (
    APPARATE,
    ExitController,
    RampCandidate,
    ThresholdTuner,
    controller_for,
)

sys.path.insert(0, str(Path(__file__).parent))
from margin_floor import adaptive_rounds


def started_at(constraint: float | None):
    """exits_bench's controller_for, the adaptive arm's start tuned at `constraint` (None: the code's)."""
    def make(layers, extra, settings, evidence=None):
        if constraint is None or settings.policy != APPARATE:
            return controller_for(layers, extra, settings, evidence)
        candidates = [RampCandidate(k, float(extra["saving"][str(k)]), float(extra["cost"][str(k)])) for k in layers]
        start = ThresholdTuner(constraint, slack_errors=settings.slack_errors).tune(
            evidence.conf.astype(np.float64), evidence.agree.astype(bool), [c.saving for c in candidates])
        return ExitController(candidates, settings, initial=dict(zip(layers, start.thresholds, strict=True)),
                              evidence=evidence)
    return make


def main() -> None:
    data, test = load_replay(Path(sys.argv[1]), "spam", None)
    for constraint in (None, 0.995, 0.998, 1.0):
        exits_bench.controller_for = started_at(constraint)
        print(f"start tuned at {constraint or 'the code: thresholds tuned once'}: {adaptive_rounds(data, test)}",
              flush=True)


if __name__ == "__main__":
    main()
