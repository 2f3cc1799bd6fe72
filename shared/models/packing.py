"""Packed (ConcatBatching) execution of BERT encoders (TCB §4).

Several requests share one batch row of `row_length` (L) tokens instead of each being padded to the
longest in the batch. Each request keeps its own position ids (restarting at 0, §4.1.1) and its own
token-type ids, and attends only to itself: the attention mask is block-diagonal (eq. 5-6). Pooling
is per request (mean over its own tokens, as `model.mean_pool`), so a packed batch returns exactly
what running each request alone returns, up to float rounding.

Slotted ConcatBatching (§4.2): a row is cut into slots of `slot_size` (z) tokens and requests sit
inside slots. Attention is computed per slot, on the row tensor reshaped [R, L, H] → [R·L/z, z, H],
so its cost is O(z²) per slot instead of O(L²) per row (eq. 8); the token-wise parts (projections,
FFN) do not care about the shape. Pure ConcatBatching is the special case z = L (one slot a row).
Empty slots are not computed, and the width is trimmed to the fullest slot.

A plan comes from the scheduler (`services/scheduler/das.py` chooses rows, slots and z):

    plan = PackingPlan.slotted([[[0, 2], [1]], [[3]]], row_length=128, slot_size=64)
    pooled = encode_packed(model, pack(token_ids, plan, type_ids))   # [n_requests, H], request order
    logits = head(pooled)                                             # heads are linear: apply after

A request longer than its slot is never truncated: alone in its slot it runs as its own batch of its
own length (`allow_oversize=True`, the default); shared with others, or with `allow_oversize=False`,
`pack` raises `ValueError` so the caller can reject it.

Two attention implementations, equal within float rounding, measured by `loadgen/probes/packing_bench.py`:
`"hf"` runs the HF BertLayer modules on the padded slot tensor with a 4-D additive block-diagonal
mask; `"sdpa"` is our own layer over the same HF weights: the token-wise parts run on the real tokens
only (a flat [T, H] layout, padding-free like TEI's `cu_seq_lengths`), and only attention scatters
them into the slot tensor for `scaled_dot_product_attention` with a boolean block mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from academus.shared.models.architectures import Architecture, read_architecture
from academus.shared.models.model import FIRST, MEAN, TeacherEncoder
from academus.shared.models.students import StudentGroup
from academus.shared.models.work import PackingPlan

Attention = Literal["hf", "sdpa"]
LayerCallback = Callable[[int], None]   # called with the layer index before each layer (deadline checks)
# after layer k: k, this pass's pooled states (computed on demand), the requests they belong to (exit ramps)
AfterLayer = Callable[[int, Callable[[], torch.Tensor], torch.Tensor], None]


@dataclass(frozen=True)
class PackedInputs:
    """One forward pass worth of slots: [S, W] tensors (S slots, W = the fullest slot's tokens)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor     # restart at 0 for every request (§4.1.1)
    token_type_ids: torch.Tensor
    segments: torch.Tensor         # per token: index into `requests`; -1 for padding
    requests: torch.Tensor         # [m] request index of each segment
    lengths: torch.Tensor          # [m] tokens of each segment

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    def to(self, device: torch.device | str) -> PackedInputs:
        return PackedInputs(*(t.to(device) for t in (self.input_ids, self.position_ids, self.token_type_ids,
                                                     self.segments, self.requests, self.lengths)))


@dataclass(frozen=True)
class PackedBatch:
    """The packed slots, plus one pass per oversize request that runs alone at its own length."""

    num_requests: int
    passes: tuple[PackedInputs, ...]

    @property
    def real_tokens(self) -> int:
        return sum(p.real_tokens for p in self.passes)

    @property
    def computed_tokens(self) -> int:
        """Token positions the model computes (real + padding) in the `"hf"` implementation."""
        return sum(p.input_ids.numel() for p in self.passes)

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(self.num_requests, tuple(p.to(device) for p in self.passes))


def pack(sequences: Sequence[Sequence[int]], plan: PackingPlan,
         type_ids: Sequence[Sequence[int]] | None = None, allow_oversize: bool = True) -> PackedBatch:
    """Builds the packed tensors for `plan` over `sequences` (token id lists, indexed by the plan)."""
    check_plan(plan, [len(s) for s in sequences], allow_oversize)
    packed, alone = [], []
    for slot in plan.slots():
        fits = sum(len(sequences[i]) for i in slot) <= plan.slot_size
        (packed if fits else alone).append(slot)
    passes = [_build(packed, sequences, type_ids)] if packed else []
    passes += [_build([slot], sequences, type_ids) for slot in alone]
    return PackedBatch(len(sequences), tuple(passes))


def check_plan(plan: PackingPlan, lengths: Sequence[int], allow_oversize: bool = True) -> None:
    """Refuses (ValueError) a plan that does not place every request exactly once, or crams a slot."""
    placed = plan.requests()
    if sorted(placed) != list(range(len(lengths))):
        raise ValueError(f"the plan must place every one of the {len(lengths)} requests exactly once, "
                         f"it places {sorted(placed)}")
    for slot in plan.slots():
        total = sum(lengths[i] for i in slot)
        if total <= plan.slot_size:
            continue
        if len(slot) > 1:
            raise ValueError(f"slot {list(slot)} holds {total} tokens, over its size {plan.slot_size}")
        if not allow_oversize:
            raise ValueError(f"request {slot[0]} has {total} tokens, over the slot size {plan.slot_size}")


def _build(slots: Sequence[Sequence[int]], sequences: Sequence[Sequence[int]],
           type_ids: Sequence[Sequence[int]] | None) -> PackedInputs:
    width = max(sum(len(sequences[i]) for i in slot) for slot in slots)
    shape = (len(slots), width)
    ids, positions, types = (torch.zeros(shape, dtype=torch.long) for _ in range(3))
    segments = torch.full(shape, -1, dtype=torch.long)
    requests, lengths = [], []
    for s, slot in enumerate(slots):
        start = 0
        for i in slot:
            n = len(sequences[i])
            ids[s, start:start + n] = torch.as_tensor(sequences[i], dtype=torch.long)
            positions[s, start:start + n] = torch.arange(n)
            if type_ids is not None:
                types[s, start:start + n] = torch.as_tensor(type_ids[i], dtype=torch.long)
            segments[s, start:start + n] = len(requests)
            requests.append(i)
            lengths.append(n)
            start += n
    return PackedInputs(ids, positions, types, segments, torch.tensor(requests), torch.tensor(lengths))


def block_mask(segments: torch.Tensor) -> torch.Tensor:
    """[S, 1, W, W] boolean: token q may attend token k iff they belong to the same request (eq. 6).

    Padding (-1) attends to the padding of its own slot only, so no softmax row is empty (no NaN)."""
    return (segments[:, :, None] == segments[:, None, :]).unsqueeze(1)


def additive_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The block mask in HF's 4-D additive form: 0 where attended, the dtype's minimum elsewhere."""
    allowed = block_mask(segments)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def segment_first(hidden: torch.Tensor, segments: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Each request's first token ([CLS] / <s>): [..., H] hidden, same-shaped segment ids → [m, H]. Real tokens
    lie in segment order, each request's together, so a request starts where the ones before it end."""
    flat = hidden.reshape(-1, hidden.shape[-1])[segments.reshape(-1) >= 0]
    return flat[lengths.cumsum(0) - lengths]


def segment_mean(hidden: torch.Tensor, segments: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean over each request's own tokens: [..., H] hidden, same-shaped segment ids → [m, H]."""
    flat, seg = hidden.reshape(-1, hidden.shape[-1]), segments.reshape(-1)
    real = seg >= 0
    sums = flat.new_zeros(len(lengths), flat.shape[-1]).index_add_(0, seg[real], flat[real])
    return sums / lengths.to(flat.dtype).unsqueeze(1)


@dataclass(frozen=True)
class _Stacks:
    """What a packed pass needs from a model: embeddings, layer stacks, their α weights, normalization, and
    the family's ways (position numbering, token types, MPNet's relative attention bias, the pooling)."""

    embeddings: nn.Module
    stacks: list[nn.ModuleList]
    alphas: torch.Tensor | None
    normalize: bool
    architecture: Architecture
    pooling: str = MEAN
    bias_sources: tuple[nn.Module, ...] = ()   # MPNet: each stack's encoder, which holds its bias by position bucket

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings with each request's positions numbered from the family's first position."""
        inputs = {"position_ids": positions + self.architecture.position_offset}
        if self.architecture.uses_token_types:
            inputs["token_type_ids"] = token_type_ids
        return self.embeddings(input_ids=input_ids, **inputs)

    def pool(self, hidden: torch.Tensor, segments: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return (segment_first if self.pooling == FIRST else segment_mean)(hidden, segments, lengths)

    def bias(self, stack: int, width: int, like: torch.Tensor) -> torch.Tensor | None:
        """MPNet's [1, heads, W, W] bias of one stack by relative position in the slot grid: within a request
        that is its own relative position, wherever it starts in the slot; across requests the block mask
        hides it."""
        if not self.bias_sources:
            return None
        return self.bias_sources[stack].compute_position_bias(like.new_empty(1, width, 1))


def _stacks(model: nn.Module, num_students: int | None, student_indices: Sequence[int] = ()) -> _Stacks:
    if isinstance(model, StudentGroup) and student_indices:
        return _member_stacks(model, student_indices)
    if isinstance(model, StudentGroup):
        k = model.check_count(num_students)
        return _group_stacks(model, list(range(k)), model.alphas()[:k], model.normalize)
    if isinstance(model, TeacherEncoder):
        return _body_stacks(model.body, model.architecture, model.normalize, model.pooling)
    if hasattr(model, "embeddings") and hasattr(model, "encoder"):   # a bare HF encoder: mean-pooled, not normalized
        return _body_stacks(model, read_architecture(model.config.to_dict()), False, MEAN)
    raise TypeError(f"cannot run {type(model).__name__} packed: expected TeacherEncoder, an encoder body or "
                    "StudentGroup")


def _body_stacks(body: nn.Module, architecture: Architecture, normalize: bool, pooling: str) -> _Stacks:
    bias = (body.encoder,) if architecture.family.relative_attention else ()
    return _Stacks(body.embeddings, [body.encoder.layer], None, normalize, architecture, pooling, bias)


def _group_stacks(group: StudentGroup, indices: Sequence[int], alphas: torch.Tensor, normalize: bool) -> _Stacks:
    encoders = [group.students[i].encoder for i in indices]
    bias = tuple(encoders) if group.architecture.family.relative_attention else ()
    return _Stacks(group.embeddings, [e.layer for e in encoders], alphas, normalize, group.architecture, MEAN, bias)


def _member_stacks(group: StudentGroup, indices: Sequence[int]) -> _Stacks:
    """A group member's share Σ_{m in indices} α_m·S_m(x), unnormalised (as `StudentGroup.partial`)."""
    if not indices or any(not 0 <= i < group.max_students for i in indices):
        raise ValueError(f"student indices {list(indices)} must be non-empty and within "
                         f"0..{group.max_students - 1}: this student group holds {group.max_students} students")
    return _group_stacks(group, indices, group.alphas()[list(indices)], False)


def encode_packed(model: nn.Module, batch: PackedBatch, attention: Attention = "sdpa",
                  num_students: int | None = None, before_layer: LayerCallback | None = None,
                  student_indices: Sequence[int] = (), after_layer: AfterLayer | None = None) -> torch.Tensor:
    """The served pooled representation of every request, [n_requests, H] in request order.

    Equal to the model's own forward on each request alone: `TeacherEncoder` → L2-normalised mean pool;
    a bare `BertModel` → mean pool; `StudentGroup` → Σ_{m<k} α_m·S_m(x) over its first k students
    (`num_students`, None = best_k), all on one shared embedding pass, normalised if `group.normalize`.
    `before_layer(i)` runs before every layer of every student (the worker's deadline check: raising
    there stops the batch). `"sdpa"` calls the layers' submodules, not the `encoder.layer.<i>` modules
    themselves, so forward hooks registered on those never fire there: use `before_layer`.
    `student_indices` (a `StudentGroup` only) returns a group member's unnormalised share instead.
    `after_layer(k, pooled, requests)` runs after layer k (1-based) of a single stack (the teacher's exit ramps):
    `pooled()` gives this pass's requests' states pooled (unnormalised), `requests` their indices."""
    parts = _stacks(model, num_students, student_indices)
    run = _encode_hf if attention == "hf" else _encode_sdpa
    after = after_layer if len(parts.stacks) == 1 else None
    out: torch.Tensor | None = None
    for inputs in batch.passes:
        pooled = run(parts, inputs, before_layer, after)
        if out is None:
            out = pooled.new_empty(batch.num_requests, pooled.shape[-1])
        out[inputs.requests] = pooled
    if out is None:
        raise ValueError("an empty batch has nothing to encode")
    return F.normalize(out, p=2, dim=1) if parts.normalize else out


def _combine(parts: _Stacks, pooled: list[torch.Tensor]) -> torch.Tensor:
    if parts.alphas is None:
        return pooled[0]
    return (parts.alphas[:, None, None] * torch.stack(pooled)).sum(0)


def _encode_hf(parts: _Stacks, inputs: PackedInputs, before_layer: LayerCallback | None,
               after_layer: AfterLayer | None = None) -> torch.Tensor:
    """HF modules on the padded slot tensor with a 4-D additive block mask and explicit position ids."""
    hidden = parts.embed(inputs.input_ids, inputs.token_type_ids, inputs.position_ids)
    mask = additive_mask(inputs.segments, hidden.dtype)
    pooled = []
    for s, stack in enumerate(parts.stacks):
        bias = parts.bias(s, inputs.segments.shape[1], hidden)
        h = hidden
        for i, layer in enumerate(stack):
            if before_layer is not None:
                before_layer(i)
            h = layer(h, mask) if bias is None else layer(h, mask, position_bias=bias)[0]
            if after_layer is not None:
                after_layer(i + 1, functools.partial(parts.pool, h, inputs.segments, inputs.lengths), inputs.requests)
        pooled.append(parts.pool(h, inputs.segments, inputs.lengths))
    return _combine(parts, pooled)


@dataclass(frozen=True)
class _Layout:
    """Flat real tokens ↔ padded slot tensor: `index` holds each real token's place in the flat S·W grid."""

    index: torch.Tensor
    slots: int
    width: int
    mask: torch.Tensor      # [S, 1, W, W] boolean block mask, or additive with MPNet's bias: [S, heads, W, W]


def _encode_sdpa(parts: _Stacks, inputs: PackedInputs, before_layer: LayerCallback | None,
                 after_layer: AfterLayer | None = None) -> torch.Tensor:
    """Own layers over the HF weights: token-wise work on real tokens only, SDPA per slot."""
    real = inputs.segments.reshape(-1) >= 0
    flat = parts.embed(*(t.reshape(1, -1)[:, real] for t in (inputs.input_ids, inputs.token_type_ids,
                                                              inputs.position_ids))).squeeze(0)
    index, token_segments = real.nonzero().squeeze(1), inputs.segments.reshape(-1)[real]
    blocks = additive_mask(inputs.segments, flat.dtype) if parts.bias_sources else block_mask(inputs.segments)
    pooled = []
    for s, stack in enumerate(parts.stacks):
        bias = parts.bias(s, inputs.segments.shape[1], flat)
        mask = blocks if bias is None else bias + blocks
        layout = _Layout(index, *inputs.segments.shape, mask)
        run_layer = _sdpa_layer if bias is None else _mpnet_sdpa_layer
        h = flat
        for i, layer in enumerate(stack):
            if before_layer is not None:
                before_layer(i)
            h = run_layer(layer, h, layout)
            if after_layer is not None:
                after_layer(i + 1, functools.partial(parts.pool, h, token_segments, inputs.lengths), inputs.requests)
        pooled.append(parts.pool(h, token_segments, inputs.lengths))
    return _combine(parts, pooled)


def _sdpa_layer(layer: nn.Module, tokens: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """One BertLayer (post-LN) on flat tokens [T, H], computed as HF's BertLayer computes it."""
    attention = layer.attention
    context = _bert_attention(attention.self, tokens, layout)
    hidden = attention.output.LayerNorm(attention.output.dense(context) + tokens)
    return layer.output.LayerNorm(layer.output.dense(layer.intermediate(hidden)) + hidden)


def _mpnet_sdpa_layer(layer: nn.Module, tokens: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """One MPNetLayer on flat tokens: its attention projects q, k, v and o itself, and its scores carry the
    relative-position bias (in `layout.mask`)."""
    attn = layer.attention.attn
    context = _slot_attention(tokens, layout, attn.q, attn.k, attn.v, attn.num_attention_heads,
                              attn.attention_head_size ** -0.5)
    hidden = layer.attention.LayerNorm(attn.o(context) + tokens)
    return layer.output.LayerNorm(layer.output.dense(layer.intermediate(hidden)) + hidden)


def _bert_attention(self_attention: nn.Module, tokens: torch.Tensor, layout: _Layout) -> torch.Tensor:
    return _slot_attention(tokens, layout, self_attention.query, self_attention.key, self_attention.value,
                           self_attention.num_attention_heads, self_attention.scaling)


def _slot_attention(tokens: torch.Tensor, layout: _Layout, query: nn.Module, key: nn.Module, value: nn.Module,
                    heads: int, scale: float) -> torch.Tensor:
    hidden = tokens.shape[-1]
    size = hidden // heads

    def to_slots(projection: nn.Module) -> torch.Tensor:
        grid = tokens.new_zeros(layout.slots * layout.width, hidden)
        grid[layout.index] = projection(tokens)
        return grid.view(layout.slots, layout.width, heads, size).transpose(1, 2)

    q, k, v = (to_slots(p) for p in (query, key, value))
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, scale=scale)
    return context.transpose(1, 2).reshape(layout.slots * layout.width, hidden)[layout.index]
