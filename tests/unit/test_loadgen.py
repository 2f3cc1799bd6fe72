"""Arrival schedules, synthetic lengths and the run report, without a server."""

from __future__ import annotations

import pytest

from academus.loadgen import schedule, texts
from academus.loadgen.cli import ratios
from academus.loadgen.runner import Record, RunResult
from academus.shared.model import teacher_dir
from academus.shared.tokenization import TeacherTokenizer


def test_poisson_rate_and_order():
    times = schedule.poisson(50, 20, seed=1)
    assert 900 < len(times) < 1100
    assert times == sorted(times) and times[0] > 0 and times[-1] < 20
    assert schedule.poisson(50, 20, seed=1) == times


def test_bursts_concentrate_load_in_the_on_window():
    times = schedule.bursts(2, 40, period_s=10, burst_s=2, duration_s=100, seed=3)
    on = sum(1 for t in times if t % 10 < 2)
    assert on > 3 * (len(times) - on)


def test_trace_replay_shifts_and_scales(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("# ts\n100.5,x\n100.0\n101.0\n")
    assert schedule.replay(path, speed=2) == [0.0, 0.25, 0.5]


@pytest.mark.parametrize("spec", ["poisson:-1", "bursts:1,2", "nope:1", "bursts:1,5,2,3"])
def test_bad_schedules_are_named(spec):
    with pytest.raises(ValueError, match="bad schedule"):
        schedule.parse(spec, 10)


def test_normal_lengths_stay_in_bounds_and_tokenize_to_their_length():
    samples = texts.normal_lengths("normal,mean=20,var=100,min=3,max=100", 300, seed=0)
    tokenizer = TeacherTokenizer(teacher_dir())
    lengths = [len(e.input_ids) for e in tokenizer.encode([s.text for s in samples])]
    assert min(lengths) >= 3 and max(lengths) <= 100
    assert 17 < sum(lengths) / len(lengths) < 23


def test_bad_length_distribution_is_named():
    with pytest.raises(ValueError, match="bad length distribution"):
        texts.normal_lengths("normal,mean=20", 5)


def test_report_counts_errors_accuracy_and_percentiles():
    run = RunResult("spam", "fifo", offered_rps=4.0, duration_s=2.0, records=[
        Record(0.0, 10.0, "OK", 1, True), Record(0.1, 20.0, "OK", 1, False),
        Record(0.2, 30.0, "OK", 1, True), Record(0.3, 5.0, "DEADLINE_EXCEEDED")])
    report = run.report()
    assert report["completed"] == 3 and report["errors"] == {"DEADLINE_EXCEEDED": 1}
    assert report["accuracy"] == pytest.approx(2 / 3, abs=1e-4)
    assert report["latency_ms"]["p50"] == pytest.approx(20.0, rel=0.01)
    assert report["throughput_rps"] == 1.5 and report["student_number"] == [(1, 3)]


def test_ratios_against_the_first_run():
    base = {"model": "a", "policy": "fifo", "latency_ms": {"p50": 10, "p95": 20, "p99": 40}, "throughput_rps": 5}
    other = {"model": "b", "policy": "fifo", "latency_ms": {"p50": 5, "p95": 10, "p99": 10}, "throughput_rps": 10}
    assert ratios([base, other]) == [{"run": "b:fifo", "vs": "a:fifo", "p50_ratio": 0.5, "p95_ratio": 0.5,
                                      "p99_ratio": 0.25, "throughput_ratio": 2.0}]
