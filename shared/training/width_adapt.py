"""`academus shard adapt`: the teacher trained to run at any width, as DynaBERT's width stage (Hou et al., 2020)
trains BERT before STI cuts it (paper §7.1). STI's narrow submodels lose up to 10 pp on MiniLM because MiniLM was
never trained to run on a subset of its heads; DynaBERT was.

1. **Rewiring.** Each layer's heads and FFN neurons are ranked by their first-order importance for the bundled
   tasks' heads (|weight × gradient| of the task loss, summed over a head's or a neuron's weights, as DynaBERT
   ranks them) and permuted in place, most important first. The function is unchanged; what moves is which
   heads and neurons a narrow width keeps: a width-m layer is shards 0..m-1 (STI's shard s is head s and the
   s-th block of neurons).
2. **Width-adaptive distillation.** Every step runs the student at each width (quarters of the heads) on a batch
   of task texts and sums three losses against the unmodified teacher: the KL divergence of the task head's
   logits, the mean squared error of every layer's states over real tokens, and one minus the cosine of
   the pooled embeddings. The full width is trained too, so it stays the teacher's.

The result is written as a sentence-transformers directory (the teacher's files, new weights) whose config says
its widths are in shard order (`WIDTH_ORDERED`) and which tasks' heads it was trained under (`ADAPTED_HEADS`),
and added to the catalogue as a user's embedding model: `shard build --model NAME` then cuts it, keeping a width-m
layer's shards in index order and those tasks' served heads at the full shape.
"""

from __future__ import annotations

import copy
import itertools
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from academus.shared.models.model import ClassifierHead, load_encoder, pad_batch, pool
from academus.shared.models.shards import (
    ADAPTED_HEADS,
    WIDTH_ORDERED,
    LayerParts,
    LayerResident,
    LayerWeights,
    ShardGeometry,
    elastic_layer,
    key_mask,
)
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import ModelRefused, add_model
from academus.shared.state.catalogue import MODEL_NAME, read_catalogue
from academus.shared.training.data import Example, fetch, load_task
from academus.shared.training.prepare import load_head, subsample
from academus.shared.training.shards import checked_tasks, widths_of

TEMPERATURE = 1.0


@dataclass(frozen=True)
class AdaptSettings:
    """How long and on what the widths are trained."""

    epochs: float = 1.0
    batch: int = 32
    lr: float = 5e-5
    max_tokens: int = 64          # texts are cut to this many tokens: the states a width learns do not need more
    texts_per_task: int | None = None   # None: the whole train split
    importance_batches: int = 8
    seed: int = 0


@dataclass(frozen=True)
class TaskBatch:
    task: str
    ids: torch.Tensor
    mask: torch.Tensor
    types: torch.Tensor
    gold: torch.Tensor     # the texts' labels (the ranking's loss reads them; distillation does not)


# --- the body at a width -----------------------------------------------------------------------------------------

def body_layers(body: nn.Module) -> list[nn.Module]:
    return list(body.encoder.layer)


def layer_at_width(layer: nn.Module, geometry: ShardGeometry, width: int) -> tuple[LayerResident, LayerWeights]:
    """A layer's first `width` shards as the elastic layer takes them, as views of its parameters (so a loss
    through them trains the layer)."""
    p = LayerParts.of(layer)
    h, n = width * geometry.head_dim, width * geometry.neurons
    resident = LayerResident(p.query.bias, p.key.bias, p.value.bias, p.output.bias, p.attention_norm,
                             p.ffn_in.bias, p.ffn_out.bias, p.output_norm)
    weights = LayerWeights(p.query.weight[:h], p.key.weight[:h], p.value.weight[:h], p.output.weight[:, :h],
                           p.ffn_in.weight[:n], p.ffn_out.weight[:, :n], p.query.bias[:h], p.key.bias[:h],
                           p.value.bias[:h], p.ffn_in.bias[:n], width, torch.arange(width))
    return resident, weights


def states_at_width(body: nn.Module, geometry: ShardGeometry, batch: TaskBatch, width: int) -> list[torch.Tensor]:
    """Every layer's output [B, T, H] with each layer on its first `width` shards."""
    hidden = body.embeddings(input_ids=batch.ids, token_type_ids=batch.types)
    mask = key_mask(batch.mask)
    states = []
    for layer in body_layers(body):
        resident, weights = layer_at_width(layer, geometry, width)
        hidden = elastic_layer(hidden, mask, resident, weights, geometry)
        states.append(hidden)
    return states


