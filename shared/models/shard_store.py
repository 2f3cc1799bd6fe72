"""The shard artifact (`shards/<model>/`): every shard of every layer at every bit width, read shard by shard.

Layout: one file a layer and bit width (`layer<l>.q<k>`, the layer's shards side by side, so that a layer's
shards are read from one place as STI co-locates them); `embeddings.rows` (a teacher's word-embedding table,
read by row block: `embedding_rows.py`); `resident.safetensors` (position and type embeddings, biases, layer
norms, each layer's centroids); `heads-<task>.safetensors` (a head a submodel shape); and `manifest.json`,
which lists every file's sha256 and every shard's offset, length, outlier count and sha256, and per task the
shard importance ranking. A shard is checked against its own crc32 each time it is read (`verify` checks sha256):
a corrupted or truncated file is refused naming the file, the shard and both checksums, never served.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save
from torch import nn

from academus.shared.models.embedding_rows import EmbeddingRows, write_rows
from academus.shared.models.model import ClassifierHead, SequenceClassifierHead
from academus.shared.models.shard_io import FileSource, Reads, Span
from academus.shared.models.shard_native import BadShard
from academus.shared.models.shards import (
    FULL,
    VERSIONS,
    LayerBuilder,
    LayerResident,
    LayerWeights,
    ShardGeometry,
    ShardWeights,
    decode_shard,
    pair_table,
)
from academus.shared.state.artifacts import (
    MANIFEST,
    ArtifactError,
    Manifest,
    checksums,
    crc32,
    now_iso,
    read_manifest,
    save_file,
    sha256_file,
    staged,
    write_atomic,
    write_manifest,
)

SHARDS_KIND = "shards"


RESIDENT = "resident.safetensors"
OWN_HEAD_PREFIX = "own."   # a user's classifier's own head, among its task's head tensors (the full shape's)
RELATIVE_BIAS = "encoder.relative_attention_bias.weight"   # MPNet's, among the resident tensors


def shards_dir(artifacts: Path, model: str) -> Path:
    return Path(artifacts) / "shards" / model


def layer_file(layer: int, bits: int) -> str:
    return f"layer{layer}.q{bits}"


def heads_file(task: str) -> str:
    return f"heads-{task}.safetensors"


def shape_key(depth: int, width: int) -> str:
    return f"d{depth}w{width}"


@dataclass(frozen=True)
class ShardEntry:
    """Where one stored shard version lies and what it must hash to."""

    file: str
    offset: int
    length: int
    outliers: int
    sha256: str
    crc32: int       # checked on every read (7 us for a full-precision MiniLM shard, sha256 0.3 ms)


@dataclass(frozen=True)
class TaskShards:
    """A task's view of the shards: importance ranking, the submodel shapes it has heads for, its labels."""

    task: str
    labels: list[str]
    importance: list[tuple[int, int]]    # (layer, shard), most important first
    widths: list[int]
    depths: list[int]
    metrics: dict[str, Any]
    min_bits: int = 2                    # the fidelity floor: fewer bits lost more than 1 pp on the dev set
    own_head: bool = False               # the full shape runs a user's classifier's own (nonlinear) head
    upgrade_order: list[tuple[int, int]] = field(default_factory=list)   # the planner's upgrades, first first

    @property
    def upgrades(self) -> list[tuple[int, int]]:
        """The order of the planner's upgrades: the shards by sensitivity (a store built before it was measured: by
        importance)."""
        return self.upgrade_order or self.importance

    def layer_order(self, layer: int) -> list[int]:
        """The layer's shards, most important first: a width-m layer runs the first m (DynaBERT's rewiring)."""
        return [s for (k, s) in self.importance if k == layer]


