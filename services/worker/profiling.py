"""The start-up profile (Student Parallelism App. B.4.1): throughput and batch latency of a model on this
device for each number of concurrent student instances and each merge size. The resource manager's
grid search picks the setting (most throughput without raising latency) from these points."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.shared.models.work import Batch

PROFILE_TOKEN = 2023  # any ordinary word piece: the profile measures shapes, not meaning


@dataclass(frozen=True)
class Measured:
    instances: int
    merge: int
    throughput: float    # samples/s, all instances together
    latency_ms: float    # mean batch time


def profile_model(runner: ModelRunner, model: str, instances: Sequence[int] = (1, 2, 4),
                  merges: Sequence[int] = (1, 2, 4, 8, 16), length: int = 32, batches: int = 6) -> list[Measured]:
    """Every (instances, merge) point: `instances` threads each run `batches` batches of `merge`
    samples of `length` tokens, all at once, as concurrent student instances would."""
    output = OUTPUT_PROBS if runner.models[model].head is not None else OUTPUT_EMBEDDING
    sample = [101] + [PROFILE_TOKEN] * (length - 2) + [102]
    runner.run(Batch(model, output, sample, [length]))  # warm-up: first-call allocations are not the device's speed
    return [_point(runner, model, output, sample, c, m, batches) for c in instances for m in merges]


def _point(runner: ModelRunner, model: str, output: str, sample: list[int], instances: int, merge: int,
           batches: int) -> Measured:
    ids, lengths = sample * merge, [len(sample)] * merge

    def instance() -> float:
        start = time.perf_counter()
        for _ in range(batches):
            runner.run(Batch(model, output, ids, lengths))
        return (time.perf_counter() - start) / batches

    with ThreadPoolExecutor(max_workers=instances) as pool:
        start = time.perf_counter()
        latencies = list(pool.map(lambda _: instance(), range(instances)))
        wall = time.perf_counter() - start
    return Measured(instances, merge, instances * batches * merge / wall, 1e3 * sum(latencies) / len(latencies))
