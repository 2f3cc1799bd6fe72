"""The dispatcher without gRPC: immediate dispatch, queueing, deadlines, lost workers, admission; and the
group sender over real gRPC, telling a lost worker from one that answered."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import REGISTRY

from academus.services.scheduler.core import (
    ABANDON_FACTOR,
    ABANDON_MIN_S,
    PROBE_AGAIN_S,
    Dispatcher,
    Group,
    Job,
    Member,
    WorkerLost,
    WorkerRef,
)
from academus.services.scheduler.policies import ConcatPolicy, FifoPolicy, PaddedPolicy, StudentPolicy, make_policy
from academus.shared.models.work import WorkItem
from academus.shared.runtime.errors import DeadlineExceeded, ResourceExhausted, Unavailable, abort_with
from academus.shared.runtime.multiplex import serve_multiplexed
from academus.shared.runtime.serving import Stubs
from academus.v1 import worker_pb2_grpc
from tests.conftest import sample


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeWorkers:
    """A controllable `send`: each call waits until the test releases or fails it. A batch of one is
    answered with the value given; a larger batch with that value once per job."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Job, asyncio.Future]] = []
        self.batches: list[list[Job]] = []

    async def send(self, worker, batch):
        fut = asyncio.get_running_loop().create_future()
        self.calls.append((worker.worker_id, batch[0], fut))
        self.batches.append(list(batch))
        value = await fut
        return [value] * len(batch)


def make_job(clock: Clock, model: str = "spam", deadline_in: float = 5.0, payload: object = None,
             texts: int = 1) -> Job:
    return Job(model=model, payload=payload, num_texts=texts, num_tokens=8 * texts,
               deadline=clock() + deadline_in, enqueued_at=clock(), batch_key=(model,))


def make_dispatcher(workers: dict[str, set[str]], capacity: int = 8, policy=None):
    clock, fake = Clock(), FakeWorkers()
    d = Dispatcher(policy if policy is not None else FifoPolicy(), fake.send, capacity, 25, clock)
    d.update_workers({w: (f"127.0.0.1:{i}", frozenset(m)) for i, (w, m) in enumerate(workers.items())})
    return d, clock, fake


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def dropped(reason: str) -> float:
    return sample("academus_scheduler_dropped_total", reason=reason)


async def test_idle_worker_takes_job_at_once_and_result_returns():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    task = asyncio.create_task(d.submit(make_job(clock, payload="x")))
    await settle()
    assert [c[0] for c in fake.calls] == ["w0"]
    fake.calls[0][2].set_result("done")
    assert await task == "done"
    assert d.load() == {"queued": 0, "idle": 1, "groups": 1, "workers": 1, "buffer": 0}


async def test_busy_worker_queues_fifo_and_drains_in_order():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    tasks = [asyncio.create_task(d.submit(make_job(clock, payload=i))) for i in range(3)]
    await settle()
    assert len(fake.calls) == 1 and len(d.policy) == 2
    for expected in range(3):
        assert fake.calls[expected][1].payload == expected
        fake.calls[expected][2].set_result(expected)
        await settle()
    assert await asyncio.gather(*tasks) == [0, 1, 2]


async def test_a_freed_group_takes_the_waiting_job_before_the_finished_one_is_answered():
    """Answering runs the callers' code on the same loop: the waiting job's call goes out first."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    events: list[str] = []
    send = d.send

    async def recorded_send(group, batch):
        events.append(f"sent {batch[0].payload}")
        return await send(group, batch)

    async def caller(i: int) -> None:
        await d.submit(make_job(clock, payload=i))
        events.append(f"answered {i}")

    d.send = recorded_send
    tasks = [asyncio.create_task(caller(i)) for i in range(2)]
    await settle()
    fake.calls[0][2].set_result("done")
    await settle()
    fake.calls[1][2].set_result("done")
    await asyncio.gather(*tasks)
    assert events == ["sent 0", "sent 1", "answered 0", "answered 1"]


async def test_job_goes_only_to_a_worker_serving_its_model():
    d, clock, fake = make_dispatcher({"w0": {"minilm"}, "w1": {"spam"}})
    task = asyncio.create_task(d.submit(make_job(clock, model="spam")))
    await settle()
    assert fake.calls[0][0] == "w1"
    fake.calls[0][2].set_result(1)
    await task


async def test_unknown_model_is_unavailable_at_once():
    d, clock, _ = make_dispatcher({"w0": {"minilm"}})
    with pytest.raises(Unavailable, match="no live worker serves model 'spam'"):
        await d.submit(make_job(clock, model="spam"))


async def test_full_queue_is_resource_exhausted_with_pushback():
    d, clock, _fake = make_dispatcher({"w0": {"spam"}}, capacity=1)
    first = asyncio.create_task(d.submit(make_job(clock)))
    second = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    with pytest.raises(ResourceExhausted) as info:
        await d.submit(make_job(clock))
    assert info.value.pushback_ms == 25 and d.stats.rejected == 1
    first.cancel()
    second.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


async def test_expired_job_is_answered_and_never_sent():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    expired = dropped("expired")
    running = asyncio.create_task(d.submit(make_job(clock, deadline_in=10)))
    late = asyncio.create_task(d.submit(make_job(clock, deadline_in=1, payload="late")))
    await settle()
    clock.now += 2
    fake.calls[0][2].set_result("ok")
    await settle()
    with pytest.raises(DeadlineExceeded, match="not computed"):
        await late
    assert await running == "ok"
    assert [c[1].payload for c in fake.calls] == [None]
    assert d.stats.expired == 1 and dropped("expired") == expired + 1


async def test_expire_waiting_answers_queued_jobs_without_a_free_worker():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    running = asyncio.create_task(d.submit(make_job(clock, deadline_in=10)))
    late = asyncio.create_task(d.submit(make_job(clock, deadline_in=1)))
    await settle()
    clock.now += 2
    assert d.expire_waiting() == 1
    with pytest.raises(DeadlineExceeded):
        await late
    fake.calls[0][2].set_result("ok")
    await running


async def test_cancelled_caller_is_skipped_and_cancels_downstream():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    cancelled = dropped("cancelled")
    running = asyncio.create_task(d.submit(make_job(clock)))
    waiting = asyncio.create_task(d.submit(make_job(clock, payload="gone")))
    await settle()
    waiting.cancel()
    running.cancel()
    await settle()
    assert fake.calls[0][2].cancelled()  # the in-flight downstream call was cancelled too
    await settle()
    assert all(c[1].payload != "gone" for c in fake.calls)
    assert d.stats.cancelled == 1 and dropped("cancelled") == cancelled + 1


async def test_a_batch_is_cancelled_downstream_only_once_every_caller_left():
    d, clock, fake = make_dispatcher({"w0": {"spam"}}, policy=PaddedPolicy(max_batch=2, max_delay_s=0.5))
    callers = [asyncio.create_task(d.submit(make_job(clock, payload=i))) for i in range(2)]
    await settle()
    assert [[j.payload for j in b] for b in fake.batches] == [[0, 1]]
    callers[0].cancel()
    await settle()
    assert not fake.calls[0][2].cancelled()  # caller 1 still waits for the batch
    callers[1].cancel()
    await settle()
    assert fake.calls[0][2].cancelled()      # nobody waits: the worker's call is cancelled
    assert d.load()["idle"] == 1


async def test_lost_worker_is_retried_on_another_group():
    d, clock, fake = make_dispatcher({"w0": {"spam"}, "w1": {"spam"}})
    task = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    first = fake.calls[0][0]
    fake.calls[0][2].set_exception(WorkerLost("connection refused"))
    await settle()
    assert len(fake.calls) == 2 and fake.calls[1][0] != first
    fake.calls[1][2].set_result("second")
    assert await task == "second"
    assert d.stats.retried == 1


async def test_a_batch_a_departed_worker_holds_is_given_up_once_overdue_and_runs_elsewhere():
    """A hung worker's open connection neither answers nor refuses: once its heartbeat's key lapsed (and its probe
    went unanswered: none here), its batch is retried on a live worker instead of waiting out the deadline."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}, "w1": {"spam"}})
    job = asyncio.create_task(d.submit(make_job(clock, deadline_in=10.0)))
    await settle()
    hung = fake.calls[0][0]
    other = "w1" if hung == "w0" else "w0"
    d.update_workers({other: (f"127.0.0.1:{int(other[1])}", frozenset({"spam"}))})
    await settle()
    assert len(fake.calls) == 1 and d.stats.abandoned == 0   # a worker that stopped drains within the batch's time
    clock.now += ABANDON_MIN_S
    assert d.expire_waiting() == 0   # nothing queued expired; the flight is given up
    await settle()
    assert d.stats.abandoned == 1 and [c[0] for c in fake.calls] == [hung, other]
    fake.calls[1][2].set_result("elsewhere")
    assert await job == "elsewhere"
    assert d.stats.retried == 1 and not d._flights


