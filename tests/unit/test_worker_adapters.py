"""The worker's adapter cache (HMI §6.2) and tenant batches on the real teacher: layer-wise fetches,
LRU within the budget, prefetch on and off give the same answers as applying the adapters directly."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from academus.loadgen.probes.adapters_bench import perturbed_adapter
from academus.services.worker.adapters import AdapterCache, AdapterKey
from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.shared.models.adapters import AdapterWeights, encode_with_adapters
from academus.shared.models.model import pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch
from academus.shared.runtime.errors import InvalidArgument, NotFound
from tests.conftest import artifacts_path, sample

TEXTS = ["a warm, funny and wholly unexpected film", "a dull mess", "the plot never quite lands"]


def trained_like(seed: int, labels: list[str]) -> AdapterWeights:
    return perturbed_adapter(labels, seed)


class Store:
    """Stands in for the store's Get on the prefetch thread: the real file format, sliced per layer,
    as the adapter store slices it; records every piece asked for."""

    def __init__(self, adapters: dict[AdapterKey, AdapterWeights], gate: threading.Event | None = None) -> None:
        self.adapters, self.gate, self.calls = adapters, gate, []

    def __call__(self, key: AdapterKey, layers, head: bool) -> bytes:
        self.calls.append((key, tuple(layers), head))
        if key not in self.adapters:
            raise NotFound(f"adapter {key} not found")
        if self.gate is not None and not head:
            self.gate.wait(5)  # later layers held back: the batch must wait for them in the hook
        adapter = self.adapters[key]
        return adapter.to_bytes([i for i in layers if i in adapter.layers], head=head)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(artifacts_path(), ["minilm"])


def tokens(texts: list[str]) -> tuple[list[int], list[int]]:
    encoded = TeacherTokenizer(teacher_dir()).encode(texts)
    return [i for e in encoded for i in e.input_ids], [len(e.input_ids) for e in encoded]


def direct(runner: ModelRunner, adapters: list[AdapterWeights | None]) -> tuple[np.ndarray, np.ndarray | None]:
    encoded = TeacherTokenizer(teacher_dir()).encode(TEXTS)
    ids, mask, types = pad_batch([e.input_ids for e in encoded])
    with torch.inference_mode():
        pooled, probs = encode_with_adapters(runner.models["minilm"].encoder, ids, mask, types, adapters)
    return pooled.numpy(), None if probs is None else probs.numpy()


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_tenant_batch_through_the_cache_equals_the_adapters_applied_directly(runner, prefetch):
    a, b = trained_like(1, ["neg", "pos"]), trained_like(2, ["x", "y", "z"])
    store = Store({("t1", "m", 1): a, ("t2", "m", 3): b})
    cache = AdapterCache(store, budget_bytes=1 << 30, prefetch=prefetch)
    keys = [("t1", "m", 1), ("t2", "m", 3), ("t1", "m", 1)]
    ids, lengths = tokens(TEXTS)
    tenants = asyncio.run(cache.acquire(keys))
    served = runner.run(Batch("minilm", OUTPUT_PROBS, ids, lengths), tenants=tenants).values
    _, expected = direct(runner, [a, b, a])
    assert served.shape == (3, 3) and np.abs(served - expected).max() < 1e-5
    assert served[0, 2] == 0.0 and abs(served[1].sum() - 1) < 1e-5   # 2-label rows zero-padded
    layer_calls = [c for c in store.calls if c[0] == ("t1", "m", 1)]
    assert layer_calls[0][1:] == ((3,), True)                      # head + first layer, then layer by layer
    assert sorted(c[1:] for c in layer_calls[1:]) == [((4,), False), ((5,), False)]
    assert cache.stats()["misses"] == 2 and cache.stats()["hits"] == 0
    cache.close()


def test_rows_without_an_adapter_get_the_plain_embedding(runner):
    a = trained_like(3, ["neg", "pos"])
    cache = AdapterCache(Store({("t1", "m", 1): a}), budget_bytes=1 << 30)
    ids, lengths = tokens(TEXTS)
    tenants = asyncio.run(cache.acquire([None, ("t1", "m", 1), None]))
    served = runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths), tenants=tenants).values
    plain = runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths)).values
    adapted, _ = direct(runner, [None, a, None])
    assert np.abs(served[[0, 2]] - plain[[0, 2]]).max() < 1e-6
    assert np.abs(served[1] - adapted[1]).max() < 1e-5 and np.abs(served[1] - plain[1]).max() > 1e-3
    with pytest.raises(InvalidArgument, match="output=label needs an adapter"):
        runner.run(Batch("minilm", OUTPUT_PROBS, ids, lengths), tenants=tenants)
    cache.close()


def test_later_layers_stream_in_while_the_batch_computes(runner):
    """The first piece is fetched before computing; layers 4 and 5 are held back until the batch
    runs, and the layer hooks wait for them instead of computing without them."""
    gate = threading.Event()
    a = trained_like(4, ["neg", "pos"])
    cache = AdapterCache(Store({("t1", "m", 1): a}, gate), budget_bytes=1 << 30)
    ids, lengths = tokens(TEXTS)
    tenants = asyncio.run(cache.acquire([("t1", "m", 1)] * 3))
    assert not tenants.entries[0].complete.done()       # acquire returned with layers still to come
    threading.Timer(0.2, gate.set).start()
    served = runner.run(Batch("minilm", OUTPUT_PROBS, ids, lengths), tenants=tenants).values
    _, expected = direct(runner, [a, a, a])
    assert np.abs(served - expected).max() < 1e-5
    cache.close()


def cache_counts(cache: str) -> tuple[float, float]:
    return sample("academus_cache_hits_total", cache=cache), sample("academus_cache_misses_total", cache=cache)


def test_the_cache_evicts_the_least_recently_used_beyond_its_budget_and_counts_hits(runner):
    adapters = {("t", f"m{i}", 1): trained_like(i, ["a", "b"]) for i in range(3)}
    one = sum(t.numel() * 4 for t in adapters[("t", "m0", 1)].tensors())
    cache = AdapterCache(Store(adapters), budget_bytes=int(2.5 * one))
    hits, misses = cache_counts("adapter")
    for key in [("t", "m0", 1), ("t", "m1", 1), ("t", "m0", 1), ("t", "m2", 1)]:
        asyncio.run(cache.acquire([key], None))
        cache._entries[key].complete.result(5)
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 3
    assert cache_counts("adapter") == (hits + 1, misses + 3)   # and so on /metrics
    assert set(cache._entries) == {("t", "m0", 1), ("t", "m2", 1)}     # m1 was least recently used
    assert cache.bytes == 2 * one                                      # the running total, after an eviction
    cache.forget(("t", "m0", 1))
    assert cache.bytes == one and cache.stats()["adapters"] == 1
    cache.close()


def test_an_adapter_missing_from_the_store_is_not_found_and_not_cached(runner):
    cache = AdapterCache(Store({}), budget_bytes=1 << 30)
    with pytest.raises(NotFound):
        asyncio.run(cache.acquire([("t9", "gone", 1)]))
    assert cache.stats()["adapters"] == 0 and cache.bytes == 0
    cache.close()


def test_misses_are_fetched_in_layer_order_across_adapters(runner):
    """Every missing adapter's first piece comes before any later layer, and layer 4 of all before
    layer 5: the batch's next layer is the one arriving (HMI §6.2)."""
    adapters = {("t", f"m{i}", 1): trained_like(20 + i, ["a", "b"]) for i in range(3)}
    hold = threading.Event()

    class Held(Store):
        def __call__(self, key, layers, head):
            hold.wait(5)   # the first fetch waits until every miss of the batch is queued
            return super().__call__(key, layers, head)

    store = Held(adapters)
    cache = AdapterCache(store, budget_bytes=1 << 30, fetch_threads=1)
    threading.Timer(0.2, hold.set).start()
    tenants = asyncio.run(cache.acquire(list(adapters)))
    for entry in tenants.entries:
        entry.complete.result(5)
    order = [(layers, head) for _, layers, head in store.calls]
    assert order == [((3,), True)] * 3 + [((4,), False)] * 3 + [((5,), False)] * 3
    cache.close()


