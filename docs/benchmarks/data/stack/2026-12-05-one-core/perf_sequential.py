"""`perf record` (2,000 samples a second, call graphs) of the gateway, the scheduler and the worker for 10 s while
the sync client sends sequential single-text requests to `null` on a fresh `concat` mesh.

    python perf_sequential.py OUT
    perf report -i OUT/scheduler.perf --no-children --sort dso --stdio

Prints the sequential p50 of each 500 requests measured meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

from academus.client import Client
from academus.loadgen.overhead import measure
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up


def main(out: Path) -> list[float]:
    out.mkdir(parents=True, exist_ok=True)
    state = up(MeshOptions(run_dir=out / "run", gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (out / "run" / ADMIN_KEY_FILE).read_text().strip()
        with Client(state.gateway, api_key=key) as client:
            measure(client, "null", 16, 300, 50)
            perfs = [subprocess.Popen(["perf", "record", "-F", "2000", "-g", "-o", str(out / f"{s.name}.perf"),
                                       "-p", str(s.pid), "--", "sleep", "10"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for s in state.services if s.name in ("gateway", "scheduler") or s.name.startswith("worker")]
            stop, p50s = threading.Event(), []

            def loop() -> None:
                while not stop.is_set():
                    p50s.append(measure(client, "null", 16, 500, 0)["e2e_ms"]["p50"])

            sender = threading.Thread(target=loop)
            sender.start()
            for perf in perfs:
                perf.wait()
            stop.set()
            sender.join()
        return p50s
    finally:
        down(out / "run")


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
