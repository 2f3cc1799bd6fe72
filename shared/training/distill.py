"""`academus distill`: a group of shallow students from the teacher (Student Parallelism §3.1–3.2).

Algorithm 1 (sequential student training): the first student is the teacher's embeddings + bottom N
layers; each later one copies the last trained student. Student i minimises
    L = ½‖T(x) − B⁽ⁱ⁻¹⁾(x) − α_i·S_N⁽ⁱ⁾(x)‖²  +  λ·½‖B⁽ⁱ⁻¹⁾(x) − S_⌈N/2⌉⁽ⁱ⁾(x)‖²      (eqs. 2–4)
where T(x) is the teacher's pooled, L2-normalised representation (what the task heads read) and
B⁽ⁱ⁻¹⁾ = Σ_{m<i} α_m·S_m the fixed ensemble of earlier students; α_i is optimised jointly with the
student (α_0 = 1). The first student sees all training data (and has no stacking term: B⁽⁰⁾ = 0),
later ones the top a % by residual error plus a random b % of the rest. Students are added while the
validation loss of B⁽ⁱ⁾ decreases, at most M; a student that does not improve it is dropped.

Algorithm 2 (adaptive pruning): all students, α and the head are fine-tuned jointly on every prefix
k = 1..M in each batch (gradients summed across prefixes), with soft cross-entropy against the teacher's
soft labels (1 − cosine to T(x) for the embedding task; `gold_weight` mixes in the gold labels). Every prefix
is scored on validation; the best k is the default served count, and the test split is scored once for every k.

Layout: <artifacts>/students/<task>/ (weights.safetensors + manifest.json), report in
<artifacts>/students/report.json; the catalogue entries `<task>-students` / `minilm-students`.
`academus distill ablations` (shared/training/ablations.py) adds Table 3's ablations and the BERT-2L
baseline to the report; `--init minilm-l3` starts the first student from paraphrase-MiniLM-L3-v2
(shared/training/onnx_init.py) instead of the teacher's bottom layers, `--init spread` from teacher layers
spaced evenly over its depth (`students.source_layers`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from academus.shared.models.model import (
    ClassifierHead,
)
from academus.shared.models.students import StudentGroup, check_layers, from_teacher, source_layers
from academus.shared.runtime.config import artifacts_dir as default_artifacts_dir
from academus.shared.training.data import data_dir as default_data_dir
from academus.shared.training.distill_data import (
    CUT_FROM_TEACHER,
    DISTILL_TASKS,
    EMBEDDING_TASK,
    INITIALISATIONS,
    SERVED_NAMES,
    DistillConfig,
    DistillData,
    Split,
    Teacher,
    collate,
    epoch_batches,
    load_classification,
    load_embedding,
    load_file,
    log_progress,
    token_batches,
)
from academus.shared.training.prepare import (
    classification_metrics,
)
from academus.shared.training.student_artifacts import (
    register_user_group,
    students_dir,
    write_student_catalogue,
    write_student_group,
)

# --- losses and sampling -------------------------------------------------------------------------

def boost_loss(target: torch.Tensor, previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Eq. 2, batch mean: ½‖T(x) − B⁽ⁱ⁻¹⁾(x) − α_i·S⁽ⁱ⁾(x)‖² (`current` already carries α_i)."""
    return 0.5 * (target - previous - current).square().sum(-1).mean()


