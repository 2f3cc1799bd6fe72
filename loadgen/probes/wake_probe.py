"""How long a hop-like thread waits to run after it wakes while forward passes hold every core, on the
kernel's slice and on a short one (shared/runtime/slices.py).

    python -m academus.loadgen.probes.wake_probe [--work-ms 0.5 1.0] [--slices-us 0 100] [--wakes 1500]
                                                 [--out .academus/results/wake_probe/wake_probe.json]

One spinning process a core stands in for the compute threads, each in its own session (its own
autogroup, as `academus up` starts services). The probe thread sleeps 2 ms, wakes, and works --work-ms
of CPU, as a hop's thread does; its wake-up delay is the time past the 2 ms. The last line printed is the
summary JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

from academus.shared.runtime.slices import set_thread_slice

SLEEP_S = 0.002


def spin() -> None:
    os.setsid()
    while True:
        pass


def probe(slice_us: int, work_ms: float, wakes: int) -> dict:
    set_thread_slice(slice_us)
    delays = []
    for _ in range(wakes):
        asleep = time.perf_counter()
        time.sleep(SLEEP_S)
        woke = time.perf_counter()
        delays.append((woke - asleep - SLEEP_S) * 1e3)
        while time.perf_counter() < woke + work_ms / 1e3:
            pass
    delays.sort()
    n = len(delays)
    return {"slice_us": slice_us, "work_ms": work_ms, "p50_ms": round(delays[n // 2], 3),
            "p95_ms": round(delays[int(n * 0.95)], 3), "p99_ms": round(delays[int(n * 0.99)], 3),
            "over_1ms": round(sum(d > 1 for d in delays) / n, 4), "max_ms": round(delays[-1], 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.probes.wake_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-ms", type=float, nargs="+", default=[0.5, 1.0])
    p.add_argument("--slices-us", type=int, nargs="+", default=[0, 100], help="0: the kernel's slice")
    p.add_argument("--wakes", type=int, default=1500)
    p.add_argument("--out", type=Path, default=Path(".academus/results/wake_probe/wake_probe.json"))
    args = p.parse_args(argv)
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(os.cpu_count() or 1)]
    for s in spinners:
        s.start()
    if os.getsid(0) != os.getpid():   # the probe in a session of its own too
        os.setsid()
    try:
        time.sleep(0.5)
        rows = [probe(slice_us, work, args.wakes) for work in args.work_ms for slice_us in args.slices_us]
    finally:
        for s in spinners:
            s.terminate()
    summary = {"cores": os.cpu_count(), "kernel": os.uname().release, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
