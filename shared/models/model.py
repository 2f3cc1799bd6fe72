"""The teacher encoder and task heads; model code shared by training and the workers."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from academus.shared.models.teacher_files import teacher_dir

HIDDEN_SIZE = 384


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


class TeacherEncoder(nn.Module):
    """BERT body + mean pooling + L2 normalisation: the model's sentence embedding."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    @classmethod
    def load(cls, model_dir: Path | None = None, device: str | torch.device = "cpu") -> TeacherEncoder:
        from transformers import BertModel
        from transformers.utils import logging as hf_logging

        # The checkpoint's unused pooler weights make transformers print a load report on every start.
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            bert = BertModel.from_pretrained(str(model_dir or teacher_dir()), add_pooling_layer=False)
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        return cls(bert).to(device).eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        return nn.functional.normalize(mean_pool(hidden, attention_mask), p=2, dim=1)


class ClassifierHead(nn.Module):
    """Linear classifier over the pooled embedding; softmax gives the served probabilities."""

    def __init__(self, labels: Sequence[str], hidden_size: int = HIDDEN_SIZE) -> None:
        super().__init__()
        self.labels = list(labels)
        self.linear = nn.Linear(hidden_size, len(self.labels))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.linear(pooled)