def stack_loss(previous: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
    """Eq. 3, batch mean: ½‖B⁽ⁱ⁻¹⁾(x) − S_⌈N/2⌉⁽ⁱ⁾(x)‖²."""
    return 0.5 * (previous - middle).square().sum(-1).mean()


def soft_cross_entropy(logits: torch.Tensor, soft_targets: torch.Tensor) -> torch.Tensor:
    """−Σ p_teacher·log softmax(logits), batch mean."""
    return -(soft_targets * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


def head_loss(logits: torch.Tensor, soft_targets: torch.Tensor, gold: torch.Tensor, gold_weight: float) -> torch.Tensor:
    """Soft cross-entropy to the teacher, mixed with `gold_weight` of cross-entropy to the gold labels."""
    loss = soft_cross_entropy(logits, soft_targets)
    if gold_weight == 0.0:
        return loss
    return (1.0 - gold_weight) * loss + gold_weight * nn.functional.cross_entropy(logits, gold)


def cosine_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (1 - nn.functional.cosine_similarity(prediction, target, dim=-1)).mean()


def residual_sample(errors: torch.Tensor, top_percent: float, random_percent: float,
                    generator: torch.Generator) -> list[int]:
    """The top a % of samples by residual error, plus b % of all samples drawn from the rest."""
    n = len(errors)
    top = max(1, math.ceil(n * top_percent / 100))
    order = torch.argsort(errors, descending=True, stable=True)
    rest = order[top:]
    extra = min(len(rest), round(n * random_percent / 100))
    picked = rest[torch.randperm(len(rest), generator=generator)[:extra]]
    return sorted(order[:top].tolist() + picked.tolist())


# --- evaluation ----------------------------------------------------------------------------------

@torch.no_grad()
def student_finals(group: StudentGroup, split: Split, students: Sequence[int], cfg: DistillConfig,
                   desc: str = "eval", middle: bool = False) -> torch.Tensor:
    """Unweighted pooled outputs S_m(x) (S_⌈N/2⌉ with `middle`): (len(students), len(split), hidden)."""
    was_training = group.training
    group.eval()
    out = torch.empty(len(students), len(split), group.config.hidden_size)
    lengths = [len(e.input_ids) for e in split.encoded]
    batches = token_batches(lengths, range(len(split)), cfg.tokens_per_batch * 2, cfg.max_rows * 2)
    for batch in tqdm(batches, desc=desc, unit="batch", file=sys.stderr, leave=False):
        ids, mask, types = collate(split, batch)
        hidden, mask4d = group.prepare_inputs(ids, mask, types)
        for row, m in enumerate(students):
            out[row, batch] = group.students[m](hidden, mask4d, mask)[1 if middle else 0]
    group.train(was_training)
    return out


def prefix_sums(finals: torch.Tensor, alphas: torch.Tensor, average: bool = False) -> torch.Tensor:
    """B⁽ᵏ⁾ for k = 1..M from unweighted outputs (M, n, d): the cumulative α-weighted sum, or with
    `average` the plain mean of the first k (a bagging ensemble: equal weights, α unused)."""
    if average:
        counts = torch.arange(1, len(finals) + 1, dtype=finals.dtype, device=finals.device)
        return torch.cumsum(finals, dim=0) / counts[:, None, None]
    return torch.cumsum(alphas[:, None, None] * finals, dim=0)


def prefix_scores(prefixes: torch.Tensor, data: DistillData, split: Split,
                  head: ClassifierHead | None) -> list[dict[str, float]]:
    """Per-k scores: accuracy/F1 (and agreement with the teacher) or mean cosine to the teacher."""
    scores = []
    with torch.no_grad():
        for rep in prefixes:
            cosine = round(nn.functional.cosine_similarity(rep, split.target, dim=-1).mean().item(), 4)
            if head is None:
                scores.append({"cosine": cosine})
            else:
                pred = head(rep).argmax(-1)
                teacher_pred = data.teacher_head(split.target).argmax(-1)
                metrics = classification_metrics(pred, split.labels, len(data.labels))
                agreement = (pred == teacher_pred).float().mean().item()
                scores.append({**metrics, "agreement": round(agreement, 4), "cosine": cosine})
    return scores


def best_prefix(scores: Sequence[dict[str, float]]) -> int:
    """The best k (1-based) on validation: accuracy (cosine for embeddings); ties keep fewer students."""
    key = "accuracy" if "accuracy" in scores[0] else "cosine"
    return max(range(len(scores)), key=lambda i: (scores[i][key], -i)) + 1


def group_scores(group: StudentGroup, data: DistillData, split: Split, cfg: DistillConfig,
                 desc: str, average: bool = False) -> list[dict[str, float]]:
    finals = student_finals(group, split, range(group.max_students), cfg, desc)
    with torch.no_grad():
        prefixes = prefix_sums(finals, group.alphas(), average)
        if group.normalize:
            prefixes = nn.functional.normalize(prefixes, dim=-1)
    return prefix_scores(prefixes, data, split, group.head)


# --- Algorithm 1 ---------------------------------------------------------------------------------

def _optimizer(params: list[nn.Parameter], fast: list[nn.Parameter], cfg: DistillConfig,
               steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW, linear warm-up and decay; `fast` (α, head) get head_lr and no weight decay, so α
    entries that receive no gradient (earlier students' in Algorithm 1) never move."""
    groups = [{"params": params, "lr": cfg.lr, "weight_decay": 0.01},
              {"params": fast, "lr": cfg.head_lr, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]])
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))))
    return optimizer, schedule


