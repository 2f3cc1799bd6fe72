"""Elastic model shards (STI §4.2): vertical slices of each layer, quantized per shard at several bit widths.

A shard is one attention head (its rows of Q, K and V, its columns of the output projection) plus an equal
share of the feed-forward neurons (rows of FFN1, columns of FFN2). Any subset of a layer's shards is a
narrower layer that still attends and projects: the elastic layer below runs it. Biases and layer norms are
small and stay resident at full precision, as the paper keeps them.

Each shard is stored at 2–6 bits with Gaussian outlier-aware quantization (§6, after Zadeh et al.): the
layer's weights are fitted with one Gaussian; weights whose log-likelihood is below -4 are outliers, kept
exactly with their offsets; the rest are sorted into 2^k equal-population clusters whose means are the
centroids. A shard then stores k-bit codes, and every shard of a layer shares the layer's centroids, which
is what lets shards of different bit widths run side by side in one layer.

Codes are packed eight to k bytes. Decoding reads each group as one 64-bit word (a strided view, no copy)
and looks up code *pairs* (2k bits) in a table of centroid pairs: a few numpy passes a shard, where a
gather a code costs several times as much.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from academus.shared.models.architectures import FAMILIES, family_module
from academus.shared.models.shard_native import NATIVE, BadShard, NativePut
from academus.shared.state.artifacts import crc32

BITS = (2, 3, 4, 5, 6)
FULL = 32
VERSIONS = (*BITS, FULL)
OUTLIER_LOG_LIKELIHOOD = -4.0     # the threshold of Zadeh et al., as STI uses it
WORD_PAD = 8                      # zero bytes after the codes: the last group's 64-bit word reads them

if sys.byteorder != "little":     # the packed words are read as little-endian uint64
    raise ImportError("shard codes are packed little-endian")


@dataclass(frozen=True)
class ShardGeometry:
    """How a model's layers cut into shards: one a head, each with intermediate/heads FFN neurons."""

    layers: int
    heads: int
    hidden: int
    intermediate: int

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.intermediate % self.heads:   # else a remainder would be dropped
            raise ValueError(f"{self}: hidden and intermediate sizes must divide by the heads")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def neurons(self) -> int:
        return self.intermediate // self.heads

    @property
    def params(self) -> int:
        """Weights in one shard: Q, K, V rows and O columns of its head; FFN1 rows and FFN2 columns of its neurons."""
        return 4 * self.hidden * self.head_dim + 2 * self.hidden * self.neurons

    def blob_bytes(self, bits: int, outliers: int) -> int:
        """Bytes of one shard's stored version: packed codes, then outlier offsets and values."""
        if bits == FULL:
            return 4 * self.params
        return groups(self.params) * bits + WORD_PAD + 8 * outliers

    @classmethod
    def of(cls, config: object) -> ShardGeometry:
        return cls(int(config.num_hidden_layers), int(config.num_attention_heads), int(config.hidden_size),
                   int(config.intermediate_size))


