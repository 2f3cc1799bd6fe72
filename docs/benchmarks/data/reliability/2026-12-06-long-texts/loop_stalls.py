"""Where the gateway's event loop is held while the largest requests arrive: one fresh `concat` mesh serving `null`,
`ACADEMUS_LOOP_STALL_MS=10` on every service, long_texts_ab.py's two phases (small requests beside the largest ASCII,
then accented, requests, 10 s each); then the gateway's `loop_stall` events summed, by the innermost frame sampled.

    python loop_stalls.py RUN_COPY_DIR [NAME=VALUE ...]   # NAME=VALUE: more settings for the mesh's services

Prints one JSON line: each phase's figures (as long_texts_ab.py's) and the stalls."""

from __future__ import annotations

import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import long_texts_ab


def stalls(log: Path) -> dict:
    rows = [json.loads(line) for line in log.read_text().splitlines() if '"loop_stall"' in line]
    where: collections.Counter = collections.Counter()
    for row in rows:
        for stack in row["stacks"]:
            where[stack["frames"][0]] += stack["share"] * row["ms"]
    return {"count": len(rows), "sum_ms": round(sum(r["ms"] for r in rows)),
            "loop_thread_cpu_ms": round(sum(r["cpu_ms"] for r in rows)), "longest_ms": max(r["ms"] for r in rows),
            "innermost_frames_ms": {frame: round(ms) for frame, ms in where.most_common(6)}}


def main() -> None:
    from academus.client import Client
    from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up

    env = {"ACADEMUS_MODELS": "null", "ACADEMUS_LOOP_STALL_MS": "10", **dict(a.split("=", 1) for a in sys.argv[2:])}
    run = Path(tempfile.mkdtemp(prefix="academus-stall-"))
    up(MeshOptions(run_dir=run, gateway_port=0, deployments=[Deployment("concat")], env=env))
    try:
        state = MeshState.load(run)
        key = (run / ADMIN_KEY_FILE).read_text().strip()
        pid = next(s.pid for s in state.services if s.name.startswith("gateway"))
        with Client(state.gateway, api_key=key) as client:
            for _ in range(long_texts_ab.WARMUP):
                client.infer("null", ["a fine film"])
            out = {kind: long_texts_ab.beside_large(client, state.gateway, key, phrase, pid)
                   for kind, phrase in long_texts_ab.LARGE.items()}
    finally:
        shutil.copytree(run, sys.argv[1], ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
        down(run)
    print(json.dumps({"env": env, **out, "gateway_stalls": stalls(Path(sys.argv[1]) / "logs" / "gateway.log")}))


if __name__ == "__main__":
    main()
