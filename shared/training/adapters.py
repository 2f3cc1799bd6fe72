"""Training a tenant's bottleneck adapters and head on the frozen teacher (HMI §5.2).

Only the adapters (upper half of the layers) and the head train, with AdamW; the backbone is frozen
and stays in eval mode. The lower layers are frozen *and* below every adapter, so their output does
not change during training: it is computed once per text and cached, and each step runs only the
upper layers (half the encoder's cost, and no backward through the lower half). The forward uses the
serving code path (`BatchedAdapters` hooks), so what is trained is exactly what is served.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from academus.shared.models.adapters import (
    DEFAULT_RANK,
    AdapterWeights,
    BatchedAdapters,
    install_adapters,
    upper_layers,
)
from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.split import SplitEncoder
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import EncoderBase
from academus.shared.state.catalogue import ADAPTER_BASES, EMBEDDING, PLOT_BASES, read_catalogue
from academus.shared.state.uploads import parse_labelled_jsonl
from academus.shared.training.prepare import MAX_TOKENS, classification_metrics, length_batches


def read_labelled_jsonl(path: Path | str) -> tuple[list[str], list[str]]:
    """(texts, labels) from lines `{"text": str, "label": str|int}`; blank lines are skipped.
    Raises ValueError naming the line for bad UTF-8, bad JSON or a missing/ill-typed field, and when
    fewer than 2 distinct labels remain."""
    return parse_labelled_jsonl(Path(path).read_bytes(), str(path))


# --- cached lower layers -----------------------------------------------------------------------

@torch.no_grad()
def lower_states(encoder: nn.Module, encoded: Sequence[Any], num_lower: int, batch_size: int = 64,
                 device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Per text, the output of layers 0..num_lower-1 ([T_i, H], unpadded, on CPU)."""
    split = SplitEncoder.of(encoder)
    out: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
    for batch in length_batches([len(e.input_ids) for e in encoded], batch_size, MAX_TOKENS):
        ids, mask, types = pad_batch([encoded[i].input_ids for i in batch], [encoded[i].token_type_ids for i in batch])
        ids, mask, types = ids.to(device), mask.to(device), types.to(device)
        hidden = split.layers(split.embed(ids, types), mask, 0, num_lower)
        for row, i in enumerate(batch):
            out[i] = hidden[row, : len(encoded[i].input_ids)].cpu()
    return out


