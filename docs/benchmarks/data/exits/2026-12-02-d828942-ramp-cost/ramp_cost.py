"""What exit ramps cost inside the worker's forward, as the adaptive controller measures it: the ramps' own time
on a batch (`ExitRun.spent`) over the batch's compute time, and the batch's time against the same batch run
without ramps. Arms, alternating within each round on one `ModelRunner` (the worker's core, padded batches, all
five ramps active under the `static` policy): `vanilla` (no release asked: no ramp runs), `d828942` (the ramps
as served from d828942) and `before` (the same, with the ramp step as it was at 4eaf6f4: the head in torch,
then `ramp_signal` on its probabilities).

python ramp_cost.py --artifacts A [--batches 1 4 16] [--repeats 40] [--rounds 3] > ramp_cost.json
(A holds the sentiment head and `academus ramps train --task sentiment` ramps.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import academus.services.worker.core as worker_core
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.services.worker.exits import ExitRun
from academus.shared.models.exits import STATIC, ControllerSettings, ramp_signal
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch
from academus.shared.training.data import fetch, load_task

SPENT: list[tuple[float, float]] = []   # (the ramps' seconds, the batch's compute seconds) of the latest runs


class Served(ExitRun):
    def finish(self, final_probs: np.ndarray, batch_s: float) -> None:
        SPENT.append((float(self.spent.sum()), batch_s))
        super().finish(final_probs, batch_s)


class Before(Served):
    """The ramp step at 4eaf6f4."""

    def at_layer(self, layer, pooled, rows=None) -> None:
        j = self.index.get(layer)
        if j is None:
            return
        start = time.perf_counter()
        rows = np.arange(len(self.exit_at)) if rows is None else rows
        probs = self.exits.ramps.probs(layer, self.exits.ramps.finish(pooled())).float().cpu().numpy()
        self.conf[rows, j], self.preds[rows, j], self.entropy[rows, j] = ramp_signal(probs)
        waiting = self.exit_at[rows] == len(self.active.layers)
        exits = waiting & self.active.rule.exits_at(j, self.conf[rows], self.preds[rows], self.entropy[rows])
        self.spent[j] += time.perf_counter() - start
        if exits.any():
            released = rows[exits]
            self.exit_at[released] = j
            self.release(released.tolist(), layer, probs[exits])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifacts", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runner = ModelRunner(args.artifacts, ["sentiment"], exit_settings=ControllerSettings(policy=STATIC))
    test = load_task("sentiment", fetch(None)).test
    encoded = TeacherTokenizer(teacher_dir()).encode([e.text for e in test][:256], truncate=True)
    arms = {"vanilla": None, "d828942": Served, "before": Before}
    out: dict = {"torch_threads": torch.get_num_threads(), "rounds": []}
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        result: dict = {"order": order}
        for size in args.batches:
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            spent: dict[str, list[float]] = {arm: [] for arm in arms}
            for i in range(args.repeats):
                texts = encoded[(i * size) % 200:(i * size) % 200 + size]
                batch = Batch("sentiment", OUTPUT_PROBS, [t for e in texts for t in e.input_ids],
                              [len(e.input_ids) for e in texts])
                for arm in order:
                    worker_core.ExitRun = arms[arm] or Served
                    SPENT.clear()
                    start = time.perf_counter()
                    runner.run(batch, release=None if arms[arm] is None else lambda *a: None)
                    times[arm].append(time.perf_counter() - start)
                    if SPENT:
                        spent[arm].append(SPENT[0][0] / SPENT[0][1])
            result[str(size)] = {arm: {"batch_ms_median": round(statistics.median(t) * 1e3, 3),
                                       "ramps_share_median": round(statistics.median(spent[arm]), 5)
                                       if spent[arm] else None}
                                 for arm, t in times.items()}
            for arm in ("d828942", "before"):
                result[str(size)][arm]["batch_over_vanilla"] = round(
                    statistics.median(a / b for a, b in zip(times[arm], times["vanilla"], strict=True)), 4)
        out["rounds"].append(result)
        print(json.dumps(result), file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