async def test_a_departed_worker_that_answers_its_probe_keeps_its_batch_and_one_that_does_not_loses_it():
    """Past its estimate, a departed worker is asked whether it still answers: one draining after it deregistered
    does and keeps its batch (asked again PROBE_AGAIN_S later); a hung one does not."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}, "w1": {"spam"}})
    answers, asked = [True, False], []

    async def probe(worker: WorkerRef) -> bool:
        asked.append(worker.worker_id)
        return answers.pop(0)

    d.probe = probe
    job = asyncio.create_task(d.submit(make_job(clock, deadline_in=10.0)))
    await settle()
    held = fake.calls[0][0]
    other = "w1" if held == "w0" else "w0"
    d.update_workers({other: (f"127.0.0.1:{int(other[1])}", frozenset({"spam"}))})
    clock.now += ABANDON_MIN_S
    d.expire_waiting()
    await settle()
    assert asked == [held] and d.stats.abandoned == 0 and len(fake.calls) == 1   # draining: left to finish
    d.expire_waiting()
    await settle()
    assert asked == [held]   # not asked again within PROBE_AGAIN_S
    clock.now += PROBE_AGAIN_S
    d.expire_waiting()
    await settle()
    assert asked == [held, held] and d.stats.abandoned == 1   # no answer now: hung
    assert [c[0] for c in fake.calls] == [held, other]
    fake.calls[1][2].set_result("elsewhere")
    assert await job == "elsewhere"


async def test_a_slow_batch_on_a_listed_worker_is_never_given_up():
    d, clock, fake = make_dispatcher({"w0": {"spam"}, "w1": {"spam"}})
    job = asyncio.create_task(d.submit(make_job(clock, deadline_in=1000.0)))
    await settle()
    clock.now += 100 * ABANDON_MIN_S   # slow is not hung: the heartbeat's TTL decides
    d.abandon_departed()
    await settle()
    assert d.stats.abandoned == 0
    fake.calls[0][2].set_result("slow")
    assert await job == "slow" and len(fake.calls) == 1


async def test_a_departed_workers_batch_within_its_time_is_left_to_finish():
    """A worker that deregistered drains what it runs: its batch is given up only past ABANDON_FACTOR times its
    measured time."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.service_s["spam"], d.batch_texts["spam"] = 2.0, 1.0
    job = asyncio.create_task(d.submit(make_job(clock, deadline_in=100.0)))
    await settle()
    d.update_workers({})
    clock.now += ABANDON_FACTOR * 2.0 - 0.1
    d.abandon_departed()
    await settle()
    assert d.stats.abandoned == 0
    fake.calls[0][2].set_result("drained")
    assert await job == "drained"


@pytest.mark.parametrize(("deadline_in", "lost_after", "service_s", "why"), [
    (1.0, 2.0, None, "worker lost, and the deadline passed before a retry"),
    (0.6, 0.5, 0.5, "worker lost, and no time left to retry"),   # a batch takes 500 ms; 100 ms are left
])
async def test_a_lost_worker_whose_job_has_no_time_left_to_retry_is_unavailable(deadline_in, lost_after, service_s,
                                                                                why):
    """DESIGN §8: a worker lost mid-request is retried while the deadline allows, else UNAVAILABLE: so
    when the deadline passed meanwhile, and when the retry could not finish in time."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}, "w1": {"spam"}})
    if service_s is not None:
        d.service_s["spam"] = service_s
    job = asyncio.create_task(d.submit(make_job(clock, deadline_in=deadline_in)))
    await settle()
    clock.now += lost_after
    fake.calls[0][2].set_exception(WorkerLost("connection reset"))
    with pytest.raises(Unavailable, match=why):
        await job
    assert len(fake.calls) == 1                                # not sent again


async def test_a_lost_worker_stays_out_while_redis_still_lists_it_and_is_back_after_its_quarantine():
    """Until its heartbeat key expires Redis lists a dead worker: a refresh then must not send it the
    retry. Listed after a heartbeat TTL, it is alive (its key renewed), and it serves again."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}, "w1": {"spam"}})
    live = {w: (d.workers[w].address, frozenset({"spam"})) for w in ("w0", "w1")}
    first = asyncio.create_task(d.submit(make_job(clock)))
    second = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    assert sorted(c[0] for c in fake.calls) == ["w0", "w1"]
    lost = next(c for c in fake.calls if c[0] == "w1")
    lost[2].set_exception(WorkerLost("connection refused", "w1"))
    await settle()
    d.update_workers(live)                       # the refresh, within the quarantine
    assert d.workers["w1"].lost and d.stats.retried == 1
    assert d.model_load()["spam"]["groups"] == 1   # its group is neither idle nor busy: not there
    d.service_s["spam"] = 1.0
    with pytest.raises(DeadlineExceeded, match="cannot be met"):    # a second of work ahead, for one live group
        await d.submit(make_job(clock, deadline_in=0.8))
    next(c for c in fake.calls if c[0] == "w0")[2].set_result("w0 first")
    await settle()
    assert [c[0] for c in fake.calls[2:]] == ["w0"]   # the retry went to the live worker, not back to w1
    fake.calls[2][2].set_result("w0 again")
    assert sorted(await asyncio.gather(first, second)) == ["w0 again", "w0 first"]
    clock.now += d.lost_quarantine_s
    d.update_workers(live)                       # still listed a TTL later: alive again
    assert not d.workers["w1"].lost
    assert d.model_load()["spam"]["groups"] == 2
    third = asyncio.create_task(d.submit(make_job(clock)))
    fourth = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    assert sorted(c[0] for c in fake.calls[3:]) == ["w0", "w1"]
    for call in fake.calls[3:]:
        call[2].set_result(call[0])
    assert sorted(await asyncio.gather(third, fourth)) == ["w0", "w1"]


async def test_a_lost_worker_listed_at_another_address_serves_at_once():
    """A worker back at another address (restarted, placed again) is not the one that was lost."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    task = asyncio.create_task(d.submit(make_job(clock, deadline_in=0.5)))
    await settle()
    fake.calls[0][2].set_exception(WorkerLost("connection refused", "w0"))
    with pytest.raises(Unavailable):
        await task
    d.update_workers({"w0": ("127.0.0.1:9999", frozenset({"spam"}))})
    assert not d.workers["w0"].lost
    again = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    fake.calls[1][2].set_result("back")
    assert await again == "back" and fake.calls[1][0] == "w0"


async def test_a_lost_worker_that_registers_again_on_its_address_serves_at_once():
    """A restart on the same address (the supervisor keeps the ports) registers anew: the new registration
    token proves a live process, so the quarantine does not hold it out; the same token does."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    address = d.workers["w0"].address
    d.update_workers({"w0": (address, frozenset({"spam"}), 1, "first")})
    task = asyncio.create_task(d.submit(make_job(clock, deadline_in=0.5)))
    await settle()
    fake.calls[0][2].set_exception(WorkerLost("connection refused", "w0"))
    with pytest.raises(Unavailable):
        await task
    d.update_workers({"w0": (address, frozenset({"spam"}), 1, "first")})   # the dead process, still listed
    assert d.workers["w0"].lost
    d.update_workers({"w0": (address, frozenset({"spam"}), 1, "second")})  # registered again, within the quarantine
    assert not d.workers["w0"].lost and d.workers["w0"].registration == "second"
    again = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    fake.calls[1][2].set_result("back")
    assert await again == "back" and fake.calls[1][0] == "w0"


async def test_lost_last_worker_is_unavailable_not_a_hang():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    running = asyncio.create_task(d.submit(make_job(clock)))
    queued = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    fake.calls[0][2].set_exception(WorkerLost("connection reset"))
    await settle()
    for task in (running, queued):
        with pytest.raises(Unavailable):
            await task


async def test_workers_leaving_placements_fail_their_waiting_jobs():
    d, clock, _fake = make_dispatcher({"w0": {"spam"}})
    running = asyncio.create_task(d.submit(make_job(clock)))
    queued = asyncio.create_task(d.submit(make_job(clock)))
    await settle()
    d.update_workers({})
    with pytest.raises(Unavailable):
        await queued
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="fifo"):
        make_policy("nope")


async def test_padded_waits_for_the_batch_to_fill_then_sends_one_merged_call():
    d, clock, fake = make_dispatcher({"w0": {"spam"}}, policy=PaddedPolicy(max_batch=4, max_delay_s=0.5))
    tasks = [asyncio.create_task(d.submit(make_job(clock, payload=i))) for i in range(3)]
    await settle()
    assert fake.calls == []  # 3 texts < 4 and the head has waited 0 s of its 0.5 s
    tasks.append(asyncio.create_task(d.submit(make_job(clock, payload=3))))
    await settle()
    assert [[j.payload for j in b] for b in fake.batches] == [[0, 1, 2, 3]]
    fake.calls[0][2].set_result("r")
    assert await asyncio.gather(*tasks) == ["r"] * 4


async def test_padded_sends_a_partial_batch_when_the_delay_expires():
    d, clock, fake = make_dispatcher({"w0": {"spam"}}, policy=PaddedPolicy(max_batch=8, max_delay_s=0.02))
    tasks = [asyncio.create_task(d.submit(make_job(clock, payload=i))) for i in range(2)]
    await settle()
    assert fake.calls == []
    clock.now += 0.05  # the dispatcher's timer fires on the real loop; the fake clock says it is due
    await asyncio.sleep(0.05)
    assert [[j.payload for j in b] for b in fake.batches] == [[0, 1]]
    fake.calls[0][2].set_result("r")
    await asyncio.gather(*tasks)


async def test_padded_batches_only_same_key_and_caps_at_max_batch():
    d, clock, fake = make_dispatcher({"w0": {"spam", "minilm"}}, policy=PaddedPolicy(max_batch=4, max_delay_s=0))
    jobs = [make_job(clock, "spam", payload="s3", texts=3), make_job(clock, "minilm", payload="m1"),
            make_job(clock, "spam", payload="s2", texts=2)]
    tasks = [asyncio.create_task(d.submit(j)) for j in jobs]
    await settle()
    assert [[j.payload for j in b] for b in fake.batches] == [["s3"]]  # s2 would overflow 4 texts
    fake.calls[0][2].set_result("a")
    await settle()
    assert [[j.payload for j in b] for b in fake.batches][1] == ["m1"]
    fake.calls[1][2].set_result("b")
    await settle()
    fake.calls[2][2].set_result("c")
    assert await asyncio.gather(*tasks) == ["a", "b", "c"]


