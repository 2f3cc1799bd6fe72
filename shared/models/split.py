"""An encoder run in parts: its embeddings, any span of its layers, its pooling, as its own forward runs them
(positions numbered by family, MPNet's relative-position bias). Tenant adapters' training runs the lower layers
once and the adapted upper ones each step; PLOT tables hold the lower layers' states and the hierarchical model
runs the upper ones on them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask

from academus.shared.models.architectures import Architecture, read_architecture
from academus.shared.models.model import MEAN, TeacherEncoder, body_inputs, padded_positions, pool


@dataclass(frozen=True)
class SplitEncoder:
    """An encoder's parts, pooled as it is served: a TeacherEncoder's own family, pooling and normalisation; a bare
    body as the bundled teacher's (mean, L2-normalised)."""

    body: nn.Module
    architecture: Architecture
    pooling: str = MEAN
    normalize: bool = True

    @classmethod
    def of(cls, encoder: nn.Module) -> SplitEncoder:
        if isinstance(encoder, TeacherEncoder):
            return cls(encoder.body, encoder.architecture, encoder.pooling, encoder.normalize)
        return cls(encoder, read_architecture(encoder.config.to_dict()))

    def embed(self, ids: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings of right-padded ids, positions numbered as the family numbers them."""
        return self.body.embeddings(input_ids=ids, **body_inputs(self.architecture, types,
                                                                 padded_positions(self.architecture, ids)))

    def layers(self, hidden: torch.Tensor, mask: torch.Tensor | None, start: int,
               stop: int | None = None) -> torch.Tensor:
        """Layers start..stop-1 on right-padded states (mask None: no padding); MPNet's relative-position bias as
        its encoder adds it."""
        extended = None if mask is None else create_bidirectional_mask(config=self.body.config, inputs_embeds=hidden,
                                                                         attention_mask=mask)
        relative = self.architecture.family.relative_attention
        bias = self.body.encoder.compute_position_bias(hidden) if relative else None
        for layer in self.body.encoder.layer[start:stop]:
            hidden = layer(hidden, extended) if bias is None else layer(hidden, extended, bias)[0]
        return hidden

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return pool(hidden, mask, self.pooling, self.normalize)
