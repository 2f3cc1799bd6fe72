"""The teacher trained at every width (`academus shard adapt`) against the teacher, both whole and at full
precision, under the teacher's served heads: test accuracy of each, their agreement, and the cosine of their
embeddings, on each bundled task's whole test split. Whether the width training kept the teacher.

    python -m academus.loadgen.probes.adapted_teacher --artifacts A --model NAME [--heads H]

`--heads`: the artifacts holding the teacher's task heads (default: A). The last line printed is the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from academus.shared.models.model import TeacherEncoder
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import open_model
from academus.shared.runtime.config import offline_hub
from academus.shared.state.catalogue import read_catalogue
from academus.shared.training.data import TASKS, load_task
from academus.shared.training.prepare import in_text_order, load_head, padded_batches


def compare(teacher: torch.nn.Module, adapted: torch.nn.Module, head: torch.nn.Module, task: str) -> dict:
    data = load_task(task)
    texts, gold = [e.text for e in data.test], torch.tensor([e.label for e in data.test])
    batches = list(padded_batches(TeacherTokenizer(teacher_dir()), texts, 64))
    ours, theirs = in_text_order(batches, len(texts), teacher), in_text_order(batches, len(texts), adapted)
    with torch.inference_mode():
        a, b = head(ours).argmax(1), head(theirs).argmax(1)
    cosine = (ours * theirs).sum(1)
    return {"texts": len(texts), "teacher_accuracy": round(float((a == gold).float().mean()), 4),
            "adapted_accuracy": round(float((b == gold).float().mean()), 4),
            "agreement": round(float((a == b).float().mean()), 4),
            "cosine_mean": round(float(cosine.mean()), 4), "cosine_min": round(float(cosine.min()), 4)}


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--model", required=True, help="the model `shard adapt` added")
    p.add_argument("--heads", type=Path, default=None, help="artifacts holding the teacher's task heads")
    args = p.parse_args(argv)
    adapted, _, _ = open_model(args.artifacts / read_catalogue(args.artifacts)[args.model]["source"])
    teacher = TeacherEncoder.load()
    heads = args.heads or args.artifacts
    print(json.dumps({"model": args.model, **{task: compare(teacher, adapted, load_head(heads, task), task)
                                              for task in TASKS}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
