"""Latency summaries shared by the demo and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary(values_ms: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values_ms, 50), 3),
        "p95": round(percentile(values_ms, 95), 3),
        "p99": round(percentile(values_ms, 99), 3),
        "mean": round(sum(values_ms) / len(values_ms), 3) if values_ms else float("nan"),
        "count": len(values_ms),
    }
