"""Issue 33's many-connections figure as a function of the offered rate: on a fresh `concat` mesh serving `null`
a round, the sequential p50 (the sync client, 500 requests), then 512 connections (two load-generator
processes, stack_bench's `--share` runner) offering each rate in turn for 10 s (the order reversed every other
round), and the same rates over 2 connections. Per run: p50 and p99, p50 over the sequential p50, and the CPU
ms a request of the gateway, the scheduler and the worker (from /proc, over the whole run).

    python connections_by_rate.py ROUNDS OUT.json RATE [RATE ...]
"""
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from academus.client import Client
from academus.loadgen.bench import process_cpu_s
from academus.loadgen.overhead import measure
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

DURATION_S = 10


def open_run(run_dir: Path, pids: dict[str, int], connections: int, rate: float, tmp: Path) -> dict:
    """One run; once again when a load generator failed (opening 256 connections at once, one was at times refused
    by the handshake: `tcp handshaker shutdown`)."""
    try:
        return one_open_run(run_dir, pids, connections, rate, tmp)
    except RuntimeError:
        return one_open_run(run_dir, pids, connections, rate, tmp) | {"retried": True}


def one_open_run(run_dir: Path, pids: dict[str, int], connections: int, rate: float, tmp: Path) -> dict:
    start_at = time.time() + 2 + connections / 100   # each share opens its connections first
    results = [tmp / f"open-{connections}-{rate}-{k}.json" for k in range(2)]
    kids = [subprocess.Popen([sys.executable, "-m", "academus.loadgen.stack_bench", "--share", str(connections // 2),
                              "--run-dir", str(run_dir), "--model", "null", "--duration", str(DURATION_S),
                              "--start-at", str(start_at), "--result", str(r), "--rate", str(rate / 2)])
            for r in results]
    time.sleep(max(0.0, start_at - time.time()))
    before = {n: process_cpu_s(p) for n, p in pids.items()}
    if any([k.wait() for k in kids]):
        raise RuntimeError("a load generator failed")
    after = {n: process_cpu_s(p) for n, p in pids.items()}
    parts = [json.loads(r.read_text()) for r in results]
    lat = sorted(x for p in parts for x in p["latencies_ms"])
    errors = sum(sum(p["errors"].values()) for p in parts)
    return {"connections": connections, "rate": rate, "completed": len(lat), "errors": errors,
            "p50_ms": lat[len(lat) // 2], "p99_ms": lat[int(len(lat) * 0.99)],
            "cpu_ms": {n: round((after[n] - before[n]) * 1e3 / max(1, len(lat)), 3) for n in pids}}


def main() -> None:
    rounds, out, rates = int(sys.argv[1]), Path(sys.argv[2]), [float(r) for r in sys.argv[3:]]
    rows = []
    with tempfile.TemporaryDirectory(prefix="conns-") as tmp:
        for r in range(rounds):
            run_dir = Path(tmp) / f"run-{r}"
            state = up(MeshOptions(run_dir=run_dir, gateway_port=0, deployments=[Deployment("concat")],
                                   env={"ACADEMUS_MODELS": "null"}))
            try:
                key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
                with Client(state.gateway, api_key=key) as client:
                    sequential = measure(client, "null", 16, 500, 100)["e2e_ms"]["p50"]
                pids = {s.service: s.pid for s in state.services if s.service in ("gateway", "scheduler", "worker")}
                for rate in rates if r % 2 == 0 else rates[::-1]:
                    for connections in (512, 2):
                        row = open_run(run_dir, pids, connections, rate, Path(tmp))
                        row |= {"round": r, "sequential_p50_ms": sequential,
                                "p50_x_sequential": round(row["p50_ms"] / sequential, 2)}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            finally:
                down(run_dir)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
