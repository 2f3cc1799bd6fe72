"""HMI §6.1 pipelined representation retrieval, at the scheduler.

A request for a PLOT model (its catalogue spec names a table: `plot`, `lower_layers`, `domain`) that
finds no free group waits in the policy's queue; meanwhile the scheduler looks its texts up in a live
plot service holding that table (and the request's overlay), so the batch carries its layer-K states
to the worker, which then runs only the upper layers. The lookup never delays a dispatch: a batch
whose lookups have not all finished goes without states (they are cancelled) and the worker looks the
texts up itself, with the same table and the same answers (up to the fp16 wire rounding).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from academus.services.scheduler.core import Job
from academus.shared.models.plot.registry import PlotEndpoint
from academus.shared.runtime.serving import Stubs
from academus.shared.state.catalogue import ModelSpec
from academus.v1 import plot_pb2, tensors_pb2, worker_pb2


def job_domain(job: Job, spec: ModelSpec) -> str:
    """A tenant model brings its own overlay (all texts of a job share its AdapterRef); else the spec's."""
    adapters = job.payload.adapters
    return adapters[0].domain if adapters and adapters[0].tenant else spec.domain


class PlotPrefetcher:
    def __init__(self, stubs: Stubs, clock: Callable[[], float] = time.monotonic) -> None:
        self.stubs, self.clock = stubs, clock
        self.specs: dict[str, ModelSpec] = {}        # the served PLOT models
        self.endpoints: list[PlotEndpoint] = []      # live plot services
        self.stats = {"plot_prefetch_started": 0, "plot_prefetch_used": 0, "plot_prefetch_missed": 0,
                      "plot_prefetch_failed": 0}

    def update(self, specs: dict[str, ModelSpec], endpoints: list[PlotEndpoint]) -> None:
        self.specs = {name: spec for name, spec in specs.items() if spec.plot}
        self.endpoints = endpoints

    def on_wait(self, job: Job) -> None:
        """Starts the job's lookup when a plot service holds its model's table and overlay."""
        spec = self.specs.get(job.model)
        if spec is None or job.prefetch is not None:
            return
        domain = job_domain(job, spec)
        endpoint = next((e for e in self.endpoints if e.serves(spec.plot, spec.lower_layers, domain)), None)
        if endpoint is None:
            return
        self.stats["plot_prefetch_started"] += 1
        job.prefetch = asyncio.get_running_loop().create_task(self._lookup(endpoint.address, job, domain))

    async def _lookup(self, address: str, job: Job, domain: str) -> plot_pb2.LookupResponse:
        tokens = job.payload.tokens
        request = plot_pb2.LookupRequest(domain=domain, batch=tensors_pb2.TokenBatch(
            input_ids=tokens.input_ids, lengths=tokens.lengths))
        return await self.stubs(address).Lookup(request, timeout=max(job.deadline - self.clock(), 1e-3))

    def attach(self, request: worker_pb2.RunRequest, batch: Sequence[Job]) -> None:
        """Puts the batch's states on its worker request when every job's lookup has succeeded; otherwise
        cancels what is still running and leaves the lookup to the worker."""
        tasks = [job.prefetch for job in batch]
        if not any(tasks):
            return
        for job in batch:
            job.prefetch = None
        done = [t for t in tasks if t is not None and t.done() and not t.cancelled()]
        failed = sum(1 for t in done if t.exception() is not None)
        self.stats["plot_prefetch_failed"] += failed
        if len(done) == len(tasks) and not failed:
            request.plot_states.CopyFrom(merge_lookups([t.result() for t in done]))
            self.stats["plot_prefetch_used"] += len(batch)
            return
        self.stats["plot_prefetch_missed"] += len(batch)
        for task in tasks:
            if task is not None:
                task.cancel()


def merge_lookups(parts: Sequence[plot_pb2.LookupResponse]) -> plot_pb2.LookupResponse:
    """The jobs' states back to back in batch order: the merged request's text order."""
    first = parts[0]
    merged = plot_pb2.LookupResponse(hidden=first.hidden, dtype=first.dtype, lower_layers=first.lower_layers,
                                     model=first.model, states=b"".join(p.states for p in parts))
    for part in parts:
        merged.lengths.extend(part.lengths)
    return merged
