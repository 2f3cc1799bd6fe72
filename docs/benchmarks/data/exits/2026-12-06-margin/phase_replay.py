"""Spam's replay, phase by phase: each arm's released share and agreement in the drifting order's three phases
(easy ham, hard ham, spam), and the adaptive controller's active ramps, thresholds and margin every 64 texts.

    python phase_replay.py ARTIFACTS ROUNDS

ARTIFACTS: spam prepared in full and its ramps trained (`academus prepare --task spam`, `academus ramps train --task
spam`). The arms run as exits_bench.run_arm runs them (batches of 8, the worker's controller, its window started
with the ramps' evidence); round r's order is drifting_order's with seed r."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from academus.loadgen.exits_bench import drifting_order, load_replay
from academus.shared.models.exits import ControllerSettings, controller_for, released_agreement, replay

BATCH, EVERY = 8, 64


def phases(test) -> dict[int, str]:
    ham = [i for i, e in enumerate(test) if e.label == 0]
    cut = int(len(ham) * 0.9)   # as drifting_order cuts it
    return {**dict.fromkeys(ham[:cut], "easy ham"), **dict.fromkeys(ham[cut:], "hard ham"),
            **{i: "spam" for i, e in enumerate(test) if e.label == 1}}


def one_arm(data, order: list[int], arm: str) -> tuple[np.ndarray, np.ndarray, list, object]:
    controller = controller_for(data.layers, data.extra, replace(ControllerSettings(), policy=arm), data.evidence)
    n, trace = len(order), []
    released, agreed = np.zeros(n, bool), np.ones(n, bool)
    for start in range(0, n, BATCH):
        rows, span = np.array(order[start:start + BATCH]), slice(start, min(start + BATCH, n))
        layers = controller.active.layers
        signals = data.columns(layers, rows)
        exit_at = replay(controller.active.rule, signals)
        released[span] = exit_at < len(layers)
        agreed[span] = released_agreement(exit_at, signals.preds == data.final[rows][:, None])
        controller.observe(layers, signals, data.final[rows], exit_at)
        if reason := controller.due():
            controller.tune(reason)
        if start % EVERY == 0:
            thresholds = [round(t, 3) for t in getattr(controller.active.rule, "thresholds", ())]
            trace.append((start, list(controller.active.layers), thresholds, round(controller.margin, 2)))
    return released, agreed, trace, controller


def main() -> None:
    data, test = load_replay(Path(sys.argv[1]), "spam", None)
    phase_of = phases(test)
    for seed in range(int(sys.argv[2])):
        order = drifting_order("spam", test, seed)
        in_phase = np.array([phase_of[i] for i in order])
        for arm in ("apparate", "deebert", "static"):
            released, agreed, trace, controller = one_arm(data, order, arm)
            by_phase = {p: (int((in_phase == p).sum()), round(float(released[in_phase == p].mean()), 3),
                            round(float(agreed[in_phase == p].mean()), 4)) for p in ("easy ham", "hard ham", "spam")}
            print(f"round {seed} {arm}: released {released.mean():.3f}, agreeing {agreed.mean():.4f}; "
                  f"by phase (texts, released, agreeing): {by_phase}")
            if arm == "apparate":
                for start, layers, thresholds, margin in trace:
                    print(f"    text {start} ({in_phase[start]}): ramps {layers} thresholds {thresholds} "
                          f"margin {margin}")
                for event in controller.events:
                    if event.kind != "tuned":
                        print("    ", event.as_dict())


if __name__ == "__main__":
    main()
