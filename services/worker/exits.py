"""Exit ramps inside the teacher's forward (Apparate): a batch asked for early exits runs the model's active
ramps after their layers, releases each text at the first confident one (`release`, on the compute thread),
and runs on to the end; its full answer then feeds the model's ExitController (thresholds, ramp set), which
observes it off the compute thread.

A ramp sees layer k's output: a forward hook on the layer module for padded batches, the packed encoder's
`after_layer` for ConcatBatching. Both call `ExitRun.at_layer` with the pooled states of some texts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from academus.shared.models.exits import ControllerSettings, EntropyRule, ExitController, ExitSignals, controller_for
from academus.shared.models.model import MEAN
from academus.shared.models.ramps import ExitRamps, load_ramps, ramps_dir
from academus.shared.runtime.logs import log_event
from academus.shared.state.artifacts import MANIFEST, ArtifactError, file_stamp

# rows (texts of the batch), the layer they exit after, their probabilities [len(rows), C]
Release = Callable[[list[int], int, np.ndarray], None]


@dataclass
class ModelExits:
    """A served classifier's ramps and the controller that keeps their thresholds."""

    ramps: ExitRamps
    controller: ExitController


def ramps_stamp(artifacts: Path, task: str) -> tuple[int, int] | None:
    """What changes when `ramps train` writes the task's ramps (the directory is replaced by a rename): its
    manifest's inode and mtime; None without one."""
    return file_stamp(ramps_dir(artifacts, task) / MANIFEST)


def load_exits(artifacts: Path, task: str, hidden_size: int, labels: Sequence[str], device: torch.device,
               settings: ControllerSettings, name: str) -> ModelExits | None:
    """The task's ramps when `ramps train` made them; None when there are none. A malformed artifact is
    refused (logged with its file; the model serves without early exits)."""
    directory = ramps_dir(artifacts, task)
    if not directory.exists():
        return None
    try:
        ramps, manifest = load_ramps(directory, hidden_size, labels, device)
        controller = controller_for(ramps.layers, manifest.extra, settings, ramps.evidence)
    except (ArtifactError, KeyError, TypeError, ValueError) as e:
        log_event("ramps_refused", logging.ERROR, model=name, error=str(e))
        return None
    log_event("ramps_loaded", model=name, layers=list(ramps.layers), policy=settings.policy)
    return ModelExits(ramps, controller)


@dataclass
class PendingRamp:
    """A deferred ramp's step: its logits (a pinned host tensor the device is filling, or a host array) and
    its cost (the device events around its kernels, or the seconds it took on the host)."""

    layer: int
    j: int
    rows: np.ndarray | None
    logits: torch.Tensor | np.ndarray
    cost: tuple[torch.cuda.Event, torch.cuda.Event] | float

    def read(self) -> tuple[np.ndarray, float]:
        """Its logits on the host and the seconds it cost; on a device, once its copy has landed."""
        if isinstance(self.cost, float):
            return np.asarray(self.logits), self.cost
        begin, done = self.cost
        done.synchronize()
        return self.logits.numpy(), begin.elapsed_time(done) / 1e3


