"""The worker's tenant adapters (HMI §6.2): an LRU cache within a byte budget (GPU memory on a GPU
worker), misses fetched from the adapter store layer by layer.

A miss costs one blocking fetch of the first piece (the head and the lowest adapted layer; its header
carries the metadata the batch needs); the remaining layers stream in on the prefetch threads while the
batch computes the lower, unadapted layers (the pieces of one rank, e.g. layer 5 of every miss of a
batch, in one GetMany), and the hook of adapted layer i waits only for layer i
(`TenantBatch.layer_ready`). With prefetch off, a miss waits for every layer before computing: the
ablation of HMI Table 6. On a GPU worker the pieces are copied from pinned memory on a CUDA stream of their
own, and a layer's hook makes the compute stream wait for that layer's copy event (the GPU waits, not the
CPU); on CPU the prefetch threads alone overlap the fetches with compute.

The fetch source is the worker's host tier (`host_tier.HostAdapters`: every served adapter in host
memory) or, without one, the store itself; on a CPU worker a miss resident in the host tier is taken at
once, with no fetch."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import redis
import torch

from academus.shared.models.adapters import BUNDLED_BASES, AdapterWeights, upper_layers
from academus.shared.runtime.errors import DeadlineExceeded, ServingError, Unavailable, from_rpc_error, from_status
from academus.shared.runtime.metrics import CACHE_HITS, CACHE_MISSES
from academus.shared.runtime.serving import CHANNEL_OPTIONS
from academus.shared.runtime.tls import mesh_channel_sync, mesh_generation
from academus.shared.state.keys import Keys
from academus.v1 import adapter_store_pb2, adapter_store_pb2_grpc, tensors_pb2

DEFAULT_FIRST_LAYER = upper_layers(BUNDLED_BASES["minilm"][0])[0]   # where adapters start by default (layer 3)
FIRST_PIECE, LAST = -1, 1 << 30               # fetch queue ranks: first pieces before any layer
AdapterKey = tuple[str, str, int]            # tenant, name, version (0: the latest when first fetched)
# (key, layers, head) -> that piece: safetensors bytes (the store) or parsed (the host tier); raises
# NotFound / Unavailable.
FetchPiece = Callable[[AdapterKey, Sequence[int], bool], "bytes | AdapterWeights"]
FetchMany = Callable[[Sequence[tuple[AdapterKey, Sequence[int], bool]]], list]  # -> a piece or the error, each
HITS, MISSES = CACHE_HITS.labels("adapter"), CACHE_MISSES.labels("adapter")   # the device cache's lookups


def _one(fetch: FetchPiece, piece: tuple[AdapterKey, Sequence[int], bool]) -> bytes | AdapterWeights | Exception:
    """A fetcher without `many`: one call a piece, its error as its answer."""
    try:
        return fetch(*piece)
    except Exception as e:
        return e


@dataclass
class CachedAdapter:
    """One adapter as it arrives: `weights` exists after the first piece; `ready[i]` is set once layer
    i is in `weights.layers` (dict assignment is atomic, so the compute thread may read as it fills)."""

    key: AdapterKey
    first: Future = field(default_factory=Future)
    complete: Future = field(default_factory=Future)
    weights: AdapterWeights | None = None
    ready: dict[int, threading.Event] = field(default_factory=dict)
    copies: dict[int, tuple[Any, list[torch.Tensor]]] = field(default_factory=dict)  # GPU: layer -> copy event
    error: ServingError | None = None
    bytes: int = 0

    def wait_layer(self, i: int, deadline: float | None) -> None:
        event = self.ready.get(i)
        if event is None:
            return  # the adapter has no layer i
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not event.wait(timeout):
            raise DeadlineExceeded(f"adapter {self.key[0]}/{self.key[1]} layer {i} did not arrive before the "
                                   "deadline")
        if self.error is not None:
            raise self.error
        if i in self.copies:  # GPU: the compute stream waits for the copy stream, not the CPU
            copied, tensors = self.copies[i]
            stream = torch.cuda.current_stream()
            stream.wait_event(copied)
            for t in tensors:  # the allocator must not reuse them while this stream still reads them
                t.record_stream(stream)


@dataclass(frozen=True)
class Piece:
    """One queued fetch: layer `layer` of an adapter, with its head and header when `first`."""

    entry: CachedAdapter
    layer: int
    first: bool


@dataclass(frozen=True)
class TenantBatch:
    """A batch's per-row adapters (None: the base model) and the wait the layer hooks run first."""

    weights: list[AdapterWeights | None]
    entries: list[CachedAdapter]
    deadline: float | None = None
    batched: bool = True          # False: each tenant's adapter applied separately (the ablation)
    domains: tuple[str, ...] = ()  # each row's PLOT overlay (a PLOT base); empty: the root for all

    def row_domains(self, rows: int) -> list[str]:
        return list(self.domains) if self.domains else [""] * rows

    def layer_ready(self, i: int) -> None:
        for entry in self.entries:
            entry.wait_layer(i, self.deadline)