def _line_search_alpha(group: StudentGroup, split: Split, residual: torch.Tensor, indices: list[int],
                       cfg: DistillConfig, middle: bool = False) -> float:
    """α minimising ½‖R − α·S‖² for the last student (on ≤ 2000 of `indices`): a new student's start."""
    sample = [indices[j] for j in torch.linspace(0, len(indices) - 1, min(2000, len(indices))).long().tolist()]
    sub = Split([split.encoded[i] for i in sample], split.target[sample], split.labels[:0])
    s = student_finals(group, sub, [group.max_students - 1], cfg, "line search", middle)[0]
    return float((residual[sample] * s).sum() / s.square().sum().clamp(min=1e-12))


def distill_loss(target: torch.Tensor, previous: torch.Tensor, current: torch.Tensor, middle: torch.Tensor,
                 lam: float, first: bool) -> torch.Tensor:
    """Eq. 4: L_boost + λ·L_stack; the first student (B⁽⁰⁾ = 0) and λ = 0 have no stacking term."""
    loss = boost_loss(target, previous, current)
    if first or lam == 0:
        return loss
    return loss + lam * stack_loss(previous, middle)


def train_student(group: StudentGroup, split: Split, previous: torch.Tensor, indices: list[int],
                  cfg: DistillConfig, generator: torch.Generator, desc: str, mid_scale: float = 1.0,
                  train_alpha: bool = True) -> float:
    """Trains the last student (and its α unless it is the first or `train_alpha` is off) on `indices`
    (repeats allowed: a bootstrap sample); returns the last loss."""
    i = group.max_students - 1
    student = group.students[i]
    batches = list(epoch_batches(split, indices, cfg.boost_epochs, cfg, generator))
    fast = [group.alpha] if i > 0 and train_alpha else []
    optimizer, schedule = _optimizer(list(student.parameters()), fast, cfg, len(batches))
    group.train()
    loss_value = float("nan")
    with tqdm(batches, desc=desc, unit="batch", file=sys.stderr, leave=False) as bar:
        for batch in bar:
            ids, mask, types = collate(split, batch)
            hidden, mask4d = group.prepare_inputs(ids, mask, types)
            final, middle = student(hidden, mask4d, mask)
            prev = previous[batch]
            loss = distill_loss(split.target[batch], prev, group.alphas()[i] * final, mid_scale * middle,
                                cfg.lam, first=i == 0)
            loss_value = _step(loss, optimizer, schedule, bar)
    return loss_value


def _step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, schedule, bar) -> float:
    """One optimizer and LR-schedule step; shows and returns the loss."""
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    schedule.step()
    value = loss.item()
    bar.set_postfix(loss=f"{value:.4f}")
    return value


