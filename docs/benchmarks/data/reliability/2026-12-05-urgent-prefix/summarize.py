"""mesh_ab.sh's runs, a JSON line each: python summarize.py OUT > mesh_ab.jsonl"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    for path in sorted(Path(sys.argv[1]).glob("*/summary.json")):
        name, _, round_ = path.parent.name.rpartition("-")
        run = json.loads(path.read_text())["runs"]["reference"]
        waits = run["queue_wait"]
        print(json.dumps({"arm": name, "round": int(round_), "sent": run["sent"], "lost": run["lost"],
                          "goodput_rps": run["goodput_rps"], "goodput_rps_by_model": run["goodput_rps_by_model"],
                          "refusal_p99_ms": run["refusal_p99_ms"], "p99_ms_by_model": run["p99_by_models"],
                          "queue_wait_over_1s": {m: w["over_1s"] for m, w in waits.items()},
                          "queue_wait_over_2s": {m: w["over_2s"] for m, w in waits.items()}}))


if __name__ == "__main__":
    main()
