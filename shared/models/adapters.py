"""Tenant bottleneck adapters (HMI §3.2.2) on the shared teacher, batched across tenants (HMI §6.3).

An adapter is, per upper layer i, down (H→r), ReLU, up (r→H) with a residual, plus a task head
(C×H). One teacher serves every tenant: forward hooks on the upper layers' attention output
projections add each row's own adapter; rows without one (slot 0, all zeros) get exactly the base
output, so the same hooked teacher also serves plain requests.

File format (safetensors): tensors `layers.{i}.down.weight` [r,H], `layers.{i}.down.bias` [r],
`layers.{i}.up.weight` [H,r], `layers.{i}.up.bias` [H], `head.weight` [C,H], `head.bias` [C];
header metadata `format`, `base`, `labels` (JSON), `rank`, `layers` (JSON: every layer the adapter
has, even when the file holds a subset; see `to_bytes`), `hidden`, and `base_layers` (how many layers the
base has; a file without it sits on a bundled base, whose shape is known).

A base is a bundled one (`minilm`, `minilm-plot`) or a user's embedding model (`academus models add`): its
layers and width come from its config, so an adapter carries them rather than looking them up here.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn
from torch.nn import functional as F

from academus.shared.models.model import HIDDEN_SIZE
from academus.shared.state.catalogue import ADAPTER_BASES

FORMAT = "academus-adapter/1"
DEFAULT_RANK = 16
# the bundled bases' (layers, hidden size); a user's model's come from its config
BUNDLED_BASES: dict[str, tuple[int, int]] = {name: (6, HIDDEN_SIZE) for name in ADAPTER_BASES}
LAYER_KEYS = ("down.weight", "down.bias", "up.weight", "up.bias")
_NAME = re.compile(r"^(?:layers\.(\d+)\.(down|up)\.(weight|bias)|head\.(weight|bias))$")

Tensors = dict[str, torch.Tensor]


def upper_layers(num_layers: int) -> tuple[int, ...]:
    """The upper half of the layers (HMI §3.1 O2: task knowledge lives there): 3,4,5 of 6."""
    return tuple(range(num_layers // 2, num_layers))


def base_shape(base: str, layers: int = 0, hidden: int = 0) -> tuple[int, int]:
    """(layers, hidden size) of a base: as given (a user's model, from its config), else a bundled base's. A
    bundled base's name given another shape is refused: its adapters would not fit the served teacher."""
    bundled = BUNDLED_BASES.get(base)
    if bundled is None and not (layers and hidden):
        raise ValueError(f"unknown adapter base {base!r}: not a bundled base ({', '.join(sorted(BUNDLED_BASES))}), "
                         "and its layers and hidden size are not given")
    if bundled is not None and (layers or hidden) and (layers, hidden) != bundled:
        raise ValueError(f"base {base!r} has {bundled[0]} layers of hidden size {bundled[1]}, not {layers} of "
                         f"{hidden}")
    return bundled or (layers, hidden)


@dataclass
class AdapterWeights:
    """One tenant's adapters and head. `layers[i]` maps LAYER_KEYS to tensors; a partial piece (one
    layer for layer-wise prefetch) holds a subset of `layer_ids` and maybe no head."""

    base: str
    labels: list[str]
    rank: int
    layers: dict[int, Tensors]
    head_weight: torch.Tensor | None = None
    head_bias: torch.Tensor | None = None
    layer_ids: tuple[int, ...] = field(default=())   # all layers of the full adapter; () = keys of `layers`
    base_layers: int = 0    # the base's layers (0: a bundled base's)
    hidden: int = 0         # the base's hidden size (0: a bundled base's)

    def __post_init__(self) -> None:
        if not self.layer_ids:
            self.layer_ids = tuple(sorted(self.layers))
        self.layer_ids = tuple(sorted(self.layer_ids))
        self.base_layers, self.hidden = base_shape(self.base, self.base_layers, self.hidden)

    @classmethod
    def init(cls, labels: Sequence[str], base: str = "minilm", rank: int = DEFAULT_RANK,
             layers: Sequence[int] | None = None, seed: int = 0, shape: tuple[int, int] = (0, 0)) -> AdapterWeights:
        """A fresh adapter: down small random, up zero (starts as the identity, Houlsby), head random.
        `shape`: the base's (layers, hidden size), for a base that is not bundled."""
        num_layers, hidden = base_shape(base, *shape)
        generator = torch.Generator().manual_seed(seed)
        ids = tuple(layers) if layers is not None else upper_layers(num_layers)
        weights = {i: {"down.weight": torch.randn(rank, hidden, generator=generator) * 0.01,
                       "down.bias": torch.zeros(rank),
                       "up.weight": torch.zeros(hidden, rank),
                       "up.bias": torch.zeros(hidden)} for i in ids}
        bound = hidden ** -0.5               # nn.Linear's default init range
        head_w = (torch.rand(len(labels), hidden, generator=generator) * 2 - 1) * bound
        head_b = (torch.rand(len(labels), generator=generator) * 2 - 1) * bound
        out = cls(base, list(labels), rank, weights, head_w, head_b, ids, num_layers, hidden)
        out.validate()
        return out

    @property
    def complete(self) -> bool:
        return set(self.layers) == set(self.layer_ids) and self.head_weight is not None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None,
           non_blocking: bool = False) -> AdapterWeights:
        """A copy on `device` (e.g. a worker's GPU cache, so batches do not copy weights each time).
        `non_blocking`: from pinned host memory, asynchronous on the current CUDA stream."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if non_blocking:
                t = t.pin_memory()
            return t.to(device=device, dtype=dtype or t.dtype, non_blocking=non_blocking)

        return replace(self, labels=list(self.labels), layers={i: {k: move(v) for k, v in w.items()}
                                                               for i, w in self.layers.items()},
                       head_weight=move(self.head_weight), head_bias=move(self.head_bias))

    def piece(self, layers: Sequence[int], head: bool) -> AdapterWeights:
        """The same tensors (no copy) of some layers (none: all), with the head or without: what the store's
        Get of those layers answers."""
        wanted = set(layers) if layers else set(self.layers)
        return replace(self, layers={i: t for i, t in self.layers.items() if i in wanted},
                       head_weight=self.head_weight if head else None, head_bias=self.head_bias if head else None)

    def pinned(self) -> AdapterWeights:
        """A copy in pinned (page-locked) host memory, which a GPU copies from asynchronously."""
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return replace(self, layers={i: {k: pin(v) for k, v in w.items()} for i, w in self.layers.items()},
                       head_weight=pin(self.head_weight), head_bias=pin(self.head_bias))

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor this adapter (or piece) holds."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor (e.g. for an optimizer, or `.requires_grad_()`)."""
        out = [t for i in sorted(self.layers) for t in (self.layers[i][k] for k in LAYER_KEYS)]
        return out + [t for t in (self.head_weight, self.head_bias) if t is not None]

    def validate(self) -> None:
        """Raises ValueError naming the first problem: base, labels, layer ids, names or shapes."""
        num_layers, hidden = self.base_layers, self.hidden
        if len(self.labels) < 1 or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels must be distinct and non-empty, got {self.labels!r}")
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        bad = [i for i in self.layer_ids if not 0 <= i < num_layers]
        if bad or not self.layer_ids:
            raise ValueError(f"layers {list(self.layer_ids)} must be a non-empty subset of 0..{num_layers - 1}")
        extra = sorted(set(self.layers) - set(self.layer_ids))
        if extra:
            raise ValueError(f"tensors for layers {extra}, which are not among the adapter's layers "
                             f"{list(self.layer_ids)}")
        r, h, c = self.rank, hidden, len(self.labels)
        shapes = {"down.weight": (r, h), "down.bias": (r,), "up.weight": (h, r), "up.bias": (h,)}
        for i, tensors in self.layers.items():
            missing = [k for k in LAYER_KEYS if k not in tensors]
            if missing:
                raise ValueError(f"layer {i} lacks {', '.join(f'layers.{i}.{k}' for k in missing)}")
            for key, shape in shapes.items():
                _check_tensor(f"layers.{i}.{key}", tensors[key], shape)
        if (self.head_weight is None) != (self.head_bias is None):
            raise ValueError("head.weight and head.bias must come together")
        if self.head_weight is not None and self.head_bias is not None:
            _check_tensor("head.weight", self.head_weight, (c, h))
            _check_tensor("head.bias", self.head_bias, (c,))

    def metadata(self) -> dict[str, str]:
        return {"format": FORMAT, "base": self.base, "labels": json.dumps(self.labels),
                "rank": str(self.rank), "layers": json.dumps(list(self.layer_ids)), "hidden": str(self.hidden),
                "base_layers": str(self.base_layers)}

    def to_bytes(self, layers: Sequence[int] | None = None, head: bool = True) -> bytes:
        """The adapter (or a subset: some layers, with or without the head) as safetensors bytes."""
        wanted = sorted(self.layers) if layers is None else sorted(set(layers))
        missing = [i for i in wanted if i not in self.layers]
        if missing:
            raise ValueError(f"this adapter holds no layers {missing} (it holds {sorted(self.layers)})")
        tensors = {f"layers.{i}.{k}": self.layers[i][k].detach().float().contiguous().cpu()
                   for i in wanted for k in LAYER_KEYS}
        if head:
            if self.head_weight is None or self.head_bias is None:
                raise ValueError("this adapter piece has no head to write")
            tensors["head.weight"] = self.head_weight.detach().float().contiguous().cpu()
            tensors["head.bias"] = self.head_bias.detach().float().contiguous().cpu()
        return st_save(tensors, metadata=self.metadata())

    @classmethod
    def from_bytes(cls, data: bytes) -> AdapterWeights:
        """Parses and validates a file written by `to_bytes` (whole or a piece); ValueError if bad."""
        try:
            tensors = st_load(bytes(data))
            meta = _header_metadata(data)
        except (SafetensorError, ValueError, TypeError) as e:
            raise ValueError(f"not a valid safetensors adapter file: {e}") from e
        out = cls(**_parse_metadata(meta), layers={})
        for name, tensor in tensors.items():
            found = _NAME.match(name)
            if not found:
                raise ValueError(f"unexpected tensor {name!r} in an adapter file (expected layers.<i>.down|up."
                                 "weight|bias and head.weight|bias)")
            if found.group(4):
                setattr(out, f"head_{found.group(4)}", tensor)
            else:
                out.layers.setdefault(int(found.group(1)), {})[f"{found.group(2)}.{found.group(3)}"] = tensor
        out.validate()
        return out

    @classmethod
    def merge(cls, pieces: Iterable[AdapterWeights]) -> AdapterWeights:
        """Joins pieces of one adapter (e.g. per-layer prefetches) into one; they must agree on base,
        labels, rank and layer ids and must not hold the same layer twice."""
        pieces = list(pieces)
        if not pieces:
            raise ValueError("nothing to merge")
        first = pieces[0]
        out = replace(first, labels=list(first.labels), layers={}, head_weight=None, head_bias=None)
        for piece in pieces:
            if piece.metadata() != first.metadata():
                raise ValueError(f"pieces of different adapters: {piece.metadata()} vs {first.metadata()}")
            twice = sorted(set(piece.layers) & set(out.layers))
            if twice or (piece.head_weight is not None and out.head_weight is not None):
                raise ValueError(f"two pieces hold the same {'layers ' + str(twice) if twice else 'head'}")
            out.layers.update(piece.layers)
            if piece.head_weight is not None:
                out.head_weight, out.head_bias = piece.head_weight, piece.head_bias
        out.validate()
        return out


