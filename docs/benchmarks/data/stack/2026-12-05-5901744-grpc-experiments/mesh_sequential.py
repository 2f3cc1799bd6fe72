"""Sequential single-text requests to `null` on a fresh `concat` mesh: the p50 and its per-hop split
(academus.loadgen.overhead), and each service's thread names. Run it with GRPC_EXPERIMENTS set or not in the
environment: `up` starts the mesh's launcher from this process, so the launcher, the services it forks and this
process's client all see the same value. `--plain`: the services start as plain processes (no launcher), each
with the environment given after it (`GRPC_EXPERIMENTS=` empty: gRPC's defaults), while this process's client
keeps its own.

    [GRPC_EXPERIMENTS=...] python mesh_sequential.py OUT [--plain [ENV=VALUE ...]]"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

from academus.client import Client
from academus.loadgen.overhead import measure
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up


def main(out: Path, plain: bool, env: dict[str, str]) -> None:
    state = up(MeshOptions(run_dir=out / "run", gateway_port=0, deployments=[Deployment("concat")],
                           env={"ACADEMUS_MODELS": "null"} | env, launcher=not plain))
    try:
        key = (out / "run" / ADMIN_KEY_FILE).read_text().strip()
        with Client(state.gateway, api_key=key) as client:
            result = measure(client, "null", 16, 1500, 200)
        print(f"client GRPC_EXPERIMENTS=[{os.environ.get('GRPC_EXPERIMENTS', '')}]", "plain services" if plain else
              "launcher", env, f"p50 {result['e2e_ms']['p50']} ms", result["per_hop_p50_ms"])
        for service in state.services:
            if service.name in ("gateway", "scheduler", "worker-0"):
                tasks = Path(f"/proc/{service.pid}/task").iterdir()
                print(" ", service.name, dict(collections.Counter((t / "comm").read_text().strip() for t in tasks)))
    finally:
        down(out / "run")


if __name__ == "__main__":
    plain = sys.argv[2:3] == ["--plain"]
    main(Path(sys.argv[1]), plain, dict(a.split("=", 1) for a in sys.argv[3 if plain else 2:]))
