"""The `concat` (TCB DAS + ConcatBatching) and `bucketed` policies under the Dispatcher, on a fake clock:
the batch a freed group gets, the plan that goes with it to the worker, expiry, oversize requests."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from academus.services.scheduler.core import Dispatcher, Job
from academus.services.scheduler.policies import (
    BucketedPolicy,
    ConcatPolicy,
    ConcatSettings,
    LatencyModel,
    PaddedPolicy,
    make_policy,
)
from academus.services.scheduler.sender import batch_of
from academus.services.scheduler.server import policy_from
from academus.shared.models.packing import pack
from academus.shared.models.work import WorkItem
from academus.shared.models.work_wire import batch_to_pb, plan_from_pb
from academus.shared.runtime import config as cfg
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from academus.v1 import worker_pb2
from tests.unit.test_scheduler_core import Clock

BATCH_S = 0.010   # every fake batch takes 10 ms of clock time, whatever its shape


def fixed() -> LatencyModel:
    """A latency model that already knows it: 10 ms a batch."""
    return LatencyModel(overhead_s=BATCH_S, per_token_s=1e-12)


class FakeWorker:
    """`send` that records each batch and the worker request it goes as, and waits for the test."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.batches: list[list[Job]] = []
        self.requests: list[worker_pb2.RunRequest] = []
        self.answers: list[asyncio.Future] = []

    async def send(self, group, batch):
        self.batches.append(list(batch))
        self.requests.append(batch_to_pb(batch_of(batch)))
        answer = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        await answer
        self.clock.now += BATCH_S
        return [job.payload.request_id for job in batch]


def job(clock: Clock, lengths: tuple[int, ...], name: str = "", deadline_in: float = 5.0, model: str = "minilm") -> Job:
    ids = [101 + k for n in lengths for k in range(n)]
    payload = WorkItem(model, "embedding", ids, list(lengths), request_id=name)
    return Job(model=model, payload=payload, num_texts=len(lengths), num_tokens=sum(lengths),
               deadline=clock() + deadline_in, enqueued_at=clock(), batch_key=(model,), max_length=max(lengths),
               lengths=lengths)


def dispatcher(policy) -> tuple[Dispatcher, Clock, FakeWorker]:
    clock = Clock()
    worker = FakeWorker(clock)
    d = Dispatcher(policy, worker.send, 1024, 25, clock)
    d.update_workers({"w0": ("127.0.0.1:1", frozenset({"minilm", "spam"}))})
    return d, clock, worker


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def queue_behind_a_running_batch(d: Dispatcher, clock: Clock, worker: FakeWorker,
                                       jobs: list[Job]) -> list[asyncio.Task]:
    """Occupies the only worker with a first job, then queues `jobs` so the next dispatch sees them all."""
    tasks = [asyncio.create_task(d.submit(job(clock, (5,), "busy")))]
    await settle()
    for j in jobs:
        tasks.append(asyncio.create_task(d.submit(j)))
        clock.now += 0.001
    await settle()
    return tasks


def placed_texts(request: worker_pb2.RunRequest) -> list[int]:
    return sorted(t for row in request.packing.rows for slot in row.slots for t in slot.requests)


async def release(worker: FakeWorker, k: int) -> None:
    worker.answers[k].set_result(None)
    await settle()


async def finish(worker: FakeWorker, tasks: list[asyncio.Task], return_exceptions: bool = False) -> list:
    """Answers every batch sent until every caller has its result (or, with `return_exceptions`, its refusal)."""
    while not all(t.done() for t in tasks):
        pending = [a for a in worker.answers if not a.done()]
        assert pending, "a caller waits but no batch is running"
        pending[0].set_result(None)
        await settle()
    return await asyncio.gather(*tasks, return_exceptions=return_exceptions)


