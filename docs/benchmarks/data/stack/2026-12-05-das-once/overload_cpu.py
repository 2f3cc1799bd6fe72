"""CPU a `concat` decision in a steady overload: 1,024 requests waiting in a ConcatPolicy (8 rows of L = 128, a 1 s
wait bound), each batch's requests replaced by new ones, the clock moving 13 ms a batch, so that most of the queue is
due. Versions of das.py in one process (the policy's module is pointed at each in turn), the order reversed every
other round; each version's CPU over the first's.

    python overload_cpu.py ROUNDS OUT.json NAME=PATH NAME=PATH [...]   (PATH: a copy of services/scheduler/das.py)
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from academus.loadgen.wait_bound_sim import task_lengths
from academus.services.scheduler import policies
from academus.services.scheduler.core import Job
from academus.services.scheduler.policies import ConcatPolicy, LatencyModel

sys.path.insert(0, str(Path(__file__).parent))
from das_cpu import load


def decision_us(lengths: list[int], warm: int = 20, decisions: int = 200) -> float:
    rng, now = random.Random(0), 0.0
    policy = ConcatPolicy(128, 8, latency=LatencyModel())
    policy.bound_wait(1.0)

    def arrive(at: float) -> None:
        n = rng.choice(lengths)
        policy.push(Job("sim", None, 1, n, at + 5, at, ("sim",), max_length=n, lengths=(n,)), at)

    for k in range(1024):
        arrive(k * 0.0005)
    now = 0.512
    started = 0.0
    for step in range(warm + decisions):
        if step == warm:
            started = time.process_time()
        for _ in policy.next_batch(lambda job: True, now):
            arrive(now)
        now += 0.013
    return (time.process_time() - started) / decisions * 1e6


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    arms = {name: load(name, path) for name, path in (a.split("=", 1) for a in sys.argv[3:])}
    lengths = task_lengths("sentiment", 256)
    rows = []
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        row = {"round": r, "order": order}
        for name in order:
            policies.das = arms[name]
            row[name] = round(decision_us(lengths), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    first, *others = list(arms)
    ratios = {f"{name}_over_{first}": [round(row[name] / row[first], 3) for row in rows] for name in others}
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rounds": rows, "ratios": ratios,
                               "median_ratio": {k: statistics.median(v) for k, v in ratios.items()}}, indent=1) + "\n")
    print(json.dumps({k: statistics.median(v) for k, v in ratios.items()}))


if __name__ == "__main__":
    main()