class AdapterCache:
    """LRU of adapters within `budget_bytes`; misses go to the store on the prefetch threads.

    Fetches run in layer order across adapters (a priority queue): every missing adapter's first piece
    before any later layer, then layer 5 of all of them before layer 6, so the batch's next layer is
    always the one arriving, as HMI §6.2's layer-wise prefetch."""

    def __init__(self, fetch: FetchPiece, budget_bytes: int, device: torch.device | str = "cpu",
                 prefetch: bool = True, batched: bool = True, first_layer: int = DEFAULT_FIRST_LAYER,
                 fetch_threads: int = 2, fetch_batch: int = 32) -> None:
        self.fetch, self.budget, self.device = fetch, budget_bytes, torch.device(device)
        # Pieces of one rank (the batch's misses at one layer) travel together: one store call for all;
        # fetch_batch=1 is one Get a piece, as before GetMany (the ablation).
        many = getattr(fetch, "many", None) if fetch_batch > 1 else None
        self.fetch_many: FetchMany = many or (lambda pieces: [_one(fetch, p) for p in pieces])
        self.fetch_batch = max(1, fetch_batch)
        self.first_layer = first_layer
        self.prefetch, self.batched = prefetch, batched
        # HMI §6.2: on a GPU the pieces are copied on their own CUDA stream, overlapping the batch's compute.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # On a CPU worker an adapter in the host tier is already where compute reads it: a miss takes it
        # at once, with no fetch thread (on a GPU it must still be copied, layer by layer).
        self._resident = getattr(fetch, "resident", None) if self.copy_stream is None else None
        self._entries: OrderedDict[AdapterKey, CachedAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.PriorityQueue[tuple[int, int, tuple[Piece, ...] | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._fetcher, name=f"adapter-prefetch-{i}", daemon=True)
                         for i in range(max(1, fetch_threads))]
        for thread in self._threads:
            thread.start()
        self.hits = self.misses = self._bytes = 0   # _bytes: the entries' total, kept as pieces come and go

    @property
    def bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, float]:
        """This cache's figures, and its source's (the host tier's) where it has any."""
        total = self.hits + self.misses
        source = getattr(self.fetch, "stats", None)
        return {"adapters": len(self._entries), "bytes": self.bytes, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / total if total else 0.0, **(source() if source else {})}

    async def acquire(self, keys: Sequence[AdapterKey | None], deadline: float | None = None,
                      first_layer: int | None = None) -> TenantBatch:
        """Each row's adapter, fetched first where missing; returns once every first piece is here
        (every piece, with prefetch off). `first_layer`: the base's lowest adapted layer by default (a base
        deeper than the teacher's), fetched with the head."""
        entries: dict[AdapterKey, CachedAdapter] = {}
        missed: list[CachedAdapter] = []
        for key in keys:
            if key is not None and key not in entries:
                entries[key] = self._entry(key, missed)
        missed = [entry for entry in missed if not self._from_host(entry)]
        if missed:  # one queue item: their first pieces come in one store call
            self._queue.put((FIRST_PIECE, next(self._order),
                             tuple(Piece(entry, first_layer if first_layer is not None else self.first_layer,
                                         first=True) for entry in missed)))
        waits = [e.first if self.prefetch else e.complete for e in entries.values()]
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(w) for w in waits)), timeout)
        except TimeoutError as e:
            raise DeadlineExceeded("the batch's adapters did not arrive from the adapter store before the "
                                   "deadline") from e
        weights = [None if key is None else entries[key].weights for key in keys]
        return TenantBatch(weights, list(entries.values()), deadline, self.batched)

    def _entry(self, key: AdapterKey, missed: list[CachedAdapter]) -> CachedAdapter:
        """The cached adapter, or a new entry appended to `missed` (the caller queues its first piece)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.error is None:
                self._entries.move_to_end(key)
                self.hits += 1
                HITS.inc()
                return entry
            self.misses += 1
            MISSES.inc()
            if entry is not None:  # failed, not yet dropped by its fetch thread
                self._drop(key)
            entry = CachedAdapter(key)
            self._entries[key] = entry
        missed.append(entry)
        return entry

    def _from_host(self, entry: CachedAdapter) -> bool:
        """Completes a CPU miss from the host tier when the adapter is resident there: its first piece
        is the whole adapter, so nothing is left to queue."""
        whole = self._resident(entry.key) if self._resident else None
        if whole is not None:
            self._first_arrived(entry, whole, None)
        return whole is not None

    def _fetcher(self) -> None:
        while (item := self._queue.get())[2] is not None:
            pieces = self._same_rank(item)
            for start in range(0, len(pieces), self.fetch_batch):  # a call stays within the store's limit
                self._fetch(pieces[start:start + self.fetch_batch])

    def _same_rank(self, item: tuple[int, int, tuple[Piece, ...] | None]) -> list[Piece]:
        """The popped pieces and those queued behind them at their rank (other adapters' same layer)."""
        pieces = list(item[2])
        while len(pieces) < self.fetch_batch:
            try:
                following = self._queue.get_nowait()
            except queue.Empty:
                break
            if following[2] is None or following[0] != item[0]:
                self._queue.put(following)  # a later layer, or the stop mark: back where it was
                break
            pieces.extend(following[2])
        return pieces

    def _fetch(self, pieces: list[Piece]) -> None:
        """One store call for the pieces; each adapter whose piece failed fails alone."""
        pieces = [p for p in pieces if p.entry.error is None]
        if not pieces:
            return
        try:
            results = self.fetch_many([(p.entry.key, [p.layer], p.first) for p in pieces])
        except Exception as e:  # the store is unreachable: every one of them failed
            results = [e] * len(pieces)
        for piece, result in zip(pieces, results, strict=True):
            entry = piece.entry
            try:
                if isinstance(result, Exception):
                    raise result
                parsed = result if isinstance(result, AdapterWeights) else AdapterWeights.from_bytes(result)
                weights, copied = self._on_device(parsed)
                (self._first_arrived if piece.first else self._layer_arrived)(entry, weights, copied)
            except ServingError as e:
                self._fail(entry, e)
            except Exception as e:  # a bad file or a broken connection: this adapter fails, others go on
                self._fail(entry, Unavailable(f"adapter {entry.key[0]}/{entry.key[1]} could not be loaded: {e}"))

    def _first_arrived(self, entry: CachedAdapter, first: AdapterWeights, copied: Any) -> None:
        """The head + the lowest adapted layer of the default placement (its header names every layer
        the adapter has); then each other layer is queued at its layer's rank."""
        if copied is not None:  # the batch waits for the first piece anyway: finish its copy on this thread
            copied.synchronize()
        entry.ready = {i: threading.Event() for i in first.layer_ids}
        entry.weights = replace(first, layers={})
        self._arrived(entry, first)
        entry.first.set_result(entry)
        rest = sorted(set(first.layer_ids) - set(first.layers))
        for i in rest:
            self._queue.put((i, next(self._order), (Piece(entry, i, first=False),)))
        if not rest:
            self._completed(entry)

    def _layer_arrived(self, entry: CachedAdapter, piece: AdapterWeights, copied: Any) -> None:
        self._arrived(entry, piece, copied)
        if all(event.is_set() for event in entry.ready.values()):
            self._completed(entry)

    def _completed(self, entry: CachedAdapter) -> None:
        if not entry.complete.done():
            entry.complete.set_result(entry)
        self._evict()

    def _on_device(self, piece: AdapterWeights) -> tuple[AdapterWeights, Any]:
        """A piece (a layer it lacks is simply absent) on this worker's device, and on a GPU the event
        that marks the end of its copy on the copy stream (None on CPU)."""
        if self.copy_stream is None:
            return piece.to(self.device), None
        with torch.cuda.stream(self.copy_stream):
            moved = piece.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy_stream)
        return moved, copied

    def _arrived(self, entry: CachedAdapter, piece: AdapterWeights, copied: Any = None) -> None:
        with self._lock:  # two fetch threads may bring layers of one adapter at once
            before = entry.bytes
            self._add(entry, piece, copied)
            if self._entries.get(entry.key) is entry:  # one forgotten meanwhile no longer counts
                self._bytes += entry.bytes - before

    @staticmethod
    def _add(entry: CachedAdapter, piece: AdapterWeights, copied: Any = None) -> None:
        if copied is not None:  # a later layer, still copying: its hook makes the compute stream wait
            for i, tensors in piece.layers.items():
                entry.copies[i] = (copied, list(tensors.values()))
        for i, tensors in piece.layers.items():
            entry.weights.layers[i] = tensors
            entry.ready[i].set()
        entry.bytes += piece.nbytes

    def _fail(self, entry: CachedAdapter, error: ServingError) -> None:
        entry.error = error
        with self._lock:
            if self._entries.get(entry.key) is entry:
                self._drop(entry.key)
        for event in entry.ready.values():
            event.set()                     # waiting hooks wake up and raise the error
        for future in (entry.first, entry.complete):
            if not future.done():
                future.set_exception(error)

    def _evict(self) -> None:
        """Least recently used complete adapters go until the cache fits its budget; a batch still
        holding one keeps its tensors alive until it finishes."""
        with self._lock:
            while self.bytes > self.budget and len(self._entries) > 1:
                key = next(iter(self._entries))
                if not self._entries[key].complete.done():
                    break
                self._drop(key)

    def forget(self, key: AdapterKey) -> None:
        with self._lock:
            if key in self._entries:
                self._drop(key)

    def _drop(self, key: AdapterKey) -> None:
        """Removes an entry (the caller holds the lock)."""
        self._bytes -= self._entries.pop(key).bytes

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put((LAST, next(self._order), None))


STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def get_request(key: AdapterKey, layers: Sequence[int], head: bool) -> adapter_store_pb2.GetAdapterRequest:
    return adapter_store_pb2.GetAdapterRequest(
        ref=tensors_pb2.AdapterRef(tenant=key[0], name=key[1], version=key[2]), layers=layers, head=head)


class StoreFetcher:
    """`FetchPiece` over gRPC to the adapter store, its address from config or from Redis (the store
    announces it with a heartbeat TTL). Runs on the prefetch thread, so it uses blocking clients."""

    def __init__(self, redis_url: str, keys: Keys, address: str = "", timeout_s: float = 5.0,
                 redis_password: str = "") -> None:
        self.redis = redis.Redis.from_url(redis_url, password=redis_password or None)
        self.keys, self.fixed, self.timeout_s = keys, address, timeout_s
        # (address, the process's mesh identity) -> stub: a rotated identity opens a new channel
        self._stubs: dict[tuple[str, int], adapter_store_pb2_grpc.AdapterStoreStub] = {}
        self._address = address   # the store's address as last read from Redis: one read, not one a fetch

    def _stub(self) -> adapter_store_pb2_grpc.AdapterStoreStub:
        if not self._address:
            self._address = (self.redis.get(self.keys.adapter_store()) or b"").decode()
        if not self._address:
            raise Unavailable("no adapter store is running (its address is not in Redis)")
        key = (self._address, mesh_generation())
        if key not in self._stubs:   # channels of an identity the process no longer has are let go
            self._stubs = {known: stub for known, stub in self._stubs.items() if known[1] == key[1]}
            channel = mesh_channel_sync(self._address, CHANNEL_OPTIONS)
            self._stubs[key] = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        return self._stubs[key]

    def __call__(self, key: AdapterKey, layers: Sequence[int], head: bool) -> bytes:
        return self._rpc("Get", get_request(key, layers, head)).weights

    def many(self, pieces: Sequence[tuple[AdapterKey, Sequence[int], bool]]) -> list[bytes | ServingError]:
        """Several pieces in one GetMany; each answers its bytes or its own error."""
        reply = self._rpc("GetMany", adapter_store_pb2.GetManyRequest(gets=[get_request(*p) for p in pieces]))
        return [item.adapter.weights if not item.code else from_status(STATUS_CODES[item.code], item.error)
                for item in reply.items]

    def _rpc(self, method: str, request):
        try:
            return getattr(self._stub(), method)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # the store moved or restarted: read its address again
                self._address = self.fixed
            raise from_rpc_error(e, "adapter store") from e

    def close(self) -> None:
        self.redis.close()
