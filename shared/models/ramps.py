"""Exit ramps (Apparate §3.1): at a candidate layer k, the model's own pooling of layer k's output and a head
shaped like the served one, trained with the backbone frozen to agree with the model's answer.

A ramp is cheap next to a layer (a pooling and one small matmul); its cost still counts, since every text
that reaches it pays it (`shared/models/exits.py` keeps the active ramps' summed cost within a budget).
The artifact (`ramps/<task>/`) holds every candidate's head, the manifest its layers, pooling, agreement,
measured cost, and the thresholds the baselines tune once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from academus.shared.models.model import FIRST, MEAN, finish_pooled, pool
from academus.shared.state.artifacts import MANIFEST, WEIGHTS, ArtifactError, Manifest, load_artifact, write_artifact

RAMPS_KIND = "ramps"


def ramps_dir(artifacts: Path, task: str) -> Path:
    return Path(artifacts) / "ramps" / task


class ExitRamps(nn.Module):
    """One linear head a candidate layer, over that layer's output pooled as the served model pools."""

    def __init__(self, layers: Sequence[int], hidden_size: int, labels: Sequence[str], pooling: str = MEAN,
                 normalize: bool = True) -> None:
        super().__init__()
        self.layers = tuple(int(k) for k in layers)
        self.labels = list(labels)
        self.pooling, self.normalize = pooling, normalize
        self.heads = nn.ModuleDict({str(k): nn.Linear(hidden_size, len(self.labels)) for k in self.layers})

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """A padded batch's layer output [B, T, H] pooled as the model pools its last layer's."""
        return pool(hidden, attention_mask, self.pooling, self.normalize)

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        return finish_pooled(pooled, self.normalize)

    def probs(self, layer: int, pooled: torch.Tensor) -> torch.Tensor:
        """[n, C] probabilities of the ramp at `layer` for already pooled (and finished) states."""
        return torch.softmax(self.heads[str(layer)](pooled), dim=-1)


def save_ramps(directory: Path, ramps: ExitRamps, *, teacher: str, task: str, metrics: dict[str, Any],
               extra: dict[str, Any]) -> Manifest:
    tensors = {f"layer{k}.{name}": t for k in ramps.layers
               for name, t in ramps.heads[str(k)].state_dict().items()}
    return write_artifact(directory, RAMPS_KIND, tensors, teacher=teacher, task=task, labels=ramps.labels,
                          metrics=metrics, extra={"layers": list(ramps.layers), "pooling": ramps.pooling,
                                                  "normalize": ramps.normalize, **extra})


def load_ramps(directory: Path, hidden_size: int, labels: Sequence[str],
               device: str | torch.device = "cpu") -> tuple[ExitRamps, Manifest]:
    """The ramps at `directory`, checked against their manifest and against the model they serve (width,
    labels); anything else is an ArtifactError naming the file."""
    manifest, tensors = load_artifact(directory, device)
    source = Path(directory) / MANIFEST
    if manifest.kind != RAMPS_KIND:
        raise ArtifactError(f"{source}: kind {manifest.kind!r} is not {RAMPS_KIND!r}")
    if list(manifest.labels) != list(labels):
        raise ArtifactError(f"{source}: labels {manifest.labels} are not the served model's {list(labels)}")
    try:
        layers = [int(k) for k in manifest.extra["layers"]]
        pooling, normalize = manifest.extra["pooling"], bool(manifest.extra["normalize"])
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"{source}: extra.layers, extra.pooling and extra.normalize are required ({e})") from e
    if pooling not in (MEAN, FIRST) or not layers:
        raise ArtifactError(f"{source}: pooling {pooling!r} or layers {layers} cannot be served")
    ramps = ExitRamps(layers, hidden_size, labels, pooling, normalize)
    try:
        ramps.heads.load_state_dict({k.removeprefix("layer"): v for k, v in tensors.items()},
                                    strict=True)
    except RuntimeError as e:   # a tensor of the wrong width, or one missing
        raise ArtifactError(f"{Path(directory) / WEIGHTS}: not ramps for a {hidden_size}-wide "
                            f"model with {len(labels)} labels: {e}") from e
    return ramps.to(device).eval(), manifest
