"""The worker's host memory tier (HMI §6.2): whole adapters kept in host memory answer the device
cache's pieces without a store call; misses are fetched whole and together; the budget holds (LRU on
use, warming never evicts); version 0 is never kept; the warmer loads exactly the served READY models
of the worker's bases, read from a real Redis."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from academus.services.worker.adapters import AdapterCache, AdapterKey
from academus.services.worker.core import OUTPUT_PROBS
from academus.services.worker.host_tier import HostAdapters, HostWarmer
from academus.shared.models.adapters import AdapterWeights
from academus.shared.models.work import Batch
from academus.shared.runtime.errors import NotFound, ResourceExhausted
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import FAILED, TenantModel, TenantRegistry
from tests.unit.test_worker_adapters import TEXTS, cache_counts, direct, runner, tokens, trained_like  # noqa: F401

LABELS = ["neg", "pos"]


class WholeStore:
    """Stands in for the store's GetMany: the real file bytes (whole with layers=()), an error for an
    unknown key; records each call."""

    def __init__(self, adapters: dict[AdapterKey, AdapterWeights]) -> None:
        self.adapters, self.calls = adapters, []

    def __call__(self, pieces):
        self.calls.append([(key, tuple(layers), head) for key, layers, head in pieces])
        return [self.adapters[key].to_bytes([i for i in layers if i in self.adapters[key].layers] or None, head)
                if key in self.adapters else NotFound(f"adapter {key} not found") for key, layers, head in pieces]


def adapters(count: int) -> dict[AdapterKey, AdapterWeights]:
    return {(f"t{k}", "m", 1): trained_like(k, LABELS) for k in range(count)}


def test_pieces_come_from_host_memory_once_the_whole_adapter_is_there():
    stored = adapters(2)
    store = WholeStore(stored)
    host = HostAdapters(store, budget_bytes=1 << 30)
    key = ("t0", "m", 1)
    hits, misses = cache_counts("adapter_host")
    first = host(key, [3], True)
    later = host(key, [5], False)
    assert store.calls == [[(key, (), True)]]                      # one whole-file fetch, then none
    assert set(first.layers) == {3} and first.head_weight is not None and first.layer_ids == (3, 4, 5)
    assert set(later.layers) == {5} and later.head_weight is None
    assert (later.layers[5]["up.weight"] == stored[key].layers[5]["up.weight"]).all()
    assert host.stats()["host_hits"] == 1 and host.stats()["host_misses"] == 1
    assert cache_counts("adapter_host") == (hits + 1, misses + 1)


def test_a_batchs_misses_are_fetched_whole_in_calls_of_batch_and_one_missing_fails_alone():
    store = WholeStore(adapters(5))
    host = HostAdapters(store, budget_bytes=1 << 30, batch=2)
    keys = [(f"t{k}", "m", 1) for k in range(5)] + [("nobody", "m", 1)]
    results = host.many([(key, [3], True) for key in keys])
    assert [len(call) for call in store.calls] == [2, 2, 2]
    assert all(isinstance(r, AdapterWeights) for r in results[:5]) and isinstance(results[5], NotFound)
    assert host.stats()["host_adapters"] == 5


def test_a_failed_call_for_several_adapters_is_retried_one_by_one():
    """A GetMany of several whole files can exceed one message's limit (adapters of up to 8 MB)."""
    store = WholeStore(adapters(3))

    def one_at_a_time(pieces):
        if len(pieces) > 1:
            raise ResourceExhausted("received message larger than max")
        return store(pieces)

    host = HostAdapters(one_at_a_time, budget_bytes=1 << 30)
    results = host.many([(key, [3], True) for key in store.adapters] + [(("nobody", "m", 1), [3], True)])
    assert all(isinstance(r, AdapterWeights) for r in results[:3]) and isinstance(results[3], NotFound)
    assert [len(call) for call in store.calls] == [1, 1, 1, 1]


def test_version_zero_is_fetched_each_time_never_kept():
    store = WholeStore({("t0", "m", 0): trained_like(0, LABELS)})
    host = HostAdapters(store, budget_bytes=1 << 30)
    host(("t0", "m", 0), [3], True)
    host(("t0", "m", 0), [4], False)
    assert len(store.calls) == 2 and host.stats()["host_adapters"] == 0


