"""Arrival schedules (tweet-like traces included), synthetic lengths, the run report, timeline, utility,
latency breakdowns and ratios, without a server."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context

from academus.client import AcademusError, InferResult, Metadata, Prediction
from academus.loadgen import analysis, plots, runner, schedule, texts
from academus.loadgen.analysis import ratios
from academus.loadgen.cli import main, summary_lines
from academus.loadgen.exits_live import main as exits_live_main
from academus.loadgen.exits_live import rounds_json, summarize
from academus.loadgen.runner import Record, RunResult
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.tracing import JsonlSpanExporter, read_traces


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


def test_closed_loop_schedule_names_its_callers():
    assert schedule.closed_concurrency("closed:64") == 64
    assert schedule.closed_concurrency("poisson:5") is None
    for bad in ("closed:0", "closed:x", "closed:"):
        with pytest.raises(ValueError, match="closed:N needs a whole number"):
            schedule.closed_concurrency(bad)


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


def test_report_names_each_error_codes_most_frequent_messages():
    full, late = "scheduler 127.0.0.1:1: queue full (256)", "deadline passed in the queue"
    records = [Record(0.1 * i, 5.0 + i, "RESOURCE_EXHAUSTED", details=full) for i in range(3)]
    records += [Record(0.5, 40.0, "DEADLINE_EXCEEDED", details=late), Record(0.6, 1.0, "OK", 1),
                *(Record(0.7, 2.0, "CANCELLED", details=f"m{i}") for i in range(5))]
    examples = RunResult("m", "", 1.0, 1.0, records).report()["error_examples"]
    assert examples["RESOURCE_EXHAUSTED"] == [{"details": full, "count": 3, "p50_ms": 6.0}]
    assert examples["DEADLINE_EXCEEDED"] == [{"details": late, "count": 1, "p50_ms": 40.0}]
    assert len(examples["CANCELLED"]) == 3 and "OK" not in examples


def test_report_gives_how_long_each_error_code_took_to_come_back():
    records = [Record(0.01 * i, float(i + 1), "RESOURCE_EXHAUSTED") for i in range(100)]
    records += [Record(0.5, 4990.0, "DEADLINE_EXCEEDED"), Record(0.6, 8.0, "OK", 1)]
    times = RunResult("m", "", 1.0, 1.0, records).report()["error_latency_ms"]
    assert times["RESOURCE_EXHAUSTED"]["p50"] == pytest.approx(50.5, abs=0.6)
    assert times["RESOURCE_EXHAUSTED"]["p99"] == pytest.approx(99.0, abs=1.1)
    assert times["DEADLINE_EXCEEDED"] == {"p50": 4990.0, "p99": 4990.0} and "OK" not in times


def test_chaos_overload_targets_judge_refusal_time_goodput_and_loss():
    from academus.loadgen.chaos_bench import overload_targets, refusal_p99

    refused = [Record(0.0, 10.0 + i / 10, "RESOURCE_EXHAUSTED") for i in range(100)]
    figures = {"lost": 0, "refusal_p99_ms": refusal_p99(refused), "goodput_rps": 91.0, "probe_refusal_p99_ms": 12.0}
    assert figures["refusal_p99_ms"] == pytest.approx(19.9, abs=0.11)
    assert all(overload_targets(figures, capacity_rps=100.0).values())
    missed = overload_targets(figures | {"lost": 2, "refusal_p99_ms": 4900.0, "goodput_rps": 80.0,
                                         "probe_refusal_p99_ms": None}, 100.0)
    assert not any(missed.values()), missed
    assert refusal_p99([Record(0.0, 3.0, "OK")]) is None


def test_chaos_charges_a_fault_the_failures_beyond_the_reference_in_the_seconds_it_hit():
    """Past capacity fault-free runs fail different shares; a fault's cost is what the requests sent from it until
    its victim served again (NEAR_FAULT_S at least) failed beyond the same seconds of the reference, as a share of
    the whole run."""
    from academus.loadgen.chaos_bench import against_reference, failed_by_second

    def run(far: list[str], near: list[str], late: list[str], back_s: float | None = None) -> dict:
        records = [Record(1.5, 5.0, c) for c in far] + [Record(12.5, 5.0, c) for c in near] + \
            [Record(17.5, 5.0, c) for c in late]
        codes = far + near + late
        return {"sent": len(records), "failed": sum(c != "OK" for c in codes), "p99_models": [], "failed_pct": 0.0,
                "p99_by_models": {}, "failed_by_second": failed_by_second(records, 30.0), "fault_at_s": 10.0,
                "victim_back_s": back_s}

    half = ["OK"] * 10 + ["RESOURCE_EXHAUSTED"] * 10
    reference = run(["OK"] * 30 + ["RESOURCE_EXHAUSTED"] * 30, half, half)
    faulted = run(["OK"] * 16 + ["RESOURCE_EXHAUSTED"] * 44, ["OK"] * 4 + ["UNAVAILABLE"] * 16, ["UNAVAILABLE"] * 20)
    figures = against_reference(faulted, reference)
    assert (figures["excess_failed"], figures["excess_failed_pct"]) == (30, 30.0)   # 80 failed against 50
    assert (figures["near_fault_s"], figures["excess_near_fault"]) == (5, 6)       # 16 against 20 x 0.5, 10-14 s
    slow = against_reference(faulted | {"victim_back_s": 8.2}, reference)         # back at 18.2 s: 10-17 s
    assert (slow["near_fault_s"], slow["excess_near_fault"], slow["excess_near_fault_pct"]) == (8, 16, 16.0)
    lucky = against_reference(run(["OK"] * 60, half, half), reference)
    assert lucky["excess_near_fault"] == lucky["excess_failed"] == 0


def test_chaos_refusals_are_told_apart_by_where_they_were_given():
    from academus.loadgen.chaos_bench import refusals_by_origin

    def refused(ms: float, details: str) -> Record:
        return Record(0.0, ms, "RESOURCE_EXHAUSTED", details=details)

    records = [refused(2.0 + i, "every scheduler serving model 'm' has a full queue; retry in 5 ms") for i in range(3)]
    records += [refused(40.0, "scheduler queue holds about 1200 ms of work ahead; the limit is ..."),
                refused(9.0, "tenant 't' is over its rate limit of 5 requests/s"), refused(1.0, "something else"),
                Record(0.0, 700.0, "DEADLINE_EXCEEDED", details="scheduler queue")]
    by_origin = refusals_by_origin(records)
    assert by_origin["gateway"] == {"count": 3, "p50_ms": 3.0, "p99_ms": pytest.approx(4.0, abs=0.03)}
    assert by_origin["scheduler"]["count"] == by_origin["quota"]["count"] == by_origin["other"]["count"] == 1
    assert by_origin["scheduler"]["p99_ms"] == 40.0 and set(by_origin) == {"gateway", "scheduler", "quota", "other"}


def test_one_read_of_the_mesh_gives_its_counters_refusal_times_and_queue_waits():
    from prometheus_client.samples import Sample

    from academus.loadgen.chaos_bench import metric_figures

    def read(dropped: float, refused: tuple[float, float], waited: tuple[float, float]) -> list:
        bucket = "academus_rpc_error_seconds_bucket"
        waits = "academus_scheduler_queue_wait_seconds_bucket"
        return [("scheduler", Sample("academus_scheduler_dropped_total", {"reason": "cancelled"}, dropped)),
                ("gateway", Sample(bucket, {"code": "RESOURCE_EXHAUSTED", "le": "0.01"}, refused[0])),
                ("gateway", Sample(bucket, {"code": "RESOURCE_EXHAUSTED", "le": "+Inf"}, refused[1])),
                ("gateway", Sample(bucket, {"code": "DEADLINE_EXCEEDED", "le": "+Inf"}, 50.0)),
                ("scheduler", Sample(waits, {"model": "sentiment", "le": "1.0"}, waited[0])),
                ("scheduler", Sample(waits, {"model": "sentiment", "le": "2.0"}, waited[1])),
                ("scheduler", Sample(waits, {"model": "sentiment", "le": "+Inf"}, waited[1]))]

    figures = metric_figures(read(1.0, (0.0, 0.0), (0.0, 0.0)), read(5.0, (100.0, 100.0), (75.0, 100.0)))
    assert figures["counters"] == {"academus_scheduler_dropped_total,reason=cancelled": 4.0}
    assert figures["gateway_refusal_p99_ms"] == pytest.approx(10.0)
    assert figures["queue_wait"]["sentiment"] == {"p99_ms": 2000.0, "over_1s": 0.25, "over_2s": 0.0}
    assert figures["queue_wait"]["sentiment-students"] == {"p99_ms": None, "over_1s": None, "over_2s": None}


def test_the_refusal_probe_reports_its_own_p99_beside_the_load():
    from academus.loadgen.chaos_bench import probe_refusal_p99

    probe = {"OK": {"count": 40, "p50_ms": 300.0, "p99_ms": 900.0},
             "RESOURCE_EXHAUSTED": {"count": 160, "p50_ms": 2.1, "p99_ms": 18.5}}
    assert probe_refusal_p99({"beside": {"refusal_probe": probe}}) == 18.5
    assert probe_refusal_p99({"beside": {"made": 3}}) is None and probe_refusal_p99({}) is None


def test_the_hosts_steal_is_read_from_proc_stat_and_its_largest_step_is_a_runs_pause(tmp_path):
    """A pause of the host's (steal) stalls every process at once: the bench reports the most of it between two
    samples, beside the slowest requests it may explain."""
    import os

    from academus.loadgen.chaos_bench import host_steal_s, steal_figures, table

    stat = tmp_path / "stat"
    stat.write_text("cpu  258545 599 27712 365102 870 0 936 270 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    assert host_steal_s(stat) == pytest.approx(270 / os.sysconf("SC_CLK_TCK"))
    assert host_steal_s(tmp_path / "absent") is None
    assert host_steal_s() is None or host_steal_s() >= 0   # this machine's own, where its kernel counts it
    samples = [{"steal_s": 2.70}, {"steal_s": 2.71}, {"steal_s": None}, {"steal_s": 2.81}, {"steal_s": 2.88}]
    assert steal_figures(samples) == {"total_s": pytest.approx(0.18), "most_between_samples_s": pytest.approx(0.1)}
    assert steal_figures([{"steal_s": 1.0}]) is None and steal_figures([{}, {}]) is None
    row = table({"runs": {"reference": {"sent": 10, "host_steal": steal_figures(samples)}}}).splitlines()[1]
    assert row.split()[-2:] == ["0.10", "-"]   # the steal column, then no errors


def test_the_gateways_share_of_a_refusal_is_the_bucket_holding_its_p99():
    from academus.loadgen.chaos_bench import bucket_p99_ms

    before = {0.001: 5.0, 0.002: 5.0, 0.005: 5.0, float("inf"): 5.0}
    after = {0.001: 905.0, 0.002: 1003.0, 0.005: 1004.0, float("inf"): 1005.0}   # 900, 998, 999, 1000 since
    assert bucket_p99_ms(before, after) == pytest.approx(2.0)   # 998 of 1000 within 2 ms; 990 needed
    assert bucket_p99_ms(before, {**after, 0.002: 904.0}) == pytest.approx(5.0)
    assert bucket_p99_ms(after, after) is None


def test_the_share_of_queue_waits_past_the_bound_comes_from_the_buckets_between_two_reads():
    from academus.loadgen.chaos_bench import bucket_share_over

    before = {0.5: 10.0, 1.0: 10.0, 2.0: 10.0, float("inf"): 10.0}
    after = {0.5: 70.0, 1.0: 85.0, 2.0: 105.0, float("inf"): 110.0}   # 100 since: 75 within 1 s, 95 within 2 s
    assert bucket_share_over(before, after, 1.0) == 0.25 and bucket_share_over(before, after, 2.0) == 0.05
    assert bucket_share_over(after, after, 1.0) is None


async def test_the_metrics_interceptor_times_a_refusal_apart_from_the_answers():
    import grpc
    from prometheus_client import REGISTRY

    from academus.shared.runtime.metrics import MetricsInterceptor

    class Context:
        def __init__(self) -> None:
            self.status = None

        def code(self):
            return self.status

    async def refuse(request, context):
        context.status = grpc.StatusCode.RESOURCE_EXHAUSTED

    async def answer(request, context):
        return "answer"

    def refusals() -> float:
        labels = {"service": "test", "method": "M", "code": "RESOURCE_EXHAUSTED"}
        return REGISTRY.get_sample_value("academus_rpc_error_seconds_count", labels) or 0.0

    interceptor, counted = MetricsInterceptor("test"), refusals()
    await interceptor.wrap(answer, "/x.Y/M")(None, Context())
    assert refusals() == counted
    await interceptor.wrap(refuse, "/x.Y/M")(None, Context())
    assert refusals() == counted + 1


def test_the_soak_reports_each_processs_rss_growth_over_the_second_half():
    from academus.loadgen.chaos_bench import rss_growth

    samples = [{"t": t, "rss_mib": {"worker-0": 600.0 + t, "gateway": 90.0, "gone": None if t > 40 else 5.0}}
               for t in range(0, 61, 10)]
    assert rss_growth(samples, half_s=30) == {"gateway": 0.0, "worker-0": 30.0}   # 630 -> 660; none for "gone"
    assert rss_growth(samples[:1], half_s=0) == {}


def test_ratios_against_the_first_run():
    base = {"model": "a", "policy": "fifo", "latency_ms": {"p50": 10, "p95": 20, "p99": 40}, "throughput_rps": 5,
            "utility": 2.0}
    other = {"model": "b", "policy": "fifo", "latency_ms": {"p50": 5, "p95": 10, "p99": 10}, "throughput_rps": 10,
             "utility": 3.0}
    assert ratios([base, other]) == [{"run": "b:fifo", "vs": "a:fifo", "p50_ratio": 0.5, "p95_ratio": 0.5,
                                      "p99_ratio": 0.25, "throughput_ratio": 2.0, "utility_ratio": 1.5}]


# --- tweet-like trace -------------------------------------------------------------------------------

def outside_bursts(times: list[float], shape: schedule.TweetShape) -> list[float]:
    return [t for t in times if not any(b.covers(t) for b in shape.bursts)]


def test_tweet_trace_follows_the_diurnal_shape():
    shape = schedule.tweet_shape(40, 200, seed=5)
    times = outside_bursts(schedule.tweet(40, 200, seed=5), shape)
    trough = sum(1 for t in times if t < 20 or t >= 180)     # the "night" at both ends
    peak = sum(1 for t in times if 80 <= t < 120)            # midday, as long a window
    assert peak > 2 * trough
    assert not any(b.covers(0) or b.covers(100) for b in shape.bursts)  # this seed's bursts are elsewhere
    assert shape.rate(0) == pytest.approx(0.3 * shape.rate(100))
    assert shape.diurnal_range() == pytest.approx((shape.rate(0), shape.rate(100)))


def test_tweet_trace_keeps_its_mean_rate_and_order():
    times = schedule.tweet(40, 200, seed=5)
    assert times == sorted(times) and times[0] > 0 and times[-1] < 200
    assert 0.9 * 40 < len(times) / 200 < 1.1 * 40


def test_tweet_trace_has_bursts_well_above_the_diurnal_rate():
    shape = schedule.tweet_shape(40, 200, seed=5)
    times = schedule.tweet(40, 200, seed=5)
    assert 2 <= len(shape.bursts) <= 4
    for burst in shape.bursts:
        assert 3 <= burst.factor <= 5 and 0 < burst.length_s <= 5
        inside = sum(1 for t in times if burst.covers(t))
        without_burst = shape.rate(burst.start_s + burst.length_s / 2) / burst.factor * burst.length_s
        assert inside > 2 * without_burst


def test_tweet_trace_is_deterministic_per_seed():
    assert schedule.tweet(20, 60, seed=3) == schedule.tweet(20, 60, seed=3)
    assert schedule.tweet(20, 60, seed=3) != schedule.tweet(20, 60, seed=4)
    assert schedule.parse("tweet:20", 60, seed=3) == schedule.tweet(20, 60, seed=3)


def test_trace_command_writes_a_replayable_file(tmp_path, capsys):
    path = tmp_path / "tweet.trace"
    assert main(["trace", "--kind", "tweet", "--duration", "60", "--mean-rps", "20", "--seed", "2",
                 "--out", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    replayed = schedule.parse(f"trace:{path}", 60)
    expected = schedule.tweet(20, 60, seed=2)
    assert summary["requests"] == len(replayed) == len(expected)
    # replay shifts the first arrival to 0
    assert replayed == pytest.approx([t - expected[0] for t in expected], abs=1e-5)
    assert len(summary["bursts"]) >= 2 and summary["peak_rps"] > 3 * summary["trough_rps"]


# --- runs, timeline, utility, breakdown --------------------------------------------------------------

def test_runs_parse_model_and_optional_policy_and_early_exits():
    RunSpec = analysis.RunSpec
    assert analysis.parse_runs("spam:student, spam:fifo,minilm,spam+early-exit,spam:fifo+early-exit") == [
        RunSpec("spam", "student"), RunSpec("spam", "fifo"), RunSpec("minilm", ""), RunSpec("spam", "", True),
        RunSpec("spam", "fifo", True)]
    assert [r.early_exit for r in analysis.parse_runs("spam,minilm", early_exit=True)] == [True, True]
    assert RunSpec("spam", "fifo", True).label == "spam:fifo+early-exit" and RunSpec("spam").label == "spam"
    for bad in ("spam,:fifo", "+early-exit"):
        with pytest.raises(ValueError, match=r"bad run .* expected MODEL"):
            analysis.parse_runs(bad)


def test_an_early_exit_run_reports_the_answers_each_layer_released_and_is_told_apart_in_ratios():
    records = [Record(0.1, 5.0, "OK", exit_layer=2), Record(0.2, 9.0, "OK"), Record(0.3, 4.0, "OK", exit_layer=2),
               Record(0.4, 3.0, "OK", exit_layer=1), Record(0.5, 50.0, "DEADLINE_EXCEEDED")]
    early = RunResult("spam", "padded", 5.0, 1.0, records, early_exit=True).report()
    assert early["early_exit"] and early["exits"] == {"released_early": 0.75,
                                                      "exit_layers": {"0": 1, "1": 1, "2": 2}}
    plain = RunResult("spam", "padded", 5.0, 1.0, [Record(0.1, 9.0, "OK")]).report()
    assert not plain["early_exit"] and "exits" not in plain
    assert analysis.ratios([plain, early])[0]["run"] == "spam:padded+early-exit"
    lines = summary_lines({"runs": [plain, early]})
    assert lines[2] == "  released early: 0.75 of the answers (layer 1: 1, layer 2: 2)"
    assert lines[1].startswith("spam:padded+early-exit ") and len(lines) == 3


def test_an_early_exit_runs_answers_are_compared_with_the_first_runs_text_by_text():
    """A run's answers against the baseline's for the same texts: early releases that name another label than the
    full model count against the agreement; texts the baseline did not answer, errors and embeddings are left out."""
    base = [Record(0.1, 9.0, "OK", text="win cash", answer="spam"), Record(0.2, 9.0, "OK", text="lunch?", answer="ham"),
            Record(0.3, 9.0, "OK", text="win cash", answer="spam"), Record(0.4, 9.0, "OK", text="hi", answer="ham"),
            Record(0.5, 50.0, "DEADLINE_EXCEEDED", text="lost")]
    early = [Record(0.1, 4.0, "OK", text="win cash", answer="spam", exit_layer=2),
             Record(0.2, 4.0, "OK", text="lunch?", answer="spam", exit_layer=1),
             Record(0.3, 9.0, "OK", text="hi", answer="ham"), Record(0.4, 9.0, "OK", text="win cash", answer="spam"),
             Record(0.5, 4.0, "OK", text="lost", answer="ham", exit_layer=2),
             Record(0.6, 50.0, "UNAVAILABLE", text="hi")]
    assert analysis.agreement(base, early) == {"agreement": 0.75, "compared": 4}
    assert analysis.agreement(base, []) is None
    assert analysis.agreement([Record(0.1, 9.0, "OK", text="t")], [Record(0.1, 9.0, "OK", text="t")]) is None
    report = {"runs": [RunResult("spam", "padded", 5.0, 1.0, base).report(),
                       RunResult("spam", "padded", 5.0, 1.0, early, early_exit=True).report()]}
    report["ratios_vs_first"] = analysis.ratios(report["runs"])
    report["ratios_vs_first"][0]["answers"] = analysis.agreement(base, early)
    assert summary_lines(report)[-1] == "  answers agreeing with spam:padded's for the same texts: 0.75 of 4"


def test_an_answer_is_recorded_with_what_was_sent():
    meta = Metadata("padded", 1, 0, "w", 1.0, 0.1, 0.5, 0.1, 0.3, 0.3, 1, False)
    answer = InferResult("spam", "r", [Prediction(label="ham", exit_layer=3)], meta)
    alone = runner.answered(texts.Sample("hello", "ham"), 0.0, 1.0, answer, "g")
    pair = runner.answered(texts.Sample("a passage", None, "the query"), 0.0, 1.0, answer, "g")
    assert (alone.text, alone.answer, alone.exit_layer, alone.correct) == ("hello", "ham", 3, True)
    assert pair.text == "the query\x00a passage" and pair.correct is None


def test_timeline_bins_sends_and_answers_by_second():
    records = [Record(0.1, 100.0, "OK", 2), Record(0.5, 700.0, "OK", 4), Record(0.9, 200.0, "OK", 3),
               Record(1.2, 50.0, "UNAVAILABLE"), Record(1.5, 1000.0, "OK", 1)]
    bins = analysis.timeline(records, duration_s=2.0)
    assert [b["t"] for b in bins] == [0.0, 1.0, 2.0]       # the 2.5 s answer gets a tail bin
    assert [b["offered"] for b in bins] == [3, 2, 0]
    assert [b["completed"] for b in bins] == [1, 2, 1]      # answers at 0.2 | 1.2, 1.1 | 2.5
    assert [b["errors"] for b in bins] == [0, 1, 0]
    assert [b["offered_failed"] for b in bins] == [0, 1, 0]   # by when it was sent: 1.2 s
    assert bins[0]["p50_ms"] == 100.0 and bins[1]["students_mean"] == 3.5 and bins[2]["p50_ms"] == 1000.0


def test_timeline_leaves_empty_bins_without_latency():
    bins = analysis.timeline([Record(0.1, 10.0, "OK", 1)], duration_s=3.0)
    assert [b["completed"] for b in bins] == [1, 0, 0]
    assert bins[1]["p50_ms"] is None and bins[1]["students_mean"] is None


def test_utility_counts_answers_within_their_deadline():
    records = [Record(0.0, 10.0, "OK", tokens=10), Record(0.0, 90.0, "OK", tokens=4),
               Record(0.0, 150.0, "OK", tokens=2),           # late
               Record(0.0, 10.0, "DEADLINE_EXCEEDED", tokens=0)]
    assert analysis.utility(records, deadline_ms=100) == pytest.approx(1 / 10 + 1 / 4)
    assert analysis.utility(records, deadline_ms=None) == pytest.approx(1 / 10 + 1 / 4 + 1 / 2)


def meta(**ms: float) -> Metadata:
    fields = {"gateway_ms": 0.0, "tokenize_ms": 0.0, "scheduler_ms": 0.0, "queue_ms": 0.0, "worker_ms": 0.0,
              "compute_ms": 0.0} | ms
    return Metadata(policy="fifo", batch_size=1, student_count=0, worker_id="w0", attempts=1, **fields)


def test_breakdown_takes_the_median_of_each_hop():
    records = [
        Record(0.0, 12.0, "OK", meta=meta(gateway_ms=10, tokenize_ms=1, scheduler_ms=8, queue_ms=2, worker_ms=5,
                                          compute_ms=4)),
        Record(0.0, 30.0, "OK", meta=meta(gateway_ms=25, tokenize_ms=2, scheduler_ms=20, queue_ms=10, worker_ms=8,
                                          compute_ms=6)),
        Record(0.0, 20.0, "OK", meta=meta(gateway_ms=16, tokenize_ms=3, scheduler_ms=14, queue_ms=4, worker_ms=7,
                                          compute_ms=5)),
        Record(0.0, 99.0, "UNAVAILABLE"),
    ]
    assert analysis.breakdown(records) == {"gateway": 2.0, "tokenize": 2.0, "queue": 4.0, "compute": 5.0,
                                           "worker_overhead": 2.0, "scheduler_overhead": 2.0, "network": 4.0}
    assert analysis.breakdown(records[3:]) == {}


def test_tail_breakdown_averages_the_slowest_answers_only():
    fast = [Record(0.0, 10.0, "OK", meta=meta(gateway_ms=9, scheduler_ms=8, worker_ms=6, compute_ms=5))
            for _ in range(19)]
    slow = Record(0.0, 50.0, "OK", meta=meta(gateway_ms=48, scheduler_ms=47, queue_ms=30, worker_ms=7,
                                             compute_ms=6))
    tail = analysis.tail_breakdown([*fast, slow, Record(0.0, 99.0, "UNAVAILABLE")])
    assert tail == {"gateway": 1.0, "tokenize": 0.0, "queue": 30.0, "compute": 6.0, "worker_overhead": 1.0,
                    "scheduler_overhead": 10.0, "network": 2.0, "answers": 1}
    assert analysis.tail_breakdown(fast)["answers"] == 19, "equal latencies: all are at the 95th percentile"
    assert analysis.tail_breakdown([]) == {}


def write_spans(path, durations_ms: list[tuple[float, float, float]]) -> None:
    """One trace per (gateway server, gateway->worker client, worker server) durations, through the real
    JSON-lines exporter of shared/runtime/tracing.py."""
    exporter = JsonlSpanExporter(path)
    tracers = {name: TracerProvider(resource=Resource.create({"service.name": f"academus-{name}"}))
               for name in ("gateway", "worker")}
    for provider in tracers.values():
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway, worker = (tracers[n].get_tracer("test") for n in ("gateway", "worker"))
    t0 = 1_000_000_000
    for root_ms, client_ms, server_ms in durations_ms:
        root = gateway.start_span("/academus.v1.Inference/Infer", kind=SpanKind.SERVER, start_time=t0)
        call = gateway.start_span("/academus.v1.Worker/Run", context=set_span_in_context(root),
                                  kind=SpanKind.CLIENT, start_time=t0 + 1_000_000)
        served = worker.start_span("/academus.v1.Worker/Run", context=set_span_in_context(call),
                                   kind=SpanKind.SERVER, start_time=t0 + 1_500_000)
        for span, ms, start in ((served, server_ms, 1_500_000), (call, client_ms, 1_000_000), (root, root_ms, 0)):
            span.end(end_time=t0 + start + int(ms * 1e6))
        t0 += 100_000_000


def test_span_breakdown_from_the_exporters_json_lines(tmp_path):
    path = tmp_path / "traces.jsonl"
    write_spans(path, [(10, 6, 4), (20, 9, 6), (30, 12, 7)])
    spans = [s for trace in read_traces([path]).values() for s in trace]
    result = analysis.span_breakdown(spans)
    assert result["traces"] == 3
    rows = {(r["service"], r["kind"], r["name"]): (r["count"], r["p50_ms"]) for r in result["spans"]}
    assert rows == {("academus-gateway", "SERVER", "/academus.v1.Inference/Infer"): (3, 20.0),
                    ("academus-gateway", "CLIENT", "/academus.v1.Worker/Run"): (3, 9.0),
                    ("academus-worker", "SERVER", "/academus.v1.Worker/Run"): (3, 6.0)}
    assert result["hops"] == [{"from": "academus-gateway", "to": "academus-worker", "name": "/academus.v1.Worker/Run",
                               "count": 3, "p50_ms": 3.0, "p95_ms": 5.0}]


def test_breakdown_command_prints_json_last(tmp_path, capsys):
    path = tmp_path / "traces.jsonl"
    write_spans(path, [(10, 6, 4)])
    assert main(["breakdown", "--traces", str(path)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["traces"] == 1
    assert main(["breakdown", "--traces", str(tmp_path / "missing.jsonl")]) == 1


def test_report_holds_utility_breakdown_and_timeline():
    run = RunResult("spam", "student", offered_rps=2.0, duration_s=2.0, deadline_ms=100.0, records=[
        Record(0.2, 20.0, "OK", 3, tokens=5, meta=meta(gateway_ms=15, scheduler_ms=10, worker_ms=8, compute_ms=6)),
        Record(1.2, 500.0, "OK", 2, tokens=5)])
    report = run.report()
    assert report["utility"] == pytest.approx(0.2) and report["utility_per_s"] == pytest.approx(0.1)
    assert report["breakdown_ms"]["network"] == 5.0 and report["breakdown_ms"]["compute"] == 6.0
    assert [b["completed"] for b in report["timeline"]] == [1, 1]
    assert [b["students_mean"] for b in report["timeline"]] == [3.0, 2.0]


def test_timeline_plot_is_written(tmp_path):
    run = RunResult("spam", "fifo", 2.0, 2.0, records=[Record(0.2, 20.0, "OK", 3), Record(1.2, 30.0, "OK", 2)])
    assert plots.timeline(run, tmp_path / "t.png").stat().st_size > 1000


def test_embedding_student_variants_change_one_thing_each():
    from academus.loadgen.probes.embedding_student_bench import VARIANTS, variant_config

    base = variant_config("base")
    assert base.max_students == 1 and base.boost_epochs == 1.0 and base.layers == 2
    assert variant_config("layers3").layers == 3
    more = variant_config("more")   # twice the texts, half a pass: the same number of steps
    assert more.boost_epochs == 0.5 and more.extra_sotu == VARIANTS["more"]["extra_sotu"] > 12000


def test_closed_callers_keep_at_most_n_in_flight_and_send_each_index_once():
    import asyncio

    from academus.loadgen.runner import closed_callers

    sent: list[int] = []
    in_flight, peak = 0, 0

    async def send(i: int) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        sent.append(i)
        await asyncio.sleep(0.005)
        in_flight -= 1

    elapsed = asyncio.run(closed_callers(3, 0.1, send))
    assert peak == 3 and elapsed >= 0.1
    assert len(sent) == len(set(sent)) > 6
    assert sorted(sent)[:3] == [0, 1, 2]   # caller k sends k, k + 3, k + 6, ...
    assert all(i - 3 in sent for i in sent if i >= 3)


def test_student_bench_starts_at_the_best_pruned_k_unless_told():
    from academus.loadgen.student_bench import start_students

    spec = {"max_students": 4, "default_students": 1}
    assert start_students(spec, 0) == 1            # where the resource manager starts the group
    assert start_students(spec, 2) == 2 and start_students(spec, 9) == 4
    assert start_students({"max_students": 3, "default_students": 0}, 0) == 3


def test_student_bench_takes_the_median_of_the_half_load_rounds():
    from academus.loadgen.student_bench import summarise

    def run(model: str, p50: float, p95: float) -> dict:
        return {"model": model, "policy": "p", "latency_ms": {"p50": p50, "p95": p95}, "throughput_rps": 10.0,
                "timeline": [], "accuracy": 0.5, "breakdown_ms": {}, "tail_breakdown_ms": {}}

    halves = [{"runs": [run("t", 50, t95), run("s", 15, s95), run("2l", 25, 40)]}
              for t95, s95 in ((100, 30), (160, 32), (80, 28))]   # (a) per round: 0.3, 0.2, 0.35
    capacities = [run("t", 1, 1) | {"cpu_ms_per_request": {}}, run("s", 1, 1) | {"cpu_ms_per_request": {}}]
    summary = summarise(capacities, halves, {"runs": [run("t", 1, 1), run("s", 1, 1)]}, {}, 10.0)
    assert summary["a_p95_students_vs_teacher"] == 0.3
    assert [r["a_p95"] for r in summary["half_load_rounds"]] == [0.3, 0.2, 0.35]
    assert summary["b_p95_students_vs_single_2l"] == 0.75 and summary["a_p50_students_vs_teacher"] == 0.3


def test_half_load_bench_counts_the_collections_between_two_readings():
    from academus.loadgen.half_load_bench import collections

    def reading(count: float, total_s: float, buckets: dict[str, float], gen: str = "2") -> dict:
        return {("academus_gc_pause_seconds_count", gen, ""): count,
                ("academus_gc_pause_seconds_sum", gen, ""): total_s} | {
            ("academus_gc_pause_seconds_bucket", gen, le): v for le, v in buckets.items()}

    before = reading(1, 0.01, {"0.05": 1, "0.1": 1, "0.2": 1, "+Inf": 1})
    after = reading(3, 0.25, {"0.05": 1, "0.1": 2, "0.2": 3, "+Inf": 3}) | reading(5, 0.001, {"0.05": 5}, gen="0")
    assert collections(before, after) == {"0": {"count": 5, "total_ms": 1.0, "longest_le_ms": 50.0},
                                          "2": {"count": 2, "total_ms": 240.0, "longest_le_ms": 200.0}}
    assert collections(after, after) == {}


def test_half_load_bench_arms_set_a_switch_or_change_a_mesh_option():
    import argparse

    from academus.loadgen.half_load_bench import arm_setting

    args = argparse.Namespace(ablate="workers", workers=2, instances=1)
    arm_args, env = arm_setting(args, 3)
    assert (arm_args.workers, arm_args.instances, env, args.workers) == (3, 1, {}, 2)  # the caller's args untouched
    args = argparse.Namespace(ablate="gc_freeze", workers=2, instances=1)
    assert arm_setting(args, "false") == (args, {"ACADEMUS_GC_FREEZE": "false"})


def test_half_load_bench_compares_two_model_sets_by_their_directories(tmp_path):
    import argparse

    from academus.loadgen.half_load_bench import arm_setting, arms_of

    args = argparse.Namespace(ablate="artifacts", artifacts=tmp_path / "full", other_artifacts=tmp_path / "narrow")
    assert arms_of(args) == [("other_artifacts", tmp_path / "narrow"), ("artifacts", tmp_path / "full")]
    assert arm_setting(args, tmp_path / "narrow")[0].artifacts == tmp_path / "narrow"
    with pytest.raises(SystemExit, match="--other-artifacts"):
        arms_of(argparse.Namespace(ablate="artifacts", artifacts=tmp_path / "full", other_artifacts=None))
    assert arms_of(argparse.Namespace(ablate="gc_freeze"))[0] == ("frozen", "true")


def test_serving_profile_classifies_each_sample_by_its_stack():
    from academus.loadgen.serving_profile import classify, shares

    lib, site = "/py/lib/python3.11", "/py/lib/python3.11/site-packages"
    loop = f"run ({site}/uvloop/__init__.py:92);Runner.run ({lib}/asyncio/runners.py:118)"
    lines = [f"{loop} 6",                                                                   # C under the loop
             f"Thread._bootstrap ({lib}/threading.py:1002);Thread.run ({lib}/threading.py:982) 2",  # the poller
             f"{loop};UnaryUnaryCall._invoke ({site}/grpc/aio/_call.py:595) 2",
             f"{loop};Gateway.tokenize (/w/services/gateway/core.py:205) 2",
             f"{loop};ServerSpans.wrap.<locals>.wrapped (/w/shared/tracing.py:111);"  # the span wraps the handler
             "Infer (/w/services/gateway/server.py:117) 3",
             f"{loop};ClientSpans.intercept (/w/shared/tracing.py:142);start_span ({site}/opentelemetry/t.py:1) 2",
             f"_worker ({lib}/t.py:81);Module._call_impl ({site}/torch/nn/modules/module.py:1789);pool (/w/m.py:53) 3"]
    assert shares(lines) == {"grpc_and_loop": 0.5, "model": 0.15, "python": 0.25, "tracing": 0.1, "samples": 20}
    assert classify([f"Thread.run ({lib}/threading.py:982)",
                     f"BatchProcessor.worker ({site}/opentelemetry/sdk/_shared_internal/__init__.py:162)"]) == "tracing"
    assert classify([f"Thread.run ({lib}/threading.py:982)", f"select ({lib}/selectors.py:415)"]) == "python"
    export = [f"Thread.run ({lib}/threading.py:982)", "export (/w/shared/tracing.py:39)", f"dumps ({lib}/json/x.py:2)"]
    assert classify(export) == "tracing"  # the standard library's frames count for their caller


def test_serving_profile_reads_each_threads_cpu_and_switches_a_request():
    import os

    from academus.loadgen.serving_profile import per_request, threads_reading

    before = {"cpu:python": 1.0, "cpu:event_engine": 0.25, "voluntary_ctxt_switches": 100,
              "nonvoluntary_ctxt_switches": 10}
    after = {"cpu:python": 1.5, "cpu:event_engine": 0.35, "cpu:new": 0.05, "voluntary_ctxt_switches": 400,
             "nonvoluntary_ctxt_switches": 60}
    assert per_request(before, after, 100) == {
        "cpu_ms_per_request": {"event_engine": 1.0, "new": 0.5, "python": 5.0},
        "switches_per_request": {"voluntary": 3.0, "nonvoluntary": 0.5}}
    reading = threads_reading(os.getpid())  # this process, from /proc: its main thread at least
    assert reading["voluntary_ctxt_switches"] >= 1 and any(k.startswith("cpu:") for k in reading)


def test_stat_cpu_s_reads_user_plus_system_past_a_command_name_with_spaces():
    import os
    from pathlib import Path

    from academus.loadgen.bench import stat_cpu_s

    tick = os.sysconf("SC_CLK_TCK")
    fields = ["S"] + ["0"] * 10 + [str(3 * tick), str(tick)] + ["0"] * 30   # utime, stime: fields 14, 15
    assert stat_cpu_s("123 (a) b (c) " + " ".join(fields)) == 4.0
    assert stat_cpu_s(Path(f"/proc/{os.getpid()}/stat").read_text()) > 0


def test_shares_interleave_the_schedule_with_the_texts_one_process_would_send():
    from academus.loadgen.shares import merge, split
    from academus.loadgen.texts import Sample

    arrivals, samples = [0.1 * i for i in range(7)], [Sample(f"t{i}") for i in range(3)]
    shares = split(arrivals, samples, 3)
    assert [s.arrivals for s in shares] == [arrivals[0::3], arrivals[1::3], arrivals[2::3]]
    sent = {at: s.samples[j % len(s.samples)].text for s in shares for j, at in enumerate(s.arrivals)}
    assert sent == {at: samples[i % 3].text for i, at in enumerate(arrivals)}
    assert [s.concurrency for s in split([], samples, 3, concurrency=7)] == [3, 2, 2]
    assert [s.concurrency for s in split([], samples, 4, concurrency=2)] == [1, 1]   # no idle process
    assert len(split([0.0], samples, 4)) == 1
    with pytest.raises(ValueError, match="--procs must be >= 1"):
        split(arrivals, samples, 0)
    parts = [RunResult("m", "", None, 3.0, [Record(0.2, 5.0, "OK"), Record(0.9, 6.0, "OK")], 5000.0, "student"),
             RunResult("m", "student", None, 3.4, [Record(0.5, 7.0, "UNAVAILABLE")], 5000.0, "student")]
    merged = merge(parts, offered_rps=1.0, concurrency=None)
    assert [r.sent_at for r in merged.records] == [0.2, 0.5, 0.9] and merged.duration_s == 3.4
    assert merged.policy == "student" and merged.report()["sent"] == 3 and merged.offered_rps == 1.0


def test_grpc_core_refuses_calls_past_its_pending_limit_as_cancelled():
    """What the H200 bursts met at the gateway: calls the server's loop has not yet taken, past grpc-core's
    pending limit, end CANCELLED with no message of the server's; under the limit, every call is served."""
    import asyncio

    from academus.loadgen.probes.grpc_backlog import measure

    assert asyncio.run(measure(40, 0.2))["codes"] == {"OK": 40}
    flooded = asyncio.run(measure(300, 0.5, pending_limit=20))
    assert flooded["codes"].get("CANCELLED", 0) > 0 and flooded["codes"].get("OK", 0) > 0
    assert set(flooded["messages"]) == {"CANCELLED: CANCELLED"}
    framed = asyncio.run(measure(300, 0.5, pending_limit=20, streams=True))  # one call: nothing pends in grpc-core
    assert framed["codes"] == {"OK": 300}


