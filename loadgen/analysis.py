"""Pure summaries of a run: per-second timeline, TCB utility, latency breakdown (from response
metadata or from exported spans), `model:policy[+early-exit]` run specs and ratios between runs."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from academus.loadgen.stats import percentile

if TYPE_CHECKING:
    from academus.client import Metadata
    from academus.loadgen.runner import Record


EARLY_EXIT_SUFFIX = "+early-exit"


@dataclass(frozen=True)
class RunSpec:
    """What one run asks for: a model, the deployment's policy ("" lets the gateway pick), and whether each request
    asks for early exits (answered as soon as every text has a result; `InferRequest.early_exit`)."""

    model: str
    policy: str = ""
    early_exit: bool = False

    @property
    def label(self) -> str:
        return run_label(self.model, self.policy) + (EARLY_EXIT_SUFFIX if self.early_exit else "")


def parse_runs(spec: str, early_exit: bool = False) -> list[RunSpec]:
    """`spam:student,spam:fifo,spam,spam+early-exit` -> RunSpecs; `early_exit` asks it of every run."""
    runs = []
    for part in spec.split(","):
        run, early = part.strip(), early_exit
        if run.endswith(EARLY_EXIT_SUFFIX):
            run, early = run.removesuffix(EARLY_EXIT_SUFFIX), True
        model, _, policy = run.partition(":")
        if not model.strip():
            raise ValueError(f"bad run {part!r} in {spec!r}: expected MODEL[:POLICY][{EARLY_EXIT_SUFFIX}]")
        runs.append(RunSpec(model.strip(), policy.strip(), early))
    return runs


def run_label(model: str, policy: str) -> str:
    return f"{model}:{policy}" if policy else model


def exit_summary(layers: Sequence[int]) -> dict:
    """Of the answers to requests that asked for early exits (each its text's exit layer, 0: the full model's), the
    share a ramp released and how many each layer did."""
    early = [layer for layer in layers if layer]
    return {"released_early": round(len(early) / len(layers), 4) if layers else None,
            "exit_layers": {str(layer): n for layer, n in sorted(Counter(layers).items())}}


def agreement(base: Sequence[Record], other: Sequence[Record]) -> dict | None:
    """How often `other`'s answers name the label `base` answered for the same text (its most frequent, if it
    answered a text twice): for a run that asked for early exits against one that did not, the released results'
    agreement with the unmodified model (Apparate's accuracy constraint). None when no answered text is in both."""
    answers: dict[str, Counter] = {}
    for r in base:
        if r.code == "OK" and r.answer:
            answers.setdefault(r.text, Counter())[r.answer] += 1
    usual = {text: counts.most_common(1)[0][0] for text, counts in answers.items()}
    same = [r.answer == usual[r.text] for r in other if r.code == "OK" and r.answer and r.text in usual]
    return {"agreement": round(sum(same) / len(same), 4), "compared": len(same)} if same else None


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def timeline(records: Sequence[Record], duration_s: float, bin_s: float = 1.0) -> list[dict]:
    """Bins of `bin_s` seconds from the start. A request is offered in the bin it was sent in; its
    answer (OK or error), latency and student count land in the bin it came back in, so the tail
    after the last send gets bins too. `offered_failed`: of the requests offered in a bin, those that
    failed (what a fault at that time cost)."""
    end = max([duration_s, *(r.done_at for r in records)])
    count = max(1, math.ceil(end / bin_s))

    def index(t: float) -> int:
        return min(count - 1, max(0, int(t / bin_s)))

    offered, offered_failed, errors = [0] * count, [0] * count, [0] * count
    latencies: list[list[float]] = [[] for _ in range(count)]
    students: list[list[int]] = [[] for _ in range(count)]
    for r in records:
        sent, done = index(r.sent_at), index(r.done_at)
        offered[sent] += 1
        if r.code == "OK":
            latencies[done].append(r.latency_ms)
            students[done].append(r.students)
        else:
            offered_failed[sent] += 1
            errors[done] += 1
    return [{"t": round(i * bin_s, 3), "offered": offered[i], "offered_failed": offered_failed[i],
             "completed": len(latencies[i]), "errors": errors[i],
             "p50_ms": _rounded(percentile(latencies[i], 50)) if latencies[i] else None,
             "p95_ms": _rounded(percentile(latencies[i], 95)) if latencies[i] else None,
             "students_mean": _rounded(statistics.fmean(students[i])) if students[i] else None}
            for i in range(count)]


def utility(records: Iterable[Record], deadline_ms: float | None) -> float:
    """TCB's utility: each request answered OK within its deadline is worth 1/l, l its token count,
    so serving many short requests in time beats serving a few long ones."""
    return sum(1 / r.tokens for r in records
               if r.code == "OK" and r.tokens > 0 and (deadline_ms is None or r.latency_ms <= deadline_ms))


def components(latency_ms: float, m: Metadata) -> dict[str, float]:
    """Where one request's client-side latency went, from the hop timings in its response metadata."""
    return {
        "gateway": m.gateway_ms - m.scheduler_ms,
        "tokenize": m.tokenize_ms,  # part of gateway
        "queue": m.queue_ms,
        "compute": m.compute_ms,
        "worker_overhead": m.worker_ms - m.compute_ms,
        "scheduler_overhead": m.scheduler_ms - m.queue_ms - m.worker_ms,
        "network": latency_ms - m.gateway_ms,
    }


def answered_components(records: Iterable[Record]) -> list[tuple[float, dict[str, float]]]:
    """(latency, components) of each OK answer that carries metadata."""
    return [(r.latency_ms, components(r.latency_ms, r.meta)) for r in records if r.code == "OK" and r.meta is not None]


def breakdown(records: Iterable[Record]) -> dict[str, float]:
    """The median of each component over the OK answers that carry metadata (medians of parts do not
    add up to the median latency exactly)."""
    parts = [p for _, p in answered_components(records)]
    if not parts:
        return {}
    return {name: round(statistics.median(p[name] for p in parts), 3) for name in parts[0]}


def tail_breakdown(records: Iterable[Record], q: float = 95) -> dict[str, float]:
    """The mean of each component over the answers at or past the q-th latency percentile: what the slow
    requests spent their time on (medians say what the typical one did)."""
    parts = answered_components(records)
    if not parts:
        return {}
    cut = percentile([latency for latency, _ in parts], q)
    tail = [p for latency, p in parts if latency >= cut]
    return {name: round(statistics.fmean(p[name] for p in tail), 3) for name in tail[0]} | {"answers": len(tail)}


def _ms(span: dict) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e6


def _quantiles(values: list[float]) -> dict:
    return {"count": len(values), "p50_ms": round(statistics.median(values), 3),
            "p95_ms": round(percentile(values, 95), 3)}


def span_breakdown(spans: Sequence[dict]) -> dict:
    """Durations of exported spans (shared/runtime/tracing.py's JSON lines) by service, span name and kind,
    and each hop's wire time: a client span's duration minus that of the server span it called."""
    spans = [s for s in spans if s.get("end_ns") is not None and s.get("start_ns") is not None]
    by_id = {s["span_id"]: s for s in spans}
    durations: dict[tuple[str, str, str], list[float]] = {}
    hops: dict[tuple[str, str, str], list[float]] = {}
    for s in spans:
        durations.setdefault((s["service"] or "", s["name"], s["kind"]), []).append(_ms(s))
        caller = by_id.get(s["parent_id"] or "")
        if s["kind"] == "SERVER" and caller is not None and caller["kind"] == "CLIENT":
            hops.setdefault((caller["service"] or "", s["service"] or "", s["name"]), []).append(_ms(caller) - _ms(s))
    return {
        "traces": len({s["trace_id"] for s in spans}),
        "spans": [{"service": k[0], "name": k[1], "kind": k[2]} | _quantiles(v) for k, v in sorted(durations.items())],
        "hops": [{"from": k[0], "to": k[1], "name": k[2]} | _quantiles(v) for k, v in sorted(hops.items())],
    }


def report_label(run: dict) -> str:
    """A run's report labelled as its RunSpec is."""
    return RunSpec(run["model"], run["policy"], bool(run.get("early_exit"))).label


def ratios(runs: Sequence[dict]) -> list[dict]:
    """Each later run against the first: latency percentiles, throughput and utility as ratios."""
    base = runs[0]
    out = []
    for r in runs[1:]:
        entry = {"run": report_label(r), "vs": report_label(base)}
        for q in ("p50", "p95", "p99"):
            if base["latency_ms"].get(q) and r["latency_ms"].get(q):
                entry[f"{q}_ratio"] = round(r["latency_ms"][q] / base["latency_ms"][q], 3)
        for name, field in (("throughput_ratio", "throughput_rps"), ("utility_ratio", "utility")):
            if base.get(field):
                entry[name] = round(r.get(field, 0.0) / base[field], 3)
        out.append(entry)
    return out
