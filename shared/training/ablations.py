"""`academus distill ablations`: the ablations of Student Parallelism's Table 3 and the BERT-2L baseline.

Every variant changes one thing against the full method, which is rerun here under the same config
(the `reference` row), so the comparison does not mix a quick and a default run:
- no-stacking: λ = 0 in eq. 4; Algorithms 1 and 2 otherwise unchanged.
- bagging: every student starts from the same initial student and fits T(x) directly (½‖T − S‖²; no
  stacking term, as there is no chain of earlier students to stack on) on its own bootstrap sample; the
  ensemble is the plain mean (equal α, not learned). Students are added while the validation loss of the
  mean decreases; Algorithm 2 then runs on prefix means.
- no-pruning: the reference's Algorithm 1 group, fine-tuned with soft cross-entropy on the full group only
  (no prefix training) and served with all M students.
- bert-2l: one 2-layer model (teacher embeddings + bottom layers, a fresh linear head) fine-tuned on the gold
  labels with cross-entropy for boost_epochs + prune_epochs epochs; no distillation.
The served k of each group is chosen on validation (all M for no-pruning). The test split is never cut,
even with --quick, so every row is scored on the same fixed split as the served group. Only metrics are
written (<artifacts>/students/ablations/<task>[-quick].json, merged by variant); the served artifact is
untouched.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from academus.shared.models.students import StudentGroup, from_teacher
from academus.shared.runtime.config import artifacts_dir as default_artifacts_dir
from academus.shared.state.artifacts import update_json
from academus.shared.training.distill import (
    _initial_group,
    _optimizer,
    _step,
    adaptive_pruning,
    best_prefix,
    boost_loss,
    check_args,
    ffn_keep,
    group_scores,
    load_data,
    sequential_training,
    student_finals,
    student_sources,
    teacher_scores,
    train_student,
)
from academus.shared.training.distill_data import (
    EMBEDDING_TASK,
    DistillConfig,
    DistillData,
    Split,
    Teacher,
    collate,
    epoch_batches,
)

VARIANTS = ("reference", "no-stacking", "bagging", "no-pruning", "bert-2l")


def log_progress(message: str) -> None:
    print(f"[ablations] {message}", file=sys.stderr, flush=True)


def ablations_path(artifacts: Path, task: str, quick: bool = False) -> Path:
    """Quick and default runs are kept apart: <task>.json and <task>-quick.json."""
    return Path(artifacts) / "students" / "ablations" / f"{task}{'-quick' if quick else ''}.json"


# --- pieces --------------------------------------------------------------------------------------

def bootstrap_sample(n: int, generator: torch.Generator) -> list[int]:
    """n indices drawn uniformly with replacement (sorted; repeats kept)."""
    return sorted(torch.randint(n, (n,), generator=generator).tolist())


def hard_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """−log softmax(logits)[gold], batch mean: BERT-2L's loss on the task labels."""
    return nn.functional.cross_entropy(logits, labels)


def bagging_training(group: StudentGroup, data: DistillData, cfg: DistillConfig,
                     generator: torch.Generator) -> list[dict[str, Any]]:
    """Bagging in place of Algorithm 1: independent students from one start, each on a bootstrap sample."""
    train, val = data.splits["train"], data.splits["validation"]
    start_state = copy.deepcopy(group.students[0].state_dict())
    no_previous = torch.zeros_like(train.target)
    val_sum = torch.zeros_like(val.target)
    best_val = boost_loss(val.target, val_sum, val_sum).item()
    history: list[dict[str, Any]] = []
    for i in range(cfg.max_students):
        if i > 0:
            group.add_student(alpha=1.0).load_state_dict(start_state)
        indices = bootstrap_sample(len(train), generator)
        clock = time.perf_counter()
        loss = train_student(group, train, no_previous, indices, replace(cfg, lam=0.0), generator,
                             f"bagged student {i + 1}/{cfg.max_students}", train_alpha=False)
        val_sum = val_sum + student_finals(group, val, [i], cfg, "validation")[0]
        val_loss = boost_loss(val.target, val_sum / (i + 1), torch.zeros_like(val_sum)).item()
        record = {"student": i + 1, "samples": len(indices), "unique": len(set(indices)),
                  "train_loss": round(loss, 5), "validation_loss": round(val_loss, 5),
                  "seconds": round(time.perf_counter() - clock, 1)}
        log_progress(f"bagging: {record}")
        history.append(record)
        if i > 0 and val_loss >= best_val:      # the first student is always kept
            record["dropped"] = True
            group.drop_last()
            break
        best_val = val_loss
    return history


def train_direct(group: StudentGroup, split: Split, cfg: DistillConfig, generator: torch.Generator,
                 epochs: float) -> float:
    """BERT-2L: the group's single student and its head trained on gold labels (CE); returns the last loss."""
    student, head = group.students[0], group.head
    batches = list(epoch_batches(split, range(len(split)), epochs, cfg, generator))
    optimizer, schedule = _optimizer(list(student.parameters()), list(head.parameters()), cfg, len(batches))
    group.train()
    loss_value = float("nan")
    with tqdm(batches, desc="BERT-2L (cross-entropy)", unit="batch", file=sys.stderr, leave=False) as bar:
        for batch in bar:
            ids, mask, types = collate(split, batch)
            final = group.student_outputs(ids, mask, types, 1)[0][0]
            loss_value = _step(hard_cross_entropy(head(final), split.labels[batch]), optimizer, schedule, bar)
    return loss_value


# --- variants ------------------------------------------------------------------------------------