class ExitRun:
    """One batch's pass through the active ramps: each text's signals so far, where it was released."""

    def __init__(self, exits: ModelExits, texts: int, release: Release, deferred: bool = False) -> None:
        self.exits = exits
        self.deferred = deferred   # a GPU's ramps: queued with the layers, read back by `settle`
        self.pending: list[PendingRamp] = []
        self.on_gpu = deferred and next(exits.ramps.parameters()).is_cuda   # read only when deferred
        self.active = exits.controller.active        # one snapshot for the whole batch
        self.index = {layer: j for j, layer in enumerate(self.active.layers)}
        ramps = len(self.active.layers)
        self.conf = np.full((texts, ramps), np.nan, dtype=np.float32)
        self.preds = np.full((texts, ramps), -1, dtype=np.int64)
        self.entropy = np.full((texts, ramps), np.nan, dtype=np.float32)
        self.exit_at = np.full(texts, ramps)
        self.entropy_read = isinstance(self.active.rule, EntropyRule)
        self.release = release
        self.mask: torch.Tensor | None = None         # a padded batch's attention mask (the layer hooks pool)
        self.weights: torch.Tensor | np.ndarray | None = None   # [B, 1, T] its mean-pooling weights, made once
        self.spent = np.zeros(ramps)                  # seconds each ramp took on this batch (its serving cost)

    def at_layer(self, layer: int, pooled: Callable[[], torch.Tensor | np.ndarray],
                 rows: np.ndarray | None = None) -> None:
        """Layer `layer` has run for `rows` (None: every text); `pooled()` gives their states pooled as the
        model pools (computed only when a ramp sits there). Every text that reaches a ramp waits for it, so it
        computes only what the rule reads: the probabilities only for the texts it releases, the entropy only
        for DeeBERT's rule."""
        j = self.index.get(layer)
        if j is None:
            return
        if self.deferred:
            self.pending.append(self._queue(layer, j, pooled, rows))
            return
        start = time.perf_counter()
        released = self._signals(j, self.exits.ramps.host_logits(layer, pooled()), rows)
        self.spent[j] += time.perf_counter() - start   # the release's sending is the caller's, not the ramp's
        if released is not None:
            self.release(released[0].tolist(), layer, released[1])

    def _signals(self, j: int, logits: np.ndarray, rows: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray] | None:
        """Ramp j's confidences (and entropy) for `rows` from its logits; the texts it releases and their
        probabilities, None when it releases none."""
        centred = logits - logits.max(axis=1, keepdims=True)
        shifted = np.exp(centred)
        total = shifted.sum(axis=1)
        at = slice(None) if rows is None else rows
        self.conf[at, j] = 1.0 / total                     # the top probability: exp(0) over the sum
        self.preds[at, j] = logits.argmax(axis=1)
        if self.entropy_read:
            self.entropy[at, j] = np.log(total) - (shifted * centred).sum(axis=1) / total
        exits = (self.exit_at[at] == len(self.active.layers)) & \
            self.active.rule.exits_at(j, self.conf[at], self.preds[at], self.entropy[at])
        if not exits.any():
            return None
        released = np.flatnonzero(exits) if rows is None else rows[exits]
        self.exit_at[released] = j
        return released, shifted[exits] / total[exits, None]

    def _queue(self, layer: int, j: int, pooled: Callable[[], torch.Tensor | np.ndarray],
               rows: np.ndarray | None) -> PendingRamp:
        """A deferred ramp's work: on a GPU queued behind its layer, its logits copied to pinned host memory,
        timed by events on the device (a ramp costs the GPU its own kernels, never a wait for the layers)."""
        if not self.on_gpu:   # deferred on a CPU: decided later on what it computes now
            start = time.perf_counter()
            logits = self.exits.ramps.host_logits(layer, pooled())
            return PendingRamp(layer, j, rows, logits, time.perf_counter() - start)
        begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        on_device = self.exits.ramps.device_logits(layer, pooled())
        host = torch.empty(on_device.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(on_device, non_blocking=True)
        done.record()
        return PendingRamp(layer, j, rows, host, (begin, done))

    def settle(self) -> None:
        """The deferred ramps in turn, once the forward is queued: each decides when its logits reach the
        host, and its texts are released then, while the device runs the layers after it."""
        for ramp in self.pending:
            logits, seconds = ramp.read()
            start = time.perf_counter()
            released = self._signals(ramp.j, logits, ramp.rows)
            self.spent[ramp.j] += seconds + time.perf_counter() - start
            if released is not None:
                self.release(released[0].tolist(), ramp.layer, released[1])
        self.pending.clear()

    def hidden(self, layer: int, hidden: torch.Tensor) -> None:
        """A padded batch's layer output [B, T, H] (the layer hook)."""
        if layer in self.index and self.mask is not None:
            self.at_layer(layer, lambda: self._pool_padded(hidden))

    def _pool_padded(self, hidden: torch.Tensor) -> torch.Tensor | np.ndarray:
        """The mean over real tokens (or the first token), its weights made once a batch. On a CPU in NumPy: a
        torch operator here wakes the intra-op threads, which then spin through the ramp's host code and
        double its CPU."""
        if self.exits.ramps.pooling != MEAN:
            return hidden[:, 0]
        if hidden.device.type == "cpu":
            if self.weights is None:
                mask = self.mask.numpy().astype(np.float32)
                self.weights = (mask / np.maximum(mask.sum(1, keepdims=True), 1e-9))[:, None, :]
            return np.matmul(self.weights, hidden.float().numpy())[:, 0]
        if self.weights is None:
            mask = self.mask.to(hidden.dtype)
            self.weights = (mask / mask.sum(1, keepdim=True).clamp(min=1e-9)).unsqueeze(1)
        return torch.bmm(self.weights, hidden).squeeze(1)

    def finish(self, final_probs: np.ndarray, batch_s: float) -> None:
        """The full model's answers (`batch_s`: the batch's compute time): the controller's feedback, with what
        each ramp cost on it."""
        self.settle()   # a path that read its answers without settling: the ramps decide now
        signals = ExitSignals(self.conf, self.preds, self.entropy)
        self.exits.controller.feed(self.active.layers, signals, final_probs.argmax(-1), self.exit_at,
                                   ramp_seconds=self.spent, batch_s=batch_s)
