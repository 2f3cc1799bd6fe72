"""Arrival schedules for open-loop load: send times in seconds from the start of a run.

Open loop means a request leaves at its time whether or not earlier ones were answered, so a slow
server meets the offered load instead of throttling the client (the coordinated-omission trap).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
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


# Tweet-like load: a day of traffic compressed into the run, with short news bursts on top.
TROUGH_TO_PEAK = 0.3
DIURNAL_AMPLITUDE = (1 - TROUGH_TO_PEAK) / (1 + TROUGH_TO_PEAK)  # (1 - a) / (1 + a) = 0.3


@dataclass(frozen=True)
class Burst:
    start_s: float
    length_s: float
    factor: float  # multiplies the diurnal rate while the burst lasts

    def covers(self, t: float) -> bool:
        return self.start_s <= t < self.start_s + self.length_s


@dataclass(frozen=True)
class TweetShape:
    """Rate over time of a tweet-like trace (requests/s at second t of a run of `duration_s`).

    Diurnal part: one sinusoidal "day" per run, starting and ending at the trough (night) and
    peaking halfway, the trough at 0.3x the peak. Bursts: 2-4 windows of 2-5 s (at most a tenth of
    the run) where the rate is 3-5x the diurnal rate, like a news event. The whole curve is scaled
    so that its mean over the run is `mean_rps`.
    """

    mean_rps: float
    duration_s: float
    bursts: tuple[Burst, ...]
    scale: float = 1.0

    def shape(self, t: float) -> float:
        diurnal = 1 - DIURNAL_AMPLITUDE * math.cos(2 * math.pi * t / self.duration_s)
        factor = max((b.factor for b in self.bursts if b.covers(t)), default=1.0)
        return diurnal * factor

    def rate(self, t: float) -> float:
        return self.scale * self.shape(t)

    def diurnal_range(self) -> tuple[float, float]:
        """(trough, peak) of the diurnal rate, bursts left out."""
        return self.scale * (1 - DIURNAL_AMPLITUDE), self.scale * (1 + DIURNAL_AMPLITUDE)

    def peak_rate(self) -> float:
        """An upper bound of rate(t): the diurnal peak times the largest burst factor."""
        return self.scale * (1 + DIURNAL_AMPLITUDE) * max((b.factor for b in self.bursts), default=1.0)


def tweet_shape(mean_rps: float, duration_s: float, seed: int = 0) -> TweetShape:
    if mean_rps <= 0 or duration_s <= 0:
        raise ValueError(f"mean rate ({mean_rps}) and duration ({duration_s}) must be > 0")
    rng = random.Random(seed)
    bursts = []
    for _ in range(rng.randint(2, 4)):
        length = min(rng.uniform(2, 5), duration_s / 10)
        bursts.append(Burst(rng.uniform(0, duration_s - length), length, rng.uniform(3, 5)))
    unscaled = TweetShape(mean_rps, duration_s, tuple(sorted(bursts, key=lambda b: b.start_s)))
    # The mean of the shape by the midpoint rule, 100 points a second (bounded for day-long runs).
    steps = min(200_000, max(1000, int(duration_s * 100)))
    mean_shape = sum(unscaled.shape((i + 0.5) * duration_s / steps) for i in range(steps)) / steps
    return replace(unscaled, scale=mean_rps / mean_shape)


def tweet(mean_rps: float, duration_s: float, seed: int = 0) -> list[float]:
    """Arrivals of the non-homogeneous Poisson process with rate `tweet_shape(...)`, by thinning:
    candidates at the peak rate, each kept with probability rate(t) / peak."""
    shape = tweet_shape(mean_rps, duration_s, seed)
    peak = shape.peak_rate()
    rng, t, times = random.Random(seed + 1), 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return times
        if rng.random() * peak < shape.rate(t):
            times.append(t)


def write_trace(times: list[float], path: Path, header: str = "") -> Path:
    """One timestamp a line (seconds), replayable with `trace:FILE`; `#` lines are comments."""
    lines = [f"# {line}" for line in header.splitlines()] + [f"{t:.6f}" for t in times]
    Path(path).write_text("\n".join(lines) + "\n")
    return Path(path)


def closed_concurrency(spec: str) -> int | None:
    """N for `closed:N` (a closed loop of N callers, no schedule), else None."""
    kind, _, args = spec.partition(":")
    if kind != "closed":
        return None
    if not args.isdigit() or int(args) < 1:
        raise ValueError(f"bad schedule {spec!r}: closed:N needs a whole number of callers N >= 1")
    return int(args)


def parse(spec: str, duration_s: float, seed: int = 0) -> list[float]:
    """`poisson:RATE`, `bursts:BASE,BURST,PERIOD,BURST_S`, `tweet:MEAN_RATE` or `trace:FILE[,SPEED]`."""
    kind, _, args = spec.partition(":")
    try:
        if kind == "poisson":
            return poisson(float(args), duration_s, seed)
        if kind == "bursts":
            base, burst, period, burst_s = (float(x) for x in args.split(","))
            return bursts(base, burst, period, burst_s, duration_s, seed)
        if kind == "tweet":
            return tweet(float(args), duration_s, seed)
        if kind == "trace":
            path, _, speed = args.partition(",")
            return [t for t in replay(Path(path), float(speed or 1)) if t < duration_s]
    except ValueError as e:
        raise ValueError(f"bad schedule {spec!r}: {e}") from e
    raise ValueError(f"bad schedule {spec!r}: use poisson:RATE, bursts:BASE,BURST,PERIOD,BURST_S, "
                     "tweet:MEAN_RATE, trace:FILE[,SPEED] or closed:N")