def test_padded_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_batch"):
        make_policy("padded", max_batch=0, max_delay_s=0.01)


async def test_each_job_observes_its_queue_wait_once_at_its_first_dispatch():
    """Seconds from admission to dispatch, by policy and model: none for the job that found the worker free,
    the clock's 0.25 s for the one that waited for it; a retry after a lost worker is not observed again."""
    d, clock, fake = make_dispatcher({"w0": {"waits"}, "w1": {"waits"}})
    wait = {"policy": "fifo", "model": "waits"}
    count, total = (sample(f"academus_scheduler_queue_wait_seconds_{part}", **wait) for part in ("count", "sum"))
    tasks = [asyncio.create_task(d.submit(make_job(clock, model="waits", payload=i))) for i in range(3)]
    await settle()
    clock.now += 0.25
    fake.calls[0][2].set_exception(WorkerLost("connection refused"))   # retried first on the other worker
    await settle()
    for i in range(1, 4):   # w1 runs the second job, the retried one, then the one that waited
        fake.calls[i][2].set_result("r")
        await settle()
    assert await asyncio.gather(*tasks) == ["r"] * 3 and [c[0] for c in fake.calls] == ["w0", "w1", "w1", "w1"]
    assert sample("academus_scheduler_queue_wait_seconds_count", **wait) == count + 3
    assert sample("academus_scheduler_queue_wait_seconds_sum", **wait) == pytest.approx(total + 0.25)


async def test_the_student_number_of_each_student_model_with_a_live_group_is_on_metrics():
    """Set as the groups are formed from the resource manager's table (the S it adapts); a teacher model has
    none, and a student model left without a live group here loses its series."""
    from academus.services.scheduler.core import GroupTable, Member

    d = Dispatcher(StudentPolicy(), FakeWorkers().send, 8, 25, Clock())
    live = {"w0": ("127.0.0.1:0", frozenset({"s-number", "t-number"}), 2)}

    def table(students: int) -> dict[str, GroupTable]:
        return {"s-number": GroupTable("s-number", students, ((Member("w0", tuple(range(students))),),))}

    d.update_workers(live, table(3))
    assert REGISTRY.get_sample_value("academus_scheduler_student_number", {"model": "s-number"}) == 3
    assert REGISTRY.get_sample_value("academus_scheduler_student_number", {"model": "t-number"}) is None
    d.update_workers(live, table(2))   # adapted: the groups are re-formed with the new number
    assert REGISTRY.get_sample_value("academus_scheduler_student_number", {"model": "s-number"}) == 2
    d.update_workers({})               # its worker left
    assert REGISTRY.get_sample_value("academus_scheduler_student_number", {"model": "s-number"}) is None


# -- student groups across workers (eq. 6) and the `student` policy ------------------------------

def student_dispatcher(groups: list[list[tuple[str, tuple[int, ...]]]], capacity: int = 2, students: int = 2,
                       send_ahead: bool = False):
    from academus.services.scheduler.core import GroupTable, Member

    clock, fake = Clock(), FakeWorkers()
    d = Dispatcher(StudentPolicy(max_merge=4), fake.send, 8, 25, clock, send_ahead=send_ahead)
    workers = sorted({w for g in groups for w, _ in g})
    table = GroupTable("ss", students, tuple(tuple(Member(w, s) for w, s in g) for g in groups))
    d.update_workers({w: (f"127.0.0.1:{i}", frozenset({"ss"}), capacity) for i, w in enumerate(workers)},
                     {"ss": table})
    return d, clock, fake


def ss_job(clock: Clock, length: int = 10) -> Job:
    return Job(model="ss", payload=length, num_texts=1, num_tokens=length, deadline=clock() + 5,
               enqueued_at=clock(), batch_key=("ss",), max_length=length)


async def test_admission_counts_only_the_jobs_own_models_work_where_its_groups_run_nothing_else():
    """Two student models in one deployment, each its own group: six elements of `a` wait, and `b`'s
    group is busy with one job. A `b` job with 0.5 s left is admitted (nothing of `b` waits: `a`'s
    elements go to `a`'s group), an `a` job with the same deadline is refused (six batches of 0.2 s)."""
    from academus.services.scheduler.core import GroupTable, Member

    clock, fake = Clock(), FakeWorkers()
    d = Dispatcher(StudentPolicy(max_merge=1, overload_merge=1), fake.send, 16, 25, clock)   # elements of one
    tables = {m: GroupTable(m, 1, ((Member(f"w{m}", (0,)),),)) for m in ("a", "b")}
    d.update_workers({f"w{m}": (f"127.0.0.1:{i}", frozenset({m}), 1) for i, m in enumerate("ab")}, tables)
    d.service_s.update(a=0.2, b=0.2)

    def job(model: str, deadline_in: float = 5.0) -> Job:
        return Job(model=model, payload=model, num_texts=1, num_tokens=10, deadline=clock() + deadline_in,
                   enqueued_at=clock(), batch_key=(model,), max_length=10)

    running = [asyncio.create_task(d.submit(job(m))) for m in "ab"]
    waiting = [asyncio.create_task(d.submit(job("a"))) for _ in range(6)]
    await settle()
    assert len(fake.calls) == 2 and d.policy.depth() == d.policy.depth("a") == 6 and d.policy.depth("b") == 0
    admitted = asyncio.create_task(d.submit(job("b", deadline_in=0.5)))
    await settle()
    assert not admitted.done()                       # waits for b's group, not refused
    with pytest.raises(DeadlineExceeded, match="cannot be met"):
        await d.submit(job("a", deadline_in=0.5))
    for call in fake.calls[:2]:
        call[2].set_result(call[1].model)
    await settle()                                   # the groups free: b's takes the admitted job
    next(c for c in fake.calls[2:] if c[1].model == "b")[2].set_result("b")
    assert await admitted == "b"
    for task in [*running, *waiting]:
        task.cancel()
    await asyncio.gather(*running, *waiting, return_exceptions=True)


async def test_a_student_group_spans_its_members_and_runs_one_sample_at_once():
    d, clock, fake = student_dispatcher([[("w0", (0,)), ("w1", (1,))], [("w1", (0,)), ("w0", (1,))]])
    assert [g.name for g in d.groups] == ["ss/g0", "ss/g1"] and d.policy.capacity == 2
    task = asyncio.create_task(d.submit(ss_job(clock)))
    await settle()
    assert [c[0] for c in fake.calls] == ["w0+w1"] and len(fake.batches[0]) == 1  # the immediate path
    fake.calls[0][2].set_result("ok")
    assert await task == "ok"


async def test_when_every_group_is_busy_same_bin_samples_merge_in_the_buffer():
    d, clock, fake = student_dispatcher([[("w0", (0,)), ("w1", (1,))]], capacity=1)
    tasks = [asyncio.create_task(d.submit(ss_job(clock, n))) for n in (10, 11, 12, 40)]
    await settle()
    assert len(fake.calls) == 1  # one group: the first sample runs, the rest wait
    fake.calls[0][2].set_result("a")
    await settle()
    assert [j.payload for j in fake.batches[1]] == [11, 12]  # merged: one bin, one element
    fake.calls[1][2].set_result("b")
    await settle()
    assert [j.payload for j in fake.batches[2]] == [40]
    fake.calls[2][2].set_result("c")
    assert await asyncio.gather(*tasks) == ["a", "b", "b", "c"]


async def test_a_member_worker_without_free_slots_keeps_the_group_waiting():
    # both groups need w0; with capacity 1 on w0 only one group can run at a time
    d, clock, fake = student_dispatcher([[("w0", (0,)), ("w1", (1,))], [("w0", (1,)), ("w2", (0,))]], capacity=1)
    tasks = [asyncio.create_task(d.submit(ss_job(clock))) for _ in range(2)]
    await settle()
    assert len(fake.calls) == 1
    fake.calls[0][2].set_result("x")
    await settle()
    assert len(fake.calls) == 2
    fake.calls[1][2].set_result("y")
    assert await asyncio.gather(*tasks) == ["x", "y"]


async def test_a_lost_student_instance_retries_the_request_on_another_group():
    d, clock, fake = student_dispatcher([[("w0", (0, 1))], [("w1", (0, 1))]], capacity=2)
    assert d.policy.capacity == 2
    busy = asyncio.create_task(d.submit(ss_job(clock)))
    retried = asyncio.create_task(d.submit(ss_job(clock)))
    await settle()
    assert [c[0] for c in fake.calls] == ["w0", "w1"]
    fake.calls[1][2].set_exception(WorkerLost("gone", "w1"))
    await settle()
    assert d.workers["w1"].lost and d.stats.retried == 1
    assert d.policy.capacity == 1   # the buffer holds an element a live group: w1's is out
    fake.calls[0][2].set_result("first")
    await settle()
    assert fake.calls[2][0] == "w0"
    fake.calls[2][2].set_result("second")
    assert await asyncio.gather(busy, retried) == ["first", "second"]


