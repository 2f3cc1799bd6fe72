"""Two commits' early exits at one rate, in one run: a fresh mesh an arm (one padded sentiment deployment), the
Poisson schedule of exits_live at `RATE` for `SECONDS`, the arms' order alternating between rounds. An arm is
`vanilla@DIR` or `early@DIR`: `Infer` or `InferStream`, the services run with PYTHONPATH=DIR (a directory holding
an `academus` link to a commit's worktree). Each arm reports the first and final results' p25/p50/p99, the texts
released early, and the worker's ramps as `academus ramps status` shows them at the end (active layers, the
measured cost of a ramp as a share of the model's time).

`python half_load.py ARTIFACTS RATE SECONDS ROUNDS OUT ARM,ARM,...`"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from academus.client import AsyncClient
from academus.loadgen.exits_bench import drifting_order
from academus.loadgen.exits_live import one_request, open_loop, padded_mesh
from academus.shared.training.data import fetch, load_task


def ramps_status(run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "academus.shared.cli.main", "--run-dir", str(run_dir), "ramps",
                          "status"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def run(arm: str, texts: list[str], rate: float, seconds: float, artifacts: Path, seed: int) -> dict:
    kind, _, code = arm.partition("@")
    with padded_mesh("sentiment", artifacts, {"PYTHONPATH": code}) as (state, key):

        async def measure() -> dict:
            async with AsyncClient(state.gateway, api_key=key, timeout=60) as client:
                for text in texts[:16]:
                    await one_request(client, kind, "sentiment", text)
                return await open_loop(client, kind, "sentiment", texts, rate, seconds, seed)

        res = asyncio.run(measure())
        status = ramps_status(Path(state.run_dir)) if kind == "early" else {}
    first, final = np.array(res["first_ms"]), np.array(res["final_ms"])
    ramps = [m for worker in status.values() for m in worker.values()]
    return {"arm": arm, "sent": res["sent"], "answered": res["answered"],
            "released": round(float(np.mean(first < final - 0.05)), 4),
            "first_ms": {q: round(float(np.percentile(first, q)), 2) for q in (25, 50, 99)},
            "final_ms": {q: round(float(np.percentile(final, q)), 2) for q in (25, 50, 99)},
            "ramps": [{k: r.get(k) for k in ("active", "costs", "exits", "tunings", "window_agreement")}
                      for r in ramps]}


def main() -> None:
    artifacts, rate, seconds, rounds, out = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), \
        int(sys.argv[4]), Path(sys.argv[5])
    arms = sys.argv[6].split(",")
    test = load_task("sentiment", fetch(None)).test
    results = []
    for r in range(rounds):
        texts = [test[i].text for i in drifting_order("sentiment", test, seed=r)]
        for arm in arms if r % 2 == 0 else arms[::-1]:
            results.append(run(arm, texts, rate, seconds, artifacts, r) | {"round": r})
            print(json.dumps(results[-1]), flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
