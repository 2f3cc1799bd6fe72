"""Which runs of a fresh process load slowly: `python diag2.py SHARDS IO RUNS`. A 6x9 plan at 6 bits, its first 4
layers held, RUNS runs of one text of 32 tokens; a run whose loader was busy over 7 ms is counted slow (about 3.5 ms
is usual). Prints the slow runs' count and places, and whether the loader thread was last on the compute thread's
core after a run (`/proc/self/task/*/stat`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from thread_ab import held_plan

SLOW_IO_MS = 7.0


def last_cpu(tid: str) -> int:
    try:
        with open(f"/proc/self/task/{tid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[36])
    except OSError:
        return -1


def main() -> None:
    pipeline, plan, ids, mask = held_plan(sys.argv[1], 6, 9, 4, sys.argv[2])
    before = set(os.listdir("/proc/self/task"))
    pipeline.run(plan, ids, mask)
    loaders = sorted(set(os.listdir("/proc/self/task")) - before)
    main_tid = str(os.getpid())
    rows = []
    for _ in range(int(sys.argv[3])):
        result = pipeline.run(plan, ids, mask)
        rows.append((result.io_ms, last_cpu(main_tid), [last_cpu(t) for t in loaders]))
    pipeline.close()
    slow = [i for i, (io, _, _) in enumerate(rows) if io > SLOW_IO_MS]
    shared = sum(1 for _, cpu, loader in rows if loader and loader[0] == cpu)
    print(f"runs {len(rows)} slow {len(slow)} at {slow[:3]}..{slow[-3:]}; loader last on the compute's core after "
          f"{shared} runs")


if __name__ == "__main__":
    main()