def spanning(d: Dispatcher, workers: list[str]) -> None:
    """The resource manager's re-plan onto `workers`: one group of both students on the first."""
    from academus.services.scheduler.core import GroupTable, Member

    table = GroupTable("ss", 2, ((Member(workers[0], (0, 1)),),))
    d.update_workers({w: (f"127.0.0.1:{i}", frozenset({"ss"}), 2) for i, w in enumerate(workers)}, {"ss": table})


async def test_a_lost_worker_that_broke_every_group_holds_its_jobs_for_the_re_plan():
    """eq. 6 put a student of the one group on each worker: w1's loss leaves no group, but w0 still serves the
    model, so the batch in flight and a new request wait for the resource manager's re-plan onto w0."""
    d, clock, fake = student_dispatcher([[("w0", (0,)), ("w1", (1,))]], capacity=2)
    d.regroup_wait_s = 1.0
    lost = asyncio.create_task(d.submit(ss_job(clock)))
    await settle()
    fake.calls[0][2].set_exception(WorkerLost("gone", "w1"))
    await settle()
    assert d.workers["w1"].lost and d.serves("ss") and not lost.done()
    arriving_job = ss_job(clock)
    arriving = asyncio.create_task(d.submit(arriving_job))   # admitted, held: no group runs it yet
    await settle()
    assert len(fake.calls) == 1 and len(d.policy) == 2
    spanning(d, ["w0"])   # the re-plan: w1 left the placement, the group is whole on w0
    await settle()
    assert fake.calls[1][0] == "w0" and fake.batches[1] == fake.batches[0]   # the retry, at the head
    fake.calls[1][2].set_result("retried")
    await settle()
    assert fake.batches[2] == [arriving_job]
    fake.calls[2][2].set_result("held")
    assert await asyncio.gather(lost, arriving) == ["retried", "held"]
    assert d.stats.retried == 1


async def test_the_wait_for_a_re_plan_ends_in_unavailable():
    d, clock, fake = student_dispatcher([[("w0", (0,)), ("w1", (1,))]], capacity=2)
    d.regroup_wait_s = 0.05
    lost = asyncio.create_task(d.submit(ss_job(clock)))
    await settle()
    fake.calls[0][2].set_exception(WorkerLost("gone", "w1"))
    await settle()
    assert not lost.done()
    clock.now += 0.05   # the dispatcher's clock; the timer is the loop's
    await asyncio.sleep(0.1)
    with pytest.raises(Unavailable, match="no live worker serves model 'ss'"):
        await lost
    assert not d.serves("ss")
    with pytest.raises(Unavailable):
        await d.submit(ss_job(clock))


async def test_a_model_no_live_worker_serves_fails_at_once_despite_the_wait():
    """Nothing to re-plan onto (the lost worker was the model's only one): UNAVAILABLE at once, so that the
    gateway sends the model's requests to a scheduler that has workers for it."""
    d, clock, fake = student_dispatcher([[("w0", (0, 1))]], capacity=2)
    d.regroup_wait_s = 1.0
    lost = asyncio.create_task(d.submit(ss_job(clock)))
    await settle()
    fake.calls[0][2].set_exception(WorkerLost("gone", "w0"))
    await settle()
    with pytest.raises(Unavailable):
        await lost
    assert not d.serves("ss")


async def test_a_sample_that_joins_a_buffered_element_counts_only_the_elements_before_it():
    """One busy group, a buffered element of length bin 1 (9-16 tokens) and four queued samples of other
    bins, 0.2 s a batch: a sample of bin 1 with 0.3 s left joins that element at the head and is admitted
    (it starts when the running batch ends); one of a new bin, behind the running batch and five elements
    (1.2 s), is refused."""
    d, clock, fake = student_dispatcher([[("w0", (0,))]], capacity=1, students=1)
    d.service_s["ss"] = 0.2
    running = [asyncio.create_task(d.submit(ss_job(clock, length))) for length in (10, 12, 30, 50, 70, 90)]
    await settle()
    assert len(fake.calls) == 1 and d.policy.depth() == 5
    joins = ss_job(clock, 14)
    joins.deadline = clock() + 0.3
    joined = asyncio.create_task(d.submit(joins))
    alone = ss_job(clock, 110)
    alone.deadline = clock() + 0.3
    with pytest.raises(DeadlineExceeded, match=r"about 1200 ms of work ahead \(running and queued\)"):
        await d.submit(alone)
    for k in range(6):
        await settle()
        fake.calls[k][2].set_result(k)
    assert await joined == 1 and d.policy.merged >= 1   # ran with the element it joined, the second batch
    await asyncio.gather(*running)


async def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.service_s["spam"] = 0.5  # a batch takes about half a second here
    running = asyncio.create_task(d.submit(make_job(clock, payload="runs")))
    queued = asyncio.create_task(d.submit(make_job(clock, payload="waits")))
    await settle()
    with pytest.raises(DeadlineExceeded, match="cannot be met") as refused:  # one batch (0.5 s) queued ahead
        await d.submit(make_job(clock, deadline_in=0.2, payload="refused"))
    assert refused.value.nothing_ran   # the gateway may pass it to another deployment
    assert [c[1].payload for c in fake.calls] == ["runs"]
    fake.calls[0][2].set_result("a")
    await settle()
    fake.calls[1][2].set_result("b")
    assert await asyncio.gather(running, queued) == ["a", "b"]


async def test_a_queue_past_its_wait_bound_refuses_at_once_with_the_excess_as_pushback():
    """Under overload the queue is bounded in time: a request that would wait past ACADEMUS_MAX_QUEUE_WAIT_MS
    is refused RESOURCE_EXHAUSTED at once, not left to expire; one its deadline cannot wait for is still
    DEADLINE_EXCEEDED (the contract's row), and one within the bound waits its turn."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.max_queue_wait_s = 1.2
    d.service_s["spam"] = 0.5
    running = asyncio.create_task(d.submit(make_job(clock, payload="runs")))
    queued = [asyncio.create_task(d.submit(make_job(clock, payload=f"q{i}"))) for i in range(2)]  # 0.5, 1.0 s
    await settle()
    with pytest.raises(ResourceExhausted, match="about 1500 ms of work ahead; the limit is "
                                                "ACADEMUS_MAX_QUEUE_WAIT_MS=1200") as refused:
        await d.submit(make_job(clock, deadline_in=5.0, payload="refused"))   # the running batch, then two
    assert refused.value.pushback_ms == 300        # the queue is back under the bound after 0.3 s of work
    with pytest.raises(DeadlineExceeded, match="cannot be met"):
        await d.submit(make_job(clock, deadline_in=0.9, payload="too short"))
    assert d.stats.rejected == 2 and len(d.policy) == 2
    clock.now += 0.5                                # a batch took its 0.5 s: one running, one queued now
    fake.calls[0][2].set_result("a")
    await settle()
    admitted = asyncio.create_task(d.submit(make_job(clock, payload="fits")))
    for k in range(1, 4):
        await settle()
        fake.calls[k][2].set_result("bcd"[k - 1])
    assert await asyncio.gather(running, *queued, admitted) == ["a", "b", "c", "d"]


async def test_the_wait_bound_counts_what_is_left_of_the_running_batches():
    """Two groups, each 0.1 s into a 0.4 s batch, two batches queued: the next request starts when both
    queued ones have started and a group frees again, about (0.3 + 0.3 + 2 x 0.4) / 2 = 0.7 s from now, past
    a 0.65 s bound. Counting the queued batches alone (0.4 s) admitted it, and such requests waited past the
    bound."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}, "w1": {"spam"}})
    d.max_queue_wait_s = 0.65
    d.service_s["spam"] = 0.4
    jobs = [asyncio.create_task(d.submit(make_job(clock, payload=i))) for i in range(4)]
    await settle()
    assert len(fake.calls) == 2 and len(d.policy) == 2
    clock.now += 0.1
    with pytest.raises(ResourceExhausted, match="about 700 ms of work ahead") as refused:
        await asyncio.wait_for(d.submit(make_job(clock)), 1)   # admitted, it would wait for its answer
    assert refused.value.pushback_ms == 50
    for k in range(4):
        fake.calls[k][2].set_result(k)
        await settle()
    assert await asyncio.gather(*jobs) == [0, 1, 2, 3]


