"""`minilm-plot` (and `<model>-plot` on a user's embedding model): the hierarchical model of HMI §3.3 — PLOT
lookups for layers 1..K, the model's own layers K+1..N on the looked-up states, then its own pooling (mean and L2
normalisation for the teacher) (+ an optional head).

Use it in-process (`HierarchicalEncoder(store, encoder).pool(input_ids, domain)`) or over the plot
service (`.pool_states(states, lengths)` with the states a Lookup RPC returned). `PlotEncoder` wraps it
as the module a worker serves: padded (ids, mask, types) in, pooled embeddings out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from academus.shared.models.model import TeacherEncoder
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.plot.store import PlotStore
from academus.shared.models.plot.table import TableError
from academus.shared.models.work import PlotStates


class HierarchicalEncoder:
    """Upper layers of the encoder the table was built on, over PLOT states; `pool` gives the sentence embedding
    as the encoder pools it."""

    def __init__(self, store: PlotStore, encoder: TeacherEncoder, head: nn.Module | None = None) -> None:
        self.split = SplitBert(encoder, store.lower_layers)
        if store.hidden != self.split.hidden:
            raise TableError(f"the PLOT table holds {store.hidden}-wide states; the model is {self.split.hidden} wide")
        self.store = store
        self.head = head
        self.device = next(encoder.parameters()).device

    @property
    def lower_layers(self) -> int:
        return self.store.lower_layers

    def current_store(self) -> PlotStore:
        """The table as built now (PlotStore.current): a root rebuilt while serving is served from the next
        lookup on."""
        self.store = self.store.current()
        return self.store

    def pool(self, input_ids: Sequence[Sequence[int]], domain: str = "") -> torch.Tensor:
        """(B, hidden) embeddings of token id lists framed as the model's tokenizer frames them."""
        lengths = np.fromiter((len(s) for s in input_ids), dtype=np.int64, count=len(input_ids))
        flat = np.fromiter((t for s in input_ids for t in s), dtype=np.int64, count=int(lengths.sum()))
        lookup = self.current_store().lookup(flat, lengths, domain)
        return self.pool_states(lookup.states, lookup.lengths)

    def logits(self, input_ids: Sequence[Sequence[int]], domain: str = "") -> torch.Tensor:
        if self.head is None:
            raise ValueError("this hierarchical encoder has no head")
        with torch.inference_mode():
            return self.head(self.pool(input_ids, domain))

    @torch.inference_mode()
    def pool_states(self, states: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """Layer-K states of sequences back to back -> pooled embeddings."""
        return self.pool_padded(*pad_states(states, lengths, self.device))

    @torch.inference_mode()
    def pool_padded(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Padded layer-K states -> the upper layers -> pooled embeddings."""
        return self.split.pool(self.split.run_upper(hidden, mask), mask)


def padded_lookup(store: PlotStore, ids: np.ndarray, lengths: np.ndarray, domains: Sequence[str],
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Padded layer-K states of sequences given back to back, row b looked up in overlay domains[b]
    (tenants of many domains share a batch): one vectorised lookup per distinct domain."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(domains) != len(lengths):
        raise ValueError(f"{len(domains)} domains for {len(lengths)} sequences")
    distinct = list(dict.fromkeys(domains))
    for domain in distinct:
        store.load_domain(domain)   # an overlay built since the table was opened serves at once
    if len(distinct) == 1:
        return pad_states(store.lookup(ids, lengths, distinct[0]).states, lengths, device)
    states = np.empty((int(lengths.sum()), store.hidden), dtype=np.float32)
    token_row = np.repeat(np.arange(len(lengths)), lengths)
    row_domain = np.asarray(domains, dtype=object)
    for domain in distinct:
        rows = row_domain == domain
        tokens = rows[token_row]
        states[tokens] = store.lookup(np.asarray(ids)[tokens], lengths[rows], domain).states
    return pad_states(states, lengths, device)


def pad_states(states: np.ndarray, lengths: np.ndarray, device: torch.device | str = "cpu"
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, hidden) flat states -> (B, longest, hidden) right-padded, and the (B, longest) attention mask."""
    lengths = np.asarray(lengths, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    cols = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    longest = int(lengths.max()) if len(lengths) else 0
    padded = torch.zeros(len(lengths), longest, states.shape[1], dtype=torch.float32)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    padded[rows, cols] = torch.as_tensor(np.asarray(states, dtype=np.float32))
    mask[rows, cols] = 1
    return padded.to(device), mask.to(device)


class PlotEncoder(nn.Module):
    """A HierarchicalEncoder with the encoder's calling convention, for the worker's ServedModel.

    The encoder's body is a submodule (`body.encoder.layer.N`), so the worker's per-layer deadline hooks see the
    upper layers it runs; the lower ones are never called."""

    def __init__(self, hierarchical: HierarchicalEncoder, encoder: TeacherEncoder, domain: str = "") -> None:
        super().__init__()
        self.body = encoder.body
        self.normalize = encoder.normalize   # as the encoder it runs: its output is L2-normalised or not
        self.pooling = encoder.pooling
        self.hierarchical = hierarchical
        self.domain = domain

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, domains: Sequence[str] | None = None,
                states: PlotStates | None = None) -> torch.Tensor:
        """Pooled embeddings; `domains` (one a row) overrides the entry's overlay: tenant models on
        this base bring their own domain. `states` were looked up already: only the upper layers run."""
        if token_type_ids is not None and bool(token_type_ids.any()):
            raise ValueError("token_type_ids: a PLOT model takes single texts (its table holds segment-0 states)")
        store = self.hierarchical.current_store()
        if states is not None:
            states.check(store)
            return self.hierarchical.pool_states(states.states, states.lengths)
        mask = attention_mask.bool().cpu()
        lengths = mask.sum(1).numpy()
        flat = input_ids.cpu()[mask].numpy()   # row-major: each sequence's real tokens, back to back
        hidden, padded_mask = padded_lookup(store, flat, lengths,
                                            domains or [self.domain] * len(lengths), self.hierarchical.device)
        return self.hierarchical.pool_padded(hidden, padded_mask)
