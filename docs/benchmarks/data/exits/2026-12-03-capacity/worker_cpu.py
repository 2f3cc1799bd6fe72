"""What early exits cost the worker's core, in process: padded batches of sentiment's test texts through
ModelRunner, CPU ms (all threads) and wall ms a batch, per arm, the arms alternating, the medians of the rounds.

`python worker_cpu.py ARTIFACTS TEXTS_A_BATCH BATCHES ROUNDS OUT`. After 1,024 texts of feedback (tuned as due):

- vanilla: no release (the ramps do not run);
- ramps: the active ramps run, releases go to a no-op, no tuning;
- ramps+tune: the same, and each tuning due runs inline (its CPU also counted apart, `tune_ms`);
- ramps+send: releases built as the worker's server builds them (protobuf, `call_soon_threadsafe` onto a loop).

`parts_us`: microseconds a call of each step of the exit path (ExitRun's, and the controller's feedback), timed
around the calls over every arm."""

from __future__ import annotations

import asyncio
import collections
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from academus.loadgen.exits_bench import drifting_order
from academus.services.worker import exits as worker_exits
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models import exits as model_exits
from academus.shared.models.exits import ControllerSettings
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch, BatchOutput
from academus.shared.models.work_wire import output_to_pb
from academus.shared.training.data import fetch, load_task

TASK = "sentiment"
spent: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def timed(cls: type, name: str) -> None:
    inner = getattr(cls, name)

    def outer(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
            calls[name] += 1

    setattr(cls, name, outer)


def main() -> None:
    artifacts, size, n, rounds, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        Path(sys.argv[5])
    for name in ("__init__", "hidden", "at_layer", "finish"):
        timed(worker_exits.ExitRun, name)
    timed(model_exits.ExitController, "observe")
    runner = ModelRunner(artifacts, [TASK], "cpu", exit_settings=ControllerSettings())
    controller = runner.models[TASK].exits.controller
    test = load_task(TASK, fetch(None)).test
    encoded = TeacherTokenizer(teacher_dir()).encode([e.text for e in test], truncate=True)
    order = [encoded[i].input_ids for i in drifting_order(TASK, test, seed=0)]
    batches = [order[i:i + size] for i in range(0, len(order), size)]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    labels = runner.specs[TASK].labels

    def ignore(*_) -> None:
        pass

    def send(rows: list[int], layer: int, probs) -> None:
        early = BatchOutput(probs, labels, rows=tuple(rows), exit_layer=layer)
        loop.call_soon_threadsafe(ignore, output_to_pb(early, OUTPUT_PROBS))

    def run(seqs: list[list[int]], release) -> None:
        runner.run(Batch(TASK, OUTPUT_PROBS, [i for s in seqs for i in s], [len(s) for s in seqs]), release=release)

    for b in range(1024 // size):
        run(batches[b % len(batches)], ignore)
        if reason := controller.due():
            controller.tune(reason)
    spent.clear()
    calls.clear()
    arms = {"vanilla": (None, False), "ramps": (ignore, False), "ramps+tune": (ignore, True),
            "ramps+send": (send, False)}
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            release, tune = arms[arm]
            cpu, wall, tuning = time.process_time(), time.perf_counter(), 0.0
            for b in range(n):
                run(batches[(r * n + b) % len(batches)], release)
                if tune and (reason := controller.due()):
                    start = time.process_time()
                    controller.tune(reason)
                    tuning += time.process_time() - start
            results[arm].append({"cpu_ms": (time.process_time() - cpu) * 1e3 / n,
                                 "wall_ms": (time.perf_counter() - wall) * 1e3 / n, "tune_ms": tuning * 1e3 / n})
            print(r, arm, json.dumps(results[arm][-1]), flush=True)
    summary = {"texts_a_batch": size, "batches": n, "rounds": rounds, "active_ramps": list(controller.active.layers),
               **{arm: {k: round(statistics.median(x[k] for x in v), 3) for k in v[0]} for arm, v in results.items()},
               "parts_us": {k: round(spent[k] * 1e6 / calls[k], 1) for k in spent},
               "calls_a_batch": {k: round(calls[k] / (n * rounds * len(arms)), 2) for k in calls}}
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