def sequential_training(group: StudentGroup, data: DistillData, cfg: DistillConfig,
                        generator: torch.Generator) -> list[dict[str, Any]]:
    """Algorithm 1; `group` holds the initial student and ends with the kept students."""
    train, val = data.splits["train"], data.splits["validation"]
    prev_train = torch.zeros_like(train.target)
    prev_val = torch.zeros_like(val.target)
    best_val = boost_loss(val.target, prev_val, torch.zeros_like(prev_val)).item()
    history: list[dict[str, Any]] = []
    # S_⌈N/2⌉ is a hidden state (norm ~10), B⁽ⁱ⁻¹⁾ lives at T's unit scale: eq. 3 compares them after a
    # fixed least-squares rescaling of the middle layer, measured once on the initial student.
    mid_scale = _line_search_alpha(group, train, train.target, list(range(len(train))), cfg, middle=True)
    for i in range(cfg.max_students):
        if i == 0:
            indices = list(range(len(train)))
        else:
            errors = (train.target - prev_train).square().sum(-1)
            indices = residual_sample(errors, cfg.top_percent, cfg.random_percent, generator)
            group.add_student()
            alpha = _line_search_alpha(group, train, train.target - prev_train, indices, cfg)
            with torch.no_grad():
                group.alpha[i] = alpha
        start = time.perf_counter()
        train_loss = train_student(group, train, prev_train, indices, cfg, generator,
                                   f"student {i + 1}/{cfg.max_students}", mid_scale)
        weight = group.alphas()[i].detach()
        new_val = prev_val + weight * student_finals(group, val, [i], cfg, "validation")[0]
        val_loss = boost_loss(val.target, new_val, torch.zeros_like(new_val)).item()
        record = {"student": i + 1, "samples": len(indices), "stack_scale": round(mid_scale, 5),
                  "alpha": round(weight.item(), 4),
                  "train_loss": round(train_loss, 5), "validation_loss": round(val_loss, 5),
                  "seconds": round(time.perf_counter() - start, 1)}
        log_progress(f"student {i + 1}: {record}")
        if i > 0 and val_loss >= best_val:    # overfitting on the spared data: drop it (Alg. 1, line 16)
            record["dropped"] = True
            history.append(record)
            group.drop_last()
            break
        history.append(record)
        best_val, prev_val = val_loss, new_val
        if i + 1 < cfg.max_students:
            prev_train = prev_train + weight * student_finals(group, train, [i], cfg, "train outputs")[0]
    return history


# --- Algorithm 2 ---------------------------------------------------------------------------------

def prefix_loss(group: StudentGroup, data: DistillData, split: Split, batch: list[int],
                soft_labels: torch.Tensor | None, full_only: bool = False, average: bool = False,
                gold_weight: float = 0.0) -> torch.Tensor:
    """Σ_k loss of the first k students (k = 1..M) on one batch: one backward accumulates every prefix.
    `full_only` keeps k = M alone (the no-pruning ablation); `average` combines by mean (bagging)."""
    ids, mask, types = collate(split, batch)
    finals = torch.stack([f for f, _ in group.student_outputs(ids, mask, types, group.max_students)])
    prefixes = prefix_sums(finals, group.alphas(), average)
    if full_only:
        prefixes = prefixes[-1:]
    if group.head is None:
        return sum(cosine_loss(rep, split.target[batch]) for rep in prefixes)
    return sum(head_loss(group.head(rep), soft_labels[batch], split.labels[batch], gold_weight) for rep in prefixes)


