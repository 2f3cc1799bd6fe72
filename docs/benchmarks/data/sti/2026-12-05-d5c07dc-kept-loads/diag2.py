"""Which runs of a fresh process load slowly, and why: `python diag2.py SHARDS IO RUNS [--free-pages]`. A 6x9 plan
at 6 bits, its first 4 layers held, RUNS runs of one text of 32 tokens; a run whose loader was busy over 7 ms is
counted slow (about 3.5 ms is usual). Prints the slow and the other runs' count and their mean minor page faults, and
after how many runs the loader thread was last on the compute thread's core (`/proc/self/task/*/stat`).
`--free-pages`: the process does not keep its freed pages (`keep_freed_pages`), as the services do."""

from __future__ import annotations

import os
import resource
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
    pipeline, plan, ids, mask = held_plan(sys.argv[1], 6, 9, 4, sys.argv[2], "--free-pages" not in sys.argv)
    before = set(os.listdir("/proc/self/task"))
    pipeline.run(plan, ids, mask)
    loaders = sorted(set(os.listdir("/proc/self/task")) - before)
    main_tid = str(os.getpid())
    rows = []
    for _ in range(int(sys.argv[3])):
        before_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        result = pipeline.run(plan, ids, mask)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before_faults
        rows.append((result.io_ms, faults, last_cpu(main_tid), [last_cpu(t) for t in loaders]))
    pipeline.close()
    slow = [row for row in rows if row[0] > SLOW_IO_MS]
    usual = [row for row in rows if row[0] <= SLOW_IO_MS]
    shared = sum(1 for _, _, cpu, loader in rows if loader and loader[0] == cpu)
    print(f"runs {len(rows)}: slow {len(slow)} ({mean_faults(slow):.1f} minor faults a run), the others "
          f"{len(usual)} ({mean_faults(usual):.1f}); loader last on the compute's core after {shared} runs")


def mean_faults(rows: list) -> float:
    return sum(row[1] for row in rows) / max(1, len(rows))


if __name__ == "__main__":
    main()
