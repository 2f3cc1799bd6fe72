"""Running a dispatched batch on a group, as core objects: the jobs' work items merged into one `Batch`, one worker
call for a single-member group or one a member for a student group (their partial sums combined), and the answer
split back to the jobs. The edge (`server.py`) supplies `RunOn`, the worker call over the wire."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import numpy as np

from academus.services.scheduler.core import Group, Job
from academus.services.scheduler.plot_prefetch import PlotPrefetcher
from academus.services.scheduler.policies import BatchPlan
from academus.shared.models.exits import softmax
from academus.shared.models.work import (
    FINISH_L2,
    FINISH_NONE,
    FINISH_SOFTMAX,
    Batch,
    BatchOutput,
    PackingPlan,
)
from academus.shared.runtime.errors import DeadlineExceeded

OnPartial = Callable[[BatchOutput], None]
# (worker id, batch, seconds left, early answers or None) -> its answer; raises WorkerLost or a ServingError
RunOn = Callable[[str, Batch, float, OnPartial | None], Awaitable[BatchOutput]]


class GroupSender:
    """Runs a batch on a group: one worker call for a single-member group (a student group whose students
    one worker holds all runs them as one model, its head included, linear or not); for a student group
    spread over workers, one call per member in parallel, then the combiner adds the partial outputs
    (Σ α_m·S_m through the linear head) and applies the final softmax or normalisation."""

    def __init__(self, run_on: RunOn, clock: Callable[[], float], prefetcher: PlotPrefetcher | None = None) -> None:
        self.run_on, self.clock, self.prefetcher = run_on, clock, prefetcher

    async def __call__(self, group: Group, jobs: Sequence[Job]) -> list[BatchOutput]:
        remaining = max(j.deadline for j in jobs) - self.clock()
        if remaining <= 0:
            raise DeadlineExceeded("deadline passed before dispatch; not computed")
        batch = batch_of(jobs)
        if self.prefetcher is not None:
            batch = self.prefetcher.attach(batch, jobs)
        whole = len(group.members) == 1 and set(group.members[0].students) in (set(), set(range(group.students)))
        if whole and group.members[0].students:   # one worker holds every student: it runs them as one model
            batch = batch.member(group.students, ())
        if whole:
            wanted = any(j.on_partial is not None for j in jobs)
            output = await self.run_on(group.members[0].worker_id, batch, remaining,
                                       functools.partial(deliver_partial, jobs=jobs) if wanted else None)
        else:
            output = await self._fan_out(group, batch, remaining)
        return [output] if len(jobs) == 1 else output.split([j.num_texts for j in jobs])

    async def _fan_out(self, group: Group, batch: Batch, remaining: float) -> BatchOutput:
        calls = [asyncio.ensure_future(self.run_on(m.worker_id, batch.member(group.students, m.students), remaining,
                                                   None))
                 for m in group.members]
        try:
            outputs = await asyncio.gather(*calls)
        except BaseException:
            for call in calls:  # one student failed: the others' work is no longer wanted
                call.cancel()
            raise
        return combine(outputs, group)


def batch_of(jobs: Sequence[Job]) -> Batch:
    """The worker call for a batch: the jobs' items back to back, with the concat plan re-indexed to that order."""
    plan = jobs[0].plan
    return Batch.of([j.payload for j in jobs], flat_plan(plan, jobs) if plan is not None else None)


def flat_plan(plan: BatchPlan, jobs: Sequence[Job]) -> PackingPlan:
    """The policy's plan over jobs, re-indexed to the merged flat text order (jobs in batch order, each
    job's texts in its own order). Jobs of the plan no longer in the batch (dropped unrun) are skipped."""
    first_text, offset = {}, 0
    for job in jobs:
        first_text[id(job)] = offset
        offset += job.num_texts
    rows = []
    for row in plan.rows:
        slots = [tuple(first_text[id(p.job)] + t for p in slot if id(p.job) in first_text for t in p.texts)
                 for slot in row]
        if slots := tuple(slot for slot in slots if slot):
            rows.append(slots)
    return PackingPlan(tuple(rows), plan.row_length, plan.slot_size)


def combine(outputs: Sequence[BatchOutput], group: Group) -> BatchOutput:
    """The group's combiner: adds the members' partial sums, then finishes (softmax / L2 / none)."""
    first = outputs[0]
    total = np.sum([o.values.astype(np.float64) for o in outputs], axis=0)
    if first.finish == FINISH_SOFTMAX:
        total = softmax(total)
    elif first.finish == FINISH_L2:
        total /= np.maximum(np.linalg.norm(total, axis=1, keepdims=True), 1e-12)
    meta = replace(first.meta, student_count=group.students, worker_id=group.worker_id,
                   compute_ms=max(o.meta.compute_ms for o in outputs), worker_ms=max(o.meta.worker_ms for o in outputs))
    return replace(first, values=total.astype(np.float32), meta=meta, finish=FINISH_NONE)


def deliver_partial(output: BatchOutput, jobs: Sequence[Job]) -> None:
    """A worker's early answer for rows of the merged batch, split to the jobs those rows belong to (each its
    own rows, numbered within the job), for those that want early answers. A text released before, by a run of its
    batch that a lost worker cut short, is not sent again."""
    start, by_row = 0, {row: i for i, row in enumerate(output.rows)}
    for job in jobs:
        released = job.released or ()
        mine = [(row - start, by_row[row]) for row in range(start, start + job.num_texts)
                if row in by_row and row - start not in released]
        start += job.num_texts
        if not mine or job.on_partial is None or job.future.done():
            continue
        job.released = {*released, *(local for local, _ in mine)}
        job.on_partial(replace(output, values=output.values[[i for _, i in mine]],
                               rows=tuple(local for local, _ in mine)))
