"""Exit ramps (Apparate §3.1): at a candidate layer k, the model's own pooling of layer k's output and a head
shaped like the served one, trained with the backbone frozen to agree with the model's answer.

A ramp is cheap next to a layer (a pooling and one small matmul); its cost still counts, since every text
that reaches it pays it (`shared/models/exits.py` keeps the active ramps' summed cost within a budget).
The artifact (`ramps/<task>/`) holds every candidate's head and its evidence (the ramps' confidence and agreement
with the model on the validation texts, where the adaptive controller's window starts), the manifest its layers,
pooling, agreement, measured cost, and the thresholds the baselines tune once.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from academus.shared.models.exits import Evidence
from academus.shared.models.model import FIRST, MEAN, finish_pooled, pool
from academus.shared.state.artifacts import MANIFEST, WEIGHTS, ArtifactError, Manifest, load_artifact, write_artifact

RAMPS_KIND = "ramps"
EVIDENCE = "evidence."   # the weights file's tensors that are not heads: evidence.conf, evidence.agree [n, R]


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
        self.evidence: Evidence | None = None   # as `ramps train` measured it; None in an older artifact
        self._host: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # `host_logits`'s heads on a CPU

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """A padded batch's layer output [B, T, H] pooled as the model pools its last layer's."""
        return pool(hidden, attention_mask, self.pooling, self.normalize)

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        return finish_pooled(pooled, self.normalize)

    def probs(self, layer: int, pooled: torch.Tensor) -> torch.Tensor:
        """[n, C] probabilities of the ramp at `layer` for already pooled (and finished) states."""
        return torch.softmax(self.heads[str(layer)](pooled), dim=-1)

    def host_logits(self, layer: int, pooled: torch.Tensor | np.ndarray) -> np.ndarray:
        """[n, C] logits of the ramp at `layer` for pooled states not yet finished (a host array, or a tensor
        where the model runs), on the host: what serving decides on. A ramp runs on a few texts at a time, so
        on a CPU its torch operators cost more in dispatch than in arithmetic, and every text that reaches the
        ramp waits for them: there the head runs in NumPy, its L2 normalisation folded into the logits. On a
        GPU it stays on the device; only the logits travel."""
        if isinstance(pooled, torch.Tensor) and pooled.device.type != "cpu":
            return self.device_logits(layer, pooled).cpu().numpy()
        weight, bias = self._host_head(layer)
        x = pooled if isinstance(pooled, np.ndarray) else pooled.float().numpy()
        logits = x @ weight
        if self.normalize:   # (x / |x|) @ W = (x @ W) / |x|, with F.normalize's floor on |x|
            logits /= np.maximum(np.sqrt(np.einsum("ij,ij->i", x, x)), 1e-12)[:, None]
        return logits + bias

    def device_logits(self, layer: int, pooled: torch.Tensor) -> torch.Tensor:
        """[n, C] float32 logits of the ramp at `layer`, where the pooled states are."""
        return self.heads[str(layer)](self.finish(pooled)).float()

    def _host_head(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The head at `layer` as NumPy arrays ([H, C] weight, [C] bias), made once: serving never trains."""
        cached = self._host.get(layer)
        if cached is None:
            head = self.heads[str(layer)]
            cached = self._host[layer] = (head.weight.detach().float().cpu().numpy().T.copy(),
                                          head.bias.detach().float().cpu().numpy().copy())
        return cached


def save_ramps(directory: Path, ramps: ExitRamps, *, teacher: str, task: str, metrics: dict[str, Any],
               extra: dict[str, Any], evidence: Evidence | None = None) -> Manifest:
    tensors = {f"layer{k}.{name}": t for k in ramps.layers
               for name, t in ramps.heads[str(k)].state_dict().items()}
    if evidence is not None:
        tensors[f"{EVIDENCE}conf"] = torch.from_numpy(np.asarray(evidence.conf, dtype=np.float32))
        tensors[f"{EVIDENCE}agree"] = torch.from_numpy(np.asarray(evidence.agree, dtype=np.uint8))
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
    ramps.evidence = _evidence(Path(directory) / WEIGHTS, tensors, len(layers))
    try:
        ramps.heads.load_state_dict({k.removeprefix("layer"): v for k, v in tensors.items()
                                     if not k.startswith(EVIDENCE)}, strict=True)
    except RuntimeError as e:   # a tensor of the wrong width, or one missing
        raise ArtifactError(f"{Path(directory) / WEIGHTS}: not ramps for a {hidden_size}-wide "
                            f"model with {len(labels)} labels: {e}") from e
    return ramps.to(device).eval(), manifest


def _evidence(path: Path, tensors: dict[str, torch.Tensor], ramps: int) -> Evidence | None:
    """The artifact's evidence, one column a ramp; None when it has none."""
    conf, agree = tensors.get(f"{EVIDENCE}conf"), tensors.get(f"{EVIDENCE}agree")
    if conf is None and agree is None:
        return None
    if conf is None or agree is None or conf.ndim != 2 or conf.shape[1] != ramps or agree.shape != conf.shape:
        raise ArtifactError(f"{path}: evidence.conf and evidence.agree must both be [texts, {ramps}]")
    return Evidence(conf.float().cpu().numpy(), agree.cpu().numpy().astype(bool))
