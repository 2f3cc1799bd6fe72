"""Where a sequential request's time and CPU go on the `null` model, against one and three bare gRPC hops.

    python sequential_path.py [--rounds 4] [--requests 1500] [--out sequential_path.json]

First the floors: grpc.aio unary chains of 1 and 3 hops and 3 hops over Unix sockets (the stack bench's). Then
`--rounds` rounds of a fresh mesh per policy (`fifo`, `concat`; the order alternating), each sending --requests
sequential single-text requests with the sync client: end-to-end p50/p99, the per-hop split from the responses'
metadata, and each service thread's user and system CPU per request and voluntary switches per request, from
/proc/<pid>/task.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

from academus.client import Client
from academus.loadgen import grpc_floor, uds_floor
from academus.loadgen.overhead import measure
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, down, up

SERVICES = ("gateway", "scheduler", "worker-0")
TICK_MS = 1e3 / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> dict[str, tuple[str, int, int, int]]:
    """Each live thread's (name, user ticks, system ticks, voluntary switches), by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat, status = (task / "stat").read_text(), (task / "status").read_text()
        except OSError:   # the thread ended meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        voluntary = next(line for line in status.splitlines() if line.startswith("voluntary_ctxt_switches"))
        out[task.name] = (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[11]), int(fields[12]),
                          int(voluntary.split()[1]))
    return out


def per_request(before: dict, after: dict, n: int) -> dict[str, dict[str, float]]:
    """CPU ms (user, system) and voluntary switches a request, summed over the threads of each name."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for tid, (name, user, system, switches) in after.items():
        if tid in before:
            _, user0, system0, switches0 = before[tid]
            row = sums[name]
            row[0] += (user - user0) * TICK_MS / n
            row[1] += (system - system0) * TICK_MS / n
            row[2] += (switches - switches0) / n
    return {name: {"user_ms": round(u, 4), "system_ms": round(s, 4), "voluntary_switches": round(v, 3)}
            for name, (u, s, v) in sums.items()}


def one_mesh(policy: str, run_dir: Path, requests: int) -> dict:
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, deployments=[Deployment(policy)],
                           env={"ACADEMUS_MODELS": "null"}))
    try:
        key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
        pids = {s.name: s.pid for s in state.services if s.name in SERVICES}
        with Client(state.gateway, api_key=key) as client:
            measure(client, "null", 16, 100, 50)   # warm: connections open, code paths run
            before = {name: threads(pid) for name, pid in pids.items()} | {"client": threads(os.getpid())}
            figures = measure(client, "null", 16, requests, 0)
            after = {name: threads(pid) for name, pid in pids.items()} | {"client": threads(os.getpid())}
        return figures | {"cpu": {name: per_request(before[name], after[name], requests) for name in before}}
    finally:
        down(run_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--out", type=Path, default=Path("sequential_path.json"))
    args = p.parse_args()
    floors = {"grpc_1_hop": grpc_floor.chain(1, 0.0, args.requests),
              "grpc_3_hops": grpc_floor.chain(3, 0.0, args.requests),
              "uds_3_hops": uds_floor.chain(3, args.requests)}
    print(json.dumps(floors), flush=True)
    rounds = []
    for r in range(args.rounds):
        order = ("fifo", "concat") if r % 2 == 0 else ("concat", "fifo")
        arms = {policy: one_mesh(policy, args.out.parent / f"run-{r}-{policy}", args.requests) for policy in order}
        rounds.append({"order": order, "arms": arms})
        print(json.dumps({p: (a["e2e_ms"]["p50"], a["per_hop_p50_ms"]) for p, a in arms.items()}), flush=True)
    settings = vars(args) | {"out": str(args.out)}
    args.out.write_text(json.dumps({"floors": floors, "rounds": rounds, "settings": settings}, indent=1))


if __name__ == "__main__":
    main()
