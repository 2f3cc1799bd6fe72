"""Tenant adapters on each base: the same labelled sentiment data and settings on the bundled MiniLM and on users'
models from the catalogue (e.g. all-mpnet-base-v2 added as `mpnet`): each base's validation accuracy / macro F1,
untrained and trained, its adapter's parameters and the seconds training took.

    python -m academus.loadgen.probes.adapter_bases --artifacts .academus/mpnet-artifacts --bases minilm,mpnet
        [--examples 400] [--epochs 8] [--seeds 0,1,2]

Each seed draws its own held-out share and adapter initialisation; the bases alternate within a seed.

The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from academus.shared.runtime.config import use_artifacts
from academus.shared.training.adapters import train_adapter
from academus.shared.training.data import load_task
from academus.shared.training.prepare import subsample


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifacts", type=Path, default=None, help="the catalogue's folder (default: ACADEMUS_ARTIFACTS)")
    p.add_argument("--bases", default="minilm", help="comma-separated bases (default: %(default)s)")
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.artifacts:
        use_artifacts(args.artifacts)
    task = load_task("sentiment")
    train = subsample(task.train, args.examples)
    texts, labels = [e.text for e in train], [task.labels[e.label] for e in train]
    seeds = [int(s) for s in args.seeds.split(",")]
    summary: dict = {"examples": args.examples, "epochs": args.epochs, "threads": args.threads, "seeds": seeds,
                     "runs": []}
    for seed in seeds:
        for base in args.bases.split(","):
            adapter, result = train_adapter(texts, labels, base=base, epochs=args.epochs, validation_fraction=0.3,
                                            seed=seed, progress=False)
            run = {"base": base, "seed": seed, "layers": list(adapter.layer_ids), "base_layers": adapter.base_layers,
                   "hidden": adapter.hidden, "parameters": result["parameters"], "validation": result["validation"],
                   "untrained": result["untrained_validation"], "seconds": result["seconds"]}
            summary["runs"].append(run)
            print(json.dumps(run), flush=True)
    for base in args.bases.split(","):
        accuracies = [r["validation"]["accuracy"] for r in summary["runs"] if r["base"] == base]
        summary[base] = {"accuracy_mean": round(statistics.mean(accuracies), 4), "accuracy": accuracies}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
