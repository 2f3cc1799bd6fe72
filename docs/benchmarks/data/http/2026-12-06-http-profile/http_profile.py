"""py-spy of the gateway while `academus loadgen` runs CALLERS closed loops over HTTP to TEI's root (16-token
texts, `null` on a fresh `concat` mesh, 14 s): 8 s at 200 Hz from the third second, raw (collapsed stacks with line
numbers) into OUT_DIR/gateway.txt; the run's req/s and p50 printed.

    python http_profile.py CALLERS OUT_DIR"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up


def main() -> None:
    callers, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="academus-http-prof-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, http_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        gateway = next(s.pid for s in state.services if s.service == "gateway")
        load = subprocess.Popen([sys.executable, "-m", "academus.shared.cli", "--run-dir", str(run), "loadgen", "run",
                                 "--model", "null", "--schedule", f"closed:{callers}", "--duration", "14",
                                 "--length-dist", "normal,mean=16,var=1,min=16,max=16", "--key", key,
                                 "--out", str(run / "out"), "--gateway", f"http://{state.http}"],
                                stdout=subprocess.PIPE, text=True)
        time.sleep(3)
        subprocess.run(["py-spy", "record", "-p", str(gateway), "-d", "8", "-r", "200", "--format", "raw",
                        "-o", str(out / "gateway.txt"), "--nonblocking"], check=True, capture_output=True)
        report = json.loads(load.communicate()[0].splitlines()[-1])["runs"][0]
        print(json.dumps({"rps": report["throughput_rps"], "p50": report["latency_ms"]["p50"]}))
    finally:
        down(run)


if __name__ == "__main__":
    main()
