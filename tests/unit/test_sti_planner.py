"""STI's planner (§5.3–§5.4): compute planning, accumulated IO budgets, the two passes, the baselines."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from academus.shared.models.shards import FULL, VERSIONS
from academus.shared.models.sti_planner import PACE_TOLERANCE, Budgets, HardwareProfile, Plan, Planner, simulate

# Fig. 6's shape of example: a 2 x 3 submodel, one second a layer, the first layer's three shards preloaded
LOAD = {2: 0.2, 3: 0.3, 4: 0.35, 5: 0.4, 6: 0.5, FULL: 1.0}     # seconds, written as ms: the units do not matter


def profile(load: dict[int, float] | None = None, layer: float = 1.0, overhead: float = 0.0,
            decode: float = 0.0, widths: tuple[int, ...] = (3,)) -> HardwareProfile:
    return HardwareProfile("test", dict(load or LOAD), dict.fromkeys(VERSIONS, decode),
                           {w: {32: layer * w / max(widths)} for w in widths}, {32: overhead}, (32,))


def planner(prof: HardwareProfile, depths=(1, 2), widths=(3,), heads: int = 3, clock=None) -> Planner:
    importance = [(k, s) for s in range(heads) for k in range(max(depths))]
    kwargs = {"clock": clock} if clock else {}
    return Planner(prof, depths, widths, lambda k: list(range(heads)), importance,
                   lambda k, s, b: 100 * b, **kwargs)


def test_figure_6_valid_and_invalid_candidates() -> None:
    # T = 2 s for two 1 s layers: no slack; the preloaded first layer costs no IO, so layer 1 has 1 s of IO
    for candidate, valid in (((2, 2, 6), True), ((6, 2, 2), True), ((6, 6, 6), False)):
        budgets = Budgets(slack_ms=0.0, layer_ms=1.0, depth=2)
        assert budgets.would_hold({1: sum(LOAD[b] for b in candidate)}) is valid


def test_figure_6_plan_uniform_pass_then_the_most_important_shard_upgraded() -> None:
    p = planner(profile())
    preload_one_layer_at_2_bits = 3 * 100 * 2
    plan = p.plan(2.0, 32, preload_one_layer_at_2_bits)
    assert (plan.depth, plan.width, plan.feasible) == (2, 3, True)
    assert plan.preload == {(0, 0), (0, 1), (0, 2)} and all(plan.bits[(0, s)] == 2 for s in range(3))
    # uniform: 3 x 0.3 = 0.9 fits layer 1's one second, 3 x 0.35 does not; then shard 0, the most
    # important, rises to the highest version the budget still allows (0.3 -> 0.4: 5 bits)
    assert [plan.bits[(1, s)] for s in range(3)] == [5, 3, 3]
    assert simulate(plan, p.profile, 32)["finish_ms"] <= 2.0 + 1e-9


def test_without_preload_the_first_layer_needs_slack() -> None:
    p = planner(profile())
    assert not p.plan(2.0, 32, 0).feasible or p.plan(2.0, 32, 0).depth < 2
    plan = p.plan(2.6, 32, 0)            # 0.6 s of slack: the first layer at 2 bits
    assert plan.feasible and plan.depth == 2
    assert simulate(plan, p.profile, 32)["finish_ms"] <= 2.6 + 1e-9


def test_compute_planning_prefers_more_shards_then_depth() -> None:
    prof = profile(load=dict.fromkeys(VERSIONS, 0.0), layer=1.0, widths=(2, 4))
    p = planner(prof, depths=(1, 2, 3, 4), widths=(2, 4), heads=4)
    # widths cost 0.5 and 1 a layer: T = 2 fits 4 x 2 (8 shards, 2 ms) and 2 x 4 (8 shards): the deeper one
    plan = p.plan(2.0, 32)
    assert (plan.depth, plan.width) == (4, 2)
    plan = p.plan(4.0, 32)
    assert (plan.depth, plan.width) == (4, 4)


def test_a_target_too_short_for_any_plan_is_infeasible() -> None:
    p = planner(profile(overhead=0.5))
    plan = p.plan(1.2, 32, 0)
    assert not plan.feasible and (plan.depth, plan.width) == (1, 3)


@pytest.mark.parametrize("seed", range(40))
def test_a_valid_plan_never_stalls_past_its_target_in_simulation(seed: int) -> None:
    rng = random.Random(seed)
    load = dict(zip(VERSIONS, sorted(rng.uniform(0.01, 2.0) for _ in VERSIONS), strict=True))
    prof = HardwareProfile("sim", load, {b: rng.uniform(0.0, 0.1) for b in VERSIONS},
                           {w: {32: rng.uniform(0.2, 1.5) * w / 12} for w in (3, 6, 9, 12)},
                           {32: rng.uniform(0.0, 0.5)}, (32,))
    importance = [(k, s) for k in range(6) for s in range(12)]
    rng.shuffle(importance)
    p = Planner(prof, range(1, 7), (3, 6, 9, 12), lambda k: [s for (j, s) in importance if j == k], importance,
                lambda k, s, b: 1000 * b)
    target = rng.uniform(1.0, 20.0)
    plan = p.plan(target, 32, rng.choice([0, 20_000, 100_000]))
    if plan.feasible:
        assert simulate(plan, prof, 32)["finish_ms"] <= target + 1e-6
        assert plan.depth * plan.width == len(plan.bits)
    for bits in (2, 6, FULL):
        std = p.standard_pipeline(target, 32, bits)
        if std.feasible:
            assert simulate(std, prof, 32)["finish_ms"] <= target + 1e-6


def test_stdpl_and_load_and_exec_and_preload_model() -> None:
    p = planner(profile())
    load_exec = p.load_and_exec(10.0, 32)
    assert not load_exec.overlap and set(load_exec.bits.values()) == {FULL}
    assert load_exec.io_ms + load_exec.compute_ms <= 10.0
    # a pipeline at 32 bits needs 3 s before the first layer; at 2 bits 0.6 s
    assert not p.standard_pipeline(3.5, 32, FULL).feasible or p.standard_pipeline(3.5, 32, FULL).depth == 1
    assert p.standard_pipeline(2.6, 32, 2).depth == 2
    whole = p.preload_model(2.0, 32, 6)
    assert whole.depth == 2 and whole.preload == set(whole.bits) and whole.io_ms == 0


def test_planning_time_comes_from_the_clock() -> None:
    ticks = itertools.count(0.0, 0.0004)          # each clock reading 0.4 ms after the last
    p = planner(profile(), clock=lambda: next(ticks))
    assert p.plan(2.6, 32).plan_ms == pytest.approx(0.4)


def test_the_preload_fills_the_first_layers_in_load_order() -> None:
    p = planner(profile(), heads=3)
    buffer = 3 * 600 + 100                                    # a 6-bit first layer and nothing more
    assert p.held_for(buffer) == {(0, 0): 6, (0, 1): 6, (0, 2): 6}
    tight = p.plan(2.5, 32, preload_bytes=buffer)
    assert tight.preload == {(0, 0), (0, 1), (0, 2)} and {tight.bits[x] for x in tight.preload} == {6}
    assert p.preload_bytes_of(tight) == 3 * 600
    # with time to spare the most important held shard is loaded at full precision instead of decoded at 6 bits
    ample = p.plan(5.0, 32, held=p.held_for(buffer))
    assert ample.bits[(0, 0)] == FULL and (0, 0) not in ample.preload and ample.preload == {(0, 1), (0, 2)}



def test_a_held_shard_dearer_to_decode_than_to_read_better_is_read() -> None:
    """Through the page cache a full-precision read can cost less than decoding a held 6-bit shard: the buffer
    then changes nothing, rather than costing the plan its width."""
    buffer = 3 * 600 + 100                                    # a 6-bit first layer
    cached = {2: 0.45, 3: 0.5, 4: 0.5, 5: 0.55, 6: 0.6, FULL: 0.3}   # reads cheap, decoding dear
    dear = planner(profile(load=cached, decode=0.45), depths=(1, 2, 3))
    for target in (2.0, 3.0, 4.0):    # counting the decode, the buffer cost a layer (3.0, 4.0) or bits (2.0)
        with_buffer, without = dear.plan(target, 32, buffer), dear.plan(target, 32, 0)
        assert (with_buffer.depth, with_buffer.width, with_buffer.bits) == (without.depth, without.width,
                                                                             without.bits)
        assert set(with_buffer.bits.values()) == {FULL} and with_buffer.preload == set()
    cheap = planner(profile(load=cached, decode=0.1), depths=(1, 2, 3))     # held shards decoded: one layer more
    assert cheap.plan(2.6, 32, buffer).preload and cheap.plan(2.6, 32, buffer).depth == 2
    assert cheap.plan(2.6, 32, 0).depth == 1

def test_plan_key_and_summary() -> None:
    plan = Plan("x", 1, 2, [[0, 1]], {(0, 0): 2, (0, 1): 6})
    assert plan.mean_bits == 4 and plan.summary()["bits"] == {"2": 1, "6": 1}
    assert plan.key() == (1, 2, (((0, 0), 2), ((0, 1), 6)))


def test_the_fidelity_floor_keeps_every_shard_at_or_above_it() -> None:
    importance = [(k, s) for s in range(3) for k in range(2)]
    floor = Planner(profile(), (1, 2), (3,), lambda k: list(range(3)), importance, lambda k, s, b: 100 * b,
                    min_bits=6)
    # 2.6 s: two layers at 2 or 3 bits fit (test_without_preload...), at 6 bits they do not: one layer then
    plan = floor.plan(2.6, 32)
    assert plan.feasible and plan.depth == 1 and min(plan.bits.values()) >= 6
    assert min(floor.plan(30.0, 32).bits.values()) >= 6
    too_short = floor.plan(1.2, 32)
    assert not too_short.feasible and set(too_short.bits.values()) == {6}


def test_loads_are_those_measured_beside_a_layer_of_the_plans_width() -> None:
    """Beside a narrow layer the loader waits longer for the GIL: a plan is costed at its own width's loads."""
    narrow_dear = {2: dict.fromkeys(VERSIONS, 0.8), 4: dict.fromkeys(VERSIONS, 0.2)}
    prof = profile(load=dict.fromkeys(VERSIONS, 0.2), widths=(2, 4))
    prof = HardwareProfile(prof.source, prof.load_ms, prof.decode_ms, prof.compute_ms, prof.overhead_ms, prof.buckets,
                           narrow_dear, {w: dict.fromkeys(VERSIONS, 0.0) for w in narrow_dear})
    p = planner(prof, depths=(1, 2), widths=(4, 2), heads=4)
    narrow, wide = (p._uniform("x", 2, w, 2, 10.0, 32) for w in (2, 4))
    assert narrow.io_ms == pytest.approx(4 * 0.8) and wide.io_ms == pytest.approx(8 * 0.2)
    # each layer's two shards take 1.6 ms, its compute 0.5: the compute waits 1.6, then 3.2 - 2.1
    assert simulate(narrow, prof, 32)["stall_ms"] == pytest.approx(2.7)
    assert HardwareProfile.from_json(prof.to_json()) == prof
    flat = json.loads(prof.to_json())
    del flat["load_by_width"], flat["decode_by_width"]        # a profile saved before they were measured
    assert HardwareProfile.from_json(json.dumps(flat)).loads(2) == (prof.load_ms, prof.decode_ms)


