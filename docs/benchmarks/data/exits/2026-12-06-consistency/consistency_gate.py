"""Spam's confidently wrong early answers, and whether a consistency gate would stop them: release at ramp k only
where ramp k-1 predicts the same class (PABEE's patience of one, on top of the threshold).

    python consistency_gate.py ARTIFACTS

ARTIFACTS: spam prepared in full and its ramps trained (`academus prepare --task spam`, `academus ramps train --task
spam`). One pass of the served model with every ramp over the test split (exits_bench.load_replay); then, for one
threshold at every ramp, each ramp's confident answers, those that disagree with the full model, and what is left of
both under the gate."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from academus.loadgen.exits_bench import load_replay

THRESHOLDS = (0.9, 0.95, 0.99, 0.995, 0.999)


def main() -> None:
    data, _ = load_replay(Path(sys.argv[1]), "spam", None)
    conf, preds, final = data.signals.conf, data.signals.preds, data.final
    agree = preds == final[:, None]
    print(f"{len(final)} test texts; ramps after layers {data.layers}; each ramp's agreement with the full model: "
          + ", ".join(f"L{k} {agree[:, j].mean():.4f}" for j, k in enumerate(data.layers)))
    for threshold in THRESHOLDS:
        confident = conf >= threshold
        wrong = confident & ~agree
        print(f"\nthreshold {threshold}: texts confidently wrong at some ramp: {int(wrong.any(1).sum())}; "
              f"of them wrong at every ramp: {int((wrong.any(1) & ~agree.any(1)).sum())}")
        for j, k in enumerate(data.layers):
            line = f"  L{k}: confident {int(confident[:, j].sum()):4d}, wrong {int(wrong[:, j].sum()):2d}"
            if j:
                gated = confident[:, j] & (preds[:, j] == preds[:, j - 1])
                line += f"; gated by L{data.layers[j - 1]}: confident {int(gated.sum()):4d}, " \
                        f"wrong {int((gated & ~agree[:, j]).sum()):2d}"
            print(line)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