def test_an_overloaded_stream_server_refuses_stamped_frames_that_waited_half_their_timeout():
    """stream_backlog's stamped arm at five times the server's capacity: the frames that waited half of
    their timeout are refused unrun, every other one runs its handler and is answered, none is lost."""
    from academus.loadgen.probes.stream_backlog import run_arm

    arm = run_arm(True, cost_s=0.005, rate=1000.0, duration_s=1.0, timeout_s=0.2)
    assert arm["sent"] == 1000 and "unanswered" not in arm
    assert arm.get("refused_RESOURCE_EXHAUSTED", 0) > 0 and arm.get("in_time", 0) > 0
    assert arm["handler_runs"] == arm.get("in_time", 0) + arm.get("late", 0)   # every run was answered
    assert sum(v for k, v in arm.items() if k in ("in_time", "late") or k.startswith("refused_")) == 1000


def test_a_client_honouring_the_backlogs_pushback_holds_off_what_falls_due_and_loses_nothing():
    """stream_backlog's honouring arm: after a refusal the client sends nothing for the hint (1000 ms, the
    old cap, here longer than the run), so the frames due then are held off, and every frame is accounted."""
    from academus.loadgen.probes.stream_backlog import run_arm

    arm = run_arm(True, cost_s=0.005, rate=1000.0, duration_s=1.0, timeout_s=0.2, pushback_cap_ms=1000)
    assert arm["honour_pushback"] and arm["pushback_cap_ms"] == 1000 and "unanswered" not in arm
    assert arm.get("refused_RESOURCE_EXHAUSTED", 0) > 0 and arm.get("held_off", 0) > 0
    assert sum(v for k, v in arm.items() if k in ("in_time", "late", "held_off") or k.startswith("refused_")) == 1000


