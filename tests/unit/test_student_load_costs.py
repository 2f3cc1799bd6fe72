"""The bit width a student not held is read at, planned from its batch's time left (`LoadCosts`): the floor
until a load and a run are measured or without a deadline, then the most bits whose measured (or, unmeasured,
byte-scaled) load and the batch's compute fit with headroom."""

from __future__ import annotations

import pytest

from academus.services.worker.student_memory import ESTIMATE_MARGIN, LoadCosts

BYTES = {4: 400, 5: 500, 6: 600, 32: 3200}   # one student's read at each stored width above the floor (4)


def measured(load_ms: float = 10.0, ms_per_token: float = 0.01) -> LoadCosts:
    costs = LoadCosts(BYTES, floor=4)
    costs.loaded(4, load_ms)
    costs.computed(1000, ms_per_token * 1000)
    return costs


def test_the_floor_until_measured_and_without_a_deadline() -> None:
    costs = LoadCosts(BYTES, floor=4)
    assert costs.bits_for(100.0, 64, 2) == 4            # nothing measured
    costs.loaded(4, 10.0)
    assert costs.bits_for(100.0, 64, 2) == 4            # a load but no run measured
    costs.computed(64, 1.0)
    assert costs.bits_for(None, 64, 2) == 4             # no deadline: the fastest answer
    assert costs.bits_for(100.0, 64, 2) == 32


def test_unmeasured_widths_scale_up_from_the_nearest_measured_one_below() -> None:
    costs = measured(load_ms=10.0)
    assert costs.estimate_ms(4) == 10.0
    assert costs.estimate_ms(6) == pytest.approx(15.0) and costs.estimate_ms(32) == pytest.approx(80.0)
    costs.loaded(6, 12.0)                                 # measured: used as it is, and scaled from above it
    assert costs.estimate_ms(6) == 12.0 and costs.estimate_ms(32) == pytest.approx(64.0)
    assert LoadCosts(BYTES, floor=4).estimate_ms(5) is None


@pytest.mark.parametrize(("seconds_left", "bits"), [(0.001, 4), (0.023, 5), (0.04, 6), (0.2, 32)])
def test_the_most_bits_whose_load_and_the_batchs_compute_fit(seconds_left: float, bits: int) -> None:
    costs = measured(load_ms=10.0, ms_per_token=0.01)   # compute: 2 students x 100 tokens x 0.01 = 2 ms
    chosen = costs.bits_for(seconds_left, 100, 2)
    assert chosen == bits
    if chosen != 4:
        assert costs.estimate_ms(chosen) + 2.0 <= seconds_left * 1e3 / ESTIMATE_MARGIN


def test_estimates_follow_what_loads_cost_now() -> None:
    costs = measured(load_ms=10.0)
    assert costs.bits_for(0.2, 100, 2) == 32
    for _ in range(10):                                  # the source slowed down (a cold page cache)
        costs.loaded(4, 200.0)
    assert costs.load_ms[4] > 190.0 and costs.bits_for(0.2, 100, 2) == 4