class ShardStore:
    """An opened shard artifact: manifest checked, resident tensors loaded, shard files opened for reads."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest.kind != SHARDS_KIND:
            raise ArtifactError(f"{self.directory / MANIFEST}: kind {manifest.kind!r} is not {SHARDS_KIND!r}")
        self.manifest = manifest
        try:
            self.geometry = ShardGeometry(**manifest.extra["geometry"])
            self.eps = float(manifest.extra["layer_norm_eps"])
            self.versions = tuple(int(k) for k in manifest.extra["versions"])
            self.index = {(int(layer), int(bits)): [ShardEntry(**e) for e in entries]
                          for layer, by_bits in manifest.extra["index"].items() for bits, entries in by_bits.items()}
            self.tasks = {name: TaskShards(name, t["labels"], [tuple(x) for x in t["importance"]], t["widths"],
                                           t["depths"], t.get("metrics", {}), int(t.get("min_bits", 2)),
                                           bool(t.get("own_head", False)),
                                           [tuple(x) for x in t.get("upgrade_order", [])])
                          for name, t in manifest.extra.get("tasks", {}).items()}
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{self.directory / MANIFEST}: not a shard manifest ({e!r})") from e
        rows = manifest.extra.get("embedding_rows")
        self.rows = EmbeddingRows(self.directory, rows) if rows is not None else None
        self._check_sizes()
        names = {e.file for entries in self.index.values() for e in entries}   # a few dozen files, 432+ shards
        self.files = {name: self.directory / name for name in names}
        self._paths = sorted(set(self.files.values()) | ({self.rows.path} if self.rows else set()))
        self.resident = self._load_checked(RESIDENT)
        self.centroids = {(layer, k): np.ascontiguousarray(self.resident[f"layer{layer}.centroids{k}"].numpy(),
                                                          dtype=np.float32)
                          for layer in range(self.geometry.layers) for k in self.versions if k != FULL}
        self.pair_tables = {(layer, k): pair_table(c, k) for (layer, k), c in self.centroids.items()}
        self.pair_addresses = {key: table.ctypes.data for key, table in self.pair_tables.items()}   # the C loader's
        self.largest_layer_bytes = self._largest_layer_bytes()

    def _largest_layer_bytes(self) -> int:
        """The most bytes one layer's shards take, each at its largest stored version: what a reader that stages a
        layer's reads needs at most, whatever the plan."""
        longest: dict[tuple[int, int], int] = {}
        for (layer, _), entries in self.index.items():
            for shard, e in enumerate(entries):
                longest[(layer, shard)] = max(longest.get((layer, shard), 0), e.length)
        per_layer: dict[int, int] = {}
        for (layer, _), length in longest.items():
            per_layer[layer] = per_layer.get(layer, 0) + length
        return max(per_layer.values(), default=0)

    def _check_sizes(self) -> None:
        """A truncated or missing layer file is refused when the store opens, not when a request reaches it."""
        ends: dict[str, int] = {}
        for entries in self.index.values():
            for e in entries:
                ends[e.file] = max(ends.get(e.file, 0), e.offset + e.length)
        if self.rows is not None:
            ends[self.rows.path.name] = self.rows.stored_bytes
        for name, end in ends.items():
            path = self.directory / name
            if not path.is_file():
                raise ArtifactError(f"{path} is listed in the manifest but missing")
            if (size := path.stat().st_size) < end:
                raise ArtifactError(f"{path} is truncated: {size} bytes, the manifest's shards end at {end}")

    def _load_checked(self, name: str) -> dict[str, torch.Tensor]:
        path = self.directory / name
        if not path.is_file():
            raise ArtifactError(f"{path} is listed in the manifest but missing")
        data = path.read_bytes()   # read once: hashed, then parsed from memory (a cold start's ready time)
        if (actual := hashlib.sha256(data).hexdigest()) != (expected := self.manifest.files.get(name)):
            raise ArtifactError(f"{path}: sha256 {actual} does not match the manifest's {expected}")
        return safetensors_load(data)

    def entry(self, layer: int, shard: int, bits: int) -> ShardEntry:
        return self.index[(layer, bits)][shard]

    def span(self, layer: int, shard: int, bits: int) -> Span:
        """Where a shard's stored bytes lie: file, offset, length."""
        e = self.entry(layer, shard, bits)
        return self.files[e.file], e.offset, e.length

    def read_stored(self, layer: int, shard: int, bits: int) -> bytes:
        """A shard's stored bytes, read whole from its file (unchecked: `decode` checks them)."""
        with FileSource() as source:
            return source.read(*self.span(layer, shard, bits))

    def read_in_order(self, source: FileSource, shards: Iterable[tuple[int, int, int]], depth: int) -> Reads:
        """The stored bytes of `shards` ((layer, shard, version) each) through an IO source, in order, read up to
        `depth` ahead where the source reads ahead (unchecked: `put` and `decode` check them)."""
        return source.read_in_order((self.span(*x) for x in shards), depth)

    def load_layer(self, source: FileSource, layer: int, shards: Sequence[int], bits: int,
                   resident: LayerResident) -> LayerWeights:
        """A layer's shards at one version read through an IO source (a layer ahead where it reads ahead), each
        checked and put into the layer as it comes."""
        reads = self.read_in_order(source, [(layer, s, bits) for s in shards], len(shards))
        try:
            return self.build_layer(layer, shards, bits, reads, resident)
        finally:
            reads.close()

    def build_layer(self, layer: int, shards: Sequence[int], bits: int, blobs: Iterable[bytes],
                    resident: LayerResident) -> LayerWeights:
        """A layer from its shards' stored bytes at one version, each checked, then put into it in one call (STI's
        loader puts plans of mixed versions together the same way)."""
        built = LayerBuilder(shards, resident, self.geometry)
        self.put(built, layer, [(s, bits) for s in shards], list(blobs))
        return built.weights()

    def put(self, built: LayerBuilder, layer: int, shards: Sequence[tuple[int, int]],
            blobs: Sequence[bytes | memoryview], places: Sequence[int] | None = None) -> None:
        """Read shards of one layer ((shard, version) each) put in together, each checked against its size and
        CRC-32 in the same call (the C loader's, without the GIL). `places[i]`: shard i's place among `built`'s
        shards (default: `built`'s shards in order). A mismatch is refused before any shard is put, as `check`
        words it: naming the file, the shard and both checksums."""
        try:
            built.put_stored(range(len(blobs)) if places is None else places, blobs,
                             *self.stored_layout(layer, shards))
        except BadShard as e:
            self.refuse(layer, shards, blobs, e)

    def stored_layout(self, layer: int, shards: Sequence[tuple[int, int]]
                      ) -> tuple[list[int], list[np.ndarray | None], list[int], list[int]]:
        """What the C loader takes of stored shards ((shard, version) each) besides their bytes: their versions,
        pair tables, outlier counts and CRC-32s."""
        entries = [self.entry(layer, s, b) for s, b in shards]
        versions = [b for _, b in shards]
        return (versions, [self.pair_tables.get((layer, b)) for b in versions], [e.outliers for e in entries],
                [e.crc32 for e in entries])

    def refuse(self, layer: int, shards: Sequence[tuple[int, int]], blobs: Sequence[bytes | memoryview],
               refused: BadShard) -> NoReturn:
        """Raises the C loader's refusal of a layer's shards as `check` words it: an ArtifactError naming the file,
        the shard and both checksums."""
        self.check(layer, *shards[refused.i], blobs[refused.i])   # raises for a size or checksum not the manifest's
        raise refused

    def file_order(self, layer: int, shards: Sequence[tuple[int, int]]) -> list[int]:
        """The places of a layer's shards ((shard, version) each) in the order they lie in their files. A layer
        runs once all its shards are in, so its reads may take that order: a cold file read in importance order
        (out of order) loaded 1.2-1.5 times slower than in its own order, the kernel's readahead wasted."""
        entries = [self.entry(layer, s, b) for s, b in shards]
        return sorted(range(len(shards)), key=lambda i: (entries[i].file, entries[i].offset))

    def bytes_by_version(self) -> dict[str, int]:
        """Stored bytes of the whole model's shards at each version."""
        return {str(b): sum(e.length for (_, bits), es in self.index.items() if bits == b for e in es)
                for b in self.versions}

    def shard_bytes(self, layer: int, shard: int, bits: int) -> int:
        return self.entry(layer, shard, bits).length

    def paths(self) -> list[Path]:
        """The shard files and the embedding rows (a cold source drops their pages before each run)."""
        return self._paths

    @property
    def model_settings(self) -> dict[str, Any]:
        """The encoder's config as the manifest keeps it (what transformers' `AutoConfig.for_model` takes)."""
        return {"model_type": "bert", **self.manifest.extra["config"]}

    @property
    def resident_bytes(self) -> int:
        """Bytes of the resident tensors in memory: position and type embeddings, biases, norms, centroids."""
        return sum(t.numel() * t.element_size() for t in self.resident.values())

    def decode(self, layer: int, shard: int, bits: int, blob: bytes | memoryview,
               digest: str = "crc32") -> ShardWeights:
        """A read shard checked (`check`) and decoded into weights of its own."""
        entry = self.check(layer, shard, bits, blob, digest)
        values = decode_shard(blob, bits, self.geometry.params, self.pair_tables.get((layer, bits)), entry.outliers)
        return ShardWeights.from_vector(values if values.flags.writeable else values.copy(), self.geometry)

    def check(self, layer: int, shard: int, bits: int, blob: bytes | memoryview, digest: str = "crc32"
              ) -> ShardEntry:
        """A read shard's size and checksum (its crc32 on the serving path; `verify` checks sha256) against the
        manifest; a mismatch is an ArtifactError naming the file, the shard and both checksums."""
        entry = self.entry(layer, shard, bits)
        if len(blob) != entry.length:
            self._refuse(entry, layer, shard, bits, f"{len(blob)} bytes")
        if digest == "crc32" and (crc := crc32(blob)) != entry.crc32:
            self._refuse(entry, layer, shard, bits, f"crc32 {crc}")
        if digest == "sha256" and (sha := hashlib.sha256(blob).hexdigest()) != entry.sha256:
            self._refuse(entry, layer, shard, bits, f"sha256 {sha}")
        return entry

    def _refuse(self, entry: ShardEntry, layer: int, shard: int, bits: int, got: str) -> None:
        raise ArtifactError(f"{self.directory / entry.file}: shard {shard} of layer {layer} at {bits} bits "
                            f"(bytes {entry.offset}..{entry.offset + entry.length}) has {got}; the manifest says "
                            f"{entry.length} bytes, crc32 {entry.crc32}, sha256 {entry.sha256}")

    def layer_resident(self, layer: int) -> LayerResident:
        return LayerResident.from_tensors(self.resident, f"layer{layer}", self.eps)

    def embeddings_state(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("embeddings."): v for k, v in self.resident.items() if k.startswith("embeddings.")}

    def heads(self, task: str) -> dict[tuple[int, int], nn.Module]:
        """The task's head for every submodel shape (depth, width): linear, except a user's classifier's own head
        on its full shape."""
        if task not in self.tasks:
            raise ArtifactError(f"{self.directory}: no shards profiled for task {task!r} "
                                f"(has: {', '.join(self.tasks) or 'none'})")
        info = self.tasks[task]
        tensors = self._load_checked(heads_file(task))
        heads: dict[tuple[int, int], nn.Module] = {}
        for depth in info.depths:
            for width in info.widths:
                if info.own_head and (depth, width) == (self.geometry.layers, self.geometry.heads):
                    continue
                key = shape_key(depth, width)
                head = ClassifierHead(info.labels, self.geometry.hidden)
                head.linear.load_state_dict({"weight": tensors[f"{key}.weight"], "bias": tensors[f"{key}.bias"]})
                heads[(depth, width)] = head.eval()
        if info.own_head:
            heads[(self.geometry.layers, self.geometry.heads)] = self._own_head(task, info.labels, tensors)
        return heads

    def _own_head(self, task: str, labels: Sequence[str], tensors: dict[str, torch.Tensor]) -> nn.Module:
        from transformers import AutoConfig

        head = SequenceClassifierHead.for_config(AutoConfig.for_model(**self.model_settings), labels)
        state = {k.removeprefix(OWN_HEAD_PREFIX): v for k, v in tensors.items() if k.startswith(OWN_HEAD_PREFIX)}
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ArtifactError(f"{self.directory / heads_file(task)}: the classifier's own "
                                f"head lacks {missing} or has unexpected {unexpected}")
        return head.eval()

    def verify(self) -> dict[str, Any]:
        """Every file against its sha256 and every shard against its own: the first mismatch raises."""
        for name, expected in sorted(self.manifest.files.items()):
            path = self.directory / name
            if not path.is_file():
                raise ArtifactError(f"{path} is listed in the manifest but missing")
            if (actual := sha256_file(path)) != expected:
                raise ArtifactError(f"{path}: sha256 {actual} does not match the manifest's {expected}")
        shards = 0
        for (layer, bits), entries in sorted(self.index.items()):
            with open(self.directory / layer_file(layer, bits), "rb") as handle:
                for s, entry in enumerate(entries):
                    handle.seek(entry.offset)
                    self.decode(layer, s, bits, handle.read(entry.length), digest="sha256")
                    shards += 1
        blocks = 0
        if self.rows is not None:
            with FileSource() as source:
                blocks = self.rows.check_all(source)
        return {"files": len(self.manifest.files), "shards": shards, "row_blocks": blocks, "ok": True}


