"""py-spy of the gateway, the scheduler and the worker while 256 closed loops (two load-generator processes,
stack_bench's runner) run for 10 s on a fresh `concat` mesh serving `null`, after one 14 s warm-up run.

    python profile_256.py OUT [ENV=VALUE ...]

Writes OUT/<service>.txt (py-spy's raw samples, 100 a second, running or runnable threads only) and prints the
run's req/s and each process's CPU ms a request (from /proc, py-spy's own cost included)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from academus.loadgen import stack_bench
from academus.shared.cli.mesh import Deployment, MeshOptions, down, up


def main(out: Path, env: dict[str, str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(model="null", duration=14.0, procs=2)
    state = up(MeshOptions(run_dir=out / "run", gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"} | env))
    try:
        stack_bench.capacity(state, args, 256, out)   # warm-up
        spies = [subprocess.Popen(["py-spy", "record", "--nonblocking", "--rate", "100", "--duration", "10",
                                   "--format", "raw", "--full-filenames", "--output", str(out / f"{s.name}.txt"),
                                   "--pid", str(s.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for s in state.services if s.name in ("gateway", "scheduler") or s.name.startswith("worker")]
        run = stack_bench.capacity(state, args, 256, out)
        for spy in spies:
            spy.wait()
        return {"rps": run["throughput_rps"], "stack_cpu_ms": run["stack_cpu_ms"],
                "cpu_ms": {name: p["cpu_ms"] for name, p in run["processes"].items()}}
    finally:
        down(out / "run")


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[2:]))))
