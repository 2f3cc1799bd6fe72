"""A student group's students as quantized shards (STI §4.2 applied to Student Parallelism's students).

Each student's layers are cut and quantized exactly as the teacher's are (`shards.py`): one shard a head,
stored at 2–6 bits and at full precision. Student m's layer l is the artifact's layer m·L + l. The shared
embeddings, α and the head stay in the group's own artifact: a worker holds them whatever students it holds.

A worker under a memory budget serves a student it does not hold from these shards at once (an
`ElasticStudent`: its layers at a stored bit width no lower than the artifact's floor, full width, decoded on the
spot) while the full-precision student loads behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from academus.shared.models.model import mean_pool
from academus.shared.models.shard_io import FileSource
from academus.shared.models.shard_store import ShardStore
from academus.shared.models.shards import (
    LayerResident,
    LayerWeights,
    elastic_layer,
    key_mask,
    relative_bias,
)
from academus.shared.state.artifacts import WEIGHTS, ArtifactError, read_manifest

STUDENT_SHARDS_KIND = "student-group"   # the manifest's `extra["of"]`: whose layers the shards are
STUDENT_SHARDS = "student_shards"        # a group's catalogue entry's key: where its students' shards lie


class ElasticStudent(nn.Module):
    """A student whose layers run from decoded shards: the call and the outputs of `Student` (S_N, S_⌈N/2⌉)."""

    def __init__(self, index: int, bits: int, residents: Sequence[LayerResident], layers: Sequence[LayerWeights],
                 store: ShardStore, relative: nn.Module | None = None) -> None:
        """`relative`: an MPNet student's encoder of no layers, holding its relative-position bias table."""
        super().__init__()
        self.index, self.bits, self.geometry = index, bits, store.geometry
        self.residents, self.weights, self.relative = list(residents), list(layers), relative
        self.middle = -(-len(self.weights) // 2)
        self.on_run: Callable[[int, float], None] | None = None   # (tokens, milliseconds) of each run

    def forward(self, hidden: torch.Tensor, _mask4d: torch.Tensor | None,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        started, tokens = time.perf_counter(), attention_mask.numel()
        mask, middle = key_mask(attention_mask), hidden
        bias = None if self.relative is None else self.relative.compute_position_bias(hidden)
        for i, (resident, weights) in enumerate(zip(self.residents, self.weights, strict=True), start=1):
            hidden = elastic_layer(hidden, mask, resident, weights, self.geometry, bias)
            if i == self.middle:
                middle = hidden
        pooled = mean_pool(hidden, attention_mask), mean_pool(middle, attention_mask)
        if self.on_run is not None:
            self.on_run(tokens, (time.perf_counter() - started) * 1e3)
        return pooled


class StudentShards:
    """An opened student shard artifact: which student's layers lie where, and its floor bit width."""

    def __init__(self, directory: Path) -> None:
        self.store = ShardStore(directory)
        extra = self.store.manifest.extra
        if extra.get("of") != STUDENT_SHARDS_KIND:
            raise ArtifactError(f"{directory} holds the shards of {extra.get('of', 'a teacher')!r}, not of a "
                                f"student group")
        self.students, self.layers = int(extra["students"]), int(extra["student_layers"])
        self.min_bits = int(extra["min_bits"])
        self.group_sha256 = str(extra["group_sha256"])   # the group artifact's weights these shards were cut from

    def stored_bytes(self, student: int, bits: int) -> int:
        """What reading one student's layers at `bits` reads."""
        return sum(self.store.entry(k, s, bits).length for k in self._layers(student)
                   for s in range(self.store.geometry.heads))

    def load(self, student: int, bits: int, source: FileSource, device: torch.device | str = "cpu") -> ElasticStudent:
        """Student `student` at `bits`, every shard read through `source`, checked (crc32) and decoded (on the
        CPU), then put on `device`."""
        if not 0 <= student < self.students:
            raise ValueError(f"student {student} is outside 0..{self.students - 1} of {self.store.directory}")
        if bits not in self.store.versions:
            raise ValueError(f"{bits} bits is not stored in {self.store.directory} (has {list(self.store.versions)})")
        residents, layers = [], []
        shards = range(self.store.geometry.heads)
        for k in self._layers(student):
            resident = self.store.layer_resident(k)
            layers.append(_on(self.store.load_layer(source, k, shards, bits, resident), device))
            residents.append(_on(resident, device))
        return ElasticStudent(student, bits, residents, layers, self.store, self._relative(student, device))

    def _relative(self, student: int, device: torch.device | str) -> nn.Module | None:
        """An MPNet student's position-bias table (None for BERT and RoBERTa)."""
        settings = self.store.manifest.extra.get("relative_attention")
        if settings is None:
            return None
        table = self.store.resident[relative_bias_key(student)]
        return relative_bias(settings, self.store.geometry.heads, table).to(device)

    def _layers(self, student: int) -> range:
        return range(student * self.layers, (student + 1) * self.layers)


def relative_bias_key(student: int) -> str:
    """Where a student's relative-position bias table lies among the artifact's resident tensors (MPNet)."""
    return f"student{student}.relative_attention_bias.weight"


def _on(weights: LayerWeights | LayerResident, device: torch.device | str) -> LayerWeights | LayerResident:
    """The same weights with every tensor and norm on `device`."""
    if torch.device(device).type == "cpu":
        return weights
    return replace(weights, **{f.name: getattr(weights, f.name).to(device) for f in fields(weights)
                               if isinstance(getattr(weights, f.name), torch.Tensor | nn.Module)})


def open_student_shards(artifacts: Path, entry: dict[str, Any]) -> StudentShards:
    """The shards a group's catalogue entry points at, refused unless cut from the group's weights as they are."""
    shards = StudentShards(Path(artifacts) / entry[STUDENT_SHARDS])
    weights = read_manifest(Path(artifacts) / entry["students"]).files.get(WEIGHTS)
    if shards.group_sha256 != weights:
        raise ArtifactError(f"{shards.store.directory} was cut from student weights {shards.group_sha256}, but "
                            f"{entry['students']} holds {weights}: run `academus shard build --model "
                            f"{shards.store.manifest.extra.get('model', '...')}` again")
    return shards
