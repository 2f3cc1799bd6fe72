"""Early exits, replayed offline (Apparate): every arm on the same drifting arrival order of a task's test split.

`python -m academus.loadgen.exits_bench --task spam --task sentiment [--rounds 3] [--batch 8]`
`python -m academus.loadgen.exits_bench --model NAME --texts F.jsonl [--artifacts A]`: a classifier with ramps (a
user's, `academus ramps train --model NAME`, or a bundled task's) on held-out texts from a file

The served model runs once over the test split with every ramp of `academus ramps train` (their confidences,
predictions and the full model's answer per text); then each arm replays the arrival order batch by batch,
deciding exits ramp by ramp as the worker does, and the adaptive arm tunes on its own feedback as it goes:

- vanilla: no exits; apparate: thresholds tuned online, ramps adjusted (the worker's ExitController, its
  default settings, its window started with the ramps' evidence from validation, as a worker's is; not when the
  validation split is replayed, or with --without-evidence); static: per-ramp thresholds tuned once on
  validation; deebert: one entropy threshold tuned once; pabee2 / pabee3: patience; oracle: the first ramp that
  agrees with the final answer (replay only).
- Orders drift: spam is ham in file order (easy ham, then hard ham at the tail), then spam; sentiment and a
  file's texts are a shuffled third, then the rest long texts first, then short. Each round shuffles within
  those phases.
- Time is in units of the model's forward on one text: a release at layer k comes after (1 - saving_k) of it
  plus the cost of every active ramp on the way (the ramps' manifest: measured by `ramps train`); the final
  answer after 1 + every active ramp's cost. So the ratios are of model time, not of a mesh's latency.

Prints one JSON line a task and round, then the summary as the last line (with --out, also written there).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from academus.shared.models.exits import (
    NONE,
    ControllerSettings,
    Evidence,
    ExitController,
    ExitSignals,
    ThresholdTuner,
    controller_for,
    released_agreement,
    replay,
)
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.state.artifacts import ArtifactError
from academus.shared.state.uploads import parse_texts_jsonl
from academus.shared.training.data import Example, fetch, load_task
from academus.shared.training.ramps import Subject, ramp_signals, ramps_pass

ARMS = ("vanilla", "apparate", "static", "deebert", "pabee2", "pabee3", "oracle")
WINDOW, WINDOW_STEP = 256, 32


def drifting_order(task: str, test: Sequence[Example], seed: int) -> list[int]:
    """The arrival order of the test split's texts (indices), shuffled within its phases by `seed`."""
    rng = random.Random(seed)
    if task == "spam":
        ham = [i for i, e in enumerate(test) if e.label == 0]
        spam = [i for i, e in enumerate(test) if e.label == 1]
        cut = int(len(ham) * 0.9)   # hard ham sits at the tail of the file order
        phases = [ham[:cut], ham[cut:], spam]
    else:
        indices = list(range(len(test)))
        rng.shuffle(indices)
        first, rest = indices[: len(indices) // 3], indices[len(indices) // 3:]
        rest.sort(key=lambda i: -len(test[i].text))
        phases = [first, rest[: len(rest) // 2], rest[len(rest) // 2:]]
    for phase in phases:
        rng.shuffle(phase)
    return [i for phase in phases for i in phase]


class Replay:
    """One task's signals at every ramp, in arrival order, and the ramps' measured savings and costs."""

    def __init__(self, signals: ExitSignals, final: np.ndarray, layers: Sequence[int], extra: dict,
                 evidence: Evidence | None = None) -> None:
        """`extra`: the ramps' manifest's (savings, costs, the thresholds tuned once); `evidence`: the adaptive
        controller's first window."""
        self.signals, self.final, self.layers, self.extra = signals, final, tuple(layers), extra
        self.evidence = evidence
        self.saving = {int(k): float(v) for k, v in extra["saving"].items()}
        self.cost = {int(k): float(v) for k, v in extra["cost"].items()}
        self.tuned_once = extra["tuned_once"]

    def columns(self, layers: Sequence[int], rows: np.ndarray) -> ExitSignals:
        idx = [self.layers.index(k) for k in layers]
        s = self.signals
        return ExitSignals(s.conf[rows][:, idx], s.preds[rows][:, idx], s.entropy[rows][:, idx])

    def times(self, layers: Sequence[int], exit_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per text: time to its first result, and to the final one, in model forwards."""
        costs = np.array([self.cost[k] for k in layers])
        before = np.concatenate([np.cumsum(costs), [costs.sum()]]) if len(layers) else np.zeros(1)
        first_at = np.array([1.0 - self.saving[k] for k in layers] + [1.0])
        return first_at[exit_at] + before[exit_at], np.full(len(exit_at), 1.0 + costs.sum())


def run_arm(arm: str, data: Replay, order: list[int], batch: int,
            settings: ControllerSettings | None = None) -> dict[str, Any]:
    """Replays `order` through one arm (the adaptive one under `settings`); what its clients saw."""
    n = len(order)
    agreed = np.ones(n, dtype=bool)
    first, final_t = np.ones(n), np.ones(n)
    exits_at_layer = np.zeros(n, dtype=int)
    tunings: list[float] = []
    # every arm but the oracle is the worker's own controller, under the arm's exit policy
    policy = NONE if arm in ("vanilla", "oracle") else arm
    controller = controller_for(data.layers, data.extra, replace(settings or ControllerSettings(), policy=policy),
                                data.evidence)
    for start in range(0, n, batch):
        rows = np.array(order[start:start + batch])
        span = slice(start, start + len(rows))
        if arm == "vanilla":
            continue
        if arm == "oracle":   # pays no ramp: its first result at the exit layer itself
            agree = data.signals.preds[rows] == data.final[rows][:, None]
            exit_at = np.where(agree.any(1), agree.argmax(1), len(data.layers))
            saving = np.array([data.saving[k] for k in data.layers] + [0.0])
            first[span] = 1.0 - saving[exit_at]
            exits_at_layer[span] = [data.layers[j] if j < len(data.layers) else 0 for j in exit_at]
            continue
        layers, rule = controller.active.layers, controller.active.rule
        signals = data.columns(layers, rows)
        exit_at = replay(rule, signals)
        agreed[span] = released_agreement(exit_at, signals.preds == data.final[rows][:, None])
        first[span], final_t[span] = data.times(layers, exit_at)
        exits_at_layer[span] = [layers[j] if j < len(layers) else 0 for j in exit_at]
        controller.observe(layers, signals, data.final[rows], exit_at)   # a baseline's ignores it
        if reason := controller.due():
            clock = time.perf_counter()
            controller.tune(reason)
            tunings.append((time.perf_counter() - clock) * 1e3)
    return summarise(arm, agreed, first, final_t, exits_at_layer, tunings,
                     controller if controller.adaptive else None)


def summarise(arm: str, agreed: np.ndarray, first: np.ndarray, final_t: np.ndarray, exits: np.ndarray,
              tunings: list[float], controller: ExitController | None) -> dict[str, Any]:
    windows = [agreed[i:i + WINDOW].mean() for i in range(0, max(1, len(agreed) - WINDOW + 1), WINDOW_STEP)]
    out = {"arm": arm, "agreement": round(float(agreed.mean()), 5),
           "windows_at_99": round(float(np.mean([w >= 0.99 for w in windows])), 4),
           "first_p25": round(float(np.percentile(first, 25)), 4),
           "first_p50": round(float(np.median(first)), 4), "final_p99": round(float(np.percentile(final_t, 99)), 4),
           "exit_rate": round(float((exits > 0).mean()), 4),
           "exits": {str(k): int((exits == k).sum()) for k in sorted(set(exits.tolist())) if k}}
    if tunings:
        out["tunings"] = len(tunings)
        out["tuning_ms_median"] = round(statistics.median(tunings), 3)
    if controller is not None:
        out["active_at_end"] = list(controller.active.layers)
        out["changes"] = [e.as_dict() for e in controller.events if e.kind != "tuned"][-6:]
    return out


def load_replay(artifacts: Path, task: str, data_dir: Path | None, split: str = "test",
                texts_file: Path | None = None) -> tuple[Replay, list[Example]]:
    """The served model's pass with every ramp over a bundled task's split (the test split's, for the figures), or,
    given `texts_file`, over its texts for the classifier `task` (a user's, or a bundled task's)."""
    if texts_file is None:
        subject, texts = Subject.bundled(artifacts, task), load_task(task, fetch(data_dir)).splits()[split]
    else:
        subject = Subject.named(artifacts, task)
        texts = [Example(t, -1) for t in parse_texts_jsonl(texts_file.read_bytes(), str(texts_file))]
    ramps, manifest, states, final = ramps_pass(artifacts, subject, [e.text for e in texts])
    evidence = ramps.evidence if split != "validation" else None   # validation: the evidence's own texts
    return Replay(ramp_signals(ramps, states), final, ramps.layers, manifest.extra, evidence), texts


def tuning_time(repeats: int = 50, seed: int = 0) -> dict[str, float]:
    """One tuning of 2 ramps x 256 texts, ms (median and p95 of `repeats`), on random confidences."""
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.5, 1.0, (256, 2))
    agree = rng.uniform(size=(256, 2)) < conf
    tuner, times = ThresholdTuner(0.99), []
    for _ in range(repeats):
        start = time.perf_counter()
        tuner.tune(conf, agree, [0.6, 0.3])
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": round(statistics.median(times), 3), "p95_ms": round(float(np.percentile(times, 95)), 3)}


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.exits_bench", description=__doc__.split("\n")[0])
    p.add_argument("--task", action="append", choices=("spam", "sentiment"))
    p.add_argument("--model", default="", help="a classifier with ramps (a user's, or a task's), replayed on --texts")
    p.add_argument("--texts", type=Path, default=None, help='with --model: held-out texts, JSON lines {"text": ...}')
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="texts a batch (one feedback step)")
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--split", default="test", choices=("validation", "test"),
                   help="the split replayed (validation: to choose the controller's settings)")
    p.add_argument("--window", type=int, default=ControllerSettings.window, help="the adaptive arm's window")
    p.add_argument("--slack-errors", type=float, default=ControllerSettings.slack_errors,
                   help="the adaptive arm's tuner slack")
    p.add_argument("--without-evidence", action="store_true",
                   help="the adaptive arm's window starts empty, not with the ramps' evidence")
    args = p.parse_args(argv)
    settings = ControllerSettings(window=args.window, slack_errors=args.slack_errors)
    summary: dict[str, Any] = {"batch": args.batch, "rounds": args.rounds, "split": args.split,
                               "window": args.window, "slack_errors": args.slack_errors,
                               "evidence": not args.without_evidence and args.split != "validation", "tasks": {},
                               "tuning_2x256": tuning_time()}
    if bool(args.model) != (args.texts is not None):
        p.error("--model and --texts go together")
    for task in [args.model] if args.model else args.task or ["spam", "sentiment"]:
        try:
            data, test = load_replay(args.artifacts or artifacts_dir(), task, args.data, args.split, args.texts)
        except (ValueError, ArtifactError, OSError) as e:
            p.error(str(e))
        if args.without_evidence:
            data.evidence = None
        rounds = []
        for r in range(args.rounds):
            order = drifting_order("" if args.model else task, test, seed=r)   # a file's texts drift by length
            arms = [run_arm(arm, data, order, args.batch, settings) for arm in ARMS]
            rounds.append(arms)
            print(json.dumps({"task": task, "round": r, "arms": arms}), flush=True)
        summary["tasks"][task] = ratios(rounds) | {"texts": len(test)}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


def ratios(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm, over rounds: the median of agreement and of its first/final times over vanilla's."""
    out = {}
    for i, arm in enumerate(ARMS):
        runs = [r[i] for r in rounds]
        vanilla = [r[0] for r in rounds]
        out[arm] = {
            "agreement": statistics.median(x["agreement"] for x in runs),
            "agreement_min": min(x["agreement"] for x in runs),
            "windows_at_99": statistics.median(x["windows_at_99"] for x in runs),
            "first_p50_ratio": round(statistics.median(x["first_p50"] / v["first_p50"]
                                                       for x, v in zip(runs, vanilla, strict=True)), 4),
            "first_p25_ratio": round(statistics.median(x["first_p25"] / v["first_p25"]
                                                       for x, v in zip(runs, vanilla, strict=True)), 4),
            "final_p99_ratio": round(statistics.median(x["final_p99"] / v["final_p99"]
                                                       for x, v in zip(runs, vanilla, strict=True)), 4),
            "exit_rate": statistics.median(x["exit_rate"] for x in runs),
        }
    return out


if __name__ == "__main__":
    raise SystemExit(main())
