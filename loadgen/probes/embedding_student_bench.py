"""What limits the embedding students (issue 3): Algorithm 1's first student alone, trained on the same
number of samples under one change at a time, scored by mean cosine to the teacher.

    python -m academus.loadgen.probes.embedding_student_bench [--variants base,more,layers3]

- base: the default data (SOTU 12,000 + task texts), one pass, 2 layers;
- more: twice as many distinct texts (22,500 more SOTU sentences past the fixed validation and test
  slices), half a pass: the same steps;
- layers3: the default data, one pass, 3 layers (1.5× the compute).
A changed training set embeds its texts once into a cache of its own (the default run's cache is kept).
The last line printed is the JSON summary (validation, in-domain test and held-out
WordNet cosine per variant).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import torch

from academus.shared.runtime.config import artifacts_dir
from academus.shared.training import distill, distill_data

VARIANTS = {"base": {}, "more": {"extra_sotu": 22500, "boost_epochs": 0.5}, "layers3": {"layers": 3}}


def variant_config(variant: str) -> distill_data.DistillConfig:
    """One student, one pass, with the variant's change."""
    return replace(distill_data.DistillConfig(max_students=1, boost_epochs=1.0), **VARIANTS[variant])


def first_student(variant: str) -> dict:
    cfg = variant_config(variant)
    torch.manual_seed(cfg.seed)
    teacher, data = distill.load_data(distill_data.EMBEDDING_TASK, artifacts_dir(), None, cfg)
    group = distill._initial_group(teacher, data, cfg)
    train = data.splits["train"]
    started = time.perf_counter()
    distill.train_student(group, train, torch.zeros_like(train.target), list(range(len(train))), cfg,
                          torch.Generator().manual_seed(cfg.seed), f"{variant}: first student")
    out = {"train_texts": len(train), "train_s": round(time.perf_counter() - started, 1)}
    for name in ("validation", "test", "heldout"):
        out[name] = distill.group_scores(group, data, data.splits[name], cfg, name)[0]["cosine"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    summary = {}
    for variant in args.variants.split(","):
        summary[variant] = first_student(variant)
        print(f"{variant}: {json.dumps(summary[variant])}", file=sys.stderr, flush=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
