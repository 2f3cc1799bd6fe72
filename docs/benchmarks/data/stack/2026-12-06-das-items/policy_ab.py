"""A `concat` policy against an older copy of it (its policies.py and das.py), in one process.

    python policy_ab.py REFERENCE_DIR ROUNDS OUT.json   (REFERENCE_DIR: policies.py and das.py of the older commit)

1. The same decisions: seeded streams of arrivals (sentiment's token lengths, 1 to 2,048 waiting, deadlines near and
   far, the wait bound on and off, batches of 2–20 ms) through both policies; each batch's jobs, their plan's rows
   and the expired must be the same.
2. CPU a decision with 1,024 waiting (8 rows of 128, each batch's jobs replaced by new ones): in a steady overload
   (overload_cpu.py's setting: a 1 s bound, the clock moving 13 ms a batch, so that most are due), and with none due
   (no bound, 1 ms a batch); both arms in one process, the order reversed every other round.
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
from academus.services.scheduler import policies
from academus.services.scheduler.core import Job


def load(directory: Path):
    modules = {}
    for name in ("das", "policies"):
        spec = importlib.util.spec_from_file_location(f"reference_{name}", directory / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module      # dataclasses look their module up
        spec.loader.exec_module(module)
        modules[name] = module
    modules["policies"].das = modules["das"]
    return modules["policies"]


def job(k: int, n: int, at: float, deadline: float) -> Job:
    return Job("sim", k, 1, n, deadline, at, ("sim",), max_length=n, lengths=(n,))


def stream(module, seed: int, lengths: list[int]) -> list[tuple]:
    """Every decision of one seeded run: (batch's payloads, plan rows as payloads, expired payloads)."""
    rng = random.Random(seed)
    waiting, bound, step = rng.choice([1, 16, 256, 1024, 2048]), rng.choice([0.0, 0.2, 1.0]), rng.uniform(0.002, 0.02)
    policy = module.ConcatPolicy(rng.choice([64, 128]), rng.randint(1, 8), latency=module.LatencyModel())
    policy.bound_wait(bound)
    arrivals = random.Random(seed + 1)
    k, now, seen = 0, 0.0, []

    def arrive(at: float) -> None:
        nonlocal k
        policy.push(job(k, arrivals.choice(lengths), at, at + arrivals.choice([0.05, 0.5, 5.0])), at)
        k += 1

    for _ in range(waiting):
        arrive(now)
        now += 0.0005
    for _ in range(60):
        chosen = policy.next_batch(lambda j: True, now)
        expired = [j.payload for j, _ in policy.take_dropped()]
        plan = chosen[0].plan.rows if chosen else ()
        seen.append(([j.payload for j in chosen], [[[p.job.payload for p in slot] for slot in row] for row in plan],
                     expired))
        for _ in range(len(chosen) + len(expired)):
            arrive(now)
        if chosen:
            policy.observe(chosen, step)
        now += step
    return seen


SETTINGS = {"overload": (1.0, 0.013), "none_due": (0.0, 0.001)}   # (the wait bound, the clock a batch), seconds


def decision_us(module, lengths: list[int], setting: str, warm: int = 20, decisions: int = 200) -> float:
    rng, now = random.Random(0), 0.0
    bound, step_s = SETTINGS[setting]
    policy = module.ConcatPolicy(128, 8, latency=module.LatencyModel())
    policy.bound_wait(bound)
    for k in range(1024):
        policy.push(job(k, rng.choice(lengths), k * 0.0005, k * 0.0005 + 5), k * 0.0005)
    now, started = 0.512, 0.0
    for step in range(warm + decisions):
        if step == warm:
            started = time.process_time()
        for _ in policy.next_batch(lambda j: True, now):
            policy.push(job(-1, rng.choice(lengths), now, now + 5), now)
        now += step_s
    return (time.process_time() - started) / decisions * 1e6


def main() -> None:
    reference, rounds, out = load(Path(sys.argv[1])), int(sys.argv[2]), Path(sys.argv[3])
    lengths = task_lengths("sentiment", 256)
    seeds = 200
    placed = expired = 0
    for seed in range(seeds):
        decided = stream(policies, seed, lengths)
        if decided != stream(reference, seed, lengths):
            raise SystemExit(f"seed {seed}: the decisions differ")
        placed += sum(len(batch) for batch, _, _ in decided)
        expired += sum(len(gone) for _, _, gone in decided)
    print(f"the same decisions in {seeds} runs of 60 batches: {placed} jobs placed, {expired} expired", flush=True)
    arms = {"reference": reference, "new": policies}
    rows = []
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        row = {"round": r, "order": order}
        for setting in SETTINGS:
            for name in order:
                row[f"{name}_{setting}_us"] = round(decision_us(arms[name], lengths, setting), 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    ratios = {s: [round(row[f"new_{s}_us"] / row[f"reference_{s}_us"], 3) for row in rows] for s in SETTINGS}
    medians = {s: statistics.median(v) for s, v in ratios.items()}
    same = {"runs": seeds, "placed": placed, "expired": expired}
    out.write_text(json.dumps({"command": " ".join(sys.argv), "same_decisions": same, "rounds": rows,
                               "new_over_reference": ratios, "median": medians}, indent=1) + "\n")
    print("new over reference:", ratios, "medians", medians)


if __name__ == "__main__":
    main()