def test_a_plans_pace_is_its_target_with_the_tolerance_at_the_depths_of_its_width() -> None:
    p = planner(profile(widths=(2, 3)), depths=(1, 2, 3), widths=(2, 3))
    plan = p.plan(4.0, 32)
    pace = p.pace(plan, 32)
    assert pace.bound_ms == pytest.approx(4.0 * (1 + PACE_TOLERANCE))
    assert pace.layer_ms == p.profile.layer_ms(plan.width, 32) and pace.rest_ms == p.profile.tail_ms(32)
    assert pace.depths == frozenset({1, 2, 3})
    short = plan.truncated(1)
    assert (short.depth, short.width, short.shards) == (1, plan.width, plan.shards[:1])
    assert set(short.bits) == {x for x in plan.bits if x[0] == 0} and short.preload <= plan.preload


def test_a_plan_reserves_what_its_runs_spend_outside_their_layers_and_the_pace_only_their_tail() -> None:
    """A run also reads its rows, embeds, sets up its loads (a share a layer) and pools: the profile times them in
    runs. A 2-layer plan that fits the layers and the fixed part misses once two layers' set-up counts."""
    loads_free = dict.fromkeys(VERSIONS, 0.0)
    base = profile(load=loads_free, overhead=0.3)
    prof = HardwareProfile(base.source, base.load_ms, base.decode_ms, base.compute_ms, base.overhead_ms, base.buckets,
                           finish_ms={32: 0.1}, layer_setup_ms={3: {32: 0.2}, 1: {32: 0.05}})
    assert prof.rest_ms(32) == pytest.approx(0.3) and prof.rest_ms(32, 2, 3) == pytest.approx(0.7)
    assert prof.rest_ms(32, 2, 1) == pytest.approx(0.4) and prof.rest_ms(32, 2, 2) == pytest.approx(0.7)  # the dearest
    assert prof.tail_ms(32) == pytest.approx(0.1) and base.tail_ms(32) == pytest.approx(0.3)   # measured before
    assert planner(base).plan(2.5, 32).depth == 2
    reserved = planner(prof).plan(2.5, 32)
    assert reserved.depth == 1 and simulate(reserved, prof, 32)["finish_ms"] <= 2.5
    assert planner(prof).plan(2.7, 32).depth == 2
    assert planner(prof).pace(reserved, 32).rest_ms == pytest.approx(0.1)
    assert HardwareProfile.from_json(prof.to_json()) == prof
