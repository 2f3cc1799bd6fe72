"""The teacher encoder and task heads; model code shared by training and the workers."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from academus.shared.models.architectures import FIRST, MEAN, POOLINGS, Architecture, family_module, read_architecture
from academus.shared.models.teacher_files import teacher_dir

HIDDEN_SIZE = 384   # the bundled teacher's width (all-MiniLM-L6-v2); every other model's comes from its config


def weight_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the parameters and buffers of `modules`, each tensor counted once."""
    tensors = {id(t): t for m in modules if m is not None for t in (*m.parameters(), *m.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def pad_batch(
    sequences: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pads token id lists to the longest: (input_ids, attention_mask, token_type_ids)."""
    longest = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
        if type_ids is not None:
            types[row, : len(seq)] = torch.as_tensor(type_ids[row], dtype=torch.long)
    return ids, mask, types


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens, exactly as sentence-transformers' Pooling(mean_tokens)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str = MEAN, normalize: bool = True
         ) -> torch.Tensor:
    """A padded batch's layer output [B, T, H] pooled as an encoder is served: the mean over real tokens or the
    first token's state, L2-normalised when `normalize`."""
    return finish_pooled(mean_pool(hidden, attention_mask) if pooling == MEAN else hidden[:, 0], normalize)


def finish_pooled(pooled: torch.Tensor, normalize: bool) -> torch.Tensor:
    """A pooled [B, H] representation as served: L2-normalised when `normalize` (embeddings)."""
    return nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled


class TeacherEncoder(nn.Module):
    """An encoder body (BertModel, RobertaModel or MPNetModel) and its pooling: the mean over real tokens or the
    first token's hidden state, L2-normalised for embeddings. The bundled teacher is a BERT body, mean-pooled
    and normalised; a classifier's body is pooled at its first token, which its head reads."""

    def __init__(self, body: nn.Module, architecture: Architecture | None = None, pooling: str = MEAN,
                 normalize: bool = True) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        self.body = body
        self.architecture = architecture or read_architecture(body.config.to_dict())
        self.pooling, self.normalize = pooling, normalize

    @classmethod
    def load(cls, model_dir: Path | None = None, device: str | torch.device = "cpu") -> TeacherEncoder:
        """The bundled teacher (or the encoder at `model_dir`): mean-pooled and normalised."""
        return load_encoder(model_dir or teacher_dir(), device)[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        inputs = body_inputs(self.architecture, token_type_ids, padded_positions(self.architecture, input_ids))
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, **inputs).last_hidden_state
        return pool(hidden, attention_mask, self.pooling, self.normalize)


def padded_positions(architecture: Architecture, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Position ids of a right-padded batch, numbered as the family numbers them (None: the body's own, from 0)."""
    offset = architecture.position_offset
    if not offset:
        return None
    return torch.arange(offset, offset + input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def body_inputs(architecture: Architecture, token_type_ids: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The keyword inputs the family's body takes besides ids and mask: MPNet has no token types, and types
    beyond the embeddings' (a pair on a one-type RoBERTa) are read as 0, as its tokenizer would give them."""
    inputs = {} if position_ids is None else {"position_ids": position_ids}
    if token_type_ids is not None and architecture.uses_token_types:
        inputs["token_type_ids"] = token_type_ids
    return inputs


def load_encoder(model_dir: Path, device: str | torch.device = "cpu", pooling: str = MEAN, normalize: bool = True,
                 classify: bool | None = None) -> tuple[TeacherEncoder, SequenceClassifierHead | None]:
    """The encoder at `model_dir` (a transformers directory with safetensors weights), and its own head when
    it is served as a sequence classifier (`classify`, default: when it is one): then pooled at the first
    token, unnormalised, as the head was trained. A weight the model needs and the files lack is a
    ValueError naming it (transformers would initialise it at random)."""
    import transformers
    from transformers.utils import logging as hf_logging

    architecture = read_architecture(json.loads((Path(model_dir) / "config.json").read_text()),
                                     str(Path(model_dir) / "config.json"))
    family = architecture.family
    classify = architecture.classifier if classify is None else classify
    # Unused weights (a pooler, an LM head) make transformers print a load report on every start.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        if classify:
            model, info = getattr(transformers, family.classifier).from_pretrained(
                str(model_dir), use_safetensors=True, output_loading_info=True)
        else:
            model, info = getattr(transformers, family.body).from_pretrained(
                str(model_dir), add_pooling_layer=False, use_safetensors=True, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    if missing := sorted(info.get("missing_keys") or []) + sorted(info.get("mismatched_keys") or []):
        raise ValueError(f"{model_dir}: weights missing or of the wrong shape for {architecture.name}: "
                         f"{', '.join(map(str, missing[:5]))}{' ...' if len(missing) > 5 else ''}")
    if classify:
        head = SequenceClassifierHead.of(architecture, model)
        encoder = TeacherEncoder(getattr(model, family.body_attribute), architecture, FIRST, normalize=False)
        return encoder.to(device).eval(), head.to(device).eval()
    return TeacherEncoder(model, architecture, pooling, normalize).to(device).eval(), None


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A head's served answer: softmax over its labels; a head of one label (a reranker's relevance, as
    transformers' `problem_type` regression or sentence-transformers' CrossEncoder reads it) gives its sigmoid."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


class ClassifierHead(nn.Module):
    """Linear classifier over the pooled embedding; softmax gives the served probabilities."""

    def __init__(self, labels: Sequence[str], hidden_size: int = HIDDEN_SIZE) -> None:
        super().__init__()
        self.labels = list(labels)
        self.linear = nn.Linear(hidden_size, len(self.labels))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(pooled)


class SequenceClassifierHead(nn.Module):
    """A transformers sequence classifier's own head, on the first token's hidden state: BERT's pooler (dense
    + tanh) then its linear classifier; RoBERTa's and MPNet's dense + tanh + projection. Its labels are the
    config's id2label, in id order. Its students carry a copy (`for_config` rebuilds its shape)."""

    def __init__(self, labels: Sequence[str], pooler: nn.Module | None, classifier: nn.Module) -> None:
        super().__init__()
        self.labels = list(labels)
        self.pooler, self.classifier = pooler, classifier

    @classmethod
    def of(cls, architecture: Architecture, model: nn.Module) -> SequenceClassifierHead:
        """The head of a loaded `…ForSequenceClassification` (its modules, not copies)."""
        config = model.config
        labels = [str(config.id2label[i]) for i in range(len(config.id2label))]
        pooler = getattr(model, architecture.family.body_attribute).pooler if architecture.family.name == "bert" \
            else None
        return cls(labels, pooler, model.classifier)

    @classmethod
    def for_config(cls, config: Any, labels: Sequence[str]) -> SequenceClassifierHead:
        """An untrained head of the family's shape for `labels` (what a student group's copy is loaded into)."""
        config = copy.deepcopy(config)
        config.num_labels = len(labels)
        family = read_architecture(config.to_dict()).family
        if family.name == "bert":
            return cls(labels, family_module(family, "Pooler")(config), nn.Linear(config.hidden_size, len(labels)))
        return cls(labels, None, family_module(family, "ClassificationHead")(config))

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:
        if self.pooler is not None:
            return self.classifier(self.pooler.activation(self.pooler.dense(first_token)))
        return self.classifier(first_token.unsqueeze(1))   # RoBERTa's and MPNet's heads read [:, 0, :]
