"""The node-local plane's writes, one a frame against one a turn of the event loop: each arm a copy of
shared/runtime/local_plane.py, put in place before its mesh starts (the services import the checkout; the checkout's
own file is put back at the end), a fresh `concat` mesh serving `null` an arm, the order alternating.

    python turn_writes_ab.py ROUNDS OUT.json NAME=PATH NAME=PATH

The run of 2026-12-06 named its arms `turn` (the checkout's file with deferred_writer.diff applied: every frame
of a turn written at its end) and `direct` (the file before it).

Per arm, on one mesh (stack_bench's measurements, its defaults): 1,000 sequential single-text requests from the
sync client; closed loops of 64 and 256 callers for 10 s over two load-generator processes (gRPC streams); 512
client connections offering half the better of those two rates (Poisson, 10 s); then 64 callers on the HTTP port
(`POST /embed`, one aiohttp session, 10 s). Each service's CPU ms a request from /proc."""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from academus.loadgen import stack_bench
from academus.loadgen.code_arms import alternating
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

CHECKOUT = Path(__file__).resolve().parents[5]
HTTP = CHECKOUT / "docs/benchmarks/data/http/2026-12-06-http-vs-grpc/http_capacity.py"


def http_capacity():
    spec = importlib.util.spec_from_file_location("http_capacity", HTTP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_mesh(args) -> dict:
    run = Path(tempfile.mkdtemp(prefix="academus-turn-writes-"))
    args.out = run
    state = up(MeshOptions(run_dir=run, gateway_port=0, http_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        seq = stack_bench.sequential(state, args)
        caps = {str(c): stack_bench.capacity(state, args, c, run) for c in args.callers}
        best = max(c["throughput_rps"] for c in caps.values())
        conns = stack_bench.many_connections(state, args, args.open_load * best, run)
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        http = http_capacity().measure(http_capacity().http_arm, state, key, 64)
        return {"sequential": {"e2e_ms": seq["e2e_ms"], "per_hop_p50_ms": seq["per_hop_p50_ms"]},
                "capacity": {c: {"rps": v["throughput_rps"], "p50_ms": v["latency_ms"]["p50"],
                                 "stack_cpu_ms": v["stack_cpu_ms"],
                                 "cpu_ms": {n: p["cpu_ms"] for n, p in v["processes"].items()}}
                             for c, v in caps.items()},
                "connections": {"offered_rps": conns["offered_rps"], "completed": conns["completed"],
                                "errors": conns["errors"], "latency_ms": conns["latency_ms"]},
                "http_64": http}
    finally:
        down(run)


def main() -> None:
    rounds, out = int(sys.argv[1]), Path(sys.argv[2])
    arms = {name: Path(path) for name, path in (a.split("=", 1) for a in sys.argv[3:])}
    args = stack_bench.parser().parse_args(["--policy", "concat"])
    results = alternating(rounds, arms, CHECKOUT / "shared/runtime/local_plane.py", lambda _: one_mesh(args))
    out.write_text(json.dumps({"command": sys.argv, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
