"""PNG plots of a run: latency CDF, and latency / offered vs completed load / student number over time."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from academus.loadgen import analysis
from academus.loadgen.runner import RunResult


def latency_cdf(runs: list[RunResult], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        latencies = sorted(r.latency_ms for r in run.records if r.code == "OK")
        if latencies:
            ax.plot(latencies, [(i + 1) / len(latencies) for i in range(len(latencies))],
                    label=f"{run.model}:{run.policy}")
    ax.set(xlabel="latency (ms)", ylabel="fraction of requests", xscale="log", title="Latency CDF")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(bins: list[dict], key: str, bin_s: float) -> tuple[list[float], list[float]]:
    """(bin middle, value) of the bins that have a value: empty bins have no latency or student number."""
    points = [(b["t"] + bin_s / 2, b[key]) for b in bins if b[key] is not None]
    return [t for t, _ in points], [v for _, v in points]


def _steps(bins: list[dict], key: str, bin_s: float) -> tuple[list[float], list[float]]:
    """Per-second rates as a post-step line, closed at the end of the last bin."""
    times = [b["t"] for b in bins] + [bins[-1]["t"] + bin_s]
    rates = [b[key] / bin_s for b in bins]
    return times, rates + rates[-1:]


def timeline(run: RunResult, path: Path, bin_s: float = 1.0, events: Mapping[str, float] | None = None) -> Path:
    """Three panels on one time axis, from the report's per-bin timeline; each of `events` (label -> second,
    e.g. a fault injected) a vertical line across them. Errors per second show when there were any."""
    bins = analysis.timeline(run.records, run.duration_s, bin_s)
    fig, (lat, load, students) = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    for key, label in (("p50_ms", "p50"), ("p95_ms", "p95")):
        lat.plot(*_series(bins, key, bin_s), marker=".", label=label)
    lat.set(ylabel="latency (ms)", yscale="log", title=f"{run.model}:{run.policy}")
    lat.legend()
    load.step(*_steps(bins, "offered", bin_s), where="post", label="offered")
    load.step(*_steps(bins, "completed", bin_s), where="post", label="completed")
    if any(b["errors"] for b in bins):
        load.step(*_steps(bins, "errors", bin_s), where="post", label="errors")
    load.set(ylabel="load (req/s)")
    load.legend()
    students.plot(*_series(bins, "students_mean", bin_s), marker=".")
    students.set(ylabel="students (mean)", xlabel="time (s)")
    for ax in (lat, load, students):
        ax.grid(True, alpha=0.3)
        for label, at in (events or {}).items():
            ax.axvline(at, color="red", linestyle="--", linewidth=1, label=label if ax is lat else None)
    if events:
        lat.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