def groups(n: int) -> int:
    return -(-n // 8)


# --- cutting layers into shards and back ----------------------------------------------------------------------

@dataclass(frozen=True)
class LayerParts:
    """A transformer layer's projections and norms, named alike for BERT and RoBERTa (`attention.self.query`, ...)
    and MPNet (`attention.attn.q`, ...)."""

    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    output: nn.Linear
    attention_norm: nn.LayerNorm
    ffn_in: nn.Linear
    ffn_out: nn.Linear
    output_norm: nn.LayerNorm

    @classmethod
    def of(cls, layer: nn.Module) -> LayerParts:
        a = layer.attention
        if hasattr(a, "attn"):     # MPNet
            attention = (a.attn.q, a.attn.k, a.attn.v, a.attn.o, a.LayerNorm)
        else:
            attention = (a.self.query, a.self.key, a.self.value, a.output.dense, a.output.LayerNorm)
        return cls(*attention, layer.intermediate.dense, layer.output.dense, layer.output.LayerNorm)


def shard_vector(layer: nn.Module, geometry: ShardGeometry, shard: int) -> np.ndarray:
    """Shard `shard` of a layer as one flat float32 vector (Q, K, V rows; O, FFN1, FFN2 slices)."""
    d, f = geometry.head_dim, geometry.neurons
    heads, neurons = slice(shard * d, (shard + 1) * d), slice(shard * f, (shard + 1) * f)
    p = LayerParts.of(layer)
    parts = [p.query.weight[heads], p.key.weight[heads], p.value.weight[heads], p.output.weight[:, heads],
             p.ffn_in.weight[neurons], p.ffn_out.weight[:, neurons]]
    return torch.cat([w.detach().float().reshape(-1) for w in parts]).numpy()


def layer_vector(layer: nn.Module, geometry: ShardGeometry) -> np.ndarray:
    return np.concatenate([shard_vector(layer, geometry, s) for s in range(geometry.heads)])


@dataclass(frozen=True)
class ShardWeights:
    """One shard's weights as the elastic layer takes them."""

    query: torch.Tensor      # [d, H]
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor     # [H, d]
    ffn_in: torch.Tensor     # [f, H]
    ffn_out: torch.Tensor    # [H, f]

    @classmethod
    def from_vector(cls, vector: np.ndarray, geometry: ShardGeometry) -> ShardWeights:
        return cls(*(torch.from_numpy(part) for part in shard_parts(vector, geometry)))


def shard_parts(vector: np.ndarray, geometry: ShardGeometry) -> list[np.ndarray]:
    """Views of a shard's flat vector, laid out as `shard_vector` cuts it: Q, K, V rows [d, H], O columns [H, d],
    FFN1 rows [f, H], FFN2 columns [H, f]."""
    return [vector[start:end].reshape(shape) for start, end, shape in _part_layout(geometry)]


@functools.cache
def _part_layout(geometry: ShardGeometry) -> tuple[tuple[int, int, tuple[int, int]], ...]:
    """(start, end, shape) of each part: worked out once, as the loader cuts every shard it reads by it."""
    h, d, f = geometry.hidden, geometry.head_dim, geometry.neurons
    layout, start = [], 0
    for a, b in [(d, h)] * 3 + [(h, d), (f, h), (h, f)]:
        layout.append((start, start + a * b, (a, b)))
        start += a * b
    return tuple(layout)


@dataclass(frozen=True)
class LayerResident:
    """What a layer keeps in memory whatever its shards: biases and layer norms, at full precision."""

    query_bias: torch.Tensor
    key_bias: torch.Tensor
    value_bias: torch.Tensor
    output_bias: torch.Tensor
    attention_norm: nn.LayerNorm
    ffn_in_bias: torch.Tensor
    ffn_out_bias: torch.Tensor
    output_norm: nn.LayerNorm
    _picked: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, layer: nn.Module) -> LayerResident:
        p = LayerParts.of(layer)
        return cls(p.query.bias.detach(), p.key.bias.detach(), p.value.bias.detach(), p.output.bias.detach(),
                   p.attention_norm, p.ffn_in.bias.detach(), p.ffn_out.bias.detach(), p.output_norm)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}.{name}": t.detach().contiguous() for name, t in (
            ("query_bias", self.query_bias), ("key_bias", self.key_bias), ("value_bias", self.value_bias),
            ("output_bias", self.output_bias), ("attention_norm.weight", self.attention_norm.weight),
            ("attention_norm.bias", self.attention_norm.bias), ("ffn_in_bias", self.ffn_in_bias),
            ("ffn_out_bias", self.ffn_out_bias), ("output_norm.weight", self.output_norm.weight),
            ("output_norm.bias", self.output_norm.bias))}

    def picked(self, shards: Sequence[int], geometry: ShardGeometry) -> tuple[torch.Tensor, ...]:
        """The shards' indices and their query, key, value and ffn_in biases, picked once a set of shards. A plan's
        layers use the same few sets, and picking is a dozen small torch ops: 0.14 ms a layer on the loader thread,
        0.25 ms beside the compute (docs/benchmarks/sti.md)."""
        key = tuple(shards)
        if (hit := self._picked.get(key)) is None:
            d, f = geometry.head_dim, geometry.neurons
            index = torch.as_tensor(key)
            heads = (index[:, None] * d + torch.arange(d)).reshape(-1)
            neurons = (index[:, None] * f + torch.arange(f)).reshape(-1)
            hit = self._picked[key] = (index, self.query_bias[heads], self.key_bias[heads], self.value_bias[heads],
                                       self.ffn_in_bias[neurons])
        return hit

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str, eps: float) -> LayerResident:
        def norm(name: str) -> nn.LayerNorm:
            weight = tensors[f"{prefix}.{name}.weight"]
            layer_norm = nn.LayerNorm(weight.shape[0], eps=eps)
            layer_norm.load_state_dict({"weight": weight, "bias": tensors[f"{prefix}.{name}.bias"]})
            return layer_norm.eval()

        return cls(tensors[f"{prefix}.query_bias"], tensors[f"{prefix}.key_bias"], tensors[f"{prefix}.value_bias"],
                   tensors[f"{prefix}.output_bias"], norm("attention_norm"), tensors[f"{prefix}.ffn_in_bias"],
                   tensors[f"{prefix}.ffn_out_bias"], norm("output_norm"))