async def behind_a_running_batch(queued: int, measured: float | None, ran_s: float):
    """One group whose batch has run `ran_s`, `queued` jobs waiting behind it, batches measured at `measured` s (None:
    not yet): the dispatcher, its clock, its workers and the jobs, the running one first."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.queue_capacity = max(d.queue_capacity, queued + 8)
    if measured is not None:
        d.service_s["spam"] = measured
    jobs = [asyncio.create_task(d.submit(make_job(clock, payload=i))) for i in range(queued + 1)]
    await settle()
    clock.now += ran_s
    return d, clock, fake, jobs


async def answer_in_turn(fake: FakeWorkers, count: int) -> None:
    """The first `count` calls answered in the order sent, each with its index."""
    for k in range(count):
        await settle()
        fake.calls[k][2].set_result(k)


@pytest.mark.parametrize("measured", [0.05, None])
async def test_a_batch_running_longer_than_measured_raises_the_admission_estimate(measured):
    """Batches measured at 50 ms (or not yet measured) while the workers were idle; then one has run 0.5 s
    (another deployment's load on its worker). Three batches queued behind it are about 1.5 s of work, not
    0.15 s (or none): a request is refused at the 1 s bound as the slowdown forms, not after it answers."""
    d, clock, fake, jobs = await behind_a_running_batch(3, measured, 0.5)
    d.max_queue_wait_s = 1.0
    with pytest.raises(ResourceExhausted, match="about 1500 ms of work ahead"):
        await asyncio.wait_for(d.submit(make_job(clock)), 1)
    await answer_in_turn(fake, 4)
    assert await asyncio.gather(*jobs) == [0, 1, 2, 3]


async def test_a_batch_running_long_stands_for_the_next_ten_batches_not_every_one_queued():
    """Batches of 0.4 ms, 255 queued behind one that has run 8 ms (the scheduler's own loop busy under 256 callers):
    the work ahead is about 10 x 8 + 245 x 0.4 = 178 ms, inside a 1 s bound. Taken as the time of all 255 it was
    2 s, and such refusals took half the goodput of 256 closed loops. A batch that has run 0.1 s still refuses:
    10 x 0.1 + 245 x 0.4 ms = 1.098 s."""
    d, clock, fake, jobs = await behind_a_running_batch(255, 0.0004, 0.008)
    d.max_queue_wait_s = 1.0
    assert len(fake.calls) == 1 and len(d.policy) == 255
    admitted = asyncio.create_task(d.submit(make_job(clock, payload=256)))
    await settle()
    assert not admitted.done() and len(d.policy) == 256
    clock.now += 0.092
    with pytest.raises(ResourceExhausted, match="about 1098 ms of work ahead"):
        await asyncio.wait_for(d.submit(make_job(clock)), 1)
    await answer_in_turn(fake, 257)
    assert await asyncio.gather(*jobs, admitted) == list(range(257))


async def test_a_batch_running_long_does_not_refuse_a_deadline_the_measured_batches_meet():
    """Batches measured at 50 ms; one has run 0.5 s (a core taken by a process starting), three queued behind it.
    Without a wait bound a request with 1 s left is admitted: the deadline's refusal is final, and the measured
    batches (0.15 s) meet it; as the time of every queued batch the stall made it 1.5 s. One with 0.1 s left is
    still refused at once."""
    d, clock, fake, jobs = await behind_a_running_batch(3, 0.05, 0.5)
    with pytest.raises(DeadlineExceeded, match="about 150 ms of work ahead"):
        await asyncio.wait_for(d.submit(make_job(clock, deadline_in=0.1)), 1)
    admitted = asyncio.create_task(d.submit(make_job(clock, deadline_in=1.0, payload=4)))
    await answer_in_turn(fake, 5)
    assert await asyncio.gather(*jobs, admitted) == [0, 1, 2, 3, 4]
    assert d.stats.rejected == 1


async def test_a_scheduler_seeded_with_its_deployments_timings_admits_on_them_until_it_times_its_own():
    """A restarted scheduler has timed nothing: on the running batches' time alone (near 0) it let a backlog in
    past the wait bound. Seeded with the 0.5 s batches its predecessor reported, it refuses at once what would
    wait past 1 s. A model timed here keeps its own times; timings without a batch time seed nothing."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.max_queue_wait_s = 1.0
    reported = {"service_s": 0.5, "batch_texts": 1.0}
    assert d.seed("spam", reported) and d.timings() == {"spam": reported}
    jobs = [asyncio.create_task(d.submit(make_job(clock, payload=i))) for i in range(3)]   # one runs, two wait
    await settle()
    with pytest.raises(ResourceExhausted, match="about 1500 ms of work ahead"):
        await asyncio.wait_for(d.submit(make_job(clock)), 1)
    assert not d.seed("spam", {"service_s": 9.0}) and d.service_s["spam"] == 0.5
    assert not d.seed("ham", {"token_s": 0.1}) and "ham" not in d.timings()
    for k in range(3):
        clock.now += 0.25
        fake.calls[k][2].set_result(k)
        await settle()
    assert await asyncio.gather(*jobs) == [0, 1, 2]
    assert d.service_s["spam"] == pytest.approx(0.5 * 0.8 ** 3 + 0.25 * (1 - 0.8 ** 3))   # its own take over


def row_job(clock: Clock, payload: object = None) -> Job:
    """One text that fills a concat row of 128 tokens."""
    return Job(model="spam", payload=payload, num_texts=1, num_tokens=128, deadline=clock() + 5.0,
               enqueued_at=clock(), batch_key=("spam",), max_length=128, lengths=(128,))


async def test_a_concat_deployment_counts_its_batches_by_their_shape_not_the_smoothed_mean():
    """A batch of one row took 0.1 s, so one of eight rows takes 0.8 s. The smoothed batch time averages the
    batches that ran, whatever their size: 0.18 s. Behind a running batch of eight rows and eight rows queued,
    a request starts when both batches have run, in about 1.6 s, past the 1 s bound. By the smoothed time it
    was 0.36 s and was let in."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}}, capacity=64, policy=ConcatPolicy(row_length=128, rows=8))
    d.max_queue_wait_s = 1.0
    d.service_s["spam"] = 0.2
    first = asyncio.create_task(d.submit(row_job(clock, "first")))
    await settle()
    rows = [asyncio.create_task(d.submit(row_job(clock, i))) for i in range(16)]
    await settle()
    clock.now += 0.1
    fake.calls[0][2].set_result("first")           # one row in 0.1 s
    await settle()
    assert d.service_s["spam"] == pytest.approx(0.18)
    assert [len(b) for b in fake.batches] == [1, 8] and len(d.policy) == 8
    with pytest.raises(ResourceExhausted, match="about 1600 ms of work ahead"):
        await asyncio.wait_for(d.submit(row_job(clock)), 1)
    for k in (1, 2):
        fake.calls[k][2].set_result("row")
        await settle()
    assert await first == "first" and await asyncio.gather(*rows) == ["row"] * 16


async def test_a_concat_deployment_counts_a_deviation_of_its_batch_times_as_margin():
    """One-row batches took 0.1 s, then 0.2 s. Each weighs an eighth of a full batch: the smoothed time a row is
    0.1 + 0.2 / 8 x 0.1 = 0.1025 s, and its deviation 0.1 s (the first, as it is). A full batch of eight rows then
    counts 8 x (0.1025 + 0.1) = 1.62 s. Behind one just begun, a request is refused at the 1 s bound; at the mean
    alone (0.82 s) it was let in, and where batch times vary a share of such requests started past the bound."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}}, capacity=64, policy=ConcatPolicy(row_length=128, rows=8))
    d.max_queue_wait_s = 1.0
    first = asyncio.create_task(d.submit(row_job(clock, "first")))
    await settle()
    clock.now += 0.1
    fake.calls[0][2].set_result("first")
    second = asyncio.create_task(d.submit(row_job(clock, "second")))
    await settle()
    rows = [asyncio.create_task(d.submit(row_job(clock, i))) for i in range(8)]
    await settle()
    clock.now += 0.2
    fake.calls[1][2].set_result("second")          # the eight rows start as it ends
    await settle()
    assert [len(b) for b in fake.batches] == [1, 1, 8]
    assert d.token_s["spam"] * 128 == pytest.approx(0.1025) and d.token_dev["spam"] * 128 == pytest.approx(0.1)
    with pytest.raises(ResourceExhausted, match="about 1620 ms of work ahead"):
        await asyncio.wait_for(d.submit(row_job(clock)), 1)
    fake.calls[2][2].set_result("row")
    assert await first == "first" and await second == "second" and await asyncio.gather(*rows) == ["row"] * 8


def test_a_batch_weighs_in_the_time_a_token_by_its_share_of_a_full_one():
    """A fast model's full batches take 8 ms (1,024 tokens). A one-row batch held up 20 ms by a busy core moves the
    smoothed time a token, and its deviation, an eighth as far as a full batch would: a full batch is then counted
    at 15.6 ms, where a full batch as slow (160 ms) lifts it to 68.8 ms."""
    def batch(rows: int) -> list[Job]:   # formed by the policy, so that it carries its plan's tokens
        policy = ConcatPolicy(row_length=128, rows=8)
        for _ in range(rows):
            policy.push(row_job(clock), clock())
        return policy.next_batch(lambda _: True, clock())

    clock = Clock()
    held, slow = (make_dispatcher({"w0": {"spam"}}, capacity=64, policy=ConcatPolicy(row_length=128, rows=8))[0]
                  for _ in range(2))
    for d in (held, slow):
        for _ in range(30):
            d._observe(batch(8), 0.008)
        assert d._batch_time("spam") == pytest.approx(0.008)
    held._observe(batch(1), 0.020)   # 156 us a token against 7.8: 0.025 of the way, and as much deviation
    slow._observe(batch(8), 0.160)   # the same a token over a full batch: 0.2 of the way
    assert held._batch_time("spam") == pytest.approx(0.008 + 2 * 0.025 * (0.160 - 0.008), rel=1e-6)   # 15.6 ms
    assert slow._batch_time("spam") == pytest.approx(0.008 + 2 * 0.2 * (0.160 - 0.008), rel=1e-6)     # 68.8 ms


def test_queued_samples_count_as_elements_of_the_merge_bound_in_the_admission_estimate():
    """Queued samples of a student deployment join elements as they enter the buffer: counting each as a
    batch would refuse at a fraction of the wait the bound allows."""
    policy = StudentPolicy(max_merge=4, overload_merge=4)
    clock = Clock()
    lengths = [10] + [30] * 5 + [50] * 2 + [70]   # bins: the buffered element's, then 5, 2 and 1 queued
    for length in lengths:                        # the buffer holds one element (capacity 1)
        policy.push(ss_job(clock, length), clock())
    assert policy.depth() == 1 + 8           # the load signal counts waiting samples beyond the buffer
    assert policy.batches_ahead() == 1 + 2 + 1 + 1   # the estimate: each bin's samples in elements of four
    assert policy.batches_ahead("ss") == 5 and policy.batches_ahead("other") == 0
    assert [len(policy.next_batch(lambda j: True, clock())) for _ in range(4)] == [1, 4, 1, 2]
    assert policy.batches_ahead() == 1      # the last element, in the buffer; nothing queued


async def test_with_nothing_queued_a_short_deadline_is_admitted_and_left_to_the_worker():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.service_s["spam"] = 0.5
    task = asyncio.create_task(d.submit(make_job(clock, deadline_in=0.2, payload="tight")))
    await settle()
    assert [c[1].payload for c in fake.calls] == ["tight"]
    fake.calls[0][2].set_result("ok")
    assert await task == "ok"


async def test_model_load_reports_the_adaptation_signals():
    d, clock, fake = student_dispatcher([[("w0", (0,)), ("w1", (1,))]], capacity=1)
    tasks = [asyncio.create_task(d.submit(ss_job(clock, n))) for n in (10, 40)]
    await settle()
    assert d.model_load()["ss"] == {"groups": 1, "idle": 0, "busy": 1, "students": 2, "buffer": 1,
                                    "by_group": {"ss/g0": 1}}
    fake.calls[0][2].set_result("a")
    await settle()
    fake.calls[1][2].set_result("b")
    await asyncio.gather(*tasks)


async def test_a_waiting_job_whose_batch_cannot_finish_in_time_is_not_started():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.service_s["spam"], d.batch_texts["spam"] = 0.5, 1.0  # a one-text batch takes about 0.5 s
    doomed_before = dropped("doomed")
    running = asyncio.create_task(d.submit(make_job(clock, payload="runs")))
    doomed = asyncio.create_task(d.submit(make_job(clock, deadline_in=0.7, payload="doomed")))
    later = asyncio.create_task(d.submit(make_job(clock, deadline_in=5.0, payload="later")))
    await settle()
    clock.now += 0.4                 # "doomed" has waited: 0.3 s left for a 0.5 s batch
    fake.calls[0][2].set_result("a")
    await settle()
    with pytest.raises(DeadlineExceeded, match=r"cannot finish in time.*not computed"):
        await doomed
    assert [c[1].payload for c in fake.calls] == ["runs", "later"] and d.stats.doomed == 1
    assert dropped("doomed") == doomed_before + 1
    fake.calls[1][2].set_result("b")
    assert await asyncio.gather(running, later) == ["a", "b"]


async def test_the_finish_estimate_scales_down_for_a_batch_smaller_than_the_average():
    d, clock, fake = make_dispatcher({"w0": {"spam"}})
    d.service_s["spam"], d.batch_texts["spam"] = 0.8, 8.0   # full batches of 8 texts take 0.8 s
    first = asyncio.create_task(d.submit(make_job(clock, payload="runs")))
    small = asyncio.create_task(d.submit(make_job(clock, deadline_in=0.5, payload="small")))
    await settle()
    clock.now += 0.2                 # 0.3 s left; one text of an 8-text batch: about 0.1 s
    fake.calls[0][2].set_result("a")
    await settle()
    assert [c[1].payload for c in fake.calls] == ["runs", "small"] and d.stats.doomed == 0
    fake.calls[1][2].set_result("b")
    assert await asyncio.gather(first, small) == ["a", "b"]


async def test_without_drop_doomed_a_waiting_job_is_started_whatever_its_time_left():
    clock, fake = Clock(), FakeWorkers()
    d = Dispatcher(FifoPolicy(), fake.send, 8, 25, clock, drop_doomed=False)
    d.update_workers({"w0": ("127.0.0.1:0", frozenset({"spam"}))})
    d.service_s["spam"], d.batch_texts["spam"] = 0.5, 1.0
    running = asyncio.create_task(d.submit(make_job(clock, payload="runs")))
    late = asyncio.create_task(d.submit(make_job(clock, deadline_in=0.7, payload="late")))
    await settle()
    clock.now += 0.4
    fake.calls[0][2].set_result("a")
    await settle()
    assert [c[1].payload for c in fake.calls] == ["runs", "late"] and d.stats.doomed == 0
    fake.calls[1][2].set_result("b")
    assert await asyncio.gather(running, late) == ["a", "b"]


async def test_send_ahead_gives_a_busy_group_its_next_element_and_counts_it_as_buffered():
    d, clock, fake = student_dispatcher([[("w0", (0,))], [("w1", (0,))]], capacity=1, students=1, send_ahead=True)
    sent_ahead = sample("academus_scheduler_sent_ahead_total")
    first = [asyncio.create_task(d.submit(ss_job(clock, 10)))]
    clock.now += 0.001  # the second group's batch begins later: the first is expected to free first
    first.append(asyncio.create_task(d.submit(ss_job(clock, 20))))
    await settle()
    ahead = [asyncio.create_task(d.submit(ss_job(clock, n))) for n in (30, 31, 60, 62, 90)]
    await settle()
    # both groups busy: the next sample goes to the group whose batch began first, the one after to the
    # other; the rest wait in the buffer, merged by bin
    assert [c[0] for c in fake.calls] == ["w0", "w1", "w0", "w1"]
    assert [[j.payload for j in b] for b in fake.batches[2:]] == [[30], [31]]
    assert [g.in_flight for g in d.groups] == [2, 2] and d.load()["idle"] == 0 and d.stats.sent_ahead == 2
    assert sample("academus_scheduler_sent_ahead_total") == sent_ahead + 2
    assert d.model_load()["ss"] == {"groups": 2, "idle": 0, "busy": 2, "students": 1, "buffer": 4,
                                    "by_group": {"ss/g0": 1, "ss/g1": 1}}
    clock.now += 0.010
    fake.calls[0][2].set_result("a")
    await settle()
    # the batch sent ahead now runs on w0's slot, and w0 is sent the buffer's head element ahead
    assert [c[0] for c in fake.calls][4:] == ["w0"] and [j.payload for j in fake.batches[4]] == [60, 62]
    assert d.groups[0].started_at == clock.now and d.workers["w0"].running == 1
    for i in range(1, 6):
        fake.calls[i][2].set_result("r")
        await settle()
    assert await asyncio.gather(*first, *ahead) == ["a", "r", "r", "r", "r", "r", "r"]
    assert [g.in_flight for g in d.groups] == [0, 0] and d.workers["w0"].running == d.workers["w1"].running == 0


async def test_a_job_sent_ahead_on_arrival_that_cannot_finish_in_time_is_not_sent():
    """Admission counts the running batch but not the job's own compute, so it lets in a job with 0.3 s left
    behind a 0.2 s batch; sent ahead, it would finish 0.4 s from now: it is answered DEADLINE_EXCEEDED unrun.
    One with time is sent."""
    d, clock, fake = student_dispatcher([[("w0", (0,))]], capacity=1, students=1, send_ahead=True)
    d.service_s["ss"] = 0.2
    running = asyncio.create_task(d.submit(ss_job(clock, 10)))
    await settle()
    short = ss_job(clock, 20)
    short.deadline = clock() + 0.3
    with pytest.raises(DeadlineExceeded, match="cannot finish in time"):
        await asyncio.wait_for(d.submit(short), 1)   # sent ahead, it would wait for its answer
    roomy = asyncio.create_task(d.submit(ss_job(clock, 30)))
    await settle()
    assert [[j.payload for j in b] for b in fake.batches] == [[10], [30]]
    assert (d.stats.doomed, d.stats.sent_ahead) == (1, 1)
    for _, _, answer in fake.calls:
        answer.set_result("ok")
    assert await asyncio.gather(running, roomy) == ["ok", "ok"]


async def test_send_ahead_skips_groups_on_workers_of_several_slots():
    """Such a worker would run the element sent ahead at once, on the slot of another group."""
    d, clock, fake = student_dispatcher([[("w0", (0,))], [("w0", (0,))]], capacity=2, students=1, send_ahead=True)
    jobs = [asyncio.create_task(d.submit(ss_job(clock, n))) for n in (10, 20, 30)]
    await settle()
    assert [c[0] for c in fake.calls] == ["w0", "w0"] and d.stats.sent_ahead == 0
    assert d.model_load()["ss"]["buffer"] == 1   # the third waits for a group to free
    fake.calls[0][2].set_result("a")
    await settle()
    assert [j.payload for j in fake.batches[2]] == [30] and d.workers["w0"].running == 2
    for call in fake.calls[1:]:
        call[2].set_result("r")
    assert await asyncio.gather(*jobs) == ["a", "r", "r"]


async def test_send_ahead_leaves_policies_that_hold_batches_back_alone():
    clock, fake = Clock(), FakeWorkers()
    d = Dispatcher(PaddedPolicy(max_batch=4, max_delay_s=0.01), fake.send, 8, 25, clock, send_ahead=True)
    assert not d.send_ahead


async def test_a_placement_refresh_that_changes_nothing_keeps_each_groups_batches_in_flight():
    """The watcher refreshes every second: a busy group with a batch sent ahead stays busy, with its batch
    ahead, in the load signals the resource manager adapts to; a changed table forms new groups."""
    from academus.services.scheduler.core import GroupTable, Member

    d, clock, fake = student_dispatcher([[("w0", (0,)), ("w1", (1,))]], capacity=1, send_ahead=True)
    tasks = [asyncio.create_task(d.submit(ss_job(clock, length))) for length in (5, 50)]
    await settle()
    signals = d.model_load()["ss"]
    assert (signals["busy"], signals["idle"], signals["buffer"]) == (1, 0, 1)
    live = {w: (ref.address, ref.models, ref.capacity) for w, ref in d.workers.items()}
    d.update_workers(live)
    assert d.model_load()["ss"] == signals
    for _, _, answer in fake.calls:
        answer.set_result("ok")
    assert await asyncio.gather(*tasks) == ["ok", "ok"]
    assert d.model_load()["ss"]["idle"] == 1
    d.update_workers(live, {"ss": GroupTable("ss", 1, ((Member("w0", (0,)),), (Member("w1", (0,)),)))})
    assert [(g.name, g.students) for g in d.groups] == [("ss/g0", 1), ("ss/g1", 1)]


async def test_a_worker_placed_between_the_watchers_two_reads_is_in_its_groups(redis_url):
    """The resource manager registers a worker and re-forms the groups across it while the watcher is between
    reading the live workers and the group tables: the group spanning it is formed, not dropped as if its
    member were dead (which would fail every job waiting for the model as an orphan)."""
    import json

    from academus.services.scheduler.server import PlacementWatcher
    from academus.shared.runtime.redis_conn import connect
    from academus.shared.state.keys import Keys

    redis, keys = connect(redis_url), Keys("acd-watch")

    async def place(worker_id: str, port: int, groups: list, students: int) -> None:
        await redis.sadd(keys.placements(), "ss")
        await redis.sadd(keys.placement("ss"), worker_id)
        await redis.hset(keys.worker(worker_id), mapping={"address": f"127.0.0.1:{port}", "capacity": 1})
        await redis.set(keys.groups("ss"), json.dumps({"students": students, "groups": groups}))

    await place("w0", 1, [[["w0", [0]]]], 1)

    class Raced(PlacementWatcher):
        raced = False

        async def read_tables(self, models):
            if not self.raced:
                self.raced = True
                await place("w1", 2, [[["w0", [0]], ["w1", [1]]]], 2)
            return await super().read_tables(models)

    d = make_dispatcher({}, policy=StudentPolicy())[0]
    await Raced(redis, keys, d, refresh_s=1.0).refresh()
    assert [(g.name, [m.worker_id for m in g.members], g.students) for g in d.groups] == [("ss/g0", ["w0", "w1"], 2)]
    assert d.serves("ss")
    await redis.aclose()


async def test_a_node_scheduler_takes_its_nodes_groups_and_says_what_it_serves(redis_url):
    """One scheduler a node (ACADEMUS_NODE): it forms the groups whose workers are on its node and leaves
    the others' to their node's scheduler; `serving` (which it registers for the gateways) names the models
    it has a live group for, and changes with them."""
    import json

    from academus.services.scheduler.server import PlacementWatcher
    from academus.shared.runtime.redis_conn import connect
    from academus.shared.state.keys import Keys

    redis, keys = connect(redis_url), Keys("acd-node")
    for i, node in enumerate("ab"):
        await redis.hset(keys.worker(f"w{i}"), mapping={"address": f"127.0.0.1:{i + 1}", "capacity": 1,
                                                        "node": node})
        await redis.sadd(keys.placement("ss"), f"w{i}")
    await redis.sadd(keys.placements(), "ss")
    await redis.set(keys.groups("ss"), json.dumps({"students": 1, "groups": [[["w0", [0]]], [["w1", [0]]]]}))
    changes = []

    async def changed() -> None:
        changes.append(watcher.serving)

    formed = {}
    for node in ("a", "b", "c", ""):
        d = make_dispatcher({}, policy=StudentPolicy())[0]
        watcher = PlacementWatcher(redis, keys, d, refresh_s=1.0, node=node, on_serving=changed)
        await watcher.refresh()
        formed[node] = ([(g.name, g.worker_id) for g in d.groups], watcher.serving)
    assert formed == {"a": ([("ss/g0", "w0")], {"ss"}), "b": ([("ss/g1", "w1")], {"ss"}),
                      "c": ([], set()),                          # a node with no worker of it serves nothing
                      "": ([("ss/g0", "w0"), ("ss/g1", "w1")], {"ss"})}   # no node: the whole mesh
    assert changes == [{"ss"}, {"ss"}, {"ss"}]   # each watcher began with nothing: c's never changed
    await redis.delete(keys.worker("w1"))          # b's only worker is gone
    await watcher.refresh()
    assert [g.name for g in watcher.dispatcher.groups] == ["ss/g0"]
    b = PlacementWatcher(redis, keys, make_dispatcher({}, policy=StudentPolicy())[0], 1.0, node="b")
    await b.refresh()
    assert b.serving == frozenset()
    await redis.aclose()


async def test_another_models_backlog_does_not_refuse_a_job_whose_group_is_free():
    """One deployment serving two models: model A's waiting work is no reason to refuse B's request when
    B's group is idle and would start it at once."""
    d, clock, fake = make_dispatcher({"wa": {"A"}, "wb": {"B"}}, capacity=64)
    d.service_s = {"A": 0.05, "B": 0.05}
    waiting = [asyncio.create_task(d.submit(make_job(clock, model="A", deadline_in=60.0))) for _ in range(20)]
    await settle()
    assert d.policy.depth() == 19                              # one runs on wa, the rest wait for it
    served = asyncio.create_task(d.submit(make_job(clock, model="B", deadline_in=0.3)))
    await settle()
    assert [c[0] for c in fake.calls] == ["wa", "wb"]
    fake.calls[1][2].set_result("b")
    assert await served == "b"
    with pytest.raises(DeadlineExceeded, match="ms of work ahead"):   # A's own backlog still refuses A
        await d.submit(make_job(clock, model="A", deadline_in=0.3))
    for task in waiting:
        task.cancel()


class RefusingWorker(worker_pb2_grpc.WorkerServicer):
    """A live worker whose handler chooses UNAVAILABLE (its adapter store is down)."""

    async def Run(self, request, context):
        await abort_with(context, Unavailable("no adapter store is running (its address is not in Redis)"))


@pytest.mark.parametrize("streams", [True, False])
async def test_an_unavailable_the_worker_chose_is_its_answer_and_a_dead_worker_is_lost(streams):
    """Over real gRPC: the worker's own UNAVAILABLE (trailer ANSWERED) goes back as it is, the worker not
    marked lost; a worker that is gone (nothing listens) is lost, and its jobs may be retried elsewhere."""
    from academus.services.scheduler.sender import GroupSender
    from academus.services.scheduler.server import WorkerCalls

    server = grpc.aio.server()
    serve_multiplexed(server, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(RefusingWorker(), s))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    clock = Clock()
    workers = {"live": WorkerRef("live", f"127.0.0.1:{port}", frozenset({"spam"})),
               "gone": WorkerRef("gone", "127.0.0.1:1", frozenset({"spam"}))}
    sender = GroupSender(WorkerCalls(Stubs(worker_pb2_grpc.WorkerStub, multiplexed=streams), workers), clock)
    job = make_job(clock, payload=WorkItem("spam", "label", [101, 102], [2]))
    try:
        with pytest.raises(Unavailable, match="no adapter store is running") as refused:
            await sender(Group("live#0", frozenset({"spam"}), (Member("live"),)), [job])
        assert not isinstance(refused.value, WorkerLost)
        with pytest.raises(WorkerLost) as lost:
            await sender(Group("gone#0", frozenset({"spam"}), (Member("gone"),)), [job])
        assert lost.value.worker_id == "gone"
    finally:
        await server.stop(None)


def test_a_policys_depth_counts_one_model_when_asked():
    clock = Clock()
    padded, fifo = PaddedPolicy(max_batch=32), FifoPolicy()
    for policy in (padded, fifo):
        for model, n in (("a", 40), ("b", 3)):
            for _ in range(n):
                policy.push(make_job(clock, model=model), clock())
    assert (padded.depth(), padded.depth("a"), padded.depth("b"), padded.depth("c")) == (2, 2, 1, 0)
    assert (fifo.depth(), fifo.depth("a"), fifo.depth("b")) == (43, 40, 3)


# -- shards: several scheduler processes split one deployment's groups ----------------------------

def sharded_groups(shard, tables: dict, workers: dict[str, tuple[str, ...]], capacity: int = 1) -> list[str]:
    from academus.services.scheduler.core import Shard

    clock, fake = Clock(), FakeWorkers()
    d = Dispatcher(StudentPolicy(max_merge=4), fake.send, 8, 25, clock, shard=Shard(*shard))
    d.update_workers({w: (f"127.0.0.1:{i}", frozenset(m), capacity) for i, (w, m) in enumerate(workers.items())},
                     tables)
    assert d.policy.capacity == len(d.groups)   # the buffer holds one element a group of this shard's
    return [g.name for g in d.groups]


def test_shards_split_the_groups_of_each_model_and_together_cover_them():
    """Five student groups and a teacher on two workers of two slots: each shard takes a run of each
    model's groups, disjoint and together the whole table, and each run spans both workers."""
    from academus.services.scheduler.core import GroupTable, Member

    table = GroupTable("ss", 1, tuple((Member(f"w{j % 2}", (0,)),) for j in range(5)))
    workers = {"w0": ("ss", "t"), "w1": ("ss", "t")}
    shards = [sharded_groups((k, 2), {"ss": table}, workers, capacity=2) for k in range(2)]
    assert shards[0] == ["ss/g0", "ss/g1", "w0#0", "w1#0"]
    assert shards[1] == ["ss/g2", "ss/g3", "ss/g4", "w0#1", "w1#1"]
    assert sharded_groups((0, 1), {"ss": table}, workers, capacity=2) == [
        "ss/g0", "ss/g1", "ss/g2", "ss/g3", "ss/g4", "w0#0", "w1#0", "w0#1", "w1#1"]


def test_a_shard_beyond_the_group_count_shares_a_group_rather_than_serve_nothing():
    """Two groups, three shards: shard 2 takes group 0, shared with shard 0 (the worker queues the
    overlap); a model's requests reaching any shard find a group."""
    from academus.services.scheduler.core import GroupTable, Member

    table = GroupTable("ss", 2, ((Member("w0", (0, 1)),), (Member("w1", (0, 1)),)))
    workers = {"w0": ("ss",), "w1": ("ss",)}
    assert [sharded_groups((k, 3), {"ss": table}, workers) for k in range(3)] == [["ss/g0"], ["ss/g1"], ["ss/g0"]]


def test_a_shard_outside_its_count_is_refused_by_the_configuration():
    from academus.shared.runtime import config as cfg

    with pytest.raises(cfg.ConfigError, match=r"ACADEMUS_SHARD=2 must be 0\.\.ACADEMUS_SHARDS-1"):
        cfg.load(cfg.SchedulerConfig, {"ACADEMUS_SHARD": "2", "ACADEMUS_SHARDS": "2"})
    assert cfg.load(cfg.SchedulerConfig, {"ACADEMUS_SHARD": "1", "ACADEMUS_SHARDS": "2"}).shard == 1


async def test_a_group_one_worker_holds_whole_runs_as_one_model_and_a_spread_one_fans_out():
    """One member with every student: one call for the model with the group's student number and no share (so a
    head that does not add over members, a classifier's own, still serves); members apart: a share each."""
    import numpy as np

    from academus.services.scheduler.sender import GroupSender
    from academus.shared.models.work import FINISH_SOFTMAX, BatchMeta, BatchOutput

    calls = []

    async def run_on(worker_id, batch, remaining, on_partial):
        calls.append((worker_id, batch.num_students, batch.student_indices, on_partial is not None))
        finish = FINISH_SOFTMAX if batch.student_indices else ""
        return BatchOutput(np.zeros((1, 2), dtype=np.float32), ["a", "b"], BatchMeta(), finish=finish)

    clock = Clock()
    sender = GroupSender(run_on, clock)
    job = make_job(clock, model="ss", payload=WorkItem("ss", "label", [101, 102], [2]))
    job.on_partial = lambda output: None
    await sender(Group("ss/g0", frozenset({"ss"}), (Member("w0", (0, 1, 2)),), students=3), [job])
    await sender(Group("ss/g1", frozenset({"ss"}), (Member("w0", (0, 1)), Member("w1", (2,))), students=3), [job])
    assert calls == [("w0", 3, (), True), ("w0", 3, (0, 1), False), ("w1", 3, (2,), False)]


@pytest.mark.parametrize("streams", [True, False])
async def test_a_worker_registered_again_on_its_address_is_called_on_a_fresh_channel(streams):
    """Over real gRPC: a worker restarted on the same port (the supervisor keeps its ports) is reached by the
    first call after it registers again, not failed by the channel that backed off from the dead process."""
    from academus.services.scheduler.sender import GroupSender
    from academus.services.scheduler.server import WorkerCalls

    async def serve(port: int = 0) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        serve_multiplexed(server, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(RefusingWorker(), s))
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, bound

    server, port = await serve()
    clock = Clock()
    workers = {"w": WorkerRef("w", f"127.0.0.1:{port}", frozenset({"spam"}), registration="first")}
    sender = GroupSender(WorkerCalls(Stubs(worker_pb2_grpc.WorkerStub, multiplexed=streams), workers), clock)
    group = Group("w#0", frozenset({"spam"}), (Member("w"),))
    job = make_job(clock, payload=WorkItem("spam", "label", [101, 102], [2]))
    with pytest.raises(Unavailable, match="no adapter store is running"):   # the worker's own answer: reached
        await sender(group, [job])
    await server.stop(None)
    for _ in range(4):   # the dead process: each refusal lengthens the channel's backoff
        with pytest.raises(WorkerLost):
            await sender(group, [job])
    server, _ = await serve(port)
    try:
        workers["w"] = WorkerRef("w", f"127.0.0.1:{port}", frozenset({"spam"}), registration="second")
        with pytest.raises(Unavailable, match="no adapter store is running") as answered:
            await sender(group, [job])
        assert not isinstance(answered.value, WorkerLost)
    finally:
        await server.stop(None)


async def test_the_registration_names_what_a_node_serves_and_leaves_no_key_behind(redis_url):
    """A node's scheduler registers its address, policy, node and the models it has groups for, under its TTL,
    with its load report; a change of what it serves is rewritten and announced on the events channel; once
    deregistered, no key of it is left for a gateway to send to."""
    import json

    from academus.services.scheduler.server import PlacementWatcher, SchedulerRegistration
    from academus.shared.runtime import config as cfg
    from academus.shared.runtime.redis_conn import connect
    from academus.shared.state.keys import Keys

    redis, keys = connect(redis_url), Keys("acd-registration")
    await redis.sadd(keys.placement("ss"), "w0")   # placed, not yet live
    await redis.sadd(keys.placements(), "ss")
    config = cfg.SchedulerConfig(key_prefix="acd-registration", node="a", policy="student", heartbeat_ttl_s=7.0)
    d = make_dispatcher({}, policy=StudentPolicy())[0]
    watcher = PlacementWatcher(redis, keys, d, 1.0, node="a")
    registration = SchedulerRegistration(redis, keys, config, d, d.policy, watcher, None)
    watcher.on_serving = registration.reregister
    assert registration.bind("127.0.0.1:5005") == "127.0.0.1:5005"   # no configured id: the address
    await registration.announce()
    sid = "127.0.0.1:5005"
    assert await redis.hgetall(keys.scheduler(sid)) == {"address": sid, "policy": "student", "models": "",
                                                        "node": "a", "serving": ""}   # no live worker yet
    assert 0 < await redis.ttl(keys.scheduler(sid)) <= 7 and await redis.smembers(keys.schedulers()) == {sid}
    assert "queued" in await redis.hgetall(keys.load(sid)) and 0 < await redis.pttl(keys.load(sid)) <= 1000

    events = redis.pubsub()
    await events.subscribe(keys.events())
    await events.get_message(timeout=1.0)   # the subscription's own confirmation
    await redis.hset(keys.worker("w0"), mapping={"address": "127.0.0.1:1", "capacity": 1, "node": "a"})
    await redis.set(keys.groups("ss"), json.dumps({"students": 1, "groups": [[["w0", [0]]]]}))
    await watcher.refresh()   # its group formed: the node now serves ss
    assert (await redis.hgetall(keys.scheduler(sid)))["serving"] == "ss"
    message = await events.get_message(ignore_subscribe_messages=True, timeout=1.0)
    assert message is not None and message["data"] == f"serving {sid}"
    await events.aclose()

    await registration.deregister()
    assert not await redis.exists(keys.scheduler(sid), keys.load(sid))
    assert await redis.smembers(keys.schedulers()) == set()
    await redis.aclose()


async def test_a_batch_answered_long_past_its_estimate_is_learnt_as_four_times_it():
    """A worker that stood still for seconds (stopped, a host's stall) answers a full batch expected in 0.8 s after
    20 s. Learnt as it came, that one sample put the time a row at 0.58 s and its deviation at 0.48 s: 8.5 s for a
    full batch, and the queue's bound would refuse what the workers have room for until later batches brought it
    down. It counts as 3.2 s, four times its estimate: 0.16 and 0.06 s a row."""
    d, clock, fake = make_dispatcher({"w0": {"spam"}}, capacity=64, policy=ConcatPolicy(row_length=128, rows=8))
    first = asyncio.create_task(d.submit(row_job(clock, "first")))
    await settle()
    rows = [asyncio.create_task(d.submit(row_job(clock, i))) for i in range(16)]
    await settle()
    for k, took in enumerate((0.1, 0.8, 20.0)):   # a row in 0.1 s, a full batch as expected, then one held up
        clock.now += took
        fake.calls[k][2].set_result("row")
        await settle()
    assert [len(b) for b in fake.batches] == [1, 8, 8]
    assert d.token_s["spam"] * 128 == pytest.approx(0.16) and d.token_dev["spam"] * 128 == pytest.approx(0.06)
    assert await first == "row" and await asyncio.gather(*rows) == ["row"] * 16


async def test_a_stalled_batchs_pushback_hint_is_the_bound_at_most():
    """Batches measured at 50 ms; one has run 4 s (its worker stopped), three queued behind it: 12 s of work ahead
    at the stalled batch's time, 11 s past a 1 s bound. A hint of 11 s kept the gateway refusing the model for
    seconds after the stall ended (its batch given up, reliability.md); the hint is 1 s, and the next request
    after it asks again."""
    d, clock, fake, jobs = await behind_a_running_batch(3, 0.05, 4.0)
    d.max_queue_wait_s = 1.0
    with pytest.raises(ResourceExhausted, match=r"about 12000 ms of work ahead.*retry in 1000 ms") as refused:
        await asyncio.wait_for(d.submit(make_job(clock)), 1)
    assert refused.value.pushback_ms == 1000
    await answer_in_turn(fake, 4)
    assert await asyncio.gather(*jobs) == [0, 1, 2, 3]
