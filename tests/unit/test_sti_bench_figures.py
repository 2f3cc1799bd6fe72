"""sti_bench's figures from hand-made rows: each arm against the whole model, per preload buffer too."""

from __future__ import annotations

import pytest

from academus.loadgen.sti_bench import figures

ARMS = {  # arm: (accuracy, held bytes)
    "preload-32": (0.80, 90_000_000), "preload-6": (0.79, 17_000_000), "sti-1024k": (0.795, 1_000_000),
    "sti-4096k": (0.798, 4_000_000), "sti-0": (0.78, 0), "sti-random-4096k": (0.79, 4_000_000),
    "load&exec": (0.70, 0), "stdpl-32": (0.72, 0), "stdpl-2": (0.50, 0), "stdpl-6": (0.77, 0),
    "sti-4096k-paced": (0.797, 4_000_000),
}


def rows(target: float) -> list[dict]:
    return [{"task": "t", "target_x": target, "arm": arm, "accuracy": acc, "held_bytes": held,
             "p95_over_target": 1.0 + target / 10, "stall_share": 0.1, "cut_short": 0.5}
            for arm, (acc, held) in ARMS.items()]


def test_figures_compare_each_buffer_with_the_whole_model() -> None:
    fig = figures([{"rows": rows(0.5) + rows(1.0)}], [1 << 20, 4 << 20])
    assert fig["sti_arm"] == "sti-4096k"
    assert fig["sti_minus_whole_model_pp_at_T>=0.75"] == pytest.approx(-0.2)      # T = 1 only
    assert fig["held_bytes_whole_over_sti"] == pytest.approx(22.5)
    small = fig["by_preload"]["sti-1024k"]
    assert small == {"minus_whole_model_pp_at_T>=0.75": pytest.approx(-0.5), "held_bytes_whole_over_sti": 90.0,
                     "held_bytes_6bit_over_sti": 17.0}
    assert fig["by_preload"]["sti-4096k"]["held_bytes_6bit_over_sti"] == pytest.approx(4.2)
    assert fig["preload_over_none_pp"] == pytest.approx(1.8)
    assert fig["planner_order_over_random_pp"] == pytest.approx(0.8)
    assert fig["sti_over_stdpl-2_pp"] == pytest.approx(29.8) and fig["sti_p95_over_target_max"] == pytest.approx(1.1)
    assert fig["paced_minus_sti_pp"] == pytest.approx(-0.1) and fig["paced_cut_short_mean"] == 0.5


def test_the_upgrade_study_compares_the_orders_on_the_same_number_of_upgrades() -> None:
    """Table 7's case study with a scorer whose accuracy counts the upgraded shards of one layer: an upgrade order
    that names them first gains over every random order, an importance order that names them last loses."""
    from academus.loadgen.sti_bench import (
        STUDY_BITS,
        STUDY_SHARES,
        study_figures,
        study_shapes,
        study_table,
        upgrade_study,
    )
    from academus.shared.models.shard_store import TaskShards

    layers, heads = 2, 4
    importance = [(k, s) for k in (0, 1) for s in range(heads)]              # layer 0 first
    upgrade_order = importance[::-1]                                         # layer 1 first
    info = TaskShards("t", ["no", "yes"], importance, [2, 4], [1, 2], {}, upgrade_order=upgrade_order)
    assert study_shapes(info) == [(1, 2), (2, 2), (2, 4)]
    seen = []

    def score(plan) -> float:       # layer 1's shards at the high version are what counts
        seen.append(plan)
        assert plan.shards == [info.layer_order(k)[:plan.width] for k in range(plan.depth)]
        return 0.5 + sum(b > 3 for (k, _), b in plan.bits.items() if k == 1) / 10

    rows = upgrade_study(info, score, orders=4, shapes=[(layers, heads)])
    assert len(rows) == len(STUDY_BITS) * len(STUDY_SHARES)
    quarter = next(r for r in rows if r["share"] == 0.25 and r["from_bits"] == 2)
    assert quarter["upgrades"] == 2 and quarter["base"] == 0.5 and quarter["all_upgraded"] == 0.9
    assert quarter["upgrade_order"] == 0.7 and quarter["importance"] == 0.5
    assert quarter["random_min"] <= quarter["random_mean"] <= quarter["random_max"] <= 0.7
    half = next(r for r in rows if r["share"] == 0.5 and r["from_bits"] == 3)
    assert half["upgrade_order"] == 0.9 and half["importance"] == 0.5
    assert all(set(p.bits.values()) <= {2, 3, 6} and len(p.bits) == 8 for p in seen)
    fig = study_figures(rows)
    assert fig["upgrade_order_over_random_pp"] > 0 > fig["importance_over_random_pp"]
    assert fig["upgrade_order_ahead_of_random"] == "4 of 4"
    table = study_table([{"task": "t", "upgrade_study": rows}]).splitlines()
    assert len(table) == 2 + len(rows)
    assert table[2].startswith("| t | 2x4 | 2 → 6 | 2 (25%) | 0.5000 | 0.9000 | 0.7000 |")
    assert study_table([{"task": "t", "upgrade_study": []}]) == ""   # `--study-orders 0`: no table, not its header
