"""PNG plots of a run: latency CDF, and latency / offered load / student number over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

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


def timeline(run: RunResult, path: Path, bin_s: float = 1.0) -> Path:
    fig, (lat, load, students) = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    ok = [r for r in run.records if r.code == "OK"]
    lat.scatter([r.sent_at for r in ok], [r.latency_ms for r in ok], s=3)
    lat.set(ylabel="latency (ms)", yscale="log", title=f"{run.model}:{run.policy}")
    bins = int(run.duration_s / bin_s) + 1
    counts = [0] * bins
    for r in run.records:
        counts[min(bins - 1, int(r.sent_at / bin_s))] += 1
    load.step([i * bin_s for i in range(bins)], [c / bin_s for c in counts], where="post")
    load.set(ylabel="offered (req/s)")
    students.scatter([r.sent_at for r in ok], [r.students for r in ok], s=3)
    students.set(ylabel="students", xlabel="time (s)")
    for ax in (lat, load, students):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
