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
from dataclasses import replace

from academus.services.scheduler.core import Job
from academus.shared.models.plot.registry import PlotEndpoint
from academus.shared.models.plot.wire import lookup_from_pb, request_to_pb
from academus.shared.models.work import Batch, PlotStates
from academus.shared.runtime.serving import Stubs
from academus.shared.state.catalogue import ModelSpec


def job_domain(job: Job, spec: ModelSpec) -> str:
    """A tenant model brings its own overlay (all texts of a job share its adapter); else the spec's."""
    adapter = job.payload.adapter
    return adapter.domain if adapter is not None else spec.domain


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

    async def _lookup(self, address: str, job: Job, domain: str) -> PlotStates:
        item = job.payload
        request = request_to_pb(item.input_ids, item.lengths, domain)
        response = await self.stubs(address).Lookup(request, timeout=max(job.deadline - self.clock(), 1e-3))
        lookup = lookup_from_pb(response)
        return PlotStates(lookup.states, lookup.lengths, response.model, response.lower_layers)

    def attach(self, batch: Batch, jobs: Sequence[Job]) -> Batch:
        """The batch with its states when every job's lookup has succeeded (the jobs' states back to back, in
        batch order); otherwise the batch as it was, what is still running cancelled: the worker looks up."""
        tasks = [job.prefetch for job in jobs]
        if not any(tasks):
            return batch
        for job in jobs:
            job.prefetch = None
        done = [t for t in tasks if t is not None and t.done() and not t.cancelled()]
        failed = sum(1 for t in done if t.exception() is not None)
        self.stats["plot_prefetch_failed"] += failed
        if len(done) == len(tasks) and not failed:
            self.stats["plot_prefetch_used"] += len(jobs)
            return replace(batch, plot_states=PlotStates.merge([t.result() for t in done]))
        self.stats["plot_prefetch_missed"] += len(jobs)
        for task in tasks:
            if task is not None:
                task.cancel()
        return batch