@dataclass(frozen=True)
class LayerWeights:
    """A narrower layer's weights, its shards' slices put side by side once (the loader does it, off the compute
    thread), with their biases picked out of the resident ones."""

    query: torch.Tensor       # [m*d, H]
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor      # [H, m*d]
    ffn_in: torch.Tensor      # [m*f, H]
    ffn_out: torch.Tensor     # [H, m*f]
    query_bias: torch.Tensor
    key_bias: torch.Tensor
    value_bias: torch.Tensor
    ffn_in_bias: torch.Tensor
    width: int
    heads: torch.Tensor       # the shards' indices: their heads' rows of a relative-position bias

    @classmethod
    def assemble(cls, shards: Sequence[int], weights: Sequence[ShardWeights], resident: LayerResident,
                 geometry: ShardGeometry) -> LayerWeights:
        """`weights[i]` is shard `shards[i]`'s."""
        return cls.of(shards, resident, geometry, torch.cat([w.query for w in weights]),
                      torch.cat([w.key for w in weights]), torch.cat([w.value for w in weights]),
                      torch.cat([w.output for w in weights], dim=1), torch.cat([w.ffn_in for w in weights]),
                      torch.cat([w.ffn_out for w in weights], dim=1))

    @classmethod
    def of(cls, shards: Sequence[int], resident: LayerResident, geometry: ShardGeometry,
           *matrices: torch.Tensor) -> LayerWeights:
        """The shards' matrices put side by side (query, key, value, output, ffn_in, ffn_out), with their biases."""
        index, query_bias, key_bias, value_bias, ffn_in_bias = resident.picked(shards, geometry)
        return cls(*matrices, query_bias, key_bias, value_bias, ffn_in_bias, len(shards), index)