def test_a_client_reacting_once_a_round_trip_is_not_held_off_again_by_its_stale_backlog():
    """stream_backlog's hold-off rules: every refusal renews the hold-off (the gateway's), or, once a round
    trip, only the refusal of a frame sent since the hold-off began."""
    from academus.loadgen.probes.stream_backlog import ClientHoldOff

    renewing, once = ClientHoldOff(), ClientHoldOff(once_a_round_trip=True)
    for hold in (renewing, once):
        assert hold.open(0.0)
        hold.refused(50, sent_at=0.0, now=1.0)            # the first refusal: held until 1.05
        assert not hold.open(1.04)
        hold.refused(50, sent_at=0.5, now=1.04)           # a frame sent before the hold-off, refused later
    assert not renewing.open(1.06) and renewing.open(1.09)
    assert once.open(1.06)
    once.refused(50, sent_at=1.06, now=1.2)               # sent since: news
    assert not once.open(1.24) and once.open(1.25)


def test_the_load_generator_reads_only_its_own_setting_from_a_services_environment(monkeypatch):
    """A shell set up for a service (a bad ACADEMUS_PORT here) does not stop the load generator, while a bad
    slice, its own setting, is still refused by name."""
    from academus.loadgen.cli import hop_slice_us
    from academus.shared.runtime.config import ConfigError

    monkeypatch.setenv("ACADEMUS_PORT", "not-a-port")
    monkeypatch.setenv("ACADEMUS_HOP_SLICE_US", "500")
    assert hop_slice_us() == 500
    monkeypatch.setenv("ACADEMUS_HOP_SLICE_US", "5")
    with pytest.raises(ConfigError, match="ACADEMUS_HOP_SLICE_US=5"):
        hop_slice_us()
    monkeypatch.delenv("ACADEMUS_HOP_SLICE_US")
    assert hop_slice_us() == 0


