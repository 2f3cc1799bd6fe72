"""Traced layers against the layers' own forwards (services/worker/traced.py), in process on one torch
thread: the worker's compute_ms for the teacher and one student at batches of 1 and 8, alone and beside a
thread that holds the GIL in Python work for `--busy` of every millisecond (an event loop's shape).

    python -m academus.loadgen.probes.traced_bench [--tokens 25] [--busy 0.3] [--repeats 150]
        [--artifacts DIR --cases mpnet-sentiment:0,mpnet-sentiment-students:1]

`--cases` names the models (and students) to time, `--artifacts` the catalogue they are in (e.g. a user's MPNet,
whose layers take the relative-position bias).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from academus.loadgen.grpc_floor import spin
from academus.loadgen.stats import summary
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models.work import Batch
from academus.shared.runtime.config import artifacts_dir

CASES = (("sentiment", 0), ("sentiment-students", 1))


@contextmanager
def busy_thread(share: float) -> Iterator[None]:
    """A thread that spins in Python (GIL held) for `share` of every millisecond and sleeps the rest."""
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            spin(share * 1e-3)
            time.sleep((1 - share) * 1e-3)

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def compute_ms(runners: dict[str, ModelRunner], model: str, students: int, tokens: int, batch: int,
               repeats: int) -> dict[str, float]:
    """compute_ms p50 of each runner, their runs interleaved so that the machine's drift falls on both."""
    ids, lengths = list(range(1000, 1000 + tokens)) * batch, [tokens] * batch
    times: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(10 + repeats):  # the first 10: warm-up (the graphs are traced on first use)
        for name, runner in runners.items():
            ms = runner.run(Batch(model, OUTPUT_PROBS, ids, lengths, num_students=students)).compute_ms
            if i >= 10:
                times[name].append(ms)
    return {name: summary(values)["p50"] for name, values in times.items()}


def cases(text: str) -> tuple[tuple[str, int], ...]:
    """`MODEL:STUDENTS,...`, students 0 for a model that is not a student group."""
    return tuple((model, int(students or 0)) for model, _, students in (c.partition(":") for c in text.split(",")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=25)
    p.add_argument("--busy", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=150)
    p.add_argument("--artifacts", type=Path, default=None, help="the catalogue's folder (default: ACADEMUS_ARTIFACTS)")
    p.add_argument("--cases", type=cases, default=CASES, help="MODEL:STUDENTS,... (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    models = [m for m, _ in args.cases]
    artifacts = args.artifacts or artifacts_dir()
    runners = {"eager": ModelRunner(artifacts, models, traced=False),
               "traced": ModelRunner(artifacts, models, traced=True)}
    rows = []
    for beside in ("alone", "busy thread"):
        for model, students in args.cases:
            for batch in (1, 8):
                with busy_thread(args.busy) if beside != "alone" else nullcontext():
                    p50 = compute_ms(runners, model, students, args.tokens, batch, args.repeats)
                rows.append({"model": model, "batch": batch, "beside": beside, "eager_p50_ms": p50["eager"],
                             "traced_p50_ms": p50["traced"], "traced_vs_eager": round(p50["traced"] / p50["eager"], 3)})
                print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"tokens": args.tokens, "busy": args.busy, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
