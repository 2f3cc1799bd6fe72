"""The scheduler's PLOT prefetch (HMI §6.1) as a core class: only waiting jobs are looked up, only when a
live plot service holds the model's table and the job's overlay; a batch carries states only when every
job's lookup has succeeded, else the running ones are cancelled and the worker looks up. (The real plot
service and the whole path: tests/integration/test_plot_serving.py.)"""

from __future__ import annotations

import asyncio

import numpy as np

from academus.services.scheduler.core import Dispatcher, Job
from academus.services.scheduler.plot_prefetch import PlotPrefetcher
from academus.services.scheduler.policies import FifoPolicy
from academus.shared.models.plot.registry import PlotEndpoint
from academus.shared.models.work import AdapterRef, Batch, WorkItem
from academus.shared.state.catalogue import EMBEDDING, ModelSpec
from academus.v1 import plot_pb2
from tests.unit.test_scheduler_core import Clock, FakeWorkers, settle

SPECS = {"minilm-plot": ModelSpec("minilm-plot", EMBEDDING, plot="minilm", lower_layers=3),
         "minilm": ModelSpec("minilm", EMBEDDING)}
SERVICE = PlotEndpoint("p1", "127.0.0.1:1", "minilm", 3, ("legal",))


class PlotServices:
    """Stands in for the plot services' stubs: each Lookup waits until the test answers or fails it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, plot_pb2.LookupRequest]] = []
        self.answers: list[asyncio.Future] = []

    def __call__(self, address: str) -> PlotServices:
        self.address = address
        return self

    async def Lookup(self, request: plot_pb2.LookupRequest, timeout: float) -> plot_pb2.LookupResponse:
        self.requests.append((self.address, request))
        self.answers.append(asyncio.get_running_loop().create_future())
        return await self.answers[-1]


def response(lengths: list[int], fill: int) -> plot_pb2.LookupResponse:
    return plot_pb2.LookupResponse(states=bytes([fill]) * (2 * 4 * sum(lengths)), lengths=lengths, hidden=4,
                                   dtype="float16", lower_layers=3, model="minilm")


def job(clock: Clock, model: str = "minilm-plot", lengths: tuple[int, ...] = (3,), domain: str = "") -> Job:
    payload = WorkItem(model, "embedding", [101] + [7] * (sum(lengths) - 2) + [102], list(lengths),
                       adapter=AdapterRef("acme", "m", domain=domain) if domain else None)
    return Job(model=model, payload=payload, num_texts=len(lengths), num_tokens=sum(lengths),
               deadline=clock() + 5, enqueued_at=clock(), batch_key=(model,))


def prefetcher(services: PlotServices, endpoints=(SERVICE,)) -> PlotPrefetcher:
    p = PlotPrefetcher(services, Clock())
    p.update(SPECS, list(endpoints))
    return p


async def test_only_a_waiting_job_of_a_plot_model_is_looked_up():
    clock, fake, services = Clock(), FakeWorkers(), PlotServices()
    plot = prefetcher(services)
    d = Dispatcher(FifoPolicy(), fake.send, 8, 25, clock, on_wait=plot.on_wait)
    d.update_workers({"w0": ("127.0.0.1:9", frozenset({"minilm-plot", "minilm"}))})
    first, waiting, teacher = job(clock), job(clock, lengths=(4,)), job(clock, "minilm")
    tasks = [asyncio.create_task(d.submit(j)) for j in (first, waiting, teacher)]
    await settle()
    assert first.prefetch is None and teacher.prefetch is None   # dispatched at once / no table
    assert [(a, list(r.batch.lengths), r.domain) for a, r in services.requests] == [("127.0.0.1:1", [4], "")]
    services.answers[0].set_result(response([4], 1))
    await settle()
    batch = plot.attach(Batch.of([waiting.payload]), [waiting])   # what the sender does at dispatch
    assert batch.plot_states.lengths.tolist() == [4] and plot.stats["plot_prefetch_used"] == 1
    assert waiting.prefetch is None
    for t in tasks:
        t.cancel()
    await settle()


async def test_a_tenant_job_is_looked_up_in_its_domain_and_only_where_a_service_holds_it():
    services = PlotServices()
    plot = prefetcher(services)
    clock = Clock()
    legal, other = job(clock, domain="legal"), job(clock, domain="medical")
    plot.on_wait(legal)
    plot.on_wait(other)                                    # no live service holds that overlay
    await settle()
    assert [r.domain for _, r in services.requests] == ["legal"] and other.prefetch is None
    prefetcher(services, endpoints=[]).on_wait(job(clock))  # no plot service at all: nothing to do
    assert len(services.requests) == 1
    for answer in services.answers:
        answer.cancel()


async def wait_and_answer(plot: PlotPrefetcher, services: PlotServices, jobs: list[Job],
                          answers: list[plot_pb2.LookupResponse | Exception]) -> None:
    """The jobs wait (their lookups start); the first lookups get `answers`, the rest keep running."""
    first = len(services.answers)
    for j in jobs:
        plot.on_wait(j)
    await settle()
    for k, answer in enumerate(answers):
        pending = services.answers[first + k]
        pending.set_exception(answer) if isinstance(answer, Exception) else pending.set_result(answer)
    await settle()


async def test_a_batch_goes_without_states_unless_every_lookup_succeeded():
    services = PlotServices()
    plot = prefetcher(services)
    clock = Clock()
    jobs = [job(clock, lengths=(3,)), job(clock, lengths=(2, 5)), job(clock, lengths=(4,))]
    await wait_and_answer(plot, services, jobs, [response([3], 1), response([2, 5], 2)])
    pending = jobs[2].prefetch
    batch = Batch.of([j.payload for j in jobs])
    assert plot.attach(batch, jobs) is batch                # the third is still running: none are sent
    await settle()
    assert batch.plot_states is None and pending.cancelled()
    assert plot.stats["plot_prefetch_missed"] == 3 and all(j.prefetch is None for j in jobs)

    jobs = [job(clock, lengths=(3,)), job(clock, lengths=(4,))]
    await wait_and_answer(plot, services, jobs, [response([3], 1), RuntimeError("plot service gone")])
    batch = Batch.of([j.payload for j in jobs])
    assert plot.attach(batch, jobs).plot_states is None and plot.stats["plot_prefetch_failed"] == 1


async def test_merged_states_follow_the_batch_order():
    services = PlotServices()
    plot = prefetcher(services)
    clock = Clock()
    jobs = [job(clock, lengths=(3,)), job(clock, lengths=(2, 5))]
    await wait_and_answer(plot, services, jobs, [response([3], 1), response([2, 5], 2)])
    states = plot.attach(Batch.of([j.payload for j in jobs]), jobs).plot_states
    assert states.lengths.tolist() == [3, 2, 5] and (states.model, states.lower_layers) == ("minilm", 3)
    first, second = (np.frombuffer(bytes([fill]) * 2, "<f2").item() for fill in (1, 2))
    assert states.states.shape == (10, 4)
    assert (states.states[:3] == first).all() and (states.states[3:] == second).all()