def test_by_gateway_counts_each_addresss_requests_and_answered_latencies():
    records = [Record(0.0, 10.0, "OK", gateway="a:1"), Record(0.1, 30.0, "OK", gateway="a:1"),
               Record(0.2, 5.0, "DEADLINE_EXCEEDED", gateway="a:1"), Record(0.3, 20.0, "OK", gateway="b:2"),
               Record(0.4, 1.0, "RESOURCE_EXHAUSTED", gateway="b:2")]
    out = RunResult("spam", "fifo", 10.0, 1.0, records).report()["by_gateway"]
    assert {g: (v["sent"], v["completed"]) for g, v in out.items()} == {"a:1": (3, 2), "b:2": (2, 1)}
    assert out["b:2"]["p50_ms"] == out["b:2"]["p95_ms"] == 20.0 and 10.0 < out["a:1"]["p95_ms"] <= 30.0


class BlockingGateway:
    """Stands in for a gateway's client whose answers take the load generator's loop `block_s` of CPU:
    a generator saturated by its own reply handling."""

    def __init__(self, block_s: float) -> None:
        self.block_s = block_s

    async def infer(self, model, texts, timeout=None, policy="", early_exit=False, pairs=None):
        time.sleep(self.block_s)   # holds the event loop, as a busy generator's handling does
        raise AcademusError(grpc.StatusCode.UNAVAILABLE, "refused by the stand-in")


