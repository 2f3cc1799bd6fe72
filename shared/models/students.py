"""Student groups (Student Parallelism §3.1): shallow students, combined as Σ α_m·S_m(x).

Every student is N layers of the teacher's family (BERT, RoBERTa or MPNet; default 2) over one embedding
table, the teacher's own, frozen and shared by all students: it is stored once per artifact and computed
once per batch. A student's representation is the mean-pooled output of its last layer (`S_N`); its layer
⌈N/2⌉, pooled the same way, is what stacking distillation trains (`S_⌈N/2⌉`).
α_0 is fixed at 1; the other α are learned.
Any prefix of k students is a valid model: the served representation is Σ_{m<k} α_m·S_m(x).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.masking_utils import create_bidirectional_mask

from academus.shared.models.architectures import MEAN, family_module, read_architecture
from academus.shared.models.model import (
    ClassifierHead,
    SequenceClassifierHead,
    body_inputs,
    finish_pooled,
    mean_pool,
    padded_positions,
)

LINEAR, SEQUENCE = "linear", "sequence"   # a group's head: linear on Σ α·S, or a sequence classifier's own
Members = Mapping[int, nn.Module]          # students by index that stand in for the group's own

# The teacher config keys a student needs (those its family has); the rest (ids, generation settings) are
# irrelevant here.
CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "hidden_act",
               "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
               "type_vocab_size", "layer_norm_eps", "pad_token_id", "relative_attention_num_buckets")


def student_config(teacher_config: PretrainedConfig | dict[str, Any], layers: int,
                   intermediate_size: int | None = None) -> PretrainedConfig:
    """The teacher's architecture cut to `layers` layers (and, given one, a narrower feed-forward width).
    BERT and RoBERTa students attend with SDPA; MPNet's layers add their bias to the scores themselves, so
    they keep the additive mask."""
    source = teacher_config if isinstance(teacher_config, dict) else teacher_config.to_dict()
    widths = {"intermediate_size": intermediate_size} if intermediate_size else {}
    keys = {k: source[k] for k in CONFIG_KEYS if k in source and k != "model_type"}
    model_type = source.get("model_type") or "bert"
    config = AutoConfig.for_model(model_type, **(keys | widths), num_hidden_layers=layers)
    config._attn_implementation = "eager" if model_type == "mpnet" else "sdpa"
    return config


def config_keys(config: PretrainedConfig) -> dict[str, Any]:
    """What an artifact stores to rebuild the students' config (student_config reads it back)."""
    source = config.to_dict()
    return {k: source[k] for k in CONFIG_KEYS if k in source}


class Student(nn.Module):
    """N transformer layers; returns the pooled final (S_N) and middle (S_⌈N/2⌉) representations."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        family = read_architecture(config.to_dict()).family
        # named `encoder.layer.<i>`: the worker's deadline hooks find it
        self.encoder = family_module(family, "Encoder")(config)
        self.relative_attention = family.relative_attention   # MPNet: its encoder holds the position bias
        self.middle = math.ceil(config.num_hidden_layers / 2)

    def forward(self, hidden: torch.Tensor, mask4d: torch.Tensor | None,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        middle = hidden
        bias = self.encoder.compute_position_bias(hidden) if self.relative_attention else None
        for i, layer in enumerate(self.encoder.layer, start=1):
            hidden = layer(hidden, mask4d) if bias is None else layer(hidden, mask4d, bias)[0]
            if i == self.middle:
                middle = hidden
        return mean_pool(hidden, attention_mask), mean_pool(middle, attention_mask)


class AbsentStudent(nn.Module):
    """Stands in a group for a student a worker does not hold (under a student memory budget): the worker passes
    the students it runs as `members`, so this is never called."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *_inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(f"student {self.index} is not held here; pass it in `members`")


