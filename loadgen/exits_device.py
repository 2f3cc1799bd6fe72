"""Early exits on one device, in process: padded batches of a task's test texts, vanilla against exit ramps.

`python -m academus.loadgen.exits_device --device cuda --task spam [--batch 32] [--rounds 3]` (CPU when CUDA
is not there): the GPU check the issue asks for, prepared to run in a few minutes on a lent device.

The worker's ModelRunner serves the task with its ramps. Their controller first learns thresholds from
`--warm` texts of feedback. Then, per round, the arms alternate over the same batches:

- vanilla: the plain forward, each text's result at the batch's end;
- early: the forward with ramps, each text's first result when its ramp released it.

Figures: per text, the first result's time from the batch's start; per batch, the compute time (the ramps'
cost); the share of texts released early. Ratios are early over vanilla, medians over rounds. The summary (with the
controller's status: active ramps, their measured costs, its last events) is the last line printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from academus.loadgen.exits_bench import drifting_order
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models.exits import ControllerSettings
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.training.data import fetch, load_task


def run_batches(runner: ModelRunner, task: str, batches: list[list[list[int]]], early: bool
                ) -> tuple[list, list, int]:
    """Per text, seconds to its first result; per batch, seconds of compute; texts released early."""
    firsts, totals, early_texts = [], [], 0
    for seqs in batches:
        released: dict[int, float] = {}
        start = time.perf_counter()

        def release(rows: list[int], layer: int, probs: np.ndarray, start: float = start,
                    released: dict[int, float] = released) -> None:
            now = time.perf_counter()   # after the ramp's probabilities reached the host: a real release time
            released.update({r: now - start for r in rows})

        runner.run(Batch(task, OUTPUT_PROBS, [i for s in seqs for i in s], [len(s) for s in seqs]),
                   release=release if early else None)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        total = time.perf_counter() - start
        totals.append(total)
        firsts.extend(released.get(row, total) for row in range(len(seqs)))
        early_texts += len(released)
    return firsts, totals, early_texts


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.exits_device", description=__doc__.split("\n")[0])
    p.add_argument("--task", default="spam", choices=("spam", "sentiment"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=20, help="batches an arm runs a round")
    p.add_argument("--warm", type=int, default=1024, help="texts of feedback before the measured rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--artifacts", type=Path, default=None)
    args = p.parse_args(argv)
    runner = ModelRunner(args.artifacts or artifacts_dir(), [args.task], args.device,
                         exit_settings=ControllerSettings())
    exits = runner.models[args.task].exits
    if exits is None:
        raise SystemExit(f"no ramps for {args.task}: run `academus ramps train --task {args.task}` first")
    test = load_task(args.task, fetch(None)).test
    encoded = TeacherTokenizer(teacher_dir()).encode([e.text for e in test], truncate=True)
    order = [encoded[i].input_ids for i in drifting_order(args.task, test, seed=0)]
    cut = [order[i:i + args.batch] for i in range(0, len(order), args.batch)]
    seen, warming = 0, []
    while seen < args.warm:   # the controller's feedback, tuned as it comes
        seqs = cut[(seen // args.batch) % len(cut)]
        start = time.perf_counter()
        runner.run(Batch(args.task, OUTPUT_PROBS, [i for s in seqs for i in s], [len(s) for s in seqs]),
                   release=lambda *_: None)
        batch_ms = (time.perf_counter() - start) * 1e3
        seen += args.batch
        if reason := exits.controller.due():
            exits.controller.tune(reason)
        if len(warming) < 12:   # how the ramps' measured cost settles on this device
            controller = exits.controller
            warming.append({"texts": seen, "batch_ms": round(batch_ms, 3), "active": list(controller.active.layers),
                            "cost": round(max(controller.cost.values()), 5)})
    measured = cut[: args.batches]
    rounds = []
    for r in range(args.rounds):
        arms = {}
        for arm in (("vanilla", "early") if r % 2 == 0 else ("early", "vanilla")):
            firsts, totals, early_texts = run_batches(runner, args.task, measured, arm == "early")
            arms[arm] = {"first_p25_ms": float(np.percentile(firsts, 25)) * 1e3,
                         "first_p50_ms": float(np.median(firsts)) * 1e3, "batch_ms": statistics.median(totals) * 1e3,
                         "released_early": round(early_texts / len(firsts), 4)}
        rounds.append(arms)
        print(json.dumps({"round": r, **arms}), flush=True)
    summary = {"device": str(runner.device), "task": args.task, "batch": args.batch,
               "active_ramps": list(exits.controller.active.layers), **{
                   name: round(statistics.median(x["early"][key] / x["vanilla"][key] for x in rounds), 4)
                   for name, key in (("first_p50_ratio", "first_p50_ms"), ("first_p25_ratio", "first_p25_ms"),
                                     ("batch_time_ratio", "batch_ms"))},
               "released_early": statistics.median(x["early"]["released_early"] for x in rounds),
               "warming": warming, "controller": exits.controller.status()}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