def write_shard_artifact(directory: Path, *, teacher: str, geometry: ShardGeometry, layer_norm_eps: float,
                         blobs: dict[tuple[int, int], Sequence[tuple[bytes, int]]],
                         resident: dict[str, torch.Tensor], heads: dict[str, dict[str, torch.Tensor]],
                         tasks: dict[str, dict[str, Any]], extra: dict[str, Any],
                         embedding_rows: torch.Tensor | None = None) -> Manifest:
    """Writes the artifact into a staging sibling and renames it into place. `blobs[(layer, bits)]`: each
    shard's stored bytes and outlier count, in shard order; `embedding_rows`: a word-embedding table."""
    with staged(directory) as staging:
        if embedding_rows is not None:
            extra = {**extra, "embedding_rows": write_rows(staging, embedding_rows)}
        index: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for (layer, bits), shards in sorted(blobs.items()):
            name, offset, entries = layer_file(layer, bits), 0, []
            with open(staging / name, "wb") as handle:
                for blob, outliers in shards:
                    handle.write(blob)
                    entries.append({"file": name, "offset": offset, "length": len(blob), "outliers": outliers,
                                    "sha256": hashlib.sha256(blob).hexdigest(), "crc32": crc32(blob)})
                    offset += len(blob)
            index.setdefault(str(layer), {})[str(bits)] = entries
        save_file(resident, str(staging / RESIDENT))
        for task, tensors in heads.items():
            save_file(tensors, str(staging / heads_file(task)))
        manifest = Manifest(
            kind=SHARDS_KIND, teacher=teacher, task=",".join(sorted(tasks)), created=now_iso(),
            shapes={k: list(v.shape) for k, v in resident.items()}, files=checksums(staging),
            extra={"geometry": geometry.__dict__, "layer_norm_eps": layer_norm_eps, "versions": list(VERSIONS),
                   "index": index, "tasks": tasks, **extra})
        write_manifest(staging, manifest)
    return manifest


def add_task(directory: Path, task: str, heads: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Adds (or replaces) a task's heads and importance: the heads file, then the manifest, each replaced
    atomically (a crash between leaves a heads file its manifest's sha256 refuses)."""
    manifest = read_manifest(directory)
    name = heads_file(task)
    write_atomic(Path(directory) / name, save(heads))
    tasks = dict(manifest.extra.get("tasks", {})) | {task: meta}
    files = dict(manifest.files) | {name: sha256_file(Path(directory) / name)}
    write_manifest(directory, replace(manifest, files=files, extra={**manifest.extra, "tasks": tasks},
                                      task=",".join(sorted(tasks))))
