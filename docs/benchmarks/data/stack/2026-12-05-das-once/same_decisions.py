"""Random queues through two versions of das.py: the same rows, slots, expired, refused and waiting, or an error.

    python same_decisions.py REFERENCE.py SEEDS CASES    (REFERENCE.py: a copy of services/scheduler/das.py)

Each case draws L, the rows, up to 600 items (short, long past L, equal or mixed lengths), deadlines near and far,
due times or none, the batch latency, the lanes, η and the oversize mode; both `das_rows` and `slotted_das_rows`.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys

from academus.services.scheduler import das


def load(path: str):
    spec = importlib.util.spec_from_file_location("das_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def length(rng: random.Random, shape: str, row_length: int) -> int:
    if shape == "short":
        return rng.randint(1, max(1, row_length // 4))
    if shape == "long":
        return rng.randint(row_length // 2, 2 * row_length)
    if shape == "equal":
        return max(1, row_length // 4)
    return rng.randint(1, 2 * row_length)


def case(rng: random.Random, reference) -> int:
    row_length, rows = rng.choice([8, 16, 32, 64, 128]), rng.randint(1, 8)
    n, now, shape = rng.choice([0, 1, 3, 10, 50, 200, 600]), rng.uniform(0, 2), rng.choice(
        ["short", "mixed", "long", "equal"])
    fields = []
    for k in range(n):
        arrival = rng.choice([rng.uniform(0, now), float(k % 5)])
        fields.append((k, length(rng, shape, row_length), rng.choice([100.0, now + rng.uniform(-0.1, 1.0)]),
                       arrival, rng.choice([math.inf, arrival + rng.uniform(0.2, 1.5)])))
    latency = rng.choice([None, lambda r, length: 0.02, lambda r, length: 0.001 * r])
    lanes, eta, oversize = rng.randint(1, 3), rng.choice([0.5, 0.3, 0.7]), rng.choice(["alone", "reject"])
    for fill in ("das_rows", "slotted_das_rows"):
        decided = [getattr(module, fill)([module.WaitingItem(*f) for f in fields], now, row_length, rows, eta,
                                         1 - eta, latency, oversize, lanes=lanes) for module in (das, reference)]
        a, b = ((d.rows, d.expired, d.too_long, d.waiting, d.slot_size, d.slots) for d in decided)
        if a != b:
            raise SystemExit(f"{fill} differs: {a} against {b}")
    return 2


def main() -> None:
    reference, seeds, cases = load(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    compared = sum(case(rng, reference) for seed in range(seeds) for rng in [random.Random(seed)]
                   for _ in range(cases))
    print(f"the same decisions in {compared} cases")


if __name__ == "__main__":
    main()