class StudentGroup(nn.Module):
    """Students over one frozen shared embedding table, their α, and an optional task head."""

    def __init__(self, config: PretrainedConfig, num_students: int, labels: Sequence[str] = (),
                 normalize: bool = False, best_k: int | None = None, head: str = LINEAR) -> None:
        super().__init__()
        self.config = config
        self.architecture = read_architecture(config.to_dict())
        self.embeddings = family_module(self.architecture.family, "Embeddings")(config).requires_grad_(False)
        self.students = nn.ModuleList(Student(config) for _ in range(num_students))
        self.alpha = nn.Parameter(torch.ones(num_students))
        self.labels = list(labels)
        self.head_kind = head
        self.head: nn.Module | None = None
        if self.labels:
            self.head = ClassifierHead(self.labels, config.hidden_size) if head == LINEAR else \
                SequenceClassifierHead.for_config(config, self.labels)
        self.normalize = normalize            # the embedding task serves unit vectors, like the teacher
        self.pooling = MEAN                   # each student's S_N, whatever the teacher's pooling
        self.best_k = best_k or num_students

    def take_head(self, head: nn.Module) -> None:
        """A copy of the teacher's head (the students start from it: B ≈ T): linear, or a sequence classifier's
        own nonlinear one, which the group's representation then feeds as the classifier's first token did."""
        self.head_kind = SEQUENCE if isinstance(head, SequenceClassifierHead) else LINEAR
        self.head = copy.deepcopy(head).to(self.alpha.device)

    @property
    def max_students(self) -> int:
        return len(self.students)

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    def alphas(self) -> torch.Tensor:
        """α with α_0 pinned to 1 (so it never receives a gradient)."""
        return torch.cat([self.alpha.new_ones(1), self.alpha[1:]])

    def add_student(self, alpha: float = 1.0) -> Student:
        """Appends a copy of the last student (Algorithm 1, line 5) with multiplier `alpha`."""
        new = Student(self.config)
        new.load_state_dict(self.students[-1].state_dict())
        self.students.append(new)
        values = torch.cat([self.alpha.detach(), torch.tensor([alpha], dtype=self.alpha.dtype)])
        self.alpha = nn.Parameter(values.to(self.alpha.device))
        return new

    def drop_last(self) -> None:
        del self.students[-1]
        self.alpha = nn.Parameter(self.alpha.detach()[:-1].clone())
        self.best_k = min(self.best_k, self.max_students)

    def prepare_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Embedding output and the attention mask in the layers' format, shared by all students."""
        positions = padded_positions(self.architecture, input_ids)
        hidden = self.embeddings(input_ids=input_ids, **body_inputs(self.architecture, token_type_ids, positions))
        mask4d = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        return hidden, mask4d

    def check_count(self, num_students: int | None) -> int:
        """The prefix size to run: best_k for None/0; an error beyond what the group holds."""
        k = num_students or self.best_k
        if not 1 <= k <= self.max_students:
            raise ValueError(f"num_students={num_students} is outside 1..{self.max_students}: "
                             f"this student group holds {self.max_students} students")
        return k

    def student(self, index: int, members: Members | None = None) -> nn.Module:
        """Student `index`: the one `members` gives (a worker holding some students, or running one from its
        shards), else the group's own."""
        return members[index] if members is not None and index in members else self.students[index]

    def student_outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        token_type_ids: torch.Tensor | None, count: int,
                        members: Members | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(S_N, S_⌈N/2⌉) of the first `count` students, unweighted."""
        hidden, mask4d = self.prepare_inputs(input_ids, attention_mask, token_type_ids)
        return [self.student(i, members)(hidden, mask4d, attention_mask) for i in range(count)]

    def partial(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None,
                indices: Sequence[int], members: Members | None = None) -> torch.Tensor:
        """Σ_{m in indices} α_m·S_m(x), unnormalised: this worker's share of a group placed across
        workers; the shares of all members add up to the combined representation."""
        bad = [i for i in indices if not 0 <= i < self.max_students]
        if bad or not indices:
            raise ValueError(f"student indices {list(indices)} must be non-empty and within "
                             f"0..{self.max_students - 1}: this student group holds {self.max_students} students")
        hidden, mask4d = self.prepare_inputs(input_ids, attention_mask, token_type_ids)
        alphas = self.alphas()
        return sum(alphas[i] * self.student(i, members)(hidden, mask4d, attention_mask)[0] for i in indices)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, num_students: int | None = None,
                members: Members | None = None) -> torch.Tensor:
        """The combined pooled representation Σ_{m<k} α_m·S_m(x) (L2-normalised for the embedding task)."""
        k = self.check_count(num_students)
        outputs = self.student_outputs(input_ids, attention_mask, token_type_ids, k, members)
        finals = torch.stack([f for f, _ in outputs])
        combined = (self.alphas()[:k, None, None] * finals).sum(0)
        return finish_pooled(combined, self.normalize)


def check_layers(teacher_depth: int, layers: int) -> None:
    """A student is cut from the teacher's layers, so it has at most as many."""
    if not 1 <= layers <= teacher_depth:
        raise ValueError(f"--layers must be within 1..{teacher_depth} (the teacher's depth), not {layers}")


def source_layers(teacher_depth: int, layers: int, spread: bool = False) -> list[int]:
    """The teacher layers a student of `layers` is cut from: its bottom ones, or (`spread`) ones spaced evenly
    from its first to its last, as DistilBERT takes every other layer: a shallow student of a deep teacher then
    starts with the top layer that shapes the representation it must match, not 2 of 12 bottom ones."""
    check_layers(teacher_depth, layers)
    if not spread or layers == 1:
        return list(range(layers))
    return [round(j * (teacher_depth - 1) / (layers - 1)) for j in range(layers)]


def from_teacher(teacher_bert: nn.Module, layers: int, labels: Sequence[str] = (),
                 normalize: bool = False, ffn_keep: Sequence[torch.Tensor] = (),
                 sources: Sequence[int] = ()) -> StudentGroup:
    """One student: the teacher's embeddings and its layers `sources` (default: the bottom `layers`, the default
    initialisation). `ffn_keep` (one index tensor a layer, all of one size) narrows each layer's feed-forward
    block to those of the teacher's neurons."""
    sources = list(sources) or source_layers(len(teacher_bert.encoder.layer), layers)
    if len(sources) != layers:
        raise ValueError(f"a student of {layers} layers is cut from {layers} teacher layers, not {sources}")
    width = len(ffn_keep[0]) if ffn_keep else None
    group = StudentGroup(student_config(teacher_bert.config, layers, width), 1, labels, normalize)
    group.embeddings.load_state_dict(teacher_bert.embeddings.state_dict())
    if group.architecture.family.relative_attention:   # MPNet: the bias by relative position, as the teacher's
        group.students[0].encoder.relative_attention_bias.load_state_dict(
            teacher_bert.encoder.relative_attention_bias.state_dict())
    for i, source in enumerate(sources):
        state = teacher_bert.encoder.layer[source].state_dict()
        group.students[0].encoder.layer[i].load_state_dict(narrow_ffn(state, ffn_keep[i]) if ffn_keep else state)
    return group


def narrow_ffn(layer_state: dict[str, torch.Tensor], keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """A BERT layer's weights with only the feed-forward neurons `keep` (rows of the up-projection,
    columns of the down-projection): structured width pruning, so the layer's output keeps its size."""
    narrowed = dict(layer_state)
    for name in ("intermediate.dense.weight", "intermediate.dense.bias"):
        narrowed[name] = layer_state[name][keep]
    narrowed["output.dense.weight"] = layer_state["output.dense.weight"][:, keep]
    return narrowed