async def test_das_packs_many_requests_into_rows_and_the_plan_reaches_the_worker():
    d, clock, worker = dispatcher(ConcatPolicy(row_length=32, rows=2, latency=fixed()))
    lengths = [10, 20, 6, 12, 30, 9, 8]
    tasks = await queue_behind_a_running_batch(d, clock, worker, [job(clock, (n,), f"j{n}") for n in lengths])
    await release(worker, 0)
    batch, request = worker.batches[1], worker.requests[1]
    assert len(batch) > 2 and len(request.packing.rows) <= 2
    assert request.packing.row_length == request.packing.slot_size == 32
    assert placed_texts(request) == list(range(len(batch)))          # every text of the batch exactly once
    flat = list(request.tokens.lengths)
    for row in request.packing.rows:
        assert sum(flat[t] for t in row.slots[0].requests) <= 32     # no row over L
    # DAS takes the shortest first (utility 1/l): 6, 8, 9 are all in, the 30-token one waits
    assert {6, 8, 9} <= {j.num_tokens for j in batch} and 30 not in {j.num_tokens for j in batch}
    pack([[0] * n for n in flat], plan_from_pb(request))        # the worker accepts the plan as is
    assert sorted(await finish(worker, tasks)) == sorted(["busy", *(f"j{n}" for n in lengths)])


async def test_requests_that_cannot_meet_their_deadline_are_answered_and_never_computed():
    d, clock, worker = dispatcher(ConcatPolicy(row_length=64, rows=4, latency=fixed()))
    doomed = job(clock, (10,), "doomed", deadline_in=0.5)
    fine = job(clock, (12,), "fine", deadline_in=5.0)
    tasks = await queue_behind_a_running_batch(d, clock, worker, [doomed, fine])
    clock.now = doomed.deadline - 0.005     # still alive, but one batch (10 ms) would end past it
    await release(worker, 0)
    with pytest.raises(DeadlineExceeded, match="not computed"):
        await tasks[1]
    assert all(doomed is not j for batch in worker.batches for j in batch)
    assert [j.payload.request_id for j in worker.batches[1]] == ["fine"] and d.stats.expired == 1
    await release(worker, 1)
    assert await tasks[2] == "fine"


async def test_an_oversize_request_runs_alone_in_rows_of_its_own_never_truncated():
    d, clock, worker = dispatcher(ConcatPolicy(row_length=32, rows=4, latency=fixed()))
    tasks = await queue_behind_a_running_batch(d, clock, worker, [job(clock, (70,), "long"),
                                                                  job(clock, (8, 40, 9), "multi")])
    await release(worker, 0)
    await release(worker, 1)
    requests = worker.requests[1:]
    texts = {r.batch_id: list(r.tokens.lengths) for r in requests}
    long_request = next(r for r in requests if "long" in r.batch_id)
    long_index = list(long_request.tokens.lengths).index(70)
    slots = [list(s.requests) for row in long_request.packing.rows for s in row.slots]
    assert [long_index] in slots                                   # the 70-token text sits alone in its slot
    assert sum(sum(v) for v in texts.values()) == 70 + 8 + 40 + 9  # nothing cut off
    for r in requests:
        pack([[0] * n for n in r.tokens.lengths], plan_from_pb(r))
    assert sorted(await asyncio.gather(*tasks[1:])) == ["long", "multi"]


async def test_oversize_reject_refuses_at_once_naming_the_limit():
    d, clock, worker = dispatcher(ConcatPolicy(row_length=32, rows=4, oversize="reject", latency=fixed()))
    with pytest.raises(InvalidArgument, match=r"33 tokens .* L=32 \(ACADEMUS_CONCAT_ROW_LENGTH\)"):
        await d.submit(job(clock, (10, 33), "too-long"))
    assert worker.batches == [] and len(d.policy) == 0
    task = asyncio.create_task(d.submit(job(clock, (32,), "just-fits")))
    await settle()
    await release(worker, 0)
    assert await task == "just-fits"