class OneGateway:
    def __init__(self, client) -> None:
        self.client = client

    def next(self):
        return "stand-in:1", self.client


def test_send_lateness_reports_a_generator_that_fell_behind_its_schedule(capsys):
    """20 sends scheduled 1 ms apart, each holding the loop 10 ms: the last goes out >= 190 ms after the
    start, scheduled at 19 ms, and the report and the CLI's summary say so."""
    arrivals = [i * 1e-3 for i in range(20)]
    samples = [texts.Sample("a text", None)]
    result = asyncio.run(runner.run(OneGateway(BlockingGateway(0.01)), "spam", arrivals, samples, 5.0, 0.02))
    late = result.report()["send_late_ms"]
    assert late["max"] >= 170.0 and late["p50"] >= 50.0 and late["p50"] <= late["p99"] <= late["max"], late
    assert all(r.code == "UNAVAILABLE" and r.gateway == "stand-in:1" for r in result.records)
    report = {"runs": [result.report()]}
    assert any("fell behind its schedule" in line for line in summary_lines(report))


def test_send_lateness_is_absent_for_a_closed_loop_and_quiet_on_schedule():
    closed = RunResult("spam", "fifo", None, 1.0, [Record(0.0, 1.0, "OK")], concurrency=4).report()
    assert closed["send_late_ms"] is None
    on_time = RunResult("spam", "fifo", 10.0, 1.0, [Record(0.0, 1.0, "OK", late_ms=0.4),
                                                    Record(0.1, 1.0, "OK", late_ms=2.0),
                                                    Record(0.2, 1.0, "UNAVAILABLE", late_ms=1.0)]).report()
    assert on_time["send_late_ms"] == {"p50": 1.0, "p99": 2.0, "max": 2.0}
    assert not any("behind" in line for line in summary_lines({"runs": [on_time]}))


