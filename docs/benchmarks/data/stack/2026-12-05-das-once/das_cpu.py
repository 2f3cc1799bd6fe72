"""CPU a DAS decision (`das_rows`, 8 rows of L = 128) with N requests waiting, versions of das.py in one process,
the order reversed every other round; each version's figures over the first's. The requests: sentiment's test
texts' token counts, arrived over the last second (the wait bound's due times 1 s after), deadlines 5 s away,
13 ms a batch (the `null` model's).

    python das_cpu.py ROUNDS OUT.json NAME=PATH NAME=PATH [...]   (PATH: a copy of services/scheduler/das.py)
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

from academus.loadgen.wait_bound_sim import task_lengths

WAITING = (64, 256, 1024)


def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"das_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def decision_us(das, lengths: list[int], n: int, repeats: int = 40) -> float:
    rng = random.Random(n)
    arrivals = sorted(rng.uniform(0.0, 1.0) for _ in range(n))
    items = [das.WaitingItem(k, rng.choice(lengths), 6.0, a, due=a + 1.0) for k, a in enumerate(arrivals)]
    started = time.process_time()
    for _ in range(repeats):
        das.das_rows(items, 1.0, 128, 8, batch_latency=lambda rows, length: 0.013)
    return (time.process_time() - started) / repeats * 1e6


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    arms = {name: load(name, path) for name, path in (a.split("=", 1) for a in sys.argv[3:])}
    lengths = task_lengths("sentiment", 256)
    rows = []
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        row = {"round": r, "order": order}
        for name in order:
            row[name] = {n: round(decision_us(arms[name], lengths, n), 1) for n in WAITING}
        print(json.dumps(row), flush=True)
        rows.append(row)
    first, *others = list(arms)
    ratios = {f"{name}_over_{first}": {n: [round(row[name][n] / row[first][n], 3) for row in rows] for n in WAITING}
              for name in others}
    summary = {"command": " ".join(sys.argv), "rounds": rows, "ratios": ratios,
               "median_ratio": {k: {n: statistics.median(v) for n, v in r.items()} for k, r in ratios.items()}}
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["median_ratio"]))


if __name__ == "__main__":
    main()