class LayerBuilder:
    """A narrower layer put together shard by shard as the loader reads them: each shard's parts are copied once,
    from its read buffer (full precision) or its decoded vector, into the layer's matrices. Decoding into
    ShardWeights and then concatenating them copied a full-precision shard twice more: the loader took 0.45-0.65x
    the time a shard this way (docs/benchmarks/sti.md)."""

    def __init__(self, shards: Sequence[int], resident: LayerResident, geometry: ShardGeometry,
                 native: bool = True) -> None:
        """`native`: stored shards go in through the C loader where it was built (`put_stored`)."""
        w, d, f, h = len(shards), geometry.head_dim, geometry.neurons, geometry.hidden
        self.shards, self.resident, self.geometry = list(shards), resident, geometry
        self.query, self.key, self.value = (np.empty((w * d, h), np.float32) for _ in range(3))
        self.output = np.empty((h, w * d), np.float32)
        self.ffn_in = np.empty((w * f, h), np.float32)
        self.ffn_out = np.empty((h, w * f), np.float32)
        self._native = NativePut(   # shard_parts' order: Q, K, V rows, O columns, FFN1 rows, FFN2 columns
            (self.query, self.key, self.value, self.output, self.ffn_in, self.ffn_out),
            ((d, h, d * h, h),) * 3 + ((h, d, d, w * d), (f, h, f * h, h), (h, f, f, w * f)),
        ) if native and NATIVE is not None else None
        self._tensors: tuple[torch.Tensor, ...] | None = None

    def put_stored(self, places: Sequence[int], blobs: Sequence[bytes | memoryview], bits: Sequence[int],
                   pair_tables: Sequence[np.ndarray | None], outliers: Sequence[int],
                   crcs: Sequence[int] | None = None) -> None:
        """Shards `shards[places[j]]` from their stored bytes, each at its own version, checked against `crcs`
        where given: in one C call without the GIL where it was built, else decoded by NumPy and put one by one.
        A shard refused (its size, or its checksum) raises BadShard before any is put."""
        if self._native is not None:
            self._native(places, blobs, bits, pair_tables, outliers, crcs)
            return
        for j, blob in enumerate(blobs if crcs is not None else ()):
            if crc32(blob) != crcs[j]:
                raise BadShard(j, f"a stored shard of {len(blob)} bytes at {bits[j]} bits does not match its CRC-32")
        for i, blob, b, table, count in zip(places, blobs, bits, pair_tables, outliers, strict=True):
            self.put(i, decode_shard(blob, b, self.geometry.params, table, count))

    def put(self, i: int, vector: np.ndarray) -> None:
        """Shard `shards[i]`'s flat vector (`shard_parts`), each part copied to its rows or columns."""
        d, f = self.geometry.head_dim, self.geometry.neurons
        rows, neurons = slice(i * d, (i + 1) * d), slice(i * f, (i + 1) * f)
        q, k, v, o, f1, f2 = shard_parts(vector, self.geometry)
        self.query[rows] = q
        self.key[rows] = k
        self.value[rows] = v
        self.output[:, rows] = o
        self.ffn_in[neurons] = f1
        self.ffn_out[:, neurons] = f2

    @property
    def native(self) -> NativePut | None:
        """The C loader's view of the matrices (None: NumPy puts the shards)."""
        return self._native

    def weights(self, shards: Sequence[int] | None = None, resident: LayerResident | None = None) -> LayerWeights:
        """The matrices as the layer's weights; or, given them, as another layer's of the same width (its buffers
        reused in turn)."""
        if self._tensors is None:    # views of the matrices, made once: a reused buffer serves many layers
            self._tensors = tuple(torch.from_numpy(m) for m in (self.query, self.key, self.value, self.output,
                                                                 self.ffn_in, self.ffn_out))
        return LayerWeights.of(self.shards if shards is None else shards, resident or self.resident, self.geometry,
                               *self._tensors)


def elastic_layer(hidden: torch.Tensor, key_mask: torch.Tensor, resident: LayerResident, layer: LayerWeights,
                  geometry: ShardGeometry, position_bias: torch.Tensor | None = None) -> torch.Tensor:
    """A layer run on a subset of its shards: attention over their heads, the output projection from their
    columns, the FFN over their neurons. With every shard at full precision it is the original layer.
    `key_mask`: [B, 1, 1, T] booleans, True where a token is real; `position_bias`: MPNet's [B, heads, T, T], added
    to the scores of the shards' heads."""
    d = geometry.head_dim
    b, t, _ = hidden.shape

    def heads(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, weight, bias).view(b, t, layer.width, d).transpose(1, 2)

    mask = key_mask
    if position_bias is not None:
        mask = position_bias.index_select(1, layer.heads).masked_fill(~key_mask, float("-inf"))
    context = nn.functional.scaled_dot_product_attention(
        heads(layer.query, layer.query_bias), heads(layer.key, layer.key_bias),
        heads(layer.value, layer.value_bias), attn_mask=mask)
    context = context.transpose(1, 2).reshape(b, t, layer.width * d)
    attended = resident.attention_norm(nn.functional.linear(context, layer.output, resident.output_bias) + hidden)
    inner = nn.functional.gelu(nn.functional.linear(attended, layer.ffn_in, layer.ffn_in_bias))
    out = nn.functional.linear(inner, layer.ffn_out, resident.ffn_out_bias)
    return resident.output_norm(out + attended)


