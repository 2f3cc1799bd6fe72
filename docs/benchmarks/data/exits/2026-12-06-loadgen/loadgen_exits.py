"""Early exits measured by the product's load generator: `academus loadgen compare --runs spam,spam+early-exit`
(unary `Infer` against `Infer(early_exit)`), on a fresh padded spam mesh a round (`exits_live.padded_mesh`: one
worker, apparate), the runs' order alternating between rounds. Each round: a warm-up run, then the comparison,
Poisson at RATE req/s for SECONDS seconds, the test split's mails in the load generator's order.

    python loadgen_exits.py ARTIFACTS ROUNDS RATE SECONDS OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from academus.loadgen.exits_live import padded_mesh


def loadgen(run_dir: str, runs: str, rate: float, seconds: float, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", run_dir, "loadgen", "compare",
                           "--runs", runs, "--schedule", f"poisson:{rate}", "--duration", str(seconds),
                           "--texts", "task:spam", "--out", str(out)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    artifacts, rounds, rate, seconds, out = (Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                             float(sys.argv[4]), Path(sys.argv[5]))
    out.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        runs = "spam:padded,spam:padded+early-exit" if r % 2 == 0 else "spam:padded+early-exit,spam:padded"
        with padded_mesh("spam", artifacts, {}) as (state, _key):
            loadgen(state.run_dir, "spam:padded,spam:padded+early-exit", rate, 5, out / f"warm_{r}")
            report = loadgen(state.run_dir, runs, rate, seconds, out / f"round_{r}")
        (out / f"round_{r}.json").write_text(json.dumps(report))
        by_arm = {("early" if run["early_exit"] else "vanilla"): run for run in report["runs"]}
        early, vanilla = by_arm["early"], by_arm["vanilla"]
        print(json.dumps({"round": r, "order": runs, **{
            f"{q}_ratio": round(early["latency_ms"][q] / vanilla["latency_ms"][q], 3) for q in ("p50", "p95", "p99")},
            "released_early": early["exits"]["released_early"], "exit_layers": early["exits"]["exit_layers"],
            "vanilla_ms": vanilla["latency_ms"], "early_ms": early["latency_ms"],
            "accuracy": {"vanilla": vanilla["accuracy"], "early": early["accuracy"]},
            "errors": {"vanilla": vanilla["errors"], "early": early["errors"]}}), flush=True)


if __name__ == "__main__":
    main()
