"""`concat`'s queue depth summed at each admission against kept as a tally: closed loops deep enough to fill the
scheduler's queue, on fresh meshes serving `null`, the order alternating.

    python depth_ab.py ROUNDS CALLERS OUT.json NAME=PATH NAME=PATH [--file=services/scheduler/policies.py]

Each NAME=PATH is a copy of the checkout's file given by --file (default services/scheduler/policies.py), put in
place before its mesh starts (the services import the checkout); the checkout's own file is put back at the end.
A round runs each arm's mesh: one 5 s warm-up, then CALLERS closed loops for 10 s over two load-generator
processes (stack_bench's runner). Per arm: requests a second, the p50 and p99, the errors, and each service's CPU
ms a request (/proc)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from academus.loadgen import stack_bench
from academus.loadgen.code_arms import alternating
from academus.shared.cli.mesh import Deployment, MeshOptions, down, up

CHECKOUT = Path(__file__).resolve().parents[5]


def one_mesh(callers: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="academus-depth-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        stack_bench.capacity(state, argparse.Namespace(model="null", duration=5.0, procs=2), callers, run)
        cap = stack_bench.capacity(state, argparse.Namespace(model="null", duration=10.0, procs=2), callers, run)
        return {"rps": cap["throughput_rps"], "p50_ms": cap["latency_ms"]["p50"], "p99_ms": cap["latency_ms"]["p99"],
                "errors": cap.get("errors"), "stack_cpu_ms": cap["stack_cpu_ms"],
                "cpu_ms": {name: p["cpu_ms"] for name, p in cap["processes"].items()}}
    finally:
        down(run)


def main() -> None:
    rounds, callers, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    target = CHECKOUT / next((a.split("=", 1)[1] for a in sys.argv[4:] if a.startswith("--file=")),
                             "services/scheduler/policies.py")
    arms = {name: Path(path) for name, path in (a.split("=", 1) for a in sys.argv[4:] if not a.startswith("--file="))}
    results = alternating(rounds, arms, target, lambda _: one_mesh(callers))
    out.write_text(json.dumps({"rounds": results, "callers": callers}, indent=1))


if __name__ == "__main__":
    main()