def relative_bias(settings: dict[str, Any], heads: int, table: torch.Tensor) -> nn.Module:
    """MPNet's relative-position bias table (buckets × heads, shared by a model's layers) in an encoder of no layers,
    whose `compute_position_bias` computes the bias as the model does. `settings`: config keys, `model_type` too."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**{**settings, "num_hidden_layers": 0, "num_attention_heads": heads})
    with torch.device("meta"):
        encoder = family_module(FAMILIES[config.model_type], "Encoder")(config)
    encoder = encoder.to_empty(device="cpu").eval()
    encoder.relative_attention_bias.load_state_dict({"weight": table})
    return encoder


def key_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    return attention_mask.bool()[:, None, None, :]


# --- Gaussian outlier-aware quantization ------------------------------------------------------------------------

@dataclass(frozen=True)
class Codebook:
    """A layer's quantization at `bits`: sorted centroids and the cluster edges that assign a weight to one."""

    bits: int
    centroids: np.ndarray     # [2^bits] float32, ascending
    edges: np.ndarray         # [2^bits - 1]: the largest weight of each cluster but the last

    def codes(self, values: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.edges, values, side="left").astype(np.uint8)

    def pair_table(self) -> np.ndarray:
        return pair_table(self.centroids, self.bits)


def pair_table(centroids: np.ndarray, bits: int) -> np.ndarray:
    """[4^bits, 2] float32: the centroids of a code pair (low code first), the decoder's lookup table."""
    pairs = np.arange(1 << (2 * bits))
    mask = (1 << bits) - 1
    return np.stack([centroids[pairs & mask], centroids[pairs >> bits]], axis=1)


def outlier_mask(values: np.ndarray) -> np.ndarray:
    """True where a weight's log-likelihood under the layer's one fitted Gaussian is below the threshold."""
    mean, std = float(values.mean()), float(values.std())
    log_likelihood = -0.5 * np.log(2 * np.pi * std * std) - (values - mean) ** 2 / (2 * std * std)
    return log_likelihood < OUTLIER_LOG_LIKELIHOOD


