"""Where a sequential request's tail is: one `null` mesh, 3,000 sequential requests over HTTP then over gRPC (the
arms of http_vs_grpc.py), the client's p50, p99 and p99.9, then the gateway's own histograms of the two
(`academus_http_request_seconds` for /embed, `academus_rpc_seconds` for Infer). `python p99_probe.py`."""

import sys
import tempfile
from pathlib import Path

from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up
from academus.shared.runtime.metrics import scrape

sys.path.insert(0, str(Path(__file__).parent))
import http_vs_grpc as arms


def main() -> None:
    run = Path(tempfile.mkdtemp(prefix="p99-"))
    state = up(MeshOptions(run_dir=run, gateway_port=0, http_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        gateway = next(s for s in state.services if s.service == "gateway")
        for arm in (arms.http_arm, arms.grpc_arm):
            took = sorted(arm(state, key, "null", 3000))
            print(f"{arm.__name__} client p50 {1e3 * took[1500]:.2f} p99 {1e3 * took[2970]:.2f} "
                  f"p99.9 {1e3 * took[2997]:.2f} ms")
        for sample in scrape(gateway.metrics_port):
            if sample.name == "academus_http_request_seconds_bucket" and sample.labels.get("route") == "/embed":
                print("gateway, HTTP /embed: at most", sample.labels["le"], "s:", sample.value)
            if sample.name == "academus_rpc_seconds_bucket" and sample.labels.get("method") == "Infer":
                print("gateway, gRPC Infer: at most", sample.labels["le"], "s:", sample.value)
    finally:
        down(run)


if __name__ == "__main__":
    main()