def _check_tensor(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {list(shape)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected a floating point type")
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"{name} holds NaN or infinite values")


def _header_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors header (safetensors.torch.load drops it)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    return dict(header.get("__metadata__") or {})


def _parse_metadata(meta: dict[str, str]) -> dict:
    if meta.get("format") != FORMAT:
        raise ValueError(f"metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        labels, layer_ids = json.loads(meta["labels"]), json.loads(meta["layers"])
        rank, hidden, base_layers = int(meta["rank"]), int(meta["hidden"]), int(meta.get("base_layers", 0))
    except (KeyError, ValueError, TypeError) as e:
        raise ValueError(f"adapter metadata is missing or malformed ({e!r}): {meta}") from e
    if not (isinstance(labels, list) and all(isinstance(x, str) for x in labels)):
        raise ValueError(f"metadata labels must be a JSON list of strings, got {meta['labels']!r}")
    if not (isinstance(layer_ids, list) and all(isinstance(x, int) for x in layer_ids)):
        raise ValueError(f"metadata layers must be a JSON list of ints, got {meta['layers']!r}")
    base = meta.get("base", "")
    bundled = BUNDLED_BASES.get(base)
    if bundled is not None and hidden != bundled[1]:
        raise ValueError(f"metadata hidden={hidden}, but base {base!r} has hidden size {bundled[1]}")
    if bundled is not None and not base_layers:   # written before files carried their base's depth
        base_layers = bundled[0]
    return {"base": base, "labels": labels, "rank": rank, "layer_ids": tuple(layer_ids), "base_layers": base_layers,
            "hidden": hidden}


# --- applying adapters to a batch --------------------------------------------------------------

class BatchedAdapters:
    """The adapters of one batch: row b uses adapter `slots[b]` (0 = none).

    batched=True (HMI §6.3): per layer the batch's distinct adapters are stacked ([A+1, H, r], slot 0
    all zeros, ranks zero-padded to the widest, which changes nothing), gathered per row, and applied
    with one `baddbmm` per projection. batched=False loops over the adapters (the ablation baseline)."""

    def __init__(self, adapters: Sequence[AdapterWeights | None], *, batched: bool = True,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 layer_ready: Callable[[int], None] | None = None) -> None:
        # layer_ready(i) blocks until layer i of every adapter is in place: adapters still arriving
        # layer by layer (the worker's prefetch, HMI §6.2) are stacked per layer when it is reached.
        self.batched, self.layer_ready = batched, layer_ready
        self.distinct: list[AdapterWeights] = []
        index: dict[int, int] = {}
        slots = []
        for adapter in adapters:
            if adapter is not None and id(adapter) not in index:
                if layer_ready is None and not set(adapter.layer_ids) <= set(adapter.layers):
                    raise ValueError(f"adapter lacks layers {sorted(set(adapter.layer_ids) - set(adapter.layers))}"
                                     " (merge all its pieces before use)")
                index[id(adapter)] = len(self.distinct) + 1
                self.distinct.append(adapter)
            slots.append(0 if adapter is None else index[id(adapter)])
        self.device, self.dtype = torch.device(device), dtype
        self.slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.layer_ids = sorted({i for a in self.distinct for i in a.layer_ids})
        self._stacks = {i: self._stack_layer(i) for i in self.layer_ids} if batched and not layer_ready else {}

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)

    def _stack_layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """(down_w [A+1,H,r], down_b [A+1,1,r], up_w [A+1,r,H], up_b [A+1,1,H]); stays differentiable."""
        hidden = self.distinct[0].hidden
        rank = max(a.rank for a in self.distinct)
        zero = {"down.weight": torch.zeros(rank, hidden), "down.bias": torch.zeros(rank),
                "up.weight": torch.zeros(hidden, rank), "up.bias": torch.zeros(hidden)}
        down_w, down_b, up_w, up_b = [], [], [], []
        for a in [None, *self.distinct]:     # slot 0, and adapters without layer i, are all zeros
            w = zero if a is None or i not in a.layers else a.layers[i]
            pad = rank - w["down.bias"].shape[0]
            down_w.append(F.pad(self._to(w["down.weight"]).t(), (0, pad)))
            down_b.append(F.pad(self._to(w["down.bias"]), (0, pad)))
            up_w.append(F.pad(self._to(w["up.weight"]).t(), (0, 0, 0, pad)))
            up_b.append(self._to(w["up.bias"]))
        return (torch.stack(down_w), torch.stack(down_b).unsqueeze(1),
                torch.stack(up_w), torch.stack(up_b).unsqueeze(1))

    def apply(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x + up(relu(down(x))) per row, for layer i; x is [B, T, H]."""
        if i not in self.layer_ids:
            return x
        if x.shape[0] != self.slots.shape[0]:
            raise ValueError(f"the batch has {x.shape[0]} rows but {self.slots.shape[0]} adapter slots")
        if self.layer_ready is not None:
            self.layer_ready(i)
            if self.batched and i not in self._stacks:
                self._stacks[i] = self._stack_layer(i)
        return self._apply_batched(i, x) if self.batched else self._apply_looped(i, x)

    def _apply_batched(self, i: int, x: torch.Tensor) -> torch.Tensor:
        down_w, down_b, up_w, up_b = (t[self.slots] for t in self._stacks[i])
        hidden = torch.relu(torch.baddbmm(down_b.to(x.dtype), x, down_w.to(x.dtype)))
        return x + torch.baddbmm(up_b.to(x.dtype), hidden, up_w.to(x.dtype))

    def _apply_looped(self, i: int, x: torch.Tensor) -> torch.Tensor:
        out = x
        for slot, adapter in enumerate(self.distinct, start=1):
            w = adapter.layers.get(i)
            rows = (self.slots == slot).nonzero().squeeze(1)
            if w is None or rows.numel() == 0:
                continue
            part = x.index_select(0, rows)
            w = {k: self._to(v).to(x.dtype) for k, v in w.items()}
            delta = F.linear(torch.relu(F.linear(part, w["down.weight"], w["down.bias"])), w["up.weight"], w["up.bias"])
            out = out.index_add(0, rows, delta)
        return out

    def probabilities(self, pooled: torch.Tensor) -> torch.Tensor | None:
        """[B, C_max] softmax of each row's own head over its own labels, zero-padded to the widest
        head; rows without an adapter are all zero. None when no row has an adapter."""
        if not self.distinct:
            return None
        logits = self.logits(pooled)
        widths = torch.tensor([0] + [len(a.labels) for a in self.distinct], device=pooled.device)[self.slots]
        valid = torch.arange(logits.shape[1], device=pooled.device)[None, :] < widths[:, None]
        probs = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=1)
        return torch.where(valid, probs, torch.zeros_like(probs))   # rows with no head: NaN -> 0

    def logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, C_max] raw logits (padding columns and rows without an adapter are 0), for training."""
        if not self.distinct:
            raise ValueError("no row of this batch has an adapter, so there is no head to apply")
        if any(a.head_weight is None or a.head_bias is None for a in self.distinct):
            raise ValueError("an adapter in the batch has no head (merge its head piece before use)")
        return self._logits_batched(pooled) if self.batched else self._logits_looped(pooled)

    def _logits_batched(self, pooled: torch.Tensor) -> torch.Tensor:
        width = max(len(a.labels) for a in self.distinct)
        hidden = pooled.shape[1]
        weights = [pooled.new_zeros(width, hidden)]
        biases = [pooled.new_zeros(width)]
        for a in self.distinct:
            pad = width - len(a.labels)
            weights.append(F.pad(a.head_weight.to(pooled), (0, 0, 0, pad)))
            biases.append(F.pad(a.head_bias.to(pooled), (0, pad)))
        w, b = torch.stack(weights)[self.slots], torch.stack(biases)[self.slots]
        return torch.baddbmm(b.unsqueeze(2), w, pooled.unsqueeze(2)).squeeze(2)

    def _logits_looped(self, pooled: torch.Tensor) -> torch.Tensor:
        width = max(len(a.labels) for a in self.distinct)
        out = pooled.new_zeros(pooled.shape[0], width)
        for slot, a in enumerate(self.distinct, start=1):
            rows = (self.slots == slot).nonzero().squeeze(1)
            logits = F.linear(pooled.index_select(0, rows), a.head_weight.to(pooled), a.head_bias.to(pooled))
            out = out.index_add(0, rows, F.pad(logits, (0, width - len(a.labels))))
        return out


# --- hooks on a shared encoder -----------------------------------------------------------------

class AdapterInjector:
    """Forward hooks on a shared encoder's attention output projections. They do nothing unless a
    batch's adapters are active in the calling thread (`with injector.active(stack):`), so the same
    teacher keeps serving requests without adapters. The worker runs one batch at a time per model;
    the active stack is thread-local so a second thread never sees another's adapters."""

    def __init__(self, bert: nn.Module, layers: Sequence[int]) -> None:
        self._local = threading.local()
        total = len(bert.encoder.layer)
        bad = [i for i in layers if not 0 <= i < total]
        if bad:
            raise ValueError(f"layers {bad} are outside 0..{total - 1} (the encoder has {total} layers)")
        self.layers = tuple(layers)
        # Houlsby placement, as adapter-hub's `mh_adapter`: on the attention output projection, before
        # its dropout, residual and LayerNorm. The adapter then adapts what attention writes into the
        # residual stream while LayerNorm still re-normalises the sum, so a zero adapter is exactly the
        # base layer and the frozen FFN sees inputs in its usual range.
        self._handles = [attention_projection(bert.encoder.layer[i]).register_forward_hook(self._hook(i))
                         for i in self.layers]

    def _hook(self, i: int):
        def hook(_module: nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor | None:
            stack: BatchedAdapters | None = getattr(self._local, "stack", None)
            return None if stack is None else stack.apply(i, out)
        # No stack in this thread: the hook changes nothing, and a traced layer may run without it.
        hook.inactive = lambda: getattr(self._local, "stack", None) is None
        return hook

    @contextmanager
    def active(self, stack: BatchedAdapters) -> Iterator[BatchedAdapters]:
        missing = sorted(set(stack.layer_ids) - set(self.layers))
        if missing:
            raise ValueError(f"adapters for layers {missing}, but hooks are installed on {list(self.layers)}")
        previous = getattr(self._local, "stack", None)
        self._local.stack = stack
        try:
            yield stack
        finally:
            self._local.stack = previous

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def attention_projection(layer: nn.Module) -> nn.Module:
    """The linear map that writes a layer's attention into its residual stream, before dropout, residual and
    LayerNorm: BERT's and RoBERTa's `attention.output.dense`, MPNet's `attention.attn.o`."""
    attention = layer.attention
    return attention.attn.o if hasattr(attention, "attn") else attention.output.dense


_injectors: weakref.WeakKeyDictionary[nn.Module, AdapterInjector] = weakref.WeakKeyDictionary()
_injectors_lock = threading.Lock()


def _body(encoder: nn.Module) -> nn.Module:
    return getattr(encoder, "body", encoder)


def install_adapters(encoder: nn.Module) -> AdapterInjector:
    """The injector of `encoder` (a TeacherEncoder or BertModel), hooks on every layer, made once."""
    bert = _body(encoder)
    with _injectors_lock:
        if bert not in _injectors:
            _injectors[bert] = AdapterInjector(bert, range(len(bert.encoder.layer)))
        return _injectors[bert]


def remove_adapters(encoder: nn.Module) -> None:
    """Removes the hooks `install_adapters` put on `encoder` (none: nothing happens)."""
    with _injectors_lock:
        injector = _injectors.pop(_body(encoder), None)
    if injector is not None:
        injector.remove()


def encode_with_adapters(
    encoder: nn.Module, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None,
    adapters: Sequence[AdapterWeights | None], batched: bool = True,
    layer_ready: Callable[[int], None] | None = None, **forward: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pooled [B, H], probabilities [B, C_max] or None): the encoder's forward with row b's adapter
    in its upper layers and its head on the pooled embedding (see `BatchedAdapters.probabilities`).
    `forward` goes to the encoder's forward (a PLOT base's per-row `domains`)."""
    if len(adapters) != ids.shape[0]:
        raise ValueError(f"{len(adapters)} adapters for a batch of {ids.shape[0]} rows")
    bert = _body(encoder)
    hidden = int(bert.config.hidden_size)
    for a in adapters:
        if a is not None and a.hidden != hidden:
            raise ValueError(f"adapter for base {a.base!r} has hidden size {a.hidden}; the encoder has {hidden}")
    param = next(bert.parameters())
    stack = BatchedAdapters(adapters, batched=batched, device=param.device, dtype=param.dtype,
                            layer_ready=layer_ready)
    with install_adapters(encoder).active(stack):
        pooled = encoder(ids, mask, types, **forward)
    return pooled, stack.probabilities(pooled)
