"""Submodel execution (STI §5.5): a loader reads the plan's shards layer by layer while the compute thread runs
each layer as soon as its shards are in. The deadline is checked between layers.

The loader also checks and decodes each shard. The paper decodes on the compute side (C with OpenMP on a
phone, where decoding is small next to a layer); on a server CPU decoding a MiniLM layer costs about as much
as running it on one text, so here it overlaps the compute instead of adding to it, and the planner counts
it in each shard's load time. It decodes in C (`shard_native.py`). A C thread of the library's own puts the whole
plan and never takes the GIL that the compute thread needs between its torch ops (`NativeLoads`): from a mapped
source (`file`) it takes the shards where they lie; through a cold page cache (`cold`, in `shard_io.py`) it reads
them itself, asking the disk ahead. For `throttled:<MB/s>`, whose reads the bandwidth paces in Python, or where no
library was built, a Python loader thread reads each layer and puts it in one C call (`ThreadLoads`), the
`throttled` device reading up to a layer ahead (`FileSource.read_in_order`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from academus.shared.models.architectures import family_module, read_architecture
from academus.shared.models.model import MEAN, ClassifierHead, body_inputs, padded_positions, pool
from academus.shared.models.shard_io import FileSource, address
from academus.shared.models.shard_native import NATIVE, BadShard, BuiltLoad, LoaderThread, PlanLoads
from academus.shared.models.shard_store import RELATIVE_BIAS, ShardStore
from academus.shared.models.shards import (
    LayerBuilder,
    LayerResident,
    LayerWeights,
    ShardGeometry,
    ShardWeights,
    elastic_layer,
    key_mask,
    relative_bias,
)
from academus.shared.models.sti_planner import Pace, Plan
from academus.shared.state.artifacts import ArtifactError

# The working buffer: the layer computing and the one loading. Two buffers reused in turn stay in the cores' caches;
# a whole 6x12 plan decoded ahead into fresh ones (42 MB) ran 1.04-1.09x slower beside the C loader
# (docs/benchmarks/sti.md).
LOOKAHEAD_LAYERS = 2


class DeadlineMissed(Exception):
    """The deadline passed between two layers."""


class ElasticModel(nn.Module):
    """The resident part of a sharded model for one task: position and type embeddings, each layer's biases and
    norms, and the task's head a submodel shape. Word embeddings are read by row from the store; layers run on
    whatever shards a plan supplies."""

    def __init__(self, store: ShardStore, task: str,
                 heads: dict[tuple[int, int], ClassifierHead] | None = None, labels: Sequence[str] = ()) -> None:
        super().__init__()
        from transformers import AutoConfig

        if store.rows is None:
            raise ArtifactError(f"{store.directory}: no word-embedding rows (built before they were stored by "
                                f"row); rebuild it with `academus shard build`")
        self.store, self.task, self.rows = store, task, store.rows
        self.source = FileSource()           # for runs outside a pipeline, which reads through its own
        settings = store.model_settings
        self.architecture = read_architecture(settings, str(store.directory))
        self.pooling = store.manifest.extra.get("pooling", MEAN)
        self.normalize = bool(store.manifest.extra.get("normalize", True))
        self.embeddings = self._embeddings(AutoConfig.for_model(**settings))
        self.residents = [store.layer_resident(k) for k in range(store.geometry.layers)]
        self.relative = (relative_bias(settings, store.geometry.heads, store.resident[RELATIVE_BIAS])
                         if self.architecture.family.relative_attention else None)
        self.heads: dict[tuple[int, int], ClassifierHead] = heads if heads is not None else store.heads(task)
        self.labels = list(labels) or (store.tasks[task].labels if task in store.tasks else [])

    def _embeddings(self, config: object) -> nn.Module:
        """The family's embedding layer without its word embeddings (read by row from the store)."""
        with torch.device("meta"):          # no random initialisation of tables about to be replaced
            embeddings = family_module(self.architecture.family, "Embeddings")(config)
        embeddings.word_embeddings = None
        embeddings = embeddings.to_empty(device="cpu").eval()
        for name, buffer in embeddings.named_buffers():    # index buffers: rebuilt, not loaded
            if name == "position_ids":
                buffer.copy_(torch.arange(buffer.shape[-1]).expand_as(buffer))
            else:
                buffer.zero_()
        missing, unexpected = embeddings.load_state_dict(self.store.embeddings_state(), strict=False, assign=True)
        if unexpected or any(not name.endswith("_ids") for name in missing):   # buffers are rebuilt
            raise ArtifactError(f"{self.store.directory}: embeddings missing {missing}, unexpected {unexpected}")
        return embeddings

    def position_bias(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[B, heads, T, T] for MPNet, computed once a batch for every layer; None for BERT and RoBERTa."""
        return None if self.relative is None else self.relative.compute_position_bias(hidden)

    def embed(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        return self.embed_rows(self.rows.read(ids, self.source), types)

    def embed_rows(self, rows: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        """The embedding layer's output from the batch's word-embedding rows, positions numbered as the family
        numbers them."""
        positions = padded_positions(self.architecture, rows[..., 0])
        return self.embeddings(inputs_embeds=rows, **body_inputs(self.architecture, types, positions))

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The encoder's pooling, as its served embeddings are pooled (the heads read this)."""
        return pool(hidden, mask, self.pooling, self.normalize)

    def assemble(self, layer: int, shards: Sequence[int], weights: Sequence[ShardWeights]) -> LayerWeights:
        return LayerWeights.assemble(shards, weights, self.residents[layer], self.store.geometry)

    def assemble_plan(self, plan: Plan, bank: dict[tuple[int, int, int], ShardWeights]) -> list[LayerWeights]:
        """The plan's layers from decoded shards at hand (`bank[(layer, shard, bits)]`)."""
        return [self.assemble(k, shards, [bank[(k, s, plan.bits[(k, s)])] for s in shards])
                for k, shards in enumerate(plan.shards)]

    def layer(self, hidden: torch.Tensor, mask: torch.Tensor, layer: int, weights: LayerWeights,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """One layer on the shards at hand. `bias`: `position_bias` of the batch (computed here when not given)."""
        if bias is None:
            bias = self.position_bias(hidden)
        return elastic_layer(hidden, key_mask(mask), self.residents[layer], weights, self.store.geometry, bias)

    def finish(self, hidden: torch.Tensor, mask: torch.Tensor, depth: int, width: int) -> torch.Tensor:
        """The shape's head on the pooled output: [B, C] probabilities."""
        return torch.softmax(self.heads[(depth, width)](self.pool(hidden, mask)), dim=-1)

    def close(self) -> None:
        self.source.close()

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, mask: torch.Tensor, layers: Sequence[LayerWeights],
            types: torch.Tensor | None = None) -> torch.Tensor:
        """A submodel whose layers are at hand (PreloadModel, or an evaluation) on a padded batch: [B, C]
        probabilities."""
        hidden = self.embed(ids, mask, types)
        return self.run_from(hidden, mask, layers, 0, self.position_bias(hidden))

    @torch.inference_mode()
    def run_from(self, hidden: torch.Tensor, mask: torch.Tensor, layers: Sequence[LayerWeights], start: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
        """The rest of a submodel from the states entering layer `start`: [B, C] probabilities."""
        for k in range(start, len(layers)):
            hidden = self.layer(hidden, mask, k, layers[k], bias)
        return self.finish(hidden, mask, len(layers), layers[0].width)


@dataclass(frozen=True)
class RunResult:
    probs: torch.Tensor
    total_ms: float
    io_ms: float          # the loader's busy time (reads, checks, decoding) and the embedding rows' reads
    stall_ms: float       # the compute waiting for shards and embedding rows
    compute_ms: float
    depth: int = 0        # the layers that ran: the plan's, or fewer where a pace cut it short
    rest_ms: float = 0.0  # outside its layers and the waits for their shards: rows, embedding, the loads' set-up
    finish_ms: float = 0.0   # of which after the last layer: pooling, head, the loads' end


@dataclass(frozen=True)
class PublishedLayer:
    """A layer's load built into one buffer (`built`), the shards ((shard, version) each) in the order the thread
    takes them, the weights it fills, and what it reads from (`kept`: file mappings, held shards). Later runs of the
    same shards at the same versions publish it again: building it took a cold 6x9 run 0.19 ms
    (docs/benchmarks/sti.md)."""

    built: BuiltLoad
    versions: list[tuple[int, int]]
    weights: LayerWeights
    kept: list[bytes | memoryview]


# Layers' loads kept at most: a worker's plans, each from its own deadline, use a few dozen (layer, shards) sets
PUBLISHED_KEPT = 512

LayerKey = tuple[int, tuple[tuple[int, int], ...]]   # a layer and its shards at their versions, in the plan's order


@dataclass
class LoaderBuffers:
    """What the C loader's thread writes into, kept from run to run (making them anew took a run 80 us, and more
    beside the loads): the layer buffers of the last width it loaded, and the bytes of the layer it reads (sized for
    the store's largest layer once; only the pages a read touches are resident). With them, the thread itself and,
    for each buffer, the layers' loads built into it from the held shards `held`."""

    layers: list[LayerBuilder] = field(default_factory=list)
    published: list[dict[LayerKey, PublishedLayer]] = field(default_factory=list)   # one a buffer
    staging: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    thread: LoaderThread | None = None
    held: dict[tuple[int, int, int], bytes] | None = None

    def staging_for(self, size: int) -> np.ndarray:
        if self.staging.nbytes < size:
            self.staging = np.empty(size, np.uint8)
        return self.staging

    def loader_thread(self) -> LoaderThread:
        """The kept thread; a new one in a forked child, which has the loader but not its thread."""
        if self.thread is None or self.thread.pid != os.getpid():
            self.thread = LoaderThread()
        return self.thread

    def layer_buffer(self, slot: int, shards: Sequence[int], resident: LayerResident,
                     geometry: ShardGeometry) -> tuple[LayerBuilder, dict[LayerKey, PublishedLayer]]:
        """Buffer `slot` for a layer of these shards, and the loads built into it: the one there where its width is
        theirs, else a new one with none."""
        if slot == len(self.layers) or len(self.layers[slot].shards) != len(shards):
            self.layers[slot:slot + 1] = [LayerBuilder(shards, resident, geometry)]
            self.published[slot:slot + 1] = [{}]
        return self.layers[slot], self.published[slot]

    def keep_for(self, held: dict[tuple[int, int, int], bytes], slots: int) -> None:
        """A run's held shards and its buffers' count: the loads built from other held shards forgotten, and the
        buffers beyond `slots` with theirs."""
        if held is not self.held or sum(map(len, self.published)) > PUBLISHED_KEPT:
            self.published = [{} for _ in self.layers]
            self.held = held
        del self.layers[slots:], self.published[slots:]

    def close(self) -> None:
        self.published.clear()
        if self.thread is not None:
            self.thread.close()


class ShardPipeline:
    """Runs plans through one IO source: a loader thread and the calling (compute) thread. The preload buffer
    holds stored shard bytes, counted at their stored size."""

    def __init__(self, model: ElasticModel, source: FileSource, lookahead: int = LOOKAHEAD_LAYERS) -> None:
        """`lookahead`: decoded layers the loader may hold ahead of the compute (0: no bound)."""
        self.model, self.store, self.source = model, model.store, source
        self.lookahead = lookahead
        self.preloaded: dict[tuple[int, int, int], bytes] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sti-loader")
        self._running = threading.Lock()          # one run at a time: the C loader's buffers serve run after run
        self._buffers = LoaderBuffers()

    def preload(self, plan: Plan) -> int:
        """Holds the plan's preload set (a buffer filled for it); returns the buffer's bytes."""
        return self.hold({x: plan.bits[x] for x in plan.preload})

    def hold(self, shards: dict[tuple[int, int], int]) -> int:
        """Holds these shards (layer, shard) -> version as stored, replacing the buffer; returns its bytes.
        Shards already held at that version are kept, not read again."""
        held = {}
        for (k, s), b in sorted(shards.items()):
            key = (k, s, b)
            if key in self.preloaded:
                held[key] = self.preloaded[key]
                continue
            held[key] = self.store.read_stored(k, s, b)
        self.preloaded = held
        return self.resident_bytes()

    def resident_bytes(self) -> int:
        return sum(len(b) for b in self.preloaded.values())

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._buffers.close()
        self.source.close()
        self.model.close()

    def _start(self, plan: Plan) -> ThreadLoads | NativeLoads:
        """The plan's loads, begun: by the C loader's own thread where the library was built and the source maps its
        files or lets the thread read them, else by a Python loader thread (a throttled device, or NumPy decoding)."""
        window = self.lookahead if plan.overlap else 0   # Load&Exec loads the whole submodel first
        if _c_thread_loads(self.source):
            return NativeLoads(self.model, plan, self.preloaded, self.source, window, self._buffers)
        return ThreadLoads(self._loader, self.model, plan, self.preloaded, self.source, window)

    @staticmethod
    def _cut(pace: Pace | None, layer: int, started: float, compute_s: float) -> bool:
        """Whether the pace stops the run before `layer` (`compute_s`: its layers' time so far)."""
        if pace is None:
            return False
        seen_ms = compute_s * 1e3 / layer if layer else 0.0
        return pace.stops_before(layer, (time.perf_counter() - started) * 1e3, seen_ms)

    @torch.inference_mode()
    def run(self, plan: Plan, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None = None,
            deadline: float | None = None, pace: Pace | None = None) -> RunResult:
        """One request through the pipeline. `deadline`: a time.perf_counter() instant, checked between layers.
        `pace`: when a run behind its target answers from fewer layers."""
        with self._running:
            return self._run(plan, ids, mask, types, deadline, pace)

    def _run(self, plan: Plan, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None,
             deadline: float | None, pace: Pace | None) -> RunResult:
        self.source.before_run(self.store.paths())
        started = time.perf_counter()
        if self.source.ahead_layers:     # a source that asks the disk ahead: the rows first, the shards behind them
            self.model.rows.prefetch(ids, self.source)
        loads = self._start(plan)
        compute, depth = 0.0, plan.depth
        try:
            began = time.perf_counter()
            rows = self.model.rows.read(ids, self.source)   # the compute waits for them: IO and stall alike
            rows_s = time.perf_counter() - began
            waits = 0.0                        # for the layers' shards
            hidden = self.model.embed_rows(rows, types)
            bias = self.model.position_bias(hidden)
            if not plan.overlap:               # Load&Exec: the whole submodel first (no lookahead bound)
                waited = time.perf_counter()
                loads.wait(plan.depth - 1)
                waits += time.perf_counter() - waited
            for k in range(plan.depth):
                if self._cut(pace, k, started, compute):
                    depth = k
                    break
                waited = time.perf_counter()
                weights = loads.wait(k)
                waits += time.perf_counter() - waited
                if self._cut(pace, k, started, compute):   # the wait for its shards may have put it behind
                    depth = k
                    break
                if deadline is not None and time.perf_counter() > deadline:
                    raise DeadlineMissed(f"the deadline passed before layer {k} of {plan.depth}")
                began = time.perf_counter()
                hidden = self.model.layer(hidden, mask, k, weights, bias)
                compute += time.perf_counter() - began
                loads.done(k)
            layers_end = time.perf_counter()
            probs = self.model.finish(hidden, mask, depth, plan.width)
        finally:
            io = loads.finish()
        ended = time.perf_counter()
        total = ended - started
        return RunResult(probs, total * 1e3, (io + rows_s) * 1e3, (rows_s + waits) * 1e3, compute * 1e3, depth,
                         (total - compute - waits) * 1e3, (ended - layers_end) * 1e3)


def _versions(plan: Plan, layer: int) -> list[tuple[int, int]]:
    return [(s, plan.bits[(layer, s)]) for s in plan.shards[layer]]


def _stored(store: ShardStore, layer: int, versions: Sequence[tuple[int, int]],
            held: dict[tuple[int, int, int], bytes], source: FileSource, kept: list[bytes | memoryview]
            ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int], list[tuple[int, int]] | None]:
    """What the C loader takes of a layer's stored shards ((shard, version) each): where they are (held, or in their
    file's mapping, which `kept` keeps), their lengths, versions, pair tables, outlier counts and CRC-32s; and from a
    source the loader reads, each shard's (descriptor, offset) to read it from ((-1, 0): held). Addresses, not views:
    a view and its address took 4 us a shard to make."""
    addresses, lengths, reads = [], [], []
    for s, b in versions:
        e = store.entry(layer, s, b)
        if (blob := held.get((layer, s, b))) is not None:
            kept.append(blob)
            addresses.append(address(blob))
            reads.append((-1, 0))
        elif source.mapped:
            whole, start = source.mapping(store.files[e.file])
            kept.append(whole)
            addresses.append(start + e.offset)
        else:
            addresses.append(0)
            reads.append((source.descriptor(store.files[e.file]), e.offset))
        lengths.append(e.length)
    bits, _, outliers, crcs = store.stored_layout(layer, versions)
    return (addresses, lengths, bits, [store.pair_addresses.get((layer, b), 0) for b in bits], outliers, crcs,
            None if source.mapped else reads)


def _c_thread_loads(source: FileSource) -> bool:
    """Whether the C loader's thread loads from this source: where the library was built and the source maps its
    files or lets the thread read them."""
    return NATIVE is not None and (source.mapped or source.c_reads)


def load_layer_s(model: ElasticModel, source: FileSource, layer: int, shards: Sequence[int], bits: int) -> float:
    """A layer's shards at one version loaded as a plan's are, in seconds: published, then read where the source
    lets it and put by the C loader's thread (its start not counted: a pipeline keeps one); else read and put by this
    thread."""
    store = model.store
    if not _c_thread_loads(source):
        started = time.perf_counter()
        store.load_layer(source, layer, shards, bits, model.residents[layer])
        return time.perf_counter() - started
    built = LayerBuilder(shards, model.residents[layer], store.geometry)
    assert built.native is not None
    kept: list[bytes | memoryview] = []
    places, versions = _in_file_order(store, layer, [(s, bits) for s in shards])
    stored = _stored(store, layer, versions, {}, source, kept)
    loads = PlanLoads(1, 0, np.empty(store.largest_layer_bytes, np.uint8), source.ahead_layers)
    try:
        started = time.perf_counter()
        loads.publish(built.native, places, *stored)
        published = time.perf_counter() - started
        loads.wait(0)
    except BadShard as e:
        store.refuse(layer, versions, [source.bytes_at(*store.span(layer, s, b)) for s, b in versions], e)
    finally:
        busy = loads.finish()
    return published + busy


def _in_file_order(store: ShardStore, layer: int, versions: Sequence[tuple[int, int]]
                   ) -> tuple[list[int], list[tuple[int, int]]]:
    """A layer's shards ((shard, version) each) as they are read, in the order they lie in their files: their places
    in the layer, and (shard, version) each."""
    places = store.file_order(layer, versions)
    return places, [versions[i] for i in places]


class ThreadLoads:
    """A plan's layers built in order by a Python loader thread, at most `window` layers ahead of the compute's
    (0: no bound): for sources whose reads block (cold, throttled) and where the C loader was not built."""

    def __init__(self, loader: ThreadPoolExecutor, model: ElasticModel, plan: Plan,
                 held: dict[tuple[int, int, int], bytes], source: FileSource, window: int) -> None:
        self.model, self.store = model, model.store
        self._ready = [threading.Event() for _ in range(plan.depth)]
        self._out: dict[int, LayerWeights] = {}
        self._failed: list[BaseException] = []
        self._stop = threading.Event()
        self._room = threading.Semaphore(window) if window else None
        self._busy: Future[float] = loader.submit(self._load, plan, held, source)

    def _load(self, plan: Plan, held: dict[tuple[int, int, int], bytes], source: FileSource) -> float:
        """Runs on the loader thread: `held` is this run's buffer, though `hold` may replace the pipeline's meanwhile.
        The shards not held are read ahead (where the source does) by at most a layer, besides the working buffer."""
        busy = 0.0
        layers = [_in_file_order(self.store, k, _versions(plan, k)) for k in range(plan.depth)]
        reads = self.store.read_in_order(source, [(k, s, b) for k, (_, versions) in enumerate(layers)
                                                  for s, b in versions if (k, s, b) not in held],
                                         depth=len(plan.shards[0]) if plan.shards else 1)
        try:
            for k in range(plan.depth):
                if self._room is not None:
                    self._room.acquire()    # the working buffer has room, or `finish` woke it
                if self._stop.is_set():
                    return busy
                started = time.perf_counter()
                layer = LayerBuilder(plan.shards[k], self.model.residents[k], self.store.geometry)
                places, versions = layers[k]
                blobs = [held.get((k, s, b)) or next(reads) for s, b in versions]
                if self._stop.is_set():
                    return busy
                self.store.put(layer, k, versions, blobs, places)     # one call a layer, without the GIL
                self._out[k] = layer.weights()
                busy += time.perf_counter() - started
                self._ready[k].set()
        except BaseException as e:   # the compute thread re-raises it
            self._failed.append(e)
            for event in self._ready:
                event.set()
        finally:
            reads.close()
        return busy

    def wait(self, layer: int) -> LayerWeights:
        self._ready[layer].wait()
        if self._failed:
            raise self._failed[0]
        return self._out[layer]

    def done(self, layer: int) -> None:
        del self._out[layer]
        if self._room is not None:
            self._room.release()

    def finish(self) -> float:
        """Stops the loads after the layer being built: the loader's busy seconds. A loader waiting for room in the
        working buffer (a run cut short by its pace or its deadline) is woken: it polled every 50 ms, and a cut run
        waited for it, at 7-8 times its target (docs/benchmarks/sti.md)."""
        self._stop.set()
        if self._room is not None:
            self._room.release()
        return self._busy.result()


class NativeLoads:
    """A plan's layers put in order by the C loader's own thread, which never takes the GIL (`PlanLoads`): shards
    where they lie in mapped files, or read by the thread from their files where the source lets it. Publishing them
    here takes the compute thread a few microseconds a layer whose load an earlier run built, while the thread
    already puts the first; a Python loader thread, each time it took the GIL back, cost the compute about 0.2 ms
    (docs/design/sti.md). At most `window` layers are put ahead of the compute's (0: no bound), into as many buffers
    reused in turn. A layer's shards are taken in the order they lie in their files."""

    def __init__(self, model: ElasticModel, plan: Plan, held: dict[tuple[int, int, int], bytes],
                 source: FileSource, window: int, buffers: LoaderBuffers) -> None:
        """`buffers`: those of earlier runs, with their loader thread and the layers' loads they built, reused where
        the plan's layers are theirs; kept for later ones."""
        started = time.perf_counter()
        self.model, self.store, self.plan = model, model.store, plan
        self._held, self._source = held, source
        staging = None if source.mapped else buffers.staging_for(self.store.largest_layer_bytes)
        self._loads = PlanLoads(plan.depth, window, staging, source.ahead_layers, buffers.loader_thread())
        self._layers: list[PublishedLayer] = []
        try:
            self._publish(buffers, window or plan.depth)
        except BaseException:
            self._loads.finish()
            raise
        self._publish_s = time.perf_counter() - started

    def _publish(self, buffers: LoaderBuffers, slots: int) -> None:
        buffers.keep_for(self._held, slots)
        for k, shards in enumerate(self.plan.shards):
            buffer, published = buffers.layer_buffer(k % slots, shards, self.model.residents[k], self.store.geometry)
            key = (k, tuple(_versions(self.plan, k)))
            if (layer := published.get(key)) is None:
                layer = published[key] = self._built(k, key[1], buffer)
            self._loads.publish_built(layer.built)
            self._layers.append(layer)

    def _built(self, k: int, versions: Sequence[tuple[int, int]], buffer: LayerBuilder) -> PublishedLayer:
        """Layer k's load into `buffer`, its shards ((shard, version) each) taken in file order."""
        assert buffer.native is not None
        places, ordered = _in_file_order(self.store, k, versions)
        kept: list[bytes | memoryview] = []
        built = buffer.native.load(places, *_stored(self.store, k, ordered, self._held, self._source, kept))
        return PublishedLayer(built, ordered, buffer.weights(self.plan.shards[k], self.model.residents[k]), kept)

    def wait(self, layer: int) -> LayerWeights:
        try:
            self._loads.wait(layer)
        except BadShard as e:
            versions = self._layers[layer].versions
            blobs = [self._held.get((layer, s, b)) or self._source.bytes_at(*self.store.span(layer, s, b))
                     for s, b in versions]
            self.store.refuse(layer, versions, blobs, e)
        return self._layers[layer].weights

    def done(self, layer: int) -> None:
        self._loads.done()

    def finish(self) -> float:
        """Stops the loads after the layer being put: the C thread's busy seconds and the publishing's."""
        return self._loads.finish() + self._publish_s