def _scored(group: StudentGroup, data: DistillData, cfg: DistillConfig, k: int | None = None,
            average: bool = False) -> dict[str, Any]:
    """Per-k validation and test scores; k is the validation best unless given."""
    splits = [n for n in ("validation", "test", "heldout") if n in data.splits]
    scores = {n: group_scores(group, data, data.splits[n], cfg, f"{n} per k", average) for n in splits}
    k = k or best_prefix(scores["validation"])
    row = scores["heldout" if data.task == EMBEDDING_TASK else "test"][k - 1]
    return {"k": k, "students": group.max_students, "row": row, **scores}


def _pruned(group: StudentGroup, data: DistillData, cfg: DistillConfig, generator: torch.Generator,
            full_only: bool = False, average: bool = False) -> dict[str, Any]:
    adaptive_pruning(group, data, cfg, generator, full_only, average)
    return _scored(group, data, cfg, group.max_students if full_only else None, average)


def _seeded(cfg: DistillConfig) -> torch.Generator:
    torch.manual_seed(cfg.seed)
    return torch.Generator().manual_seed(cfg.seed)


def _boosting_variants(teacher: Teacher, data: DistillData, cfg: DistillConfig,
                       only: set[str]) -> dict[str, dict[str, Any]]:
    """reference and no-pruning (one Algorithm 1 run shared), and no-stacking."""
    out: dict[str, dict[str, Any]] = {}
    if only & {"reference", "no-pruning"}:
        clock = time.perf_counter()
        generator = _seeded(cfg)
        group = _initial_group(teacher, data, cfg)
        history = sequential_training(group, data, cfg, generator)
        shared = time.perf_counter() - clock
        for name, full_only in (("no-pruning", True), ("reference", False)):
            if name in only:
                clock = time.perf_counter()
                result = _pruned(copy.deepcopy(group), data, cfg, _seeded(cfg), full_only=full_only)
                own = time.perf_counter() - clock         # seconds: as if run alone, Algorithm 1 included
                out[name] = {**result, "algorithm1": history, "seconds": round(shared + own, 1),
                             "algorithm1_seconds": round(shared, 1)}
    if "no-stacking" in only:
        clock = time.perf_counter()
        lam0 = replace(cfg, lam=0.0)
        generator = _seeded(cfg)
        group = _initial_group(teacher, data, lam0)
        history = sequential_training(group, data, lam0, generator)
        out["no-stacking"] = {**_pruned(group, data, lam0, generator), "algorithm1": history,
                              "seconds": round(time.perf_counter() - clock, 1)}
    return out


def _bagging(teacher: Teacher, data: DistillData, cfg: DistillConfig) -> dict[str, Any]:
    clock = time.perf_counter()
    generator = _seeded(cfg)
    group = _initial_group(teacher, data, cfg)
    history = bagging_training(group, data, cfg, generator)
    return {**_pruned(group, data, cfg, generator, average=True), "algorithm1": history,
            "seconds": round(time.perf_counter() - clock, 1)}


def _bert_2l(teacher: Teacher, data: DistillData, cfg: DistillConfig) -> dict[str, Any]:
    clock = time.perf_counter()
    generator = _seeded(cfg)
    bert = teacher.encoder.body      # a fresh linear head; as narrow as the students
    group = from_teacher(bert, cfg.layers, data.labels, ffn_keep=ffn_keep(bert, data.splits["train"], cfg),
                         sources=student_sources(bert, cfg))   # cut as the students are
    epochs = cfg.boost_epochs + cfg.prune_epochs
    loss = train_direct(group, data.splits["train"], cfg, generator, epochs)
    return {**_scored(group, data, cfg, k=1), "epochs": epochs, "train_loss": round(loss, 5),
            "seconds": round(time.perf_counter() - clock, 1)}


# --- the run -------------------------------------------------------------------------------------

def run_ablations(task: str, artifacts: Path | None = None, data_dir: Path | None = None,
                  cfg: DistillConfig | None = None, quick: bool = False,
                  only: tuple[str, ...] = VARIANTS, full_test: bool = True) -> dict[str, Any]:
    """Runs the chosen variants for `task`, merges their metrics into the ablations JSON; returns it."""
    cfg = cfg or DistillConfig()
    check_args(task, cfg)
    unknown = set(only) - set(VARIANTS)
    if unknown or not only:
        raise ValueError(f"unknown ablation(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if task == EMBEDDING_TASK and "bert-2l" in only:
        raise ValueError("bert-2l needs task labels: not for --task embedding (use --only)")
    artifacts = Path(artifacts or default_artifacts_dir())
    if full_test:
        cfg = replace(cfg, limits={k: v for k, v in cfg.limits.items() if k != "test"})
    started = time.perf_counter()
    teacher, data = load_data(task, artifacts, data_dir, cfg)
    results = _boosting_variants(teacher, data, cfg, set(only))
    if "bagging" in only:
        results["bagging"] = _bagging(teacher, data, cfg)
    if "bert-2l" in only:
        results["bert-2l"] = _bert_2l(teacher, data, cfg)
    for result in results.values():
        result.update(quick=quick, config=asdict(cfg))
    split = "heldout" if task == EMBEDDING_TASK else "test"
    summary = {"task": task, "split": split, "counts": {n: len(s) for n, s in data.splits.items()},
               "teacher": teacher_scores(data, data.splits["test"]), "variants": results}
    log_progress(f"{task}: {len(results)} variant(s) in {time.perf_counter() - started:.0f} s")
    return write_ablations(ablations_path(artifacts, task, quick), summary)


def write_ablations(path: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Merges `summary`'s variants into the ablations JSON at `path` (`update_json`: two runs at once keep both's
    variants); returns the merged file."""
    return update_json(path, lambda merged: {**merged, **summary,
                                             "variants": {**merged.get("variants", {}), **summary["variants"]}})
