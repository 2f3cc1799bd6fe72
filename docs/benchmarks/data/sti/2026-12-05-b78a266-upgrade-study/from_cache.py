"""The upgrade study's rows for the shapes whose every evaluation an interrupted `sti_bench --study-only` run left in
its accuracy cache: `python from_cache.py ARTIFACTS TASK CACHE ORDERS DEPTHxWIDTH [...]`. Prints the study's
table and figures; refuses a case the cache lacks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from academus.loadgen.sti_bench import study_figures, study_table, upgrade_study
from academus.shared.models.shard_store import ShardStore, shards_dir


def main() -> None:
    artifacts, task, cache, orders = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in sys.argv[5:]]
    known = json.loads(cache.read_text())
    info = ShardStore(shards_dir(artifacts, "minilm")).tasks[task]
    rows = upgrade_study(info, lambda plan: known[f"{task}|{plan.key()}"], orders, shapes)
    print(study_table([{"task": task, "upgrade_study": rows}]))
    print(json.dumps({"random_orders": orders, "figures": study_figures(rows), "rows": rows}))


if __name__ == "__main__":
    main()
