"""The live runs' order replayed offline through the adaptive controller (`exits_bench.run_arm("apparate")`): the
warm-up's first 45 mails of the test split, then its first 254, batches of 1, 2 and 4.

    python replay_same_order.py ARTIFACTS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from academus.loadgen.exits_bench import load_replay, run_arm

WARM_UP, RUN = 45, 254


def main() -> None:
    data, texts = load_replay(Path(sys.argv[1]), "spam", None)
    labels = np.array([e.label for e in texts[:RUN]])
    print(json.dumps({"full_model_accuracy": round(float((data.final[:RUN] == labels).mean()), 4)}))
    for batch in (1, 2, 4):
        out = run_arm("apparate", data, list(range(WARM_UP)) + list(range(RUN)), batch)
        print(json.dumps({"batch": batch, **{k: out[k] for k in ("agreement", "windows_at_99", "exit_rate", "exits")}}))


if __name__ == "__main__":
    main()
