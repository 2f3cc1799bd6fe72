"""The worker's start-up profile measures every (instances, merge) point on the real model, and the
resource manager's choice picks one of them."""

from __future__ import annotations

from academus.services.resource_manager.allocation import ProfilePoint, choose_profile
from academus.services.worker.core import ModelRunner
from academus.services.worker.profiling import profile_model
from academus.shared.runtime.config import artifacts_dir


def test_profile_covers_the_grid_and_the_choice_is_one_of_its_points():
    runner = ModelRunner(artifacts_dir(), ["sentiment"])
    points = profile_model(runner, "sentiment", instances=(1, 2), merges=(1, 4), length=16, batches=2)
    assert [(p.instances, p.merge) for p in points] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(p.throughput > 0 and p.latency_ms > 0 for p in points)
    chosen = choose_profile([ProfilePoint(p.instances, p.merge, p.throughput, p.latency_ms) for p in points], 100)
    assert chosen.throughput == max(p.throughput for p in points)
