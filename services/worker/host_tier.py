"""HMI §6.2's host memory tier: served tenants' adapters kept whole and parsed in host memory (pinned on
a GPU worker), so that a miss of the device cache (`AdapterCache`) is a copy, not a store fetch.

The paper keeps every adapter in host memory and swaps only into GPU memory; the adapter store here
is a separate service, so a worker fills its host tier from it: a missing adapter is fetched whole on
first use (one GetMany for a batch's misses), and `warm` loads the served tenant models ahead of their
first request (`HostWarmer`, every `ACADEMUS_ADAPTER_WARM_S`). The tier answers the device cache's
piece requests as the store does (`__call__` / `many`), slicing pieces out of the resident adapter.
Past its budget it drops the least recently used; warming never evicts."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from academus.services.worker.adapters import AdapterKey, FetchMany
from academus.shared.models.adapters import AdapterWeights
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.metrics import CACHE_HITS, CACHE_MISSES
from academus.shared.state.tenants import TenantRegistry

HITS, MISSES = CACHE_HITS.labels("adapter_host"), CACHE_MISSES.labels("adapter_host")   # the host tier's lookups


class HostAdapters:
    """Whole adapters in host memory within `budget_bytes` (LRU); a `FetchPiece` with `many` for the
    device cache. Version 0 ("the latest") is never kept: the latest may change under it."""

    def __init__(self, store_many: FetchMany, budget_bytes: int, pin: bool = False, batch: int = 16) -> None:
        self.store_many, self.budget, self.pin, self.batch = store_many, budget_bytes, pin, max(1, batch)
        self._resident: OrderedDict[AdapterKey, tuple[AdapterWeights, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = self.warmed = 0

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {"host_adapters": len(self._resident), "host_bytes": self.bytes, "host_hits": self.hits,
                    "host_misses": self.misses, "host_warmed": self.warmed}

    def __contains__(self, key: AdapterKey) -> bool:
        with self._lock:
            return key in self._resident

    def resident(self, key: AdapterKey) -> AdapterWeights | None:
        """The whole adapter if it is here (a hit), else None (nothing fetched, no miss counted)."""
        with self._lock:
            found = self._resident.get(key)
            if found is None:
                return None
            self._resident.move_to_end(key)
            self.hits += 1
            HITS.inc()
            return found[0]

    def __call__(self, key: AdapterKey, layers: Sequence[int], head: bool) -> AdapterWeights:
        result = self.many([(key, layers, head)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def many(self, pieces: Sequence[tuple[AdapterKey, Sequence[int], bool]]) -> list[AdapterWeights | Exception]:
        """Each piece sliced from its resident adapter; the missing ones fetched whole first, together."""
        found = self._lookup({key for key, _, _ in pieces})
        missing = [key for key in dict.fromkeys(key for key, _, _ in pieces) if key not in found]
        found.update(self._load(missing, evict=True))
        return [whole if isinstance(whole := found[key], Exception) else whole.piece(layers, head)
                for key, layers, head in pieces]

    def warm(self, keys: Iterable[AdapterKey]) -> int:
        """Loads the keys not yet resident while the budget has room (it evicts nothing); returns how
        many were loaded."""
        keys = [k for k in dict.fromkeys(keys) if k[2] > 0 and k not in self]
        loaded = 0
        for start in range(0, len(keys), self.batch):
            if self.bytes >= self.budget:
                break
            chunk = keys[start:start + self.batch]
            self._load(chunk, evict=False)
            loaded += sum(key in self for key in chunk)
        with self._lock:
            self.warmed += loaded
        return loaded

    def _lookup(self, keys: set[AdapterKey]) -> dict[AdapterKey, AdapterWeights | Exception]:
        with self._lock:
            found = {}
            for key in keys:
                if key in self._resident:
                    self._resident.move_to_end(key)
                    found[key] = self._resident[key][0]
            self.hits += len(found)
            self.misses += len(keys) - len(found)
            HITS.inc(len(found))
            MISSES.inc(len(keys) - len(found))
            return found

    def _load(self, keys: Sequence[AdapterKey], evict: bool) -> dict[AdapterKey, AdapterWeights | Exception]:
        """Whole adapters from the store (layers=(): the whole file), in calls of `batch`; kept if they fit."""
        out: dict[AdapterKey, AdapterWeights | Exception] = {}
        for start in range(0, len(keys), self.batch):
            chunk = keys[start:start + self.batch]
            results = self._fetch(chunk)
            if len(chunk) > 1 and all(isinstance(r, Exception) for r in results):
                results = [self._fetch([key])[0] for key in chunk]  # e.g. large files past one message's limit
            for key, result in zip(chunk, results, strict=True):
                out[key] = result if isinstance(result, Exception) else self._parse(key, result, evict)
        return out

    def _fetch(self, keys: Sequence[AdapterKey]) -> list:
        """Whole files (layers=()) in one store call; a failed call is each key's error."""
        try:
            return self.store_many([(key, (), True) for key in keys])
        except Exception as e:
            return [e] * len(keys)

    def _parse(self, key: AdapterKey, data: bytes, evict: bool) -> AdapterWeights | Exception:
        try:
            weights = AdapterWeights.from_bytes(data)
        except ValueError as e:
            return e
        if self.pin:  # pinned: the device cache's copies run asynchronously on its copy stream
            weights = weights.pinned()
        if key[2] > 0:
            self._keep(key, weights, weights.nbytes, evict)
        return weights

    def _keep(self, key: AdapterKey, weights: AdapterWeights, size: int, evict: bool) -> None:
        with self._lock:
            if key in self._resident or (not evict and self.bytes + size > self.budget):
                return
            self._resident[key] = (weights, size)
            self.bytes += size
            while evict and self.bytes > self.budget and len(self._resident) > 1:
                _, (_, dropped) = self._resident.popitem(last=False)
                self.bytes -= dropped


class HostWarmer:
    """Every `interval_s`, loads the served tenant models of this worker's bases into the host tier
    (on a thread: the store calls block), so a tenant's first request finds its adapter in host memory."""

    def __init__(self, host: HostAdapters, registry: TenantRegistry, bases: Sequence[str], interval_s: float) -> None:
        self.host, self.registry, self.bases, self.interval_s = host, registry, set(bases), interval_s
        self._loaded_at: int | None = None   # tenant_models_changed when everything served was last loaded

    async def run(self) -> None:
        while self.interval_s > 0:
            try:
                await self.once()
            except Exception as e:  # Redis or the store away: try again next round
                log_event("adapter_warm_failed", logging.WARNING, error=repr(e))
            await asyncio.sleep(self.interval_s)

    async def once(self) -> int:
        """Loads what is missing; a round is one GET while no tenant model changed since the last full
        load (reading 10,000 tenants' models costs the event loop ~0.1 s)."""
        changed = await self.registry.models_changed()
        if changed == self._loaded_at:
            return 0
        served = await self.registry.served_adapters(self.bases)
        keys = [key for key in served if key not in self.host]
        loaded = await asyncio.to_thread(self.host.warm, keys) if keys else 0
        if loaded == len(keys) or self.host.bytes >= self.host.budget:  # else (store away) try again next round
            self._loaded_at = changed
        return loaded
