"""Samples /proc/stat every 10 ms: each interval's steal, idle, iowait and busy jiffies (all CPUs), and how late
the sampler itself woke.  python steal.py SECONDS OUT.jsonl"""
import json
import sys
import time
from pathlib import Path

STAT = Path("/proc/stat")


def read() -> list[int]:
    return [int(x) for x in STAT.read_text().split("\n", 1)[0].split()[1:]]


def main(seconds: float, out_path: str) -> None:
    end = time.time() + seconds
    prev, due = read(), time.perf_counter()
    with open(out_path, "w") as out:
        while time.time() < end:
            due += 0.01
            time.sleep(max(due - time.perf_counter(), 0))
            late = time.perf_counter() - due
            cur = read()
            d = [c - p for c, p in zip(cur, prev, strict=True)]
            prev = cur
            out.write(json.dumps({"ts": round(time.time(), 4), "late_ms": round(late * 1e3, 2), "user": d[0] + d[1],
                                  "sys": d[2], "idle": d[3], "iowait": d[4], "irq": d[5] + d[6],
                                  "steal": d[7]}) + "\n")
            if late > 0.05:
                due = time.perf_counter()


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2])