def fit_codebook(inliers: np.ndarray, bits: int) -> Codebook:
    """Equal-population clusters of the sorted inliers; each centroid is its cluster's mean."""
    if len(inliers) < 1 << bits:
        raise ValueError(f"{len(inliers)} weights cannot fill {1 << bits} clusters at {bits} bits")
    ordered = np.sort(inliers.astype(np.float64))
    clusters = np.array_split(ordered, 1 << bits)
    centroids = np.array([c.mean() for c in clusters], dtype=np.float32)
    edges = np.array([c[-1] for c in clusters[:-1]], dtype=np.float32)
    return Codebook(bits, centroids, edges)


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """Eight k-bit codes to k bytes, little-endian within a 64-bit word; the last group zero-padded."""
    padded = np.zeros(groups(len(codes)) * 8, dtype=np.uint64)
    padded[: len(codes)] = codes
    words = np.zeros(len(padded) // 8, dtype=np.uint64)
    for j, group in enumerate(padded.reshape(-1, 8).T):
        words |= group << np.uint64(bits * j)
    return words.view(np.uint8).reshape(-1, 8)[:, :bits].tobytes()


def encode_shard(vector: np.ndarray, bits: int, codebook: Codebook | None, outliers: np.ndarray) -> bytes:
    """One shard's stored version: raw float32 at full precision, else packed codes then the outliers'
    offsets (uint32) and exact values (float32)."""
    if bits == FULL:
        return vector.astype(np.float32).tobytes()
    assert codebook is not None and codebook.bits == bits
    where = np.flatnonzero(outliers).astype(np.uint32)
    return (pack_codes(codebook.codes(vector), bits) + bytes(WORD_PAD) + where.tobytes()
            + vector[where].astype(np.float32).tobytes())


def decode_shard(blob: bytes | memoryview, bits: int, n: int, pair_table: np.ndarray | None,
                 outliers: int) -> np.ndarray:
    """The float32 weights of a stored shard: centroids by code pair, then the outliers put back."""
    if bits == FULL:     # a view of the read buffer: read-only when it is bytes
        return np.frombuffer(blob, dtype=np.float32, count=n)
    assert pair_table is not None
    m = groups(n)
    # group i's word is the 8 bytes from i * bits: its codes are the low 8 * bits bits; the rest (the next
    # group's, or the zero pad after the last) is masked off. A strided view: no copy of the codes.
    words = np.ndarray((m,), dtype="<u8", buffer=blob, strides=(bits,))
    pairs = np.empty((m, 4), dtype=np.intp)
    mask = np.uint64((1 << (2 * bits)) - 1)
    for j in range(4):
        np.bitwise_and(words >> np.uint64(2 * bits * j), mask, out=pairs[:, j], casting="unsafe")
    values = np.take(pair_table, pairs, axis=0).reshape(-1)[:n]
    if outliers:
        start = m * bits + WORD_PAD
        where = np.frombuffer(blob, dtype=np.uint32, count=outliers, offset=start)
        values[where] = np.frombuffer(blob, dtype=np.float32, count=outliers, offset=start + 4 * outliers)
    return values


@dataclass(frozen=True)
class LayerQuantization:
    """A layer's codebooks at every bit width and its outliers, shard by shard."""

    codebooks: dict[int, Codebook]
    outliers: list[np.ndarray]      # per shard: a boolean mask over its vector

    @classmethod
    def fit(cls, shard_vectors: Sequence[np.ndarray], bits: Sequence[int] = BITS) -> LayerQuantization:
        values = np.concatenate(shard_vectors)
        mask = outlier_mask(values)
        inliers = values[~mask]
        masks = np.split(mask, np.cumsum([len(v) for v in shard_vectors])[:-1])
        return cls({k: fit_codebook(inliers, k) for k in bits}, masks)


FIDELITY_TOLERANCE = 0.01          # a floor bit width loses at most this much accuracy against full precision
WIDTH_ORDERED = "academus_width_ordered"   # a model config's key: the widths it was trained at, each its first shards
ADAPTED_HEADS = "academus_adapted_heads"   # a model config's key: the bundled tasks it was trained under the heads of


def quantize_layers(layers: Sequence[nn.Module], geometry: ShardGeometry, log: Callable[[str], None] = print
                    ) -> tuple[dict[tuple[int, int], list[tuple[bytes, int]]], dict[str, torch.Tensor]]:
    """Every shard of every layer at every version; and the layers' resident tensors (biases, norms,
    centroids)."""
    resident: dict[str, torch.Tensor] = {}
    blobs: dict[tuple[int, int], list[tuple[bytes, int]]] = {}
    for k, layer in enumerate(layers):
        vectors = [shard_vector(layer, geometry, s) for s in range(geometry.heads)]
        q = LayerQuantization.fit(vectors)
        for bits in VERSIONS:
            blobs[(k, bits)] = [(encode_shard(v, bits, q.codebooks.get(bits), q.outliers[s]), int(q.outliers[s].sum()))
                                for s, v in enumerate(vectors)]
        for bits, codebook in q.codebooks.items():
            resident[f"layer{k}.centroids{bits}"] = torch.from_numpy(codebook.centroids)
        resident |= LayerResident.of(layer).tensors(f"layer{k}")
        share = sum(int(m.sum()) for m in q.outliers) / (geometry.params * geometry.heads)
        log(f"layer {k}: {geometry.heads} shards quantized at {list(BITS)} bits; outliers {share:.3%}")
    return blobs, resident
