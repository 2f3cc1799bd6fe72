"""Arrival schedules for open-loop load: send times in seconds from the start of a run.

Open loop means a request leaves at its time whether or not earlier ones were answered, so a slow
server meets the offered load instead of throttling the client (the coordinated-omission trap).
"""

from __future__ import annotations

import random
from pathlib import Path


def poisson(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    """Exponential gaps at `rate` requests/s."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate ({rate}) and duration ({duration_s}) must be > 0")
    rng, t, times = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return times
        times.append(t)


def bursts(base_rate: float, burst_rate: float, period_s: float, burst_s: float, duration_s: float,
           seed: int = 0) -> list[float]:
    """On/off load: Poisson at `burst_rate` for the first `burst_s` of every period, else `base_rate`."""
    if not 0 < burst_s < period_s:
        raise ValueError(f"burst_s ({burst_s}) must be within (0, period_s={period_s})")
    rng, t, times = random.Random(seed), 0.0, []
    while True:
        rate = burst_rate if (t % period_s) < burst_s else base_rate
        t += rng.expovariate(rate)
        if t >= duration_s:
            return times
        times.append(t)


def replay(path: Path, speed: float = 1.0) -> list[float]:
    """Timestamps (seconds, one a line, any origin) from a trace file, shifted to start at 0."""
    raw = [float(line.split(",")[0]) for line in Path(path).read_text().splitlines()
           if line.strip() and not line.startswith("#")]
    if not raw:
        raise ValueError(f"{path} holds no timestamps")
    start = min(raw)
    return sorted((t - start) / speed for t in raw)


def parse(spec: str, duration_s: float, seed: int = 0) -> list[float]:
    """`poisson:RATE`, `bursts:BASE,BURST,PERIOD,BURST_S` or `trace:FILE[,SPEED]`."""
    kind, _, args = spec.partition(":")
    try:
        if kind == "poisson":
            return poisson(float(args), duration_s, seed)
        if kind == "bursts":
            base, burst, period, burst_s = (float(x) for x in args.split(","))
            return bursts(base, burst, period, burst_s, duration_s, seed)
        if kind == "trace":
            path, _, speed = args.partition(",")
            return [t for t in replay(Path(path), float(speed or 1)) if t < duration_s]
    except ValueError as e:
        raise ValueError(f"bad schedule {spec!r}: {e}") from e
    raise ValueError(f"bad schedule {spec!r}: use poisson:RATE, bursts:BASE,BURST,PERIOD,BURST_S or trace:FILE")