@torch.no_grad()
def plot_lower_states(store: Any, encoder: nn.Module, encoded: Sequence[Any], num_lower: int, domain: str = "",
                      batch_size: int = 64, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """`lower_states` on a PLOT base (HMI §5.2): the table's layer-K states (domain overlay first), then
    the frozen layers K+1..num_lower when the adapters start above K. The serving path looks up the same."""
    from academus.shared.models.plot.hierarchical import padded_lookup

    split = SplitEncoder.of(encoder)
    k = store.lower_layers
    if k > num_lower:
        raise ValueError(f"the PLOT table replaces layers 1..{k}, but the adapters start at layer {num_lower + 1}")
    out: list[torch.Tensor] = [torch.empty(0)] * len(encoded)
    for batch in length_batches([len(e.input_ids) for e in encoded], batch_size, MAX_TOKENS):
        ids = np.concatenate([encoded[i].input_ids for i in batch])
        hidden, mask = padded_lookup(store, ids, [len(encoded[i].input_ids) for i in batch], [domain] * len(batch),
                                     device)
        hidden = split.layers(hidden, mask, k, num_lower)
        for row, i in enumerate(batch):
            out[i] = hidden[row, : len(encoded[i].input_ids)].cpu()
    return out


def base_lower_states(encoder: nn.Module, encoded: Sequence[Any], base: str, num_lower: int, domain: str = "",
                      plot_store: Any = None, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """What the base feeds the first adapted layer: computed lower layers, or PLOT lookups on a PLOT
    base (its catalogue table unless `plot_store` is given). A domain needs a PLOT base."""
    if base not in PLOT_BASES:
        if domain:
            raise ValueError(f"domain {domain!r}: domains are PLOT overlays; base {base!r} has no PLOT "
                             f"(choose {', '.join(sorted(PLOT_BASES))})")
        return lower_states(encoder, encoded, num_lower, device=device)
    from academus.shared.models.plot.table import PlotError
    from academus.shared.runtime.config import artifacts_dir
    from academus.shared.training.plot_models import open_plot_base

    try:
        store = plot_store or open_plot_base(artifacts_dir(), base)
        return plot_lower_states(store, encoder, encoded, num_lower, domain, device=device)
    except PlotError as e:  # no table, an unknown domain, a text the table cannot represent
        raise ValueError(str(e)) from e


def upper_pooled(encoder: nn.Module, states: Sequence[torch.Tensor], num_lower: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The served pooled output of the layers from num_lower on, for cached lower states (the active adapters
    of the calling thread apply through the hooks)."""
    split = SplitEncoder.of(encoder)
    lengths = [s.shape[0] for s in states]
    hidden = nn.utils.rnn.pad_sequence(list(states), batch_first=True).to(device)
    mask = (torch.arange(hidden.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
    return split.pool(split.layers(hidden, mask, num_lower), mask)


def check_base(base: str) -> dict[str, Any]:
    """A base tenant adapters can sit on: a bundled one ({}), or a user's embedding model (its catalogue entry)."""
    if base in ADAPTER_BASES:
        return {}
    from academus.shared.runtime.config import artifacts_dir

    entry = read_catalogue(artifacts_dir()).get(base, {})
    if "source" not in entry or entry.get("kind") != EMBEDDING:
        raise ValueError(f"unknown adapter base {base!r}: tenant models sit on {', '.join(sorted(ADAPTER_BASES))} "
                         "or on an embedding model added with `academus models add`")
    return entry


def open_base(base: str, device: str | torch.device = "cpu", encoder: TeacherEncoder | None = None,
              tokenizer: TeacherTokenizer | None = None) -> tuple[TeacherEncoder, TeacherTokenizer]:
    """The encoder and tokenizer tenant adapters on `base` train on, the base checked: those given are kept (a shared
    encoder), the rest opened, the bundled teacher's for a bundled base, else the user's model's (its files checked
    against their manifest)."""
    source = encoder_base(base)
    return encoder or source.encoder(device), tokenizer or source.tokenizer()


def encoder_base(base: str) -> EncoderBase:
    """The encoder tenant adapters on `base` sit on, the base checked: the bundled teacher for a bundled base."""
    from academus.shared.runtime.config import artifacts_dir

    entry = check_base(base)
    return EncoderBase.of_entry(base, artifacts_dir(), entry) if entry else EncoderBase.bundled()


def encoder_shape(encoder: nn.Module) -> tuple[int, int]:
    """(layers, hidden size) of an encoder, as an adapter on it records its base's."""
    body = getattr(encoder, "body", encoder)
    return len(body.encoder.layer), int(body.config.hidden_size)


# --- training ----------------------------------------------------------------------------------

def _split(n: int, validation_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(n * validation_fraction))
    if n - n_val < 2:
        raise ValueError(f"{n} examples are too few to hold out {n_val} for validation and still train")
    return order[n_val:], order[:n_val]


def _batches(indices: list[int], lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar lengths (sorted within pools of 8 batches): far less padding."""
    order = list(indices)
    rng.shuffle(order)
    pool = 8 * batch_size
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start:start + pool], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _evaluate(encoder: nn.Module, adapter: AdapterWeights, states: list[torch.Tensor], gold: torch.Tensor,
              num_lower: int, batch_size: int, device: torch.device | str) -> dict[str, float]:
    order = sorted(range(len(states)), key=lambda i: states[i].shape[0])   # little padding
    pred = torch.empty(len(states), dtype=torch.long)
    injector = install_adapters(encoder)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            stack = BatchedAdapters([adapter] * len(rows), batched=False, device=device)
            with injector.active(stack):
                logits = stack.logits(upper_pooled(encoder, [states[i] for i in rows], num_lower, device))
            pred[rows] = logits.argmax(1).cpu()
    return classification_metrics(pred, gold, len(adapter.labels))


def _step(encoder: nn.Module, adapter: AdapterWeights, states: list[torch.Tensor], gold: torch.Tensor,
          num_lower: int, optimizer: torch.optim.Optimizer, device: torch.device | str) -> float:
    stack = BatchedAdapters([adapter] * len(states), batched=False, device=device)
    with install_adapters(encoder).active(stack):
        logits = stack.logits(upper_pooled(encoder, states, num_lower, device))
    loss = F.cross_entropy(logits, gold.to(logits.device))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def train_adapter(
    texts: Sequence[str], labels: Sequence[str], base: str = "minilm", rank: int = DEFAULT_RANK,
    epochs: int = 8, *, layers: Sequence[int] | None = None, label_names: Sequence[str] | None = None,
    lr: float = 2e-3, head_lr: float = 2e-2, weight_decay: float = 0.01, batch_size: int = 32,
    validation_fraction: float = 0.1, seed: int = 0, encoder: TeacherEncoder | None = None,
    tokenizer: TeacherTokenizer | None = None, device: str | torch.device = "cpu", progress: bool = True,
    on_step: Callable[[int, int], None] | None = None, domain: str = "", plot_store: Any = None,
) -> tuple[AdapterWeights, dict[str, Any]]:
    """Trains a tenant adapter + head on (texts, labels) with the backbone frozen.

    A seeded `validation_fraction` of the examples is held out; the summary has its accuracy and
    macro F1 before (random head) and after training, the per-epoch history and the seconds spent.
    `label_names` fixes the label order (default: sorted). A shared `encoder` may be passed; its
    weights are not changed and its requires_grad flags are restored. `on_step(done, total)` is called after
    each optimizer step (a job's progress; raising from it stops training). On a PLOT base the texts
    are looked up in the table (its `domain` overlay first) instead of running the lower layers."""
    started = time.perf_counter()
    names = list(label_names) if label_names is not None else sorted(set(labels))
    _check_examples(texts, labels, names)
    encoder, tokenizer = open_base(base, device, encoder, tokenizer)
    adapter = AdapterWeights.init(names, base, rank, layers, seed, shape=encoder_shape(encoder))
    num_lower = min(adapter.layer_ids)
    loaded = time.perf_counter()

    # Layers below the first adapter are frozen and see no adapter: their outputs are fixed, so computed once.
    states = base_lower_states(encoder, tokenizer.encode(list(texts), truncate=True), base, num_lower, domain,
                               plot_store, device)
    cached = time.perf_counter()
    gold = torch.tensor([names.index(label) for label in labels])
    train, val = _split(len(texts), validation_fraction, seed)
    summary: dict[str, Any] = {"base": base, "domain": domain, "rank": rank, "layers": list(adapter.layer_ids),
                               "labels": names, "counts": {"train": len(train), "validation": len(val)},
                               "epochs": epochs, "parameters": sum(t.numel() for t in adapter.tensors())}
    trained = _fit(encoder, adapter, states, gold, train, val, num_lower, summary,
                   dict(lr=lr, head_lr=head_lr, weight_decay=weight_decay, batch_size=batch_size, seed=seed,
                        epochs=epochs, device=device, progress=progress, on_step=on_step))
    done = time.perf_counter()
    summary["seconds"] = {"load": round(loaded - started, 2), "cache_lower_layers": round(cached - loaded, 2),
                          "train": round(done - cached, 2), "total": round(done - started, 2)}
    return trained, summary


def _check_examples(texts: Sequence[str], labels: Sequence[str], names: list[str]) -> None:
    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts but {len(labels)} labels")
    if len(set(names)) < 2 or len(set(names)) != len(names):
        raise ValueError(f"needs at least 2 distinct labels, got {names}")
    unknown = sorted(set(labels) - set(names))
    if unknown:
        raise ValueError(f"labels {unknown} are not among label_names {names}")


def _fit(encoder: nn.Module, adapter: AdapterWeights, states: list[torch.Tensor], gold: torch.Tensor,
         train: list[int], val: list[int], num_lower: int, summary: dict[str, Any], opts: dict[str, Any]
         ) -> AdapterWeights:
    """AdamW with a linearly decaying rate; returns the epoch with the best validation macro F1."""
    device = opts["device"]
    frozen = {p: p.requires_grad for p in encoder.parameters()}
    for p in frozen:
        p.requires_grad_(False)
    adapter = _copy(adapter, lambda t: t.detach().to(device).clone().requires_grad_())
    head = [adapter.head_weight, adapter.head_bias]
    body = [t for t in adapter.tensors() if all(t is not h for h in head)]
    optimizer = torch.optim.AdamW([{"params": body, "lr": opts["lr"]}, {"params": head, "lr": opts["head_lr"]}],
                                  weight_decay=opts["weight_decay"])
    steps = max(1, opts["epochs"] * -(-len(train) // opts["batch_size"]))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    val_states, val_gold = [states[i] for i in val], gold[val]

    def evaluate() -> dict[str, float]:
        return _evaluate(encoder, adapter, val_states, val_gold, num_lower, 64, device)

    try:
        encoder.eval()
        summary["untrained_validation"] = best_scores = evaluate()
        best, best_epoch, history = _copy(adapter, _plain), 0, []
        rng, lengths = random.Random(opts["seed"]), [s.shape[0] for s in states]
        with tqdm(total=steps, desc="adapter", unit="step", file=sys.stderr, leave=False,
                  disable=not opts["progress"]) as bar:
            for epoch in range(1, opts["epochs"] + 1):
                losses = []
                for batch in _batches(train, lengths, opts["batch_size"], rng):
                    losses.append(_step(encoder, adapter, [states[i] for i in batch], gold[batch], num_lower,
                                        optimizer, device))
                    schedule.step()
                    bar.update(1)
                    if opts["on_step"] is not None:
                        opts["on_step"](bar.n, steps)
                    bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}")
                scores = evaluate()
                history.append({"epoch": epoch, "loss": round(sum(losses) / len(losses), 4), **scores})
                if epoch == 1 or scores["f1"] > best_scores["f1"]:
                    best, best_scores, best_epoch = _copy(adapter, _plain), scores, epoch
    finally:
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    summary["history"] = history
    summary["best_epoch"] = best_epoch
    summary["validation"] = {k: best_scores[k] for k in ("accuracy", "f1")}
    best.validate()
    return best


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone()


def _copy(adapter: AdapterWeights, convert: Callable[[torch.Tensor], torch.Tensor]) -> AdapterWeights:
    assert adapter.head_weight is not None and adapter.head_bias is not None
    return replace(adapter, labels=list(adapter.labels),
                   layers={i: {k: convert(v) for k, v in w.items()} for i, w in adapter.layers.items()},
                   head_weight=convert(adapter.head_weight), head_bias=convert(adapter.head_bias))


# --- many tenants at once (the scale benchmark's bootstrap adapters, HMI §7.1) -------------------

def train_many_adapters(
    texts: Sequence[str], labels: Sequence[str], subsets: Sequence[Sequence[int]], base: str = "minilm",
    rank: int = DEFAULT_RANK, epochs: int = 2, *, lr: float = 2e-3, head_lr: float = 2e-2, batch_size: int = 128,
    seed: int = 0, encoder: TeacherEncoder | None = None, tokenizer: TeacherTokenizer | None = None,
    progress: bool = True, start: AdapterWeights | None = None,
) -> list[AdapterWeights]:
    """Adapter k trains on `subsets[k]` (indices into texts/labels, e.g. a bootstrap sample). Batches
    mix tenants, each row through its own tenant's adapter and head (the serving `BatchedAdapters`),
    so K adapters cost one pass over Σ|subset| rows, not K trainings; lower layers are computed once
    per distinct text. Adam skips adapters a batch did not touch (their gradients stay None). With
    `start`, every adapter begins as a copy of it (e.g. one trained on all the data) and is fine-tuned
    on its own subset; without, from a fresh seeded init."""
    names = sorted(set(labels))
    _check_examples(texts, labels, names)
    encoder, tokenizer = open_base(base, encoder=encoder, tokenizer=tokenizer)
    shape = encoder_shape(encoder)
    used = sorted({i for subset in subsets for i in subset})
    cached = base_lower_states(encoder, tokenizer.encode([texts[i] for i in used], truncate=True), base,
                               min(upper_layers(shape[0])))
    states = dict(zip(used, cached, strict=True))
    gold = {i: names.index(labels[i]) for i in used}
    if start is not None and list(start.labels) != names:
        raise ValueError(f"start adapter labels {start.labels} differ from the data's {names}")
    adapters = [_copy(start or AdapterWeights.init(names, base, rank, seed=seed + k, shape=shape),
                      lambda t: t.detach().clone().requires_grad_()) for k in range(len(subsets))]
    heads = [t for a in adapters for t in (a.head_weight, a.head_bias)]
    body = [t for a in adapters for w in a.layers.values() for t in w.values()]
    optimizer = torch.optim.Adam([{"params": body, "lr": lr}, {"params": heads, "lr": head_lr}])
    rng = random.Random(seed)
    frozen = {p: p.requires_grad for p in encoder.parameters()}
    for p in frozen:
        p.requires_grad_(False)
    try:
        encoder.eval()
        with tqdm(total=epochs * len(subsets), desc=f"{len(subsets)} adapters", unit="adapter", file=sys.stderr,
                  leave=False, disable=not progress) as bar:
            for _ in range(epochs):
                for batch in _tenant_batches(subsets, batch_size, rng):
                    _many_step(encoder, adapters, batch, states, gold, optimizer)
                    bar.update(len({k for k, _ in batch}))
    finally:
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    return [_copy(a, _plain) for a in adapters]


def _tenant_batches(subsets: Sequence[Sequence[int]], batch_size: int,
                    rng: random.Random) -> list[list[tuple[int, int]]]:
    """Batches of (tenant, example) rows holding whole tenants' subsets, tenants in a shuffled order:
    few distinct adapters a batch keeps the per-batch stacking (and Adam's touched set) small."""
    order = list(range(len(subsets)))
    rng.shuffle(order)
    batches, current = [], []
    for k in order:
        rows = [(k, i) for i in subsets[k]]
        rng.shuffle(rows)
        if current and len(current) + len(rows) > batch_size:
            batches.append(current)
            current = []
        current.extend(rows)
    return [*batches, current] if current else batches


def _many_step(encoder: nn.Module, adapters: list[AdapterWeights], rows: list[tuple[int, int]],
               states: dict[int, torch.Tensor], gold: dict[int, int], optimizer: torch.optim.Optimizer) -> None:
    stack = BatchedAdapters([adapters[k] for k, _ in rows])
    num_lower = min(adapters[0].layer_ids)
    with install_adapters(encoder).active(stack):
        logits = stack.logits(upper_pooled(encoder, [states[i] for _, i in rows], num_lower))
    loss = F.cross_entropy(logits, torch.tensor([gold[i] for _, i in rows]))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
