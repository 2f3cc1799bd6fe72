"""Spam's replay, the adaptive arm under other floors of the margin rule (`MIN_MARGIN`, set on the module): released
share, agreement, share of 256-text windows at >= 99 %, and the first result's p50 and p25 over vanilla's (model time),
for the 3 rounds of the drifting order.

    python margin_floor.py ARTIFACTS"""

from __future__ import annotations

import sys
from pathlib import Path

import academus.shared.models.exits as exits
from academus.loadgen.exits_bench import drifting_order, load_replay, run_arm
from academus.shared.models.exits import ControllerSettings


def adaptive_rounds(data, test, rounds: int = 3) -> list[dict]:
    """The adaptive arm against vanilla on each round's drifting order, as the module's settings stand now."""
    rows = []
    for seed in range(rounds):
        order = drifting_order("spam", test, seed)
        adaptive = run_arm("apparate", data, order, 8, ControllerSettings())
        vanilla = run_arm("vanilla", data, order, 8, ControllerSettings())
        rows.append({"released": adaptive["exit_rate"], "agreeing": adaptive["agreement"],
                     "windows_at_99": adaptive["windows_at_99"],
                     "first_p50_ratio": round(adaptive["first_p50"] / vanilla["first_p50"], 3),
                     "first_p25_ratio": round(adaptive["first_p25"] / vanilla["first_p25"], 3)})
    return rows


def main() -> None:
    data, test = load_replay(Path(sys.argv[1]), "spam", None)
    for floor in (0.05, 0.3, 0.6, 1.0):   # 0.05: the code's; 1.0: no margin rule
        exits.MIN_MARGIN = floor
        print(f"MIN_MARGIN {floor}: {adaptive_rounds(data, test)}", flush=True)


if __name__ == "__main__":
    main()
