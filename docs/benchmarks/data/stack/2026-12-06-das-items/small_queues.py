"""CPU a `concat` decision with few waiting, against an older copy (policy_ab.py's REFERENCE_DIR), in one process:
8, 64 and 256 requests of one length (16 tokens, as `null`'s bench texts), no bound and a 1 s bound, each batch's jobs
replaced by new ones; 2,000 decisions an arm, the arms twice each, reference first.

    python small_queues.py REFERENCE_DIR ROUNDS
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from policy_ab import job, load

from academus.services.scheduler import policies


def decision_us(module, waiting: int, bound: float, decisions: int = 2000) -> float:
    policy = module.ConcatPolicy(128, 8, latency=module.LatencyModel())
    policy.bound_wait(bound)
    now = 0.0
    for k in range(waiting):
        policy.push(job(k, 16, now, now + 5), now)
        now += 0.0001
    started = time.process_time()
    for _ in range(decisions):
        for _ in policy.next_batch(lambda j: True, now):
            policy.push(job(-1, 16, now, now + 5), now)
        now += 0.0005
    return (time.process_time() - started) / decisions * 1e6


def main() -> None:
    reference, rounds = load(Path(sys.argv[1])), int(sys.argv[2])
    random.seed(0)
    for waiting in (8, 64, 256):
        for bound in (0.0, 1.0):
            ratios = []
            for _ in range(rounds):
                ref = decision_us(reference, waiting, bound)
                new = decision_us(policies, waiting, bound)
                ratios.append(round(new / ref, 3))
            print(json.dumps({"waiting": waiting, "bound_s": bound, "new_over_reference": ratios,
                              "median": statistics.median(ratios)}), flush=True)


if __name__ == "__main__":
    main()
