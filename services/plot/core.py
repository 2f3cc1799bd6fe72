"""Plot service core: batch lookups over one PlotStore, with the request limits; no gRPC here."""

from __future__ import annotations

import numpy as np
from prometheus_client import Counter

from academus.shared.models.plot.store import InvalidTokens, Lookup, PlotStore
from academus.shared.runtime.config import PlotConfig

WINDOWS = Counter("academus_plot_windows_total", "Trigram windows looked up, by the level that answered",
                  ["level"])


class PlotLookup:
    """Answers lookups from the version tree on disk (the tables are memory-mapped, read-only)."""

    def __init__(self, store: PlotStore, max_tokens: int, load_new: bool = True) -> None:
        self.store = store
        self.max_tokens = max_tokens
        self.load_new = load_new   # overlays built after the start serve without a restart

    @classmethod
    def open(cls, config: PlotConfig) -> PlotLookup:
        store = PlotStore.open(config.table_dir, model=config.model, lower_layers=config.lower_layers,
                               domains=config.domain_list, verify=bool(config.verify))
        return cls(store, config.max_tokens, load_new=config.domain_list is None)

    def refresh_domains(self) -> list[str]:
        """Serves the table as it is on disk now: a rebuilt root (PlotStore.current), and the overlays built,
        rebuilt or deleted since the last call (unless ACADEMUS_DOMAINS fixed the set); returns every served
        domain. Each heartbeat calls it, so a service with no lookups lets an old root's mapping go too."""
        store = self.store = self.store.current()
        return store.sync_domains() if self.load_new else sorted(store.domains)

    def lookup(self, ids: np.ndarray, lengths: np.ndarray, domain: str = "") -> Lookup:
        if len(ids) > self.max_tokens:
            raise InvalidTokens(f"batch.input_ids holds {len(ids)} tokens; the limit is {self.max_tokens}")
        if not len(lengths):
            raise InvalidTokens("batch.lengths is empty: no sequence to look up")
        store = self.store = self.store.current()   # one store for the whole lookup, rebuilt root or not
        if self.load_new:
            store.load_domain(domain)
        result = store.lookup(ids, lengths, domain)
        for level in ("domain", "root", "backoff"):
            WINDOWS.labels(level).inc(getattr(result.counts, level))
        return result
