"""The teacher split at layer K: embeddings + layers 1..K (what PLOT replaces) and K+1..N."""

from __future__ import annotations

import torch
from torch import nn

from academus.shared.models.split import SplitEncoder


class SplitBert:
    """Runs the lower K layers or the upper N-K layers of an encoder body (no copies of weights)."""

    def __init__(self, bert: nn.Module, lower_layers: int) -> None:
        total = len(bert.encoder.layer)
        if not 1 <= lower_layers <= total:
            raise ValueError(f"lower_layers={lower_layers} is outside 1..{total} (the model has {total} layers)")
        self.bert = bert
        self.split = SplitEncoder.of(bert)
        self.lower_layers = lower_layers
        self.hidden = int(bert.config.hidden_size)

    @property
    def upper(self) -> list[nn.Module]:
        return list(self.bert.encoder.layer[self.lower_layers:])

    @torch.inference_mode()
    def lower(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L) ids -> (B, L, hidden): the output of layer K, as the full model computes it."""
        return self.split.layers(self.split.embed(input_ids), attention_mask, 0, self.lower_layers)

    @torch.inference_mode()
    def run_upper(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Layers K+1..N on (B, L, hidden) states; padded positions are masked out."""
        return self.split.layers(hidden, attention_mask, self.lower_layers)
