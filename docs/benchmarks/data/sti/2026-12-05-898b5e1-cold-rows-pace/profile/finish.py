"""How long a run's `finish` takes once its loader waits for room in the working buffer.
`python finish.py cold|file|throttled:200` from the repository root."""

from __future__ import annotations

import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import pipeline_for


def main() -> None:
    store, _, plan, pipeline = pipeline_for(6, 6, sys.argv[1])
    times = []
    for _ in range(10):
        pipeline.source.before_run(store.paths())
        loads = pipeline._start(plan)
        loads.wait(0)
        time.sleep(0.01)                       # the loader fills its window meanwhile
        started = time.perf_counter()
        loads.finish()
        times.append((time.perf_counter() - started) * 1e3)
    print(sys.argv[1], "finish ms", [round(x, 1) for x in times])
    pipeline.close()


if __name__ == "__main__":
    main()