def test_use_evicts_the_least_recently_used_past_the_budget_but_warming_never_evicts():
    stored = adapters(4)
    one = next(iter(stored.values())).nbytes
    host = HostAdapters(WholeStore(stored), budget_bytes=int(2.5 * one))
    assert host.warm(stored) == 2                                   # room for two; the others are not loaded
    assert ("t0", "m", 1) in host and ("t2", "m", 1) not in host
    host(("t0", "m", 1), [3], True)                                 # t0 is now the most recent
    host(("t2", "m", 1), [3], True)                                 # a use makes room: t1 goes
    assert [k in host for k in stored] == [True, False, True, False]
    assert host.bytes <= host.budget and host.stats()["host_warmed"] == 2


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_device_cache_over_the_host_tier_serves_exactly_the_direct_application(runner, prefetch):  # noqa: F811
    """Two adapters warmed (a CPU miss takes them at once, no fetch thread), one fetched on first use
    through the host tier (whole, then resident)."""
    stored = adapters(3)
    store = WholeStore(stored)
    host = HostAdapters(store, budget_bytes=1 << 30)
    keys = list(stored)
    host.warm(keys[:2])
    cache = AdapterCache(host, budget_bytes=1 << 30, prefetch=prefetch)
    ids, lengths = tokens(TEXTS)
    batch = asyncio.run(cache.acquire(keys))
    assert [e.complete.done() for e in batch.entries[:2]] == [True, True]
    served = runner.run(Batch("minilm", OUTPUT_PROBS, ids, lengths), tenants=batch).values
    _, want = direct(runner, [stored[k] for k in keys])
    assert np.abs(served - want).max() < 1e-5
    assert store.calls[1:] == [[(keys[2], (), True)]]               # after the warm-up: the third, whole, once
    stats = cache.stats()
    assert stats["misses"] == 3 and stats["host_hits"] == 2 + 2 and stats["host_misses"] == 1
    assert stats["bytes"] == sum(a.nbytes for a in stored.values()) and keys[2] in host
    cache.close()


async def test_served_adapters_are_the_ready_models_of_the_workers_bases(redis):
    keys = Keys("hosttier")
    registry = TenantRegistry(redis, keys)
    for tenant in ("acme", "globex", "initech"):
        await registry.create_tenant(tenant)
    await registry.register_model("acme", TenantModel("support", "minilm", "support-ad", 2, LABELS))
    await registry.register_model("globex", TenantModel("spam", "minilm-plot", "spam", 1, LABELS))
    await registry.register_model("initech", TenantModel("x", "minilm", "x", 1, LABELS, status=FAILED))
    assert await registry.served_adapters({"minilm"}) == [("acme", "support-ad", 2)]
    assert sorted(await registry.served_adapters({"minilm", "minilm-plot"})) == [
        ("acme", "support-ad", 2), ("globex", "spam", 1)]


async def test_the_warmer_loads_served_models_not_yet_resident_and_rereads_only_after_a_change(redis):
    keys = Keys("warmer")
    registry = TenantRegistry(redis, keys)
    stored = adapters(4)
    for tenant, name, version in list(stored)[:3]:
        await registry.create_tenant(tenant)
        await registry.register_model(tenant, TenantModel(name, "minilm", name, version, LABELS))
    store = WholeStore({})                                          # the store lost its files: nothing loads
    host = HostAdapters(store, budget_bytes=1 << 30)
    warmer = HostWarmer(host, registry, ["minilm"], interval_s=0.05)
    assert await warmer.once() == 0 and store.calls
    store.adapters = stored                                         # back: the next round tries again
    assert await warmer.once() == 3 and all(k in host for k in list(stored)[:3])
    calls = len(store.calls)
    assert await warmer.once() == 0 and len(store.calls) == calls   # nothing changed: nothing fetched
    await registry.create_tenant("t3")
    await registry.register_model("t3", TenantModel("m", "minilm", "m", 1, LABELS))
    assert await warmer.once() == 1 and ("t3", "m", 1) in host
