"""Mesh overhead at low load: end-to-end p50 (client -> gateway -> scheduler -> worker) minus the
worker's own compute p50, for inputs of a given token count. Sequential requests, one at a time.

    python -m academus.loadgen.overhead [--run-dir DIR] [--requests 500] [--tokens 16 64]

Without --run-dir it starts a mesh of its own (and stops it). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from academus.client import Client
from academus.loadgen.stats import summary
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up


def text_of(tokens: int) -> str:
    """A text that tokenizes to exactly `tokens` ids with [CLS] and [SEP]."""
    return " ".join(["word"] * (tokens - 2))


def measure(client: Client, model: str, tokens: int, requests: int, warmup: int) -> dict:
    text = text_of(tokens)
    rows = []
    for i in range(warmup + requests):
        start = time.perf_counter()
        result = client.infer(model, [text])
        e2e = (time.perf_counter() - start) * 1e3
        if i >= warmup:
            m = result.metadata
            rows.append((e2e, m.gateway_ms, m.scheduler_ms, m.worker_ms, m.compute_ms))
    assert result.predictions[0].num_tokens == tokens
    cols = list(zip(*rows, strict=True))
    e2e, gateway, scheduler, worker, compute = (summary(c) for c in cols)
    return {
        "tokens": tokens,
        "requests": requests,
        "e2e_ms": e2e,
        "compute_ms": compute,
        "overhead_p50_ms": round(e2e["p50"] - compute["p50"], 3),
        "per_hop_p50_ms": {
            "client<->gateway": round(e2e["p50"] - gateway["p50"], 3),
            "gateway (own + hop to scheduler)": round(gateway["p50"] - scheduler["p50"], 3),
            "scheduler (own + hop to worker)": round(scheduler["p50"] - worker["p50"], 3),
            "worker (own, outside the model)": round(worker["p50"] - compute["p50"], 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", type=Path, help="use a running mesh (default: start one)")
    p.add_argument("--model", default="minilm")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    p.add_argument("--worker-threads", type=int, default=0)
    args = p.parse_args(argv)
    own = args.run_dir is None
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="academus-overhead-"))
    state = (up(MeshOptions(run_dir=run_dir, gateway_port=0, worker_threads=args.worker_threads,
                            deployments=[Deployment("fifo")])) if own
             else MeshState.load(run_dir))
    try:
        key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
        with Client(state.gateway, api_key=key) as client:
            results = [measure(client, args.model, t, args.requests, args.warmup) for t in args.tokens]
    finally:
        if own:
            down(run_dir)
    print(json.dumps({"model": args.model, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
