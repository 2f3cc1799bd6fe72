"""Tenant adapters on `minilm-plot` against `minilm` (HMI §5.2, §7.5): the same labelled sentiment data, the
same adapter and training settings, the validation accuracy / macro F1 of each base.

    python -m academus.loadgen.probes.plot_adapters_bench [--examples 400] [--epochs 10] [--table train|general]

`--table train` builds the K=3 PLOT root from the training texts themselves (a tenant whose domain table
holds its own data, HMI's domain version); `general` from --limit SOTU + WordNet texts (text the table
never saw). The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from academus.shared.models.model import TeacherEncoder
from academus.shared.models.plot import PlotStore
from academus.shared.models.plot.layers import SplitBert
from academus.shared.training.adapters import train_adapter
from academus.shared.training.data import load_task
from academus.shared.training.plot_build import BuildOptions, build, corpus_texts
from academus.shared.training.prepare import subsample


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--table", choices=["train", "general"], default="train")
    p.add_argument("--limit", type=int, default=2000, help="general texts per corpus (--table general)")
    p.add_argument("--lower-layers", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = load_task("sentiment")
    train = subsample(task.train, args.examples)
    texts, labels = [e.text for e in train], [task.labels[e.label] for e in train]
    teacher = TeacherEncoder.load()
    table = Path(tempfile.mkdtemp(prefix="plot-adapters-"))
    started = time.perf_counter()
    corpus = texts if args.table == "train" else corpus_texts("general", limit=args.limit)
    build(corpus, table, BuildOptions(lower_layers=args.lower_layers),
          layers=SplitBert(teacher.body, args.lower_layers))
    summary: dict = {"examples": args.examples, "epochs": args.epochs, "table": args.table,
                     "lower_layers": args.lower_layers, "build_s": round(time.perf_counter() - started, 1)}
    store = PlotStore.open(table, verify=False)
    for base in ("minilm", "minilm-plot"):
        _, result = train_adapter(texts, labels, base=base, epochs=args.epochs, validation_fraction=0.3,
                                  encoder=teacher, plot_store=store, progress=False)
        summary[base] = {"validation": result["validation"], "untrained": result["untrained_validation"],
                         "train_s": result["seconds"]["total"]}
    summary["plot_vs_minilm_accuracy"] = round(summary["minilm-plot"]["validation"]["accuracy"]
                                               / summary["minilm"]["validation"]["accuracy"], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
