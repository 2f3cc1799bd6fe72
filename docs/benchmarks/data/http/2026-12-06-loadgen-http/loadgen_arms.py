"""`academus loadgen` against the same mesh's two ports: gRPC (the SDK's stream, `--streams`) and HTTP/JSON (TEI's
root, `--gateway http://...`), closed loops of CALLERS for 10 s from one process, `null` (the stack alone), a fresh
`concat` mesh an arm, the order alternating.

    python loadgen_arms.py ROUNDS CALLERS OUT.json"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from academus.loadgen.bench import process_cpu_s
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up


def one_arm(arm: str, callers: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="academus-loadgen-arms-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, http_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        target = ["--gateway", state.gateway, "--streams"] if arm == "grpc" else ["--gateway", f"http://{state.http}"]
        gateway = next(s.pid for s in state.services if s.service == "gateway")
        before = process_cpu_s(gateway)
        done = subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", str(run), "loadgen", "run",
                               "--model", "null", "--schedule", f"closed:{callers}", "--duration", "10",
                               "--length-dist", "normal,mean=16,var=1,min=16,max=16", "--key", key,
                               "--out", str(run / "out"), *target], capture_output=True, text=True, check=True)
        report = json.loads(done.stdout.splitlines()[-1])["runs"][0]
        return {"rps": report["throughput_rps"], "p50_ms": report["latency_ms"]["p50"],
                "p99_ms": report["latency_ms"]["p99"], "errors": report["errors"],
                "gateway_cpu_ms": round(1e3 * (process_cpu_s(gateway) - before) / report["completed"], 4)}
    finally:
        down(run)


def main() -> None:
    rounds, callers, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    results = []
    for r in range(rounds):
        order = ["grpc", "http"] if r % 2 == 0 else ["http", "grpc"]
        row = {"order": order} | {arm: one_arm(arm, callers) for arm in order}
        print(json.dumps(row), flush=True)
        results.append(row)
    out.write_text(json.dumps({"command": sys.argv, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
