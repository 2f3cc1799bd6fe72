"""stack_bench on the real mesh, briefly: one round of one arm, its load-generator processes and /proc readings."""

from __future__ import annotations

import json

import pytest

from academus.loadgen.stack_bench import main

pytestmark = pytest.mark.e2e


def test_one_round_measures_the_stack_its_processes_and_the_floors(tmp_path, capsys):
    assert main(["--model", "null", "--rounds", "1", "--requests", "20", "--warmup", "5", "--callers", "4",
                 "--duration", "1", "--floor-callers", "4", "--floor-duration", "0.3", "--connections", "6",
                 "--arms", "grpc=ACADEMUS_LOCAL_PLANE=0", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "stack_bench.json").read_text())
    arm = summary["rounds"][0]["arms"]["grpc"]
    assert arm["sequential"]["e2e_ms"]["count"] == 20
    run = arm["capacity"]["4"]
    assert run["completed"] > 0 and not run["errors"]
    assert {"gateway", "scheduler", "worker-0", "loadgen-0", "loadgen-1"} <= set(run["processes"])
    assert run["stack_cpu_ms"] > 0 and run["stack_voluntary_switches"] > 0
    many = arm["connections"]
    assert many["established"] >= 6 and many["completed"] > 0 and not many["errors"]   # 6 connections, really open
    assert many["offered_rps"] == round(0.5 * run["throughput_rps"], 1)
    assert summary["medians"]["headline"]["grpc"]["open_p50_x@6"] > 0
    assert set(summary["medians"]["floor_headline"]) == {"grpc", "uds"}
    assert summary["settings"]["arms"] == {"grpc": {"ACADEMUS_LOCAL_PLANE": "0"}}
    assert "| grpc |" in capsys.readouterr().out and (tmp_path / "stack_bench.png").exists()