async def test_slotted_das_cuts_rows_into_slots_of_z():
    d, clock, worker = dispatcher(make_policy("concat-slotted", concat=ConcatSettings(row_length=64, rows=2),
                                              latency=fixed()))
    lengths = [7, 9, 12, 14, 10, 8, 11]
    tasks = await queue_behind_a_running_batch(d, clock, worker, [job(clock, (n,), f"j{n}") for n in lengths])
    await release(worker, 0)
    packing = worker.requests[1].packing
    z = packing.slot_size
    assert z < 64 and all(len(row.slots) <= 64 // z for row in packing.rows)
    flat = list(worker.requests[1].tokens.lengths)
    assert all(sum(flat[t] for t in slot.requests) <= z for row in packing.rows for slot in row.slots)
    assert sorted(await finish(worker, tasks)) == sorted(["busy", *(f"j{n}" for n in lengths)])


@pytest.mark.parametrize(("name", "expected"), [("concat-fcfs", "first"), ("concat-sjf", "short"),
                                                ("concat-edf", "urgent"), ("concat", "short")])
async def test_row_fill_baselines_on_the_same_engine(name, expected):
    """One row of 20 tokens: each selection takes a different one of three 15-token-or-less requests."""
    d, clock, worker = dispatcher(make_policy(name, concat=ConcatSettings(row_length=20, rows=1), latency=fixed()))
    queued = [job(clock, (15,), "first", deadline_in=5), job(clock, (14,), "urgent", deadline_in=1),
              job(clock, (6,), "short", deadline_in=5)]
    for k, j in enumerate(queued):
        j.enqueued_at += k * 0.001                                 # arrival order: first, urgent, short
    await queue_behind_a_running_batch(d, clock, worker, queued)
    await release(worker, 0)
    assert worker.batches[1][0].payload.request_id == expected


@pytest.mark.parametrize("due_first", [True, False])
async def test_a_long_request_das_passes_over_starts_within_the_queues_wait_bound(due_first):
    """Short requests keep coming, three a batch. DAS fills each row of 32 with them, so a long request
    (30 tokens) waits until its deadline (`due_first` off: the ablation). Admitted on the promise of the
    scheduler's wait bound, it starts within it, give or take a batch."""
    d, clock, worker = dispatcher(ConcatPolicy(row_length=32, rows=1, latency=fixed(), due_first=due_first))
    d.max_queue_wait_s = 0.05
    shorts = [job(clock, (8,), f"s{k}") for k in range(4)]
    tasks = await queue_behind_a_running_batch(d, clock, worker, [job(clock, (30,), "long"), *shorts])
    for k in range(10):
        await release(worker, k)
        tasks += [asyncio.create_task(d.submit(job(clock, (8,), f"s{k}.{n}"))) for n in range(3)]
        await settle()
    ran = [j for batch in worker.batches for j in batch if j.payload.request_id == "long"]
    if due_first:
        assert ran and ran[0].started_at - ran[0].enqueued_at <= d.max_queue_wait_s + BATCH_S
    else:
        assert not ran and len(worker.batches) == 11     # ten rounds of shorts
    # the first batch took 15 ms (the clock moved as jobs queued), the rest 10 ms: that deviation is admission's
    # margin, so a few shorts arriving in the first rounds are refused at once; every admitted job is answered
    answers = await finish(worker, tasks, return_exceptions=True)
    refused = [a for a in answers if isinstance(a, BaseException)]
    assert answers[1] == "long" and all(isinstance(e, ResourceExhausted) for e in refused)


def test_plan_is_reindexed_to_the_merged_order_and_skips_jobs_dropped_before_sending():
    clock = Clock()
    policy = ConcatPolicy(row_length=40, rows=2, latency=fixed())
    jobs = [job(clock, (5, 6), "a"), job(clock, (30,), "b"), job(clock, (4,), "c")]
    for j in jobs:
        policy.push(j, clock())
    batch = policy.next_batch(lambda j: True, clock())
    assert {j.payload.request_id for j in batch} == {"a", "b", "c"}
    kept = [j for j in batch if j.payload.request_id != "b"]          # "b" was cancelled by its caller
    request = batch_to_pb(batch_of(kept))
    assert list(request.tokens.lengths) == [n for j in kept for n in j.lengths]
    assert placed_texts(request) == [0, 1, 2]
    pack([[0] * n for n in request.tokens.lengths], plan_from_pb(request))


async def test_bucketed_groups_similar_lengths_and_pads_without_a_plan():
    d, clock, worker = dispatcher(BucketedPolicy(max_batch=3, latency=fixed()))
    lengths = [60, 8, 61, 9, 62, 10]
    tasks = await queue_behind_a_running_batch(d, clock, worker, [job(clock, (n,), f"j{n}") for n in lengths])
    await release(worker, 0)
    await release(worker, 1)
    sizes = sorted(sorted(j.num_tokens for j in batch) for batch in worker.batches[1:3])
    assert sizes == [[8, 9, 10], [60, 61, 62]]
    assert not any(r.HasField("packing") for r in worker.requests)
    assert len(await finish(worker, tasks)) == 7


def test_latency_model_fits_overhead_and_per_token_cost():
    model = LatencyModel(overhead_s=0.002, per_token_s=1e-6, memory=20)
    assert model(2, 512) == pytest.approx(0.002 + 1024e-6)         # the prior before any batch
    for _ in range(200):
        for tokens in (64, 512, 1024):
            model.observe(tokens, 0.015 + tokens * 40e-6)
    assert model.overhead_s == pytest.approx(0.015, rel=1e-3) and model.per_token_s == pytest.approx(40e-6, rel=1e-3)
    for _ in range(200):                                           # one shape only: its level is followed
        model.observe(1024, 0.080)
    assert model(1, 1024) == pytest.approx(0.080, rel=1e-3)


def test_depth_counts_waiting_batches_not_requests():
    clock, policy = Clock(), ConcatPolicy(row_length=32, rows=2)
    for _ in range(16):
        policy.push(job(clock, (8,)), clock())
    assert len(policy) == 16 and policy.depth() == 2               # 128 tokens = two batches of 2 x 32


@pytest.mark.parametrize("make", [lambda: ConcatPolicy(row_length=32, rows=2), lambda: BucketedPolicy(max_batch=4)])
def test_depth_follows_the_queue_through_pushes_batches_and_removals(make):
    """`depth` keeps a tally as jobs come and go (it runs on every admission): it always equals the count over the
    waiting jobs, whole and per model, expired jobs dropped by DAS and texts longer than a row included."""
    clock, policy, draw = Clock(), make(), random.Random(7)

    def counted(model: str | None) -> int:
        waiting = policy.waiting_of(model)
        if isinstance(policy, ConcatPolicy):
            return math.ceil(sum(min(j.num_tokens, 32) for j in waiting) / 64)
        return math.ceil(len(waiting) / 4)

    for step in range(400):
        action = draw.random()
        if action < 0.6:
            lengths = tuple(draw.choice((3, 8, 20, 40)) for _ in range(draw.randint(1, 2)))
            policy.push(job(clock, lengths, deadline_in=draw.choice((0.001, 5.0)), model=draw.choice("ab")),
                        clock(), front=draw.random() < 0.1)
        elif action < 0.85:
            policy.next_batch(lambda j: j.model == "a" or draw.random() < 0.5, clock())
        else:
            policy.remove(lambda j: draw.random() < 0.2)
        clock.now += 0.0005
        assert [policy.depth(m) for m in (None, "a", "b")] == [counted(m) for m in (None, "a", "b")], step
    assert len(policy) and policy.take_dropped()   # the run queued and dropped jobs along the way


def test_a_concat_batch_computes_its_rows_tokens_and_a_full_one_r_times_l():
    """What the admission estimate multiplies the smoothed time a token by."""
    clock, policy = Clock(), ConcatPolicy(row_length=32, rows=2)
    for _ in range(12):
        policy.push(job(clock, (8,)), clock())
    formed = policy.next_batch(lambda _: True, clock())               # four jobs a row of 32 tokens
    assert len(formed) == 8 and policy.computed_tokens(formed) == 64 == policy.full_batch_tokens()
    assert policy.computed_tokens(policy.next_batch(lambda _: True, clock())) == 32   # the four left: one row
    assert PaddedPolicy().full_batch_tokens() is None and PaddedPolicy().computed_tokens(formed) is None


def test_padded_depth_counts_waiting_batches_too():
    """The admission check multiplies depth by one batch time: counting jobs refused nearly everything."""
    clock, policy = Clock(), PaddedPolicy(max_batch=16)
    for _ in range(40):
        policy.push(job(clock, (8,)), clock())
    assert policy.depth() == 3


def test_settings_are_checked():
    with pytest.raises(ValueError, match="slotted needs das"):
        ConcatPolicy(selection="fcfs", slotted=True)
    with pytest.raises(cfg.ConfigError, match="ACADEMUS_CONCAT_ETA"):
        cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_CONCAT_ETA": "1.0"})
    with pytest.raises(cfg.ConfigError, match="ACADEMUS_CONCAT_SELECTION"):
        cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_CONCAT_SELECTION": "lifo"})
    with pytest.raises(cfg.ConfigError, match="ACADEMUS_CONCAT_ROW_LENGTH"):
        cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_CONCAT_ROW_LENGTH": "1000"})
    config = cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_POLICY": "concat-slotted", "ACADEMUS_CONCAT_SLOTTED": "true"})
    assert config.concat_slotted and isinstance(make_policy(config.policy), ConcatPolicy)
    assert make_policy("concat-slotted").slotted and make_policy("concat-edf").selection == "edf"
    ablation = cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_POLICY": "concat", "ACADEMUS_CONCAT_DUE_FIRST": "false"})
    default = cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_POLICY": "concat"})
    assert not policy_from(ablation).due_first and policy_from(default).due_first


def test_the_policy_counts_the_groups_that_run_its_batches_side_by_side():
    """DAS counts how soon the batches after this one start (`das._urgent`): a batch every batch time over the
    live groups. The dispatcher tells the policy its groups as workers come and go."""
    policy = ConcatPolicy(row_length=32, rows=1, latency=fixed())
    d, _, _ = dispatcher(policy)
    assert policy.lanes == 1
    live = {f"w{k}": (f"127.0.0.1:{k + 1}", frozenset({"minilm"})) for k in range(3)}
    d.update_workers(live)
    assert policy.lanes == 3
    d.update_workers({k: v for k, v in live.items() if k != "w2"})
    assert policy.lanes == 2


def test_a_job_queued_before_the_wait_bound_is_set_is_due_by_it():
    """The policy makes each job's DAS item as it queues. A bound set later (a deployment's setting read after
    jobs arrived) reaches the jobs already waiting: the long one, passed over by utility, goes first once due."""
    clock, policy = Clock(), ConcatPolicy(row_length=32, rows=1)
    policy.push(job(clock, (30,), "long"), clock())
    for k in range(4):
        policy.push(job(clock, (8,), f"s{k}"), clock())
    clock.now += 0.1
    unbound = policy.next_batch(lambda j: True, clock())
    assert [j.payload.request_id for j in unbound] == ["s0", "s1", "s2", "s3"]   # the shorts, by utility
    for k in range(4):
        policy.push(job(clock, (8,), f"t{k}"), clock())
    policy.bound_wait(0.05)   # the long job has waited 0.1 s: past due
    assert [j.payload.request_id for j in policy.next_batch(lambda j: True, clock())] == ["long"]


def test_jobs_alike_in_every_field_are_batched_each_as_itself():
    """A decision names jobs by identity: two equal-looking jobs (a client sending the same text twice at once)
    each get a place in the rows and the plan."""
    clock, policy = Clock(), ConcatPolicy(row_length=32, rows=1)
    first = job(clock, (8,), "same")
    second = Job(**{name: getattr(first, name) for name in first.__dataclass_fields__})
    policy.push(first, clock())
    policy.push(second, clock())
    batch = policy.next_batch(lambda j: True, clock())
    assert len(batch) == 2 and batch[0] is not batch[1] and {id(j) for j in batch} == {id(first), id(second)}
    pieces = [piece.job for row in batch[0].plan.rows for slot in row for piece in slot]
    assert len(pieces) == 2 and {id(j) for j in pieces} == {id(first), id(second)}
    assert len(policy) == 0