def test_bursts_get_a_load_generator_process_per_800_requests_a_second_of_their_peak():
    from academus.loadgen.student_bench import burst_procs, run_options

    assert burst_procs(1, 390.0) == 1 and burst_procs(4, 5643.0) == 8 and burst_procs(16, 5643.0) == 16
    args = argparse.Namespace(duration=12.0, task="sentiment", timeout=5.0, procs=4, streams=True)
    assert run_options(args, procs=8)[-3:] == ["--procs", "8", "--streams"]
    assert run_options(args)[-3:] == ["--procs", "4", "--streams"]


def test_stack_bench_arms_name_their_settings_for_every_service():
    from academus.loadgen.stack_bench import Arm, parse_arm

    assert parse_arm("local=ACADEMUS_LOCAL_PLANE=1,ACADEMUS_FRAME_BATCHES=false") == Arm(
        "local", {"ACADEMUS_LOCAL_PLANE": "1", "ACADEMUS_FRAME_BATCHES": "false"})
    assert parse_arm("defaults") == Arm("defaults", {})
    assert parse_arm("url=ACADEMUS_X=a=b") == Arm("url", {"ACADEMUS_X": "a=b"})   # a value may hold "="
    for bad in ("=ACADEMUS_X=1", "a=ACADEMUS_X", "a=ACADEMUS_X=1,=2", "a=ACADEMUS_X=1,"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=ENV=VALUE"):
            parse_arm(bad)


def test_stack_bench_reads_its_own_cpu_and_switches_from_proc():
    import os

    from academus.loadgen.stack_bench import per_request, reading

    before = reading(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:   # CPU past a clock tick or two
        pass
    for _ in range(5):
        time.sleep(0.002)              # each sleep gives the core up: a voluntary switch
    after = reading(os.getpid())
    assert after["cpu_s"] - before["cpu_s"] >= 0.02
    assert after["voluntary_switches"] - before["voluntary_switches"] >= 5
    assert per_request({"cpu_s": 1.0, "voluntary_switches": 100}, {"cpu_s": 1.5, "voluntary_switches": 400},
                       100) == {"cpu_ms": 5.0, "voluntary_switches": 3.0}


def test_stack_bench_merges_the_load_generators_shares():
    from academus.loadgen.stack_bench import merge_shares

    def readings(**values: tuple[float, int]) -> dict[str, dict[str, float]]:
        return {name.replace("_", "-"): {"cpu_s": cpu, "voluntary_switches": switches}
                for name, (cpu, switches) in values.items()}

    reading = readings(gateway=(1.0, 10), scheduler=(2.0, 0), worker_0=(0.0, 0), redis=(0.0, 0))
    later = readings(gateway=(1.4, 50), scheduler=(2.2, 40), worker_0=(0.4, 100), redis=(1.0, 9))
    share = {"latencies_ms": [1.0] * 60, "errors": {"UNAVAILABLE": 1}, "duration_s": 2.0, "late_start_s": 0.01,
             "before": {"cpu_s": 0.0, "voluntary_switches": 0}, "after": {"cpu_s": 0.1, "voluntary_switches": 20}}
    merged = merge_shares([share, share | {"latencies_ms": [3.0] * 40, "duration_s": 2.5}], reading, later)
    assert merged["completed"] == 100 and merged["errors"] == {"UNAVAILABLE": 2}
    assert merged["throughput_rps"] == 40.0   # over the longer share's seconds
    assert merged["latency_ms"]["p50"] == 1.0 and merged["latency_ms"]["p99"] == 3.0
    assert merged["processes"]["loadgen-1"] == {"cpu_ms": 1.0, "voluntary_switches": 0.2}
    assert merged["stack_cpu_ms"] == 10.0 and merged["stack_voluntary_switches"] == 1.8   # redis is not the stack


def stack_round(scale: float) -> dict:
    """A stack_bench round's raw figures: two arms, the second `scale` times faster than the first."""
    def capacity(callers: int, rps: float) -> dict:
        return {"callers": callers, "throughput_rps": rps, "latency_ms": {"p50": 1000 * callers / rps, "p99": 99.0},
                "stack_cpu_ms": 2000 / rps, "stack_voluntary_switches": 10.0}

    def arm(rps: float) -> dict:
        return {"sequential": {"e2e_ms": {"p50": 4000 / rps, "p99": 8000 / rps}},
                "capacity": {"64": capacity(64, rps), "256": capacity(256, rps)}}

    floor = {"latency_ms": {"p50": 0.5, "p99": 1.0}, "capacity": {"callers": 64, "throughput_rps": 2000.0,
                                                                 "latency_ms": {"p50": 30.0, "p99": 60.0}}}
    return {"floors": {"grpc": floor, "uds": floor | {"latency_ms": {"p50": 0.1, "p99": 0.2}}},
            "arms": {"grpc": arm(1000.0), "local": arm(1000.0 * scale)}}


def test_stack_bench_ratios_to_the_floors_and_the_first_arm_and_their_medians():
    from academus.loadgen.stack_bench import medians, parse_arm, ratio, round_figures

    arms = [parse_arm("grpc=ACADEMUS_LOCAL_PLANE=0"), parse_arm("local=ACADEMUS_LOCAL_PLANE=1")]
    rounds = [round_figures(stack_round(s), arms, 64) for s in (2.0, 4.0, 2.5)]
    first = rounds[0]
    assert first["headline"]["grpc"] | first["floor_headline"]["grpc"] == first["headline"]["grpc"] | {
        "p50_ms": 0.5, "p99_ms": 1.0, "rps@64": 2000.0, "p50_ms@64": 30.0, "p99_ms@64": 60.0}
    assert first["floor_ratios"]["grpc"]["p50_ms / grpc floor"] == 8.0
    assert first["floor_ratios"]["grpc"]["p50_ms / uds floor"] == 40.0
    assert first["floor_ratios"]["local"]["rps@256 / grpc floor"] == 1.0   # against the floor's 64 callers
    versus = first["versus"]["local/grpc"]
    assert versus["p50_ms"] == 0.5 and versus["rps@256"] == 2.0 and versus["stack_cpu_ms@256"] == 0.5
    assert medians([r["versus"]["local/grpc"] for r in rounds])["rps@256"] == 2.5
    assert medians([{"a": 1.0, "b": None}, {"a": 3.0, "b": 2.0}, {"a": 2.0}]) == {"a": 2.0, "b": 2.0}
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None


def test_stack_bench_many_connections_figures_are_the_open_runs_and_its_p50_as_a_multiple():
    from academus.loadgen.stack_bench import headline

    connections = {"connections": 512, "latency_ms": {"p50": 6.0, "p99": 30.0}}
    figures = headline({"p50": 1.5, "p99": 3.0}, [], connections)
    assert figures == {"p50_ms": 1.5, "p99_ms": 3.0, "open_p50_ms@512": 6.0, "open_p99_ms@512": 30.0,
                       "open_p50_x@512": 4.0}
    assert headline({"p50": 1.5, "p99": 3.0}, []) == {"p50_ms": 1.5, "p99_ms": 3.0}


def test_stack_bench_writes_its_json_table_and_plot(tmp_path, capsys):
    from academus.loadgen.stack_bench import median_figures, parse_arm, round_figures, write

    arms = [parse_arm("grpc=ACADEMUS_LOCAL_PLANE=0"), parse_arm("local=ACADEMUS_LOCAL_PLANE=1")]
    rounds = [round_figures(stack_round(s), arms, 64) for s in (2.0, 3.0)]
    settings = {"model": "null", "rounds": 2, "callers": [64, 256], "floor_callers": 64}
    write({"settings": settings, "rounds": rounds, "medians": median_figures(rounds)}, tmp_path)
    table = (tmp_path / "stack_bench.md").read_text()
    assert table in capsys.readouterr().out
    assert "| local | 1.667 | 3.333 | 2500 | 2500 |" in table   # sequential, then each metric at 64 and 256
    assert "| grpc floor (3 hops) | 0.5 | 1 | 2000 |  |" in table
    assert "| local/grpc | 0.416 | 0.416 | 2.5 | 2.5 |" in table
    assert json.loads((tmp_path / "stack_bench.json").read_text())["medians"]["headline"]["local"]["rps@64"] == 2500
    assert (tmp_path / "stack_bench.png").read_bytes()[:4] == b"\x89PNG"


def test_uds_floor_frames_are_cut_whole_across_reads():
    from academus.loadgen.uds_floor import Framed, MessageBuffer, pack  # the plane's framing

    buffer = MessageBuffer()
    assert buffer.feed(pack(b"one") + pack(b"") + pack(b"three")[:5]) == [b"one", b""]
    assert buffer.data == bytearray(pack(b"three")[:5])
    assert buffer.feed(pack(b"three")[5:]) == [b"three"] and not buffer.data
    got = []
    framed = Framed(lambda _, message: got.append(message))
    for byte in pack(b"x" * 300) + pack(b"y"):   # a byte a read: the length prefix split too
        framed.data_received(bytes([byte]))
    assert got == [b"x" * 300, b"y"]


def test_uds_floor_chain_answers_through_its_processes():
    from academus.loadgen.uds_floor import chain

    figures = chain(3, requests=20, callers=4, duration_s=0.3)
    assert figures["latency_ms"]["count"] == 20 and figures["latency_ms"]["p50"] > 0
    assert figures["capacity"]["callers"] == 4 and figures["capacity"]["throughput_rps"] > 0


def test_the_live_exit_bench_writes_one_round_a_line_and_reads_back_the_same():
    summary = {"task": "spam", "first_p50_ratio": 0.84}
    rounds = [{arm: {"first_ms": [1.5, 2.0], "final_ms": [3.0, 2.0]} for arm in ("vanilla", "early")}] * 3
    text = rounds_json(summary, rounds)
    assert json.loads(text) == {"summary": summary, "rounds": rounds}
    assert len(text.splitlines()) == 3 + len(rounds)


def test_the_live_exit_bench_takes_percentiles_over_every_rounds_requests(tmp_path, capsys):
    """Each arm is twice as slow as the other in one round: the pooled ratio is 1, where the median of the rounds'
    ratios (2 and 0.5) would say 1.25. Agreement is weighed by the requests answered."""
    ms = [float(x) for x in range(1, 101)]
    slow = [2 * x for x in ms]

    def arm(times: list[float], capacity: float, agreement: float, answered: int) -> dict:
        return {"first_ms": times, "final_ms": times, "capacity_rps": capacity, "agreement": agreement,
                "answered": answered}

    rounds = [{"vanilla": arm(ms, 10.0, 1.0, 100), "early": arm(slow, 12.0, 1.0, 100)},
              {"vanilla": arm(slow, 10.0, 1.0, 300), "early": arm(ms, 9.0, 0.98, 300)}]
    summary = summarize("spam", 5.0, rounds)
    for name in ("first_p50_ratio", "first_p25_ratio", "final_p99_ratio"):
        assert summary[name] == 1.0, name
        assert summary["round_ratios"][name] == [2.0, 0.5], name
    assert summary["capacity_ratio"] == 1.05
    assert summary["early_agreement"] == 0.985
    saved = tmp_path / "run.json"
    saved.write_text(rounds_json(summary, rounds))
    assert exits_live_main(["--from", str(saved)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary


def test_the_live_exit_bench_says_each_processs_cpu_a_request_at_capacity():
    """The median of the rounds' CPU ms a request, per arm and process; runs saved without it still summarize."""
    def arm(worker_ms: float, gateway_ms: float) -> dict:
        return {"first_ms": [1.0], "final_ms": [1.0], "capacity_rps": 10.0, "agreement": 1.0, "answered": 1,
                "capacity_cpu_ms": {"worker-0": worker_ms, "gateway": gateway_ms}}

    rounds = [{"vanilla": arm(12.0, 0.7), "early": arm(13.0, 1.0)},
              {"vanilla": arm(12.4, 0.9), "early": arm(13.6, 1.2)},
              {"vanilla": arm(11.0, 0.8), "early": arm(20.0, 1.1)}]
    assert summarize("spam", 5.0, rounds)["capacity_cpu_ms"] == {"vanilla": {"worker-0": 12.0, "gateway": 0.8},
                                                                 "early": {"worker-0": 13.6, "gateway": 1.1}}
    del rounds[1]["early"]["capacity_cpu_ms"]
    assert "capacity_cpu_ms" not in summarize("spam", 5.0, rounds)


def test_tree_arms_run_each_arm_in_a_process_with_its_tree_on_the_path(tmp_path):
    from academus.loadgen.code_arms import trees_alternating

    for name in ("old", "new"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "which_tree.py").write_text(f"NAME = {name!r}\n")
    script = tmp_path / "arm.py"
    script.write_text("import json, sys\nimport which_tree\nassert sys.argv[1:] == ['--one']\n"
                      "print('a mesh says things first')\nprint(json.dumps({'tree': which_tree.NAME}))\n")
    out = tmp_path / "out.json"
    rows = trees_alternating(3, {"old": str(tmp_path / "old"), "new": str(tmp_path / "new")}, str(script), out)
    assert [row["order"] for row in rows] == [["old", "new"], ["new", "old"], ["old", "new"]]
    assert all(row[name] == {"tree": name} for row in rows for name in ("old", "new"))
    assert json.loads(out.read_text())["rounds"] == rows


def test_code_arms_alternate_with_each_arms_copy_in_place_and_the_file_put_back(tmp_path):
    from academus.loadgen.code_arms import alternating

    target, old, new = tmp_path / "core.py", tmp_path / "old.py", tmp_path / "new.py"
    target.write_text("checkout")
    old.write_text("old code")
    new.write_text("new code")
    seen = []
    rows = alternating(3, {"old": old, "new": new}, target, lambda name: seen.append((name, target.read_text())) or {})
    assert [row["order"] for row in rows] == [["old", "new"], ["new", "old"], ["old", "new"]]
    assert seen[:4] == [("old", "old code"), ("new", "new code"), ("new", "new code"), ("old", "old code")]
    assert target.read_text() == "checkout"

    def fails(name: str) -> dict:
        raise RuntimeError("a mesh failed")

    with pytest.raises(RuntimeError):
        alternating(1, {"new": new}, target, fails)
    assert target.read_text() == "checkout"   # put back whatever happened


class RecordingGateway:
    """Stands in for a gateway's client: answers each call with one prediction and keeps what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[list[str], list[str] | None]] = []

    async def infer(self, model, texts, timeout=None, policy="", early_exit=False, pairs=None):
        from academus.client import InferResult, Metadata, Prediction

        self.asked.append((texts, pairs))
        return InferResult(model, "r", [Prediction(label="relevance", score=0.7)],
                           Metadata("concat", 1, 0, "w", 1.0, 0.1, 0.5, 0.1, 0.3, 0.3, 1, False))


def test_a_query_pairs_every_text_after_it_and_drops_the_texts_labels():
    samples = texts.paired([texts.Sample("a passage", "pos"), texts.Sample("another", "neg")], "the query")
    assert samples == [texts.Sample("a passage", None, "the query"), texts.Sample("another", None, "the query")]
    gateway = RecordingGateway()
    result = asyncio.run(runner.run(OneGateway(gateway), "rr", [0.0, 0.001], samples, 5.0, 0.01))
    assert gateway.asked == [(["the query"], ["a passage"]), (["the query"], ["another"])]
    report = result.report()
    assert report["completed"] == 2 and report["accuracy"] is None
    alone = asyncio.run(runner.run(OneGateway(gateway), "spam", [0.0], [texts.Sample("a text", "spam")], 5.0, 0.01))
    assert gateway.asked[-1] == (["a text"], None) and alone.report()["completed"] == 1


def test_an_empty_query_or_pairs_to_openais_route_are_refused_by_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["run", "--model", "rr", "--query", "  "])
    assert "the query is empty" in capsys.readouterr().err
    assert main(["run", "--model", "minilm", "--query", "q", "--gateway", "http://127.0.0.1:9/v1/embeddings",
                 "--run-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "OpenAI's embeddings route takes no text pairs" in capsys.readouterr().err
