"""Submodel execution (STI §5.5): a loader thread reads the plan's shards layer by layer while the compute
thread runs each layer as soon as its shards are in. The IO source reads the shards in order: the `throttled`
device up to a layer ahead of the loader, so that it reads while the loader decodes (`FileSource.read_in_order`).

The loader also checks and decodes each shard. The paper decodes on the compute side (C with OpenMP on a
phone, where decoding is small next to a layer); on a server CPU decoding a MiniLM layer costs about as much
as running it on one text, so here it overlaps the compute instead of adding to it, and the planner counts
it in each shard's load time. It decodes in C (`shard_native.py`), outside the GIL that the compute thread
needs between its torch ops. The deadline is checked between layers.

Its IO sources (`file`, `cold`, `throttled:<MB/s>`) are in `shard_io.py`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from academus.shared.models.architectures import family_module, read_architecture
from academus.shared.models.model import MEAN, ClassifierHead, body_inputs, padded_positions, pool
from academus.shared.models.shard_io import FileSource
from academus.shared.models.shard_store import RELATIVE_BIAS, ShardStore
from academus.shared.models.shards import (
    LayerBuilder,
    LayerWeights,
    ShardWeights,
    elastic_layer,
    key_mask,
    relative_bias,
)
from academus.shared.models.sti_planner import Pace, Plan
from academus.shared.state.artifacts import ArtifactError


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


class ShardPipeline:
    """Runs plans through one IO source: a loader thread and the calling (compute) thread. The preload buffer
    holds stored shard bytes, counted at their stored size."""

    def __init__(self, model: ElasticModel, source: FileSource, lookahead: int = 0) -> None:
        """`lookahead`: decoded layers the loader may hold ahead of the compute (0: no bound)."""
        self.model, self.store, self.source = model, model.store, source
        self.lookahead = lookahead
        self.preloaded: dict[tuple[int, int, int], bytes] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sti-loader")

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
        self.source.close()
        self.model.close()

    def _load(self, plan: Plan, ready: list[threading.Event], out: dict[int, LayerWeights],
              failed: list[BaseException], stop: threading.Event, room: threading.Semaphore | None) -> float:
        busy = 0.0
        held = self.preloaded        # this run's buffer, though `hold` may replace it meanwhile
        # the shards not held, read ahead (where the source does) by at most a layer, besides the working buffer
        reads = self.store.read_in_order(self.source, [(k, s, plan.bits[(k, s)]) for k, shards in enumerate(plan.shards)
                                                       for s in shards if (k, s, plan.bits[(k, s)]) not in held],
                                         depth=len(plan.shards[0]) if plan.shards else 1)
        try:
            for k, shards in enumerate(plan.shards):
                while room is not None and not room.acquire(timeout=0.05):   # the working buffer is full
                    if stop.is_set():
                        return busy
                started = time.perf_counter()
                layer = LayerBuilder(shards, self.model.residents[k], self.store.geometry)
                versions = [(s, plan.bits[(k, s)]) for s in shards]
                blobs = [held.get((k, s, b)) or next(reads) for s, b in versions]
                if stop.is_set():
                    return busy
                self.store.put(layer, k, versions, blobs)     # one call a layer, without the GIL
                out[k] = layer.weights()
                busy += time.perf_counter() - started
                ready[k].set()
        except BaseException as e:   # the compute thread re-raises it
            failed.append(e)
            for event in ready:
                event.set()
        finally:
            reads.close()
        return busy

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
        self.source.before_run(self.store.paths())
        started = time.perf_counter()
        ready = [threading.Event() for _ in plan.shards]
        out: dict[int, LayerWeights] = {}
        failed: list[BaseException] = []
        stop = threading.Event()
        room = threading.Semaphore(self.lookahead) if self.lookahead and plan.overlap else None
        loading: Future[float] = self._loader.submit(self._load, plan, ready, out, failed, stop, room)
        compute, depth = 0.0, plan.depth
        try:
            began = time.perf_counter()
            rows = self.model.rows.read(ids, self.source)   # the compute waits for them: IO and stall alike
            stall = rows_s = time.perf_counter() - began
            hidden = self.model.embed_rows(rows, types)
            bias = self.model.position_bias(hidden)
            if not plan.overlap:               # Load&Exec: the whole submodel first (no lookahead bound)
                waited = time.perf_counter()
                ready[-1].wait()
                stall += time.perf_counter() - waited
            for k in range(plan.depth):
                if self._cut(pace, k, started, compute):
                    depth = k
                    break
                waited = time.perf_counter()
                ready[k].wait()
                stall += time.perf_counter() - waited
                if self._cut(pace, k, started, compute):   # the wait for its shards may have put it behind
                    depth = k
                    break
                if failed:
                    raise failed[0]
                if deadline is not None and time.perf_counter() > deadline:
                    raise DeadlineMissed(f"the deadline passed before layer {k} of {plan.depth}")
                began = time.perf_counter()
                hidden = self.model.layer(hidden, mask, k, out.pop(k), bias)
                compute += time.perf_counter() - began
                if room is not None:
                    room.release()
            probs = self.model.finish(hidden, mask, depth, plan.width)
        finally:
            stop.set()
            io = loading.result()
        total = time.perf_counter() - started
        return RunResult(probs, total * 1e3, (io + rows_s) * 1e3, stall * 1e3, compute * 1e3, depth)
