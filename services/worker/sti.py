"""A classifier served from shards under a parameter-memory budget (STI): `<task>-sti` models.

The worker holds the resident part (position and type embeddings, biases, norms, the task's heads), a cache of
the word-embedding rows recent texts read (the table itself stays in the shard artifact), and a preload buffer of
stored shards (the bottom layers' first shards, §5.5), filled when the budget is set and kept for every
batch; the budget pays for those and for the working buffer of two decoded layers (the one computing and
the one loading: the loader never runs further ahead). Each batch is planned for its time,
the set target or else what remains of its deadline, and runs through the loader/compute pipeline. A time
no submodel fits is refused at once; so is a budget below what the smallest plan needs.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge, Histogram

from academus.shared.models.model import weight_bytes
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore
from academus.shared.models.sti_pipeline import LOOKAHEAD_LAYERS, DeadlineMissed, ElasticModel, ShardPipeline
from academus.shared.models.sti_planner import Plan
from academus.shared.models.work import ShardRun
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument
from academus.shared.state.artifacts import ArtifactError
from academus.shared.training.shard_plans import load_profile, planner_for, save_profile
from academus.shared.training.shards import measure_profile

STI_RUNS = Counter("academus_worker_sti_batches_total", "Batches run from shards (STI)", ["model"])
STI_STALL = Histogram("academus_worker_sti_stall_ms", "Compute waiting for shards, a batch (STI)", ["model"],
                      buckets=(0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500))
STI_MEAN_BITS = Histogram("academus_worker_sti_mean_bits", "Mean stored bit width of a batch's shards (STI)",
                          ["model"], buckets=(2, 3, 4, 5, 6, 8, 16, 32))
STI_RESIDENT = Gauge("academus_worker_sti_resident_bytes", "Parameter bytes a shard-served model holds "
                     "(resident part and preload buffer)", ["model"])
STI_BUDGET = Gauge("academus_worker_sti_budget_bytes", "The parameter-memory budget of a shard-served model",
                   ["model"])


@dataclass(frozen=True)
class StiSettings:
    io: str = "file"            # file | cold | throttled:<MB/s>
    budget_bytes: int = 0       # 0: the resident part, the working buffer and a 4 MiB preload buffer
    target_ms: float = 0.0      # 0: what remains of each batch's deadline
    deadline_share: float = 0.8  # of the remaining time a plan may use (the rest: the hops back)


class StiModel:
    """One task's shards, planned and run batch by batch; batches are serialised (one loader, one buffer)."""

    DEFAULT_PRELOAD = 4 << 20

    def __init__(self, name: str, directory: Path, task: str, artifacts: Path, settings: StiSettings,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.settings, self.clock = name, settings, clock
        self.store = ShardStore(directory)
        self.model = ElasticModel(self.store, task)
        model_key = self.store.manifest.extra.get("model", directory.name)
        source = io_source(settings.io)
        try:
            profile = load_profile(artifacts, model_key, source.name)
        except ArtifactError:            # not profiled on this machine yet: a short profile now, kept for next time
            profile = measure_profile(self.store, settings.io, repeats=5)
            save_profile(artifacts, model_key, profile)
        self.planner = planner_for(self.store, task, profile)
        self.pipeline = ShardPipeline(self.model, source, lookahead=LOOKAHEAD_LAYERS)
        geometry = self.store.geometry
        self.fixed_bytes = self.store.resident_bytes + weight_bytes(*self.model.heads.values())
        # the embedding rows' cache counted at its bound: it fills as texts arrive
        self.common_bytes = self.fixed_bytes + self.model.rows.cache_bytes
        self.layer_bytes = {w: w * geometry.params * 4 for w in self.store.tasks[task].widths}
        self._lock = threading.Lock()
        self.preload_bytes = self.budget_bytes = 0
        self.held: dict[tuple[int, int], int] = {}
        self.set_budget(settings.budget_bytes)

    @property
    def labels(self) -> list[str]:
        return self.model.labels

    def minimum_bytes(self) -> int:
        """The smallest plan's memory: the resident part and the working buffer at the narrowest width."""
        return self.common_bytes + LOOKAHEAD_LAYERS * min(self.layer_bytes.values())

    def set_budget(self, budget_bytes: int) -> None:
        """Sets the parameter-memory budget; the preload buffer gets what the resident part and the widest
        working buffer leave (the plan narrows when even that does not fit). Refused below the minimum."""
        if budget_bytes and budget_bytes < self.minimum_bytes():
            raise InvalidArgument(
                f"{self.name}: a budget of {budget_bytes} bytes is below the {self.minimum_bytes()} bytes its "
                f"smallest plan needs ({self.common_bytes} resident, {self.minimum_bytes() - self.common_bytes} "
                f"working buffer)")
        working = LOOKAHEAD_LAYERS * max(self.layer_bytes.values())
        budget = budget_bytes or self.common_bytes + working + self.DEFAULT_PRELOAD
        with self._lock:
            self.budget_bytes = budget
            self.preload_bytes = max(0, budget - self.common_bytes - working)
            self.held = self.planner.held_for(self.preload_bytes)
            self.pipeline.hold(self.held)
        STI_BUDGET.labels(self.name).set(budget)
        STI_RESIDENT.labels(self.name).set(self.resident_bytes())

    def resident_bytes(self) -> int:
        """Parameter bytes held now: the resident part, the embedding rows cached and the preload buffer."""
        return self.fixed_bytes + self.model.rows.held_bytes() + self.pipeline.resident_bytes()

    def plan_for(self, rows: int, longest: int, deadline: float | None) -> Plan:
        if self.settings.target_ms:
            target = self.settings.target_ms
        elif deadline is not None:
            target = (deadline - self.clock()) * 1e3 * self.settings.deadline_share
        else:
            target = math.inf
        tokens = rows * longest
        plan = self.planner.plan(1e9 if math.isinf(target) else target, tokens, held=self.held)
        if not plan.feasible:
            smallest = plan.compute_ms + self.planner.profile.rest_ms(tokens, plan.depth, plan.width)
            raise DeadlineExceeded(f"{self.name}: {target:.1f} ms left for {rows} text(s) of {longest} tokens fits no "
                                   f"submodel: the smallest needs {smallest:.1f} ms of compute; not computed")
        return plan

    def run(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor,
            deadline: float | None) -> tuple[torch.Tensor, ShardRun, float]:
        """[B, C] probabilities, what ran, and the compute time in ms."""
        with self._lock:
            plan = self.plan_for(ids.shape[0], ids.shape[1], deadline)
            until = None if deadline is None else time.perf_counter() + (deadline - self.clock())
            try:
                result = self.pipeline.run(plan, ids, mask, types, deadline=until,
                                           pace=self.planner.pace(plan, ids.shape[0] * ids.shape[1]))
            except DeadlineMissed as e:
                raise DeadlineExceeded(f"{self.name}: {e}; the rest was not computed") from e
            except ArtifactError as e:   # a shard corrupted since the store opened: refused, never served
                raise InvalidArgument(f"{self.name} cannot be served: {e}") from e
        resident = self.resident_bytes()
        ran = plan.truncated(result.depth)   # a run behind its pace answered from fewer layers
        STI_RUNS.labels(self.name).inc()
        STI_STALL.labels(self.name).observe(result.stall_ms)
        STI_MEAN_BITS.labels(self.name).observe(ran.mean_bits)
        STI_RESIDENT.labels(self.name).set(resident)
        info = ShardRun(ran.depth, ran.width, round(ran.mean_bits, 3), result.io_ms, result.stall_ms, resident,
                        self.pipeline.source.name)
        return result.probs, info, result.total_ms

    def close(self) -> None:
        self.pipeline.close()

