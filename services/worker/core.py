"""The worker's model runner: teacher encoder + task heads, one padded batch at a time.

Knows nothing of gRPC. All three default models share one encoder pass: `minilm` returns the
embedding, `sentiment` and `spam` apply their linear heads to the same embedding.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from academus.shared.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.errors import DeadlineExceeded, InvalidArgument, NotFound
from academus.shared.model import HIDDEN_SIZE, ClassifierHead, TeacherEncoder, pad_batch

OUTPUT_EMBEDDING = "embedding"
OUTPUT_PROBS = "probs"


@dataclass(frozen=True)
class BatchResult:
    values: np.ndarray       # rows x dim, float32
    labels: list[str]
    compute_ms: float
    padded_tokens: int
    real_tokens: int


def resolve_device(wanted: str) -> torch.device:
    """The configured device, or CPU when CUDA is not there (every GPU path falls back)."""
    if wanted.startswith("cuda") and torch.cuda.is_available():
        return torch.device(wanted)
    return torch.device("cpu")


def split_lengths(flat: Sequence[int], lengths: Sequence[int]) -> list[Sequence[int]]:
    if sum(lengths) != len(flat):
        raise InvalidArgument(f"tokens.lengths sum to {sum(lengths)} but tokens.input_ids has {len(flat)} ids")
    out, start = [], 0
    for n in lengths:
        out.append(flat[start : start + n])
        start += n
    return out


class ModelRunner:
    """Loads the teacher once and the heads of the configured models; runs batches synchronously."""

    def __init__(self, artifacts: Path, models: Sequence[str], device: str = "cpu",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.device = resolve_device(device)
        self.clock = clock
        catalogue = json.loads((Path(artifacts) / "models.json").read_text())
        unknown = [m for m in models if m not in catalogue]
        if unknown:
            raise NotFound(f"models {unknown} are not in {artifacts}/models.json (run `academus prepare`)")
        self.encoder = TeacherEncoder.load(device=self.device)
        self._deadline: float | None = None
        for index, layer in enumerate(self.encoder.bert.encoder.layer):
            layer.register_forward_pre_hook(self._deadline_check(index))
        self.specs: dict[str, ModelSpec] = {}
        self.heads: dict[str, ClassifierHead] = {}
        for name in models:
            entry = catalogue[name]
            if entry["kind"] == CLASSIFICATION:
                from academus.shared.training.prepare import load_head  # training code only when needed

                self.heads[name] = load_head(Path(artifacts), entry.get("task", name)).to(self.device).eval()
                self.specs[name] = ModelSpec(name, CLASSIFICATION, list(self.heads[name].labels), HIDDEN_SIZE)
            else:
                self.specs[name] = ModelSpec(name, EMBEDDING, [], HIDDEN_SIZE)

    def _deadline_check(self, index: int):
        """Stops a forward pass between layers once its deadline passed: expired work is not run on."""

        def hook(_module, _args) -> None:
            if self._deadline is not None and self.clock() >= self._deadline:
                raise DeadlineExceeded(f"deadline passed before encoder layer {index}; the rest was not computed")

        return hook

    def run(self, model: str, output: str, input_ids: Sequence[int], lengths: Sequence[int],
            token_type_ids: Sequence[int] = (), deadline: float | None = None) -> BatchResult:
        """Runs one batch; refuses to start when `deadline` (clock time) has passed."""
        spec = self.specs.get(model)
        if spec is None:
            raise NotFound(f"model {model!r} is not served by this worker")
        if output == OUTPUT_PROBS and spec.kind != CLASSIFICATION:
            raise InvalidArgument(f"model {model!r} is an embedding model: it has no labels")
        if deadline is not None and self.clock() >= deadline:
            raise DeadlineExceeded("deadline passed before the batch started; not computed")
        seqs = split_lengths(input_ids, lengths)
        types = split_lengths(token_type_ids, lengths) if token_type_ids else None
        start = time.perf_counter()
        ids, mask, type_ids = pad_batch(seqs, types)
        self._deadline = deadline  # runs on the worker's single compute thread
        with torch.inference_mode():
            pooled = self.encoder(ids.to(self.device), mask.to(self.device), type_ids.to(self.device))
            values = torch.softmax(self.heads[model](pooled), dim=-1) if output == OUTPUT_PROBS else pooled
            values_np = values.float().cpu().numpy()
        return BatchResult(
            values=values_np,
            labels=spec.labels if output == OUTPUT_PROBS else [],
            compute_ms=(time.perf_counter() - start) * 1e3,
            padded_tokens=int(ids.numel()),
            real_tokens=int(mask.sum()),
        )