def test_the_misses_of_a_batch_come_in_one_store_call_a_layer_and_a_missing_one_fails_alone(runner):
    """With a store that answers many pieces at once, a batch's first pieces travel in one call, then
    each later layer of all of them in one call; an adapter the store lacks fails alone."""
    adapters = {("t", f"m{i}", 1): trained_like(30 + i, ["a", "b"]) for i in range(3)}

    class Many(Store):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.batches: list[list[tuple]] = []

        def many(self, pieces):
            self.batches.append([(key, tuple(layers), head) for key, layers, head in pieces])
            out = []
            for piece in pieces:
                try:
                    out.append(self(*piece))
                except NotFound as e:
                    out.append(e)
            return out

    store = Many(adapters)
    cache = AdapterCache(store, budget_bytes=1 << 30, fetch_threads=1)
    gone = ("t", "gone", 1)
    with pytest.raises(NotFound):
        asyncio.run(cache.acquire([*adapters, gone]))
    tenants = asyncio.run(cache.acquire(list(adapters)))   # the three that exist are cached or arriving
    for entry in tenants.entries:
        entry.complete.result(5)
    shapes = [[(layers, head) for _, layers, head in batch] for batch in store.batches]
    assert shapes == [[((3,), True)] * 4, [((4,), False)] * 3, [((5,), False)] * 3]
    assert [key for key, _, _ in store.batches[0]] == [*adapters, gone]
    assert cache.stats()["adapters"] == 3
    cache.close()
    many = {("t", f"n{i}", 1): trained_like(40 + i, ["a", "b"]) for i in range(5)}
    store = Many(many)
    cache = AdapterCache(store, budget_bytes=1 << 30, fetch_threads=1, fetch_batch=2)   # calls stay within 2
    for entry in asyncio.run(cache.acquire(list(many))).entries:
        entry.complete.result(5)
    assert [len(batch) for batch in store.batches[:3]] == [2, 2, 1] and max(map(len, store.batches)) == 2
    cache.close()