def adaptive_pruning(group: StudentGroup, data: DistillData, cfg: DistillConfig, generator: torch.Generator,
                     full_only: bool = False, average: bool = False) -> float:
    """Algorithm 2's joint fine-tuning of students, α and head over every prefix (only k = M with
    `full_only`; equal weights, α frozen, with `average`); returns the last loss."""
    train = data.splits["train"]
    soft = None
    if data.teacher_head is not None:
        with torch.no_grad():
            soft = torch.softmax(data.teacher_head(train.target), dim=-1)
    batches = list(epoch_batches(train, range(len(train)), cfg.prune_epochs, cfg, generator))
    head = list(group.head.parameters()) if group.head is not None else []
    fast = head if average else [group.alpha, *head]
    optimizer, schedule = _optimizer(list(group.students.parameters()), fast, cfg, len(batches))
    group.train()
    loss_value = float("nan")
    with tqdm(batches, desc="pruning (all prefixes)", unit="batch", file=sys.stderr, leave=False) as bar:
        for batch in bar:
            loss = prefix_loss(group, data, train, batch, soft, full_only, average, cfg.gold_weight)
            loss_value = _step(loss, optimizer, schedule, bar)
    return loss_value


# --- the whole run -------------------------------------------------------------------------------

def _calibrate_scale(group: StudentGroup, split: Split, cfg: DistillConfig) -> float:
    """Scales the first student's last LayerNorm by the least-squares c of T ≈ c·S: the teacher's
    bottom layers produce pooled vectors ~10× longer than the unit-norm T(x), which would otherwise
    cost the first epochs just shrinking them. Returns c."""
    c = _line_search_alpha(group, split, split.target, list(range(len(split))), cfg)
    norm = group.students[0].encoder.layer[-1].output.LayerNorm
    with torch.no_grad():
        norm.weight.mul_(c)
        norm.bias.mul_(c)
    return c


def student_sources(bert: nn.Module, cfg: DistillConfig) -> list[int]:
    """The teacher layers the first student is cut from, as `cfg.init` says."""
    return source_layers(len(bert.encoder.layer), cfg.layers, spread=cfg.init == "spread")


