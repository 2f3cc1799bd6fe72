"""512 connections opened at once by two load-generator processes, then 800 req/s over them for 10 s, N times on
one fresh `concat` mesh serving `null`: how many runs failed to open their connections.

    python burst_opens.py N
"""
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from connections_by_rate import one_open_run

from academus.shared.cli.mesh import Deployment, MeshOptions, down, up

with tempfile.TemporaryDirectory() as tmp:
    run_dir = Path(tmp) / "run"
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    pids = {s.service: s.pid for s in state.services if s.service in ("gateway", "scheduler", "worker")}
    fails = 0
    try:
        for i in range(int(sys.argv[1])):
            try:
                r = one_open_run(run_dir, pids, 512, 800.0, Path(tmp))
                print(i, "ok", round(r["p50_ms"], 2), flush=True)
            except RuntimeError as e:
                fails += 1
                print(i, "FAILED", e, flush=True)
    finally:
        down(run_dir)
    print("fails", fails)
