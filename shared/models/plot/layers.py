"""An encoder split at layer K: embeddings + layers 1..K (what PLOT replaces) and K+1..N, then its pooling."""

from __future__ import annotations

import torch
from torch import nn

from academus.shared.models.split import SplitEncoder


class SplitBert:
    """Runs the lower K layers or the upper N-K layers of an encoder (no copies of weights), and pools as it is
    served: a TeacherEncoder with its own pooling, a bare body as the bundled teacher's."""

    def __init__(self, encoder: nn.Module, lower_layers: int) -> None:
        self.split = SplitEncoder.of(encoder)
        self.bert = self.split.body
        total = len(self.bert.encoder.layer)
        if not 1 <= lower_layers <= total:
            raise ValueError(f"lower_layers={lower_layers} is outside 1..{total} (the model has {total} layers)")
        self.lower_layers = lower_layers
        self.hidden = int(self.bert.config.hidden_size)

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

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The model's sentence embedding of the last layer's states."""
        return self.split.pool(hidden, attention_mask)