def ffn_keep(bert: nn.Module, split: Split, cfg: DistillConfig) -> list[torch.Tensor]:
    """For each teacher layer the student is cut from (`student_sources`), the `cfg.intermediate_size` feed-forward
    neurons of most importance: mean |activation| over the real tokens of a training sample times the
    norm of the neuron's output weights, i.e. how much it adds to the layer's output on this task's
    texts. The paper's students are narrower as well as shallower (§4.1: "25 % depth and 50 % width");
    it starts from pre-trained compact models that this teacher does not come with, so the narrow
    student is cut from the teacher's own layers and distillation trains the rest. Empty: full width."""
    layers = [bert.encoder.layer[i] for i in student_sources(bert, cfg)]
    if not cfg.intermediate_size or cfg.intermediate_size >= layers[0].intermediate.dense.out_features:
        return []
    sums = [torch.zeros(layer.intermediate.dense.out_features) for layer in layers]
    mask: list[torch.Tensor] = []

    def hook(i: int):
        def add(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
            sums[i].add_((out.abs() * mask[0][..., None]).sum((0, 1)))
        return add

    handles = [layer.intermediate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        sample = list(range(min(cfg.importance_samples, len(split))))
        lengths = [len(e.input_ids) for e in split.encoded]
        with torch.no_grad():
            for batch in token_batches(lengths, sample, cfg.tokens_per_batch, cfg.max_rows):
                ids, attention, types = collate(split, batch)
                mask[:] = [attention.float()]
                bert(input_ids=ids, attention_mask=attention, token_type_ids=types)
    finally:
        for handle in handles:
            handle.remove()
    return [torch.topk(total * layer.output.dense.weight.norm(dim=0), cfg.intermediate_size).indices.sort().values
            for total, layer in zip(sums, layers, strict=True)]


def _initial_group(teacher: Teacher, data: DistillData, cfg: DistillConfig,
                   data_dir: Path | None = None) -> StudentGroup:
    normalize = data.teacher_head is None
    if cfg.init == "minilm-l3":
        from academus.shared.training.onnx_init import group_from_l3, load_minilm_l3

        state = load_minilm_l3(Path(data_dir or default_data_dir()))
        group = group_from_l3(teacher.encoder.body.config, state, cfg.layers, data.labels, normalize)
    else:
        bert = teacher.encoder.body
        group = from_teacher(bert, cfg.layers, data.labels, normalize, ffn_keep(bert, data.splits["train"], cfg),
                             student_sources(bert, cfg))
    _calibrate_scale(group, data.splits["train"], cfg)
    if data.teacher_head is not None:     # the new classifier starts from the teacher's head: B ≈ T
        group.take_head(data.teacher_head)
    return group


def teacher_scores(data: DistillData, split: Split) -> dict[str, float]:
    if data.teacher_head is None:
        return {"cosine": 1.0}
    with torch.no_grad():
        pred = data.teacher_head(split.target).argmax(-1)
    return classification_metrics(pred, split.labels, len(data.labels))


def check_args(task: str, cfg: DistillConfig, from_file: bool = False) -> None:
    """`from_file`: the examples come from a user's file, whatever task its head was trained on."""
    if task not in DISTILL_TASKS and not from_file:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(DISTILL_TASKS)}")
    if cfg.max_students < 1 or cfg.layers < 1:
        raise ValueError("--max-students and --layers must be at least 1")
    if not 0.0 <= cfg.gold_weight <= 1.0 or (cfg.gold_weight and task == EMBEDDING_TASK):
        raise ValueError(f"--gold-weight must be in [0, 1], and it mixes in gold labels only for a labelled task, "
                         f"not {cfg.gold_weight} on {task!r}")
    if cfg.boost_epochs <= 0 or cfg.prune_epochs < 0:
        raise ValueError(f"--boost-epochs must be > 0 and --prune-epochs >= 0, not {cfg.boost_epochs} and "
                         f"{cfg.prune_epochs}")
    if cfg.intermediate_size < 0 or (cfg.intermediate_size and cfg.init not in CUT_FROM_TEACHER):
        raise ValueError(f"--intermediate-size must be >= 0 (0: the teacher's width), and it narrows only "
                         f"students cut from the teacher (--init teacher or spread), not {cfg.intermediate_size} "
                         f"with --init {cfg.init}")


def load_data(task: str, artifacts: Path, data_dir: Path | None, cfg: DistillConfig,
              model: str = "", data_file: Path | None = None) -> tuple[Teacher, DistillData]:
    """The teacher (the bundled one, or a user's `model`) and the task's splits with T(x), or `data_file`'s
    (clear errors when either is missing)."""
    teacher = Teacher.user(artifacts, model) if model else Teacher.bundled()
    if cfg.init in CUT_FROM_TEACHER:   # a bad --layers is refused before the teacher runs over the data (minutes)
        check_layers(len(teacher.encoder.body.encoder.layer), cfg.layers)
    directory = Path(data_dir or default_data_dir())     # `academus prepare` fetched the task packages
    if data_file is not None:
        data = load_file(data_file, directory, teacher, cfg)
    elif task == EMBEDDING_TASK:
        data = load_embedding(directory, teacher, cfg)
    else:
        data = load_classification(task, artifacts, directory, teacher, cfg)
    return teacher, data


def user_task(artifacts: Path, model: str, task: str | None, from_file: bool = False) -> str:
    """The task a user's model is distilled on: a head's own task (trained with --task), `embedding` for an
    embedding model (the general texts), or a sequence classifier's own (its name: only its file's examples carry
    its labels). `from_file`: on a file's examples, a head's task may be any."""
    from academus.shared.models.user_models import HEAD_ON, refuse_pairs
    from academus.shared.state.artifacts import read_manifest
    from academus.shared.state.catalogue import CLASSIFICATION, read_catalogue

    refuse_pairs(artifacts, model, "students")
    entry = read_catalogue(artifacts).get(model, {})
    if "source" in entry and entry.get("kind") == CLASSIFICATION:
        if not from_file:
            raise ValueError(f"--model {model!r} is a sequence classifier with labels of its own: distil it on a file "
                             "of its examples (--data F.jsonl)")
        return model
    own = read_manifest(Path(artifacts) / entry["head"]).task if HEAD_ON in entry else EMBEDDING_TASK
    if own not in DISTILL_TASKS and not from_file:
        raise ValueError(f"--model {model!r} is a head trained on {own!r}, not on a bundled task: distil it on a "
                         f"file of its examples (--data F.jsonl), or on a bundled task's ({', '.join(DISTILL_TASKS)})")
    if task and task != own:
        raise ValueError(f"--model {model!r} is distilled on {own!r} (its head's task, or embedding for an embedding "
                         f"model), not --task {task!r}")
    return own


def distill(task: str | None, artifacts: Path | None = None, data_dir: Path | None = None,
            cfg: DistillConfig | None = None, quick: bool = False, model: str = "",
            data_file: Path | None = None) -> dict[str, Any]:
    """Runs Algorithms 1 and 2 for `task` (with `model`: on a user's model, `<model>-students`; with `data_file`:
    on its examples rather than a bundled task's) and writes the student-group artifact; returns the summary."""
    cfg = cfg or DistillConfig()
    artifacts = Path(artifacts or default_artifacts_dir())
    if data_file is not None and (task or not model):
        raise ValueError("--data distils a user's model on the file's examples: give --model (a head from `academus "
                         "heads train`, or an embedding model or sequence classifier from `academus models add`) "
                         "and no --task")
    task = user_task(artifacts, model, task, data_file is not None) if model else task
    check_args(task, cfg, data_file is not None)
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    teacher, data = load_data(task, artifacts, data_dir, cfg, model, data_file)
    seconds["data"] = time.perf_counter() - clock
    group = _initial_group(teacher, data, cfg, data_dir)
    untrained = group_scores(group, data, data.splits["validation"], cfg, "untrained student")[0]
    clock = time.perf_counter()
    history = sequential_training(group, data, cfg, generator)
    seconds["algorithm1"] = time.perf_counter() - clock
    before = group_scores(group, data, data.splits["validation"], cfg, "validation before pruning")
    clock = time.perf_counter()
    prune_loss = adaptive_pruning(group, data, cfg, generator)
    seconds["algorithm2"] = time.perf_counter() - clock
    validation = group_scores(group, data, data.splits["validation"], cfg, "validation per k")
    group.best_k = best_prefix(validation)
    test = {name: group_scores(group, data, data.splits[name], cfg, f"{name} per k")
            for name in ("test", "heldout") if name in data.splits}
    metrics = {"validation": validation, "validation_before_pruning": before, **test,
               "teacher": {name: teacher_scores(data, data.splits[name]) for name in ("validation", "test")},
               "untrained_validation": untrained, "best_k": group.best_k,
               "counts": {name: len(s) for name, s in data.splits.items()}}
    extra = {"algorithm1": history, "prune_loss": round(prune_loss, 5), "quick": quick, "config": asdict(cfg),
             "initialisation": INITIALISATIONS[cfg.init].format(layers=cfg.layers)}
    if data_file is not None:
        extra["data"] = str(data_file)
    if cfg.init not in CUT_FROM_TEACHER:
        extra["embeddings"] = "paraphrase-MiniLM-L3-v2's, frozen, one copy shared by all students"
    seconds["total"] = time.perf_counter() - started
    extra["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    key = model or task
    extra = write_student_group(artifacts, key, group, metrics, extra, teacher.name, task, teacher.max_tokens)
    if model:
        served = register_user_group(artifacts, key, teacher.model)
    else:
        write_student_catalogue(artifacts)
        served = [SERVED_NAMES[task]]
    return {"task": task, "artifact": str(students_dir(artifacts, key)), "served": sorted(served),
            "students": group.max_students,
            "best_k": group.best_k, "alpha": extra["alpha"], "validation": validation, **test,
            "teacher": metrics["teacher"], "untrained_validation": untrained, "seconds": extra["seconds"]}