def embedding(states: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The last layer's states pooled as the teacher serves them (mean over real tokens, normalised)."""
    return pool(states[-1], mask)


# --- rewiring ------------------------------------------------------------------------------------------------------

@torch.no_grad()
def _taylor(body: nn.Module, geometry: ShardGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    d = geometry.head_dim
    head_scores, neuron_scores = [], []
    for layer in body_layers(body):
        p = LayerParts.of(layer)
        taylor = [(w.weight * w.weight.grad).abs() for w in (p.query, p.key, p.value, p.output, p.ffn_in, p.ffn_out)]
        rows = taylor[0].sum(1) + taylor[1].sum(1) + taylor[2].sum(1) + taylor[3].sum(0)
        head_scores.append(rows.view(geometry.heads, d).sum(1))
        neuron_scores.append(taylor[4].sum(1) + taylor[5].sum(0))
    return torch.stack(head_scores), torch.stack(neuron_scores)


def importance_scores(body: nn.Module, geometry: ShardGeometry, batches: Sequence[TaskBatch],
                      heads: dict[str, ClassifierHead]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, each head's and each FFN neuron's |weight × gradient| of the task loss summed over its weights:
    ([L, heads], [L, neurons in all])."""
    body.zero_grad(set_to_none=True)
    for batch in batches:
        states = states_at_width(body, geometry, batch, geometry.heads)
        nn.functional.cross_entropy(heads[batch.task](embedding(states, batch.mask)), batch.gold).backward()
    scores = _taylor(body, geometry)
    body.zero_grad(set_to_none=True)
    return scores


@torch.no_grad()
def rewire(body: nn.Module, geometry: ShardGeometry, head_order: torch.Tensor, neuron_order: torch.Tensor) -> None:
    """Permutes each layer's heads (`head_order[l]`, most important first) and FFN neurons in place; the layer's
    function is unchanged."""
    d = geometry.head_dim
    for layer, heads, neurons in zip(body_layers(body), head_order, neuron_order, strict=True):
        p = LayerParts.of(layer)
        rows = (heads[:, None] * d + torch.arange(d)).reshape(-1)
        for linear in (p.query, p.key, p.value):
            linear.weight.copy_(linear.weight[rows])
            linear.bias.copy_(linear.bias[rows])
        p.output.weight.copy_(p.output.weight[:, rows])
        p.ffn_in.weight.copy_(p.ffn_in.weight[neurons])
        p.ffn_in.bias.copy_(p.ffn_in.bias[neurons])
        p.ffn_out.weight.copy_(p.ffn_out.weight[:, neurons])


# --- distillation --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TeacherTargets:
    """The frozen teacher on one batch, computed once for all the widths: every layer's states, the pooled
    embedding and the task head's log-probabilities."""

    states: list[torch.Tensor]
    pooled: torch.Tensor
    log_probs: torch.Tensor

    @classmethod
    @torch.no_grad()
    def of(cls, teacher: nn.Module, geometry: ShardGeometry, batch: TaskBatch, head: ClassifierHead) -> TeacherTargets:
        states = states_at_width(teacher, geometry, batch, geometry.heads)
        pooled = embedding(states, batch.mask)
        return cls(states, pooled, nn.functional.log_softmax(head(pooled) / TEMPERATURE, 1))


def width_loss(student: list[torch.Tensor], teacher: TeacherTargets, mask: torch.Tensor, head: ClassifierHead
               ) -> torch.Tensor:
    """The task logits' KL divergence from the teacher's, the states' MSE over real tokens averaged over layers,
    and the pooled embeddings' cosine distance."""
    pooled = embedding(student, mask)
    soft = nn.functional.kl_div(nn.functional.log_softmax(head(pooled) / TEMPERATURE, 1), teacher.log_probs,
                                log_target=True, reduction="batchmean")
    real = mask.unsqueeze(-1).to(student[0].dtype)
    per_value = real.sum() * student[0].shape[-1]
    states = sum(((s - t) ** 2 * real).sum() / per_value for s, t in zip(student, teacher.states, strict=True))
    cosine = 1 - (pooled * teacher.pooled).sum(1).mean()
    return soft + states / len(student) + cosine


def task_batches(tokenizer: TeacherTokenizer, examples: dict[str, list[Example]], settings: AdaptSettings,
                 rng: random.Random) -> list[TaskBatch]:
    """One epoch's batches: each task's texts shuffled, cut to `max_tokens`, batched within the task, the batches
    of all tasks interleaved at random."""
    batches = []
    for task, chunk in examples.items():
        encoded = tokenizer.encode([e.text for e in chunk], truncate=True)
        for rows in _sortish(encoded, settings.batch, rng):
            ids, mask, types = pad_batch([_cut(encoded[j].input_ids, settings.max_tokens) for j in rows],
                                         [_cut(encoded[j].token_type_ids, settings.max_tokens) for j in rows])
            batches.append(TaskBatch(task, ids, mask, types, torch.tensor([int(chunk[j].label) for j in rows])))
    rng.shuffle(batches)
    return batches


def _sortish(encoded: Sequence[Any], batch: int, rng: random.Random, pool: int = 16) -> Iterator[list[int]]:
    """Shuffled rows, sorted by length within pools of `pool` batches, so a batch pads little yet epochs differ."""
    order = list(range(len(encoded)))
    rng.shuffle(order)
    for start in range(0, len(order), batch * pool):
        chunk = sorted(order[start:start + batch * pool], key=lambda j: len(encoded[j].input_ids))
        yield from (chunk[i:i + batch] for i in range(0, len(chunk), batch))


def _cut(ids: list[int], n: int) -> list[int]:
    """The first n-1 tokens and the last (the separator)."""
    return list(ids) if len(ids) <= n else [*ids[:n - 1], ids[-1]]


class WidthTrainer:
    """The teacher's body trained at every width against a frozen copy of itself."""

    def __init__(self, body: nn.Module, heads: dict[str, ClassifierHead], widths: Sequence[int],
                 settings: AdaptSettings) -> None:
        self.student, self.heads, self.widths, self.settings = body, heads, list(widths), settings
        self.teacher = _frozen_copy(body)
        self.geometry = ShardGeometry.of(body.config)
        for head in heads.values():
            head.requires_grad_(False)

    def step(self, batch: TaskBatch, optimizer: torch.optim.Optimizer) -> dict[int, float]:
        head = self.heads[batch.task]
        teacher = TeacherTargets.of(self.teacher, self.geometry, batch, head)
        optimizer.zero_grad(set_to_none=True)
        losses = {}
        for width in self.widths:
            student = states_at_width(self.student, self.geometry, batch, width)
            loss = width_loss(student, teacher, batch.mask, head)
            loss.backward()
            losses[width] = float(loss.detach())
        optimizer.step()
        return losses

    def train(self, batches: Iterator[TaskBatch], steps: int, log: Callable[[str], None]) -> list[dict[int, float]]:
        optimizer = torch.optim.AdamW(self.student.parameters(), lr=self.settings.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: max(0.0, 1 - i / max(1, steps)))
        history, started = [], time.perf_counter()
        for i, batch in enumerate(itertools.islice(batches, steps)):
            history.append(self.step(batch, optimizer))
            schedule.step()
            if (i + 1) % 25 == 0 or i + 1 == steps:
                log(f"step {i + 1}/{steps} ({time.perf_counter() - started:.0f} s): loss by width "
                    f"{_mean_losses(history[-25:], self.widths)}")
        return history


def _frozen_copy(body: nn.Module) -> nn.Module:
    teacher = copy.deepcopy(body).eval()
    teacher.requires_grad_(False)
    return teacher


# --- the command ---------------------------------------------------------------------------------------------------

def adapt(artifacts: Path, name: str, tasks: Sequence[str] | None = None, data_dir: Path | None = None,
          settings: AdaptSettings = AdaptSettings(), log: Callable[[str], None] = print) -> dict[str, Any]:
    """Trains the bundled teacher at every width on the tasks' training texts and adds it to the catalogue as the
    embedding model `name`; returns a summary (the losses at the start and the end, by width)."""
    tasks = checked_tasks("minilm", False, tasks)
    _check_name(artifacts, name)
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    encoder, _ = load_encoder(teacher_dir())
    body = encoder.body.eval()   # no dropout: the widths learn the teacher's states, not noisy copies of them
    tokenizer = TeacherTokenizer(teacher_dir())
    root = fetch(data_dir)
    train = {task: load_task(task, root).train for task in tasks}
    heads = {task: load_head(artifacts, task) for task in tasks}
    head_order = rank_and_rewire(body, tokenizer, train, heads, settings)
    widths = widths_of(ShardGeometry.of(body.config).heads)
    examples = {task: subsample(train[task], settings.texts_per_task) for task in tasks}
    rng = random.Random(settings.seed)
    per_epoch = task_batches(tokenizer, examples, settings, rng)
    steps = max(1, round(settings.epochs * len(per_epoch)))
    log(f"adapt: {sum(map(len, examples.values()))} texts of {','.join(tasks)}, widths {widths}, {steps} steps of "
        f"{settings.batch}")
    history = WidthTrainer(body, heads, widths, settings).train(
        _epochs(per_epoch, tokenizer, examples, settings, rng), steps, log)
    with tempfile.TemporaryDirectory(prefix="academus-adapt-") as scratch:
        entry = add_model(artifacts, name, _write_model(Path(scratch) / name, body, widths, tasks), task="embed")
    return {"name": name, "tasks": tasks, "widths": widths, "steps": steps, "batch": settings.batch,
            "texts": {t: len(v) for t, v in examples.items()}, "max_tokens": settings.max_tokens, "lr": settings.lr,
            "loss_first_25": _mean_losses(history[:25], widths), "loss_last_25": _mean_losses(history[-25:], widths),
            "head_order": head_order.tolist(), "entry": entry, "seconds": round(time.perf_counter() - started, 1)}


def rank_and_rewire(body: nn.Module, tokenizer: TeacherTokenizer, train: dict[str, list[Example]],
                    heads: dict[str, ClassifierHead], settings: AdaptSettings) -> torch.Tensor:
    """Ranks each layer's heads and neurons on a few batches of each task's training texts and rewires the body,
    most important first; returns the heads' order [L, heads]."""
    geometry = ShardGeometry.of(body.config)
    ranking = [b for task, examples in train.items() for b in task_batches(
        tokenizer, {task: subsample(examples, settings.importance_batches * settings.batch)}, settings,
        random.Random(settings.seed))]
    head_scores, neuron_scores = importance_scores(body, geometry, ranking, heads)
    head_order = head_scores.argsort(1, descending=True)
    rewire(body, geometry, head_order, neuron_scores.argsort(1, descending=True))
    return head_order


def _check_name(artifacts: Path, name: str) -> None:
    """Before anything is trained: `add_model` would refuse the name only after."""
    if not MODEL_NAME.match(name):
        raise ModelRefused(f"--name {name!r}: a model name is 1-63 of a-z 0-9 . _ -, starting with a letter or digit")
    if name in read_catalogue(artifacts):
        raise ModelRefused(f"--name {name!r} is already in the catalogue: remove it first (academus models remove "
                           f"{name})")


def _mean_losses(history: list[dict[int, float]], widths: Sequence[int]) -> dict[int, float]:
    return {w: round(sum(h[w] for h in history) / len(history), 4) for w in widths}


def _epochs(first: list[TaskBatch], tokenizer: TeacherTokenizer, examples: dict[str, list[Example]],
            settings: AdaptSettings, rng: random.Random) -> Iterator[TaskBatch]:
    """The first epoch's batches, then freshly shuffled ones for as long as the steps last."""
    yield from first
    while True:
        yield from task_batches(tokenizer, examples, settings, rng)


def _write_model(directory: Path, body: nn.Module, widths: Sequence[int], tasks: Sequence[str]) -> Path:
    """The teacher's directory with the trained weights, its config marked with the widths trained and the tasks
    whose served heads scored the logits (`shard build` keeps those heads at the full shape)."""
    shutil.copytree(teacher_dir(), directory, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx",
                                                                          "openvino", "__pycache__", "*.py"))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # a bar per save in the command's output
    body.save_pretrained(directory, safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    config[WIDTH_ORDERED] = list(widths)
    config[ADAPTED_HEADS] = list(tasks)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
