"""The length-aware buffer (App. B.4.2) and the `student` policy: unit and property-based tests."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from academus.services.scheduler.buffer import LengthAwareBuffer
from academus.services.scheduler.core import Job
from academus.services.scheduler.policies import StudentPolicy, make_policy

_ids = itertools.count()


def job(length: int, model: str = "sentiment-students", texts: int = 1) -> Job:
    return Job(model=model, payload=next(_ids), num_texts=texts, num_tokens=length * texts, deadline=1e9,
               enqueued_at=0.0, batch_key=(model,), max_length=length)


def test_sixteen_bins_of_eight_tokens_up_to_128():
    buffer = LengthAwareBuffer(max_merge=4, bin_width=8, max_length=128)
    assert buffer.num_bins == 16
    assert [buffer.bin_of(n) for n in (1, 8, 9, 16, 17, 128, 500)] == [0, 0, 1, 1, 2, 15, 15]


def test_same_bin_merges_up_to_max_merge_then_starts_a_new_element():
    buffer = LengthAwareBuffer(max_merge=2)
    assert [buffer.push(job(n)) for n in (10, 12, 14)] == [False, True, False]
    assert [len(e.jobs) for e in buffer] == [2, 1]


def test_other_bins_and_other_models_do_not_merge():
    buffer = LengthAwareBuffer(max_merge=4)
    merged = [buffer.push(j) for j in (job(10), job(30), job(11, model="spam-students"))]
    assert merged == [False, False, False] and len(buffer) == 3


def test_a_sample_merges_into_its_bins_tail_even_when_it_is_not_the_queue_tail():
    buffer = LengthAwareBuffer(max_merge=4)
    first, other, late = job(10), job(40), job(12)
    for j in (first, other, late):
        buffer.push(j)
    assert [[x.payload for x in e.jobs] for e in buffer] == [[first.payload, late.payload], [other.payload]]


def test_elements_ahead_of_a_merge_stay_an_upper_bound_after_a_removal_and_a_retry():
    buffer = LengthAwareBuffer(max_merge=2)
    a, b, c = job(10), job(20), job(30)
    for j in (a, b, c):
        buffer.push(j)
    assert buffer.ahead_of_merge(job(30)) == 2 and buffer.ahead_of_merge(job(40)) is None
    buffer.remove(lambda j: j is b)                  # from the middle: the count may be over, never under
    assert buffer.ahead_of_merge(job(30)) == 1       # capped by the elements there are
    buffer.push_front(job(50))                       # a retry goes first: one more ahead
    assert buffer.ahead_of_merge(job(30)) == 2
    buffer.pop(), buffer.pop()
    assert buffer.ahead_of_merge(job(30)) == 0


def test_pop_takes_the_head_and_drops_its_bin_pointer():
    buffer = LengthAwareBuffer(max_merge=4)
    buffer.push(job(10))
    head = buffer.pop()
    assert head is not None and not buffer.merges(job(10))
    assert buffer.push(job(10)) is False  # a new element, not a merge into the dispatched one


def test_pop_with_a_filter_takes_the_first_element_the_group_serves():
    buffer = LengthAwareBuffer()
    buffer.push(job(10, model="a"))
    buffer.push(job(10, model="b"))
    element = buffer.pop(lambda j: j.model == "b")
    assert element is not None and element.jobs[0].model == "b" and len(buffer) == 1


def test_multi_text_requests_count_each_text_towards_max_merge():
    buffer = LengthAwareBuffer(max_merge=4)
    buffer.push(job(10, texts=3))
    assert buffer.push(job(10, texts=2)) is False
    assert buffer.push(job(10, texts=1)) is True


def test_student_policy_buffers_only_up_to_the_group_count_then_queues():
    policy = StudentPolicy(max_merge=4)
    policy.resize(2)
    for n in (10, 30, 50, 70):  # four bins: two buffer elements, two queued
        policy.push(job(n), 0.0)
    assert policy.buffer.__len__() == 2 and len(policy) == 4 and policy.depth() == 4
    first = policy.next_batch(lambda j: True, 0.0)
    assert [j.max_length for j in first] == [10]
    assert len(policy.buffer) == 2  # the queue's head moved into the freed buffer place


def test_queued_samples_merge_into_a_buffered_element_of_their_bin():
    policy = StudentPolicy(max_merge=4)
    policy.resize(1)
    for n in (10, 11, 12):
        policy.push(job(n), 0.0)
    assert [len(e.jobs) for e in policy.buffer] == [3] and policy.merged == 2


def test_make_policy_knows_student():
    assert isinstance(make_policy("student", max_merge=3), StudentPolicy)


operations = st.lists(st.one_of(st.tuples(st.just("push"), st.integers(1, 200), st.integers(1, 3)),
                                st.tuples(st.just("pop"), st.just(0), st.just(0))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations, st.integers(1, 6))
def test_buffer_invariants_hold_for_any_operation_sequence(ops, max_merge):
    buffer = LengthAwareBuffer(max_merge=max_merge)
    pushed, popped = [], []
    for op, length, texts in ops:
        if op == "push":
            j = job(length, texts=texts)
            pushed.append(j)
            buffer.push(j)
        else:
            element = buffer.pop()
            if element is not None:
                popped += element.jobs
        elements = list(buffer)
        # every element is one bin of one batch key, within max_merge (a lone oversized request aside)
        for e in elements:
            assert len({(j.batch_key, buffer.bin_of(j.max_length)) for j in e.jobs}) == 1
            assert e.samples == sum(j.num_texts for j in e.jobs)
            assert e.samples <= max_merge or len(e.jobs) == 1
        # a bin's pointer names the newest element of that bin still buffered; a sample that would
        # join it is told exactly how many elements are ahead (pushes and pops from the head only)
        for key, tail in buffer._tails.items():
            assert tail in elements and tail is [e for e in elements if e.key == key][-1]
            probe = job(tail.jobs[0].max_length)
            expected = elements.index(tail) if tail.samples + 1 <= max_merge else None
            assert buffer.ahead_of_merge(probe) == expected
        assert buffer.samples == sum(e.samples for e in elements)
    # nothing lost, nothing twice, FIFO by element
    remaining = list(buffer.jobs())
    assert sorted(j.payload for j in popped + remaining) == sorted(j.payload for j in pushed)


churn = st.lists(st.one_of(st.tuples(st.just("push"), st.integers(1, 60), st.sampled_from("ab")),
                           st.tuples(st.just("retry"), st.integers(1, 60), st.sampled_from("ab")),
                           st.tuples(st.just("pop"), st.just(0), st.sampled_from("ab")),
                           st.tuples(st.just("remove"), st.integers(0, 9), st.just(""))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(churn, st.integers(1, 4))
def test_elements_ahead_of_a_merge_are_never_undercounted_whatever_leaves_or_cuts_in(ops, max_merge):
    """Retries cutting in at the head, pops of another model's element from the middle and removals of
    expired jobs: the sequence numbers still rise from head to tail, and a sample that would join a bin's
    element is told at least as many elements ahead as there are (never fewer: it would be admitted late)."""
    buffer = LengthAwareBuffer(max_merge=max_merge)
    for op, value, model in ops:
        if op == "push":
            buffer.push(job(value, model=model))
        elif op == "retry":
            buffer.push_front(job(value, model=model))
        elif op == "pop":
            buffer.pop(lambda j, m=model: j.model == m)
        else:
            buffer.remove(lambda j, k=value: j.payload % 10 == k)
        elements = list(buffer)
        assert all(a.seq < b.seq for a, b in itertools.pairwise(elements))
        for tail in buffer._tails.values():
            probe = job(tail.jobs[0].max_length, model=tail.jobs[0].model)
            ahead = buffer.ahead_of_merge(probe)
            if tail.samples + 1 > max_merge:
                assert ahead is None
            else:
                assert elements.index(tail) <= ahead <= len(elements) - 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 200), max_size=40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 8))
def test_student_policy_never_exceeds_its_buffer_capacity_and_loses_nothing(lengths, groups, max_merge, overload):
    policy = StudentPolicy(max_merge=max_merge, overload_merge=overload)
    policy.resize(groups)
    jobs = [job(n) for n in lengths]
    for j in jobs:
        policy.push(j, 0.0)
        assert len(policy.buffer) <= groups
    out = []
    while batch := policy.next_batch(lambda j: True, 0.0):
        assert len(policy.buffer) <= groups
        out += batch
    assert sorted(j.payload for j in out) == sorted(j.payload for j in jobs) and len(policy) == 0


def test_an_arrival_joins_its_bins_element_even_while_others_queue():
    policy = StudentPolicy(max_merge=4)
    policy.resize(1)
    for n in (10, 50, 12):  # 50 queues (the one buffer place is taken); 12 fits the element of 10
        policy.push(job(n), 0.0)
    assert [[j.max_length for j in e.jobs] for e in policy.buffer] == [[10, 12]]
    assert [j.max_length for j in policy] == [10, 12, 50] and policy.merged == 1


def test_an_element_entering_the_buffer_takes_the_queued_samples_of_its_bin():
    policy = StudentPolicy(max_merge=3, overload_merge=3)   # the paper's buffer exactly
    policy.resize(1)
    for n in (10, 50, 70, 52, 53, 54):  # 50, 52, 53, 54 share a bin; 70 is another
        policy.push(job(n), 0.0)
    assert [j.max_length for j in policy.next_batch(lambda j: True, 0.0)] == [10]
    assert [[j.max_length for j in e.jobs] for e in policy.buffer] == [[50, 52, 53]]  # max_merge 3
    assert [j.max_length for j in policy.next_batch(lambda j: True, 0.0)] == [50, 52, 53]
    assert [[j.max_length for j in e.jobs] for e in policy.buffer] == [[70]]  # arrival order between bins
    assert [j.max_length for j in policy.next_batch(lambda j: True, 0.0)] == [70]
    assert [j.max_length for j in policy.next_batch(lambda j: True, 0.0)] == [54] and len(policy) == 0


def test_removing_queued_and_buffered_jobs_keeps_the_rest_in_order():
    policy = StudentPolicy(max_merge=2, overload_merge=2)   # the paper's buffer exactly
    policy.resize(1)
    jobs = [job(n) for n in (10, 11, 12, 50, 13)]  # element [10, 11]; queued 12, 50, 13
    for j in jobs:
        policy.push(j, 0.0)
    gone = {jobs[1].payload, jobs[3].payload}
    removed = policy.remove(lambda j: j.payload in gone)
    assert sorted(j.payload for j in removed) == sorted(gone)
    assert [[j.max_length for j in e.jobs] for e in policy.buffer] == [[10, 12]]  # the freed room refilled
    assert [j.max_length for j in policy] == [10, 12, 13] and policy.depth() == 2


student_ops = st.lists(st.one_of(st.tuples(st.just("push"), st.integers(1, 200), st.integers(1, 3)),
                                 st.tuples(st.just("pop"), st.just(0), st.just(0)),
                                 st.tuples(st.just("expire"), st.integers(0, 6), st.just(0))), max_size=80)


@settings(max_examples=150, deadline=None)
@given(student_ops, st.integers(1, 4), st.integers(1, 5), st.integers(0, 10))
def test_student_policy_merges_every_queued_sample_that_fits_and_loses_nothing(ops, groups, max_merge, overload):
    """Whatever the bounds (the overload bound 0: twice max_merge; at most max_merge: the paper's buffer)."""
    policy = StudentPolicy(max_merge=max_merge, overload_merge=overload)
    bound = max(overload or 2 * max_merge, max_merge)
    policy.resize(groups)
    pushed, out = [], []
    for op, value, texts in ops:
        if op == "push":
            pushed.append(job(value, texts=texts))
            policy.push(pushed[-1], 0.0)
        elif op == "pop":
            out += policy.next_batch(lambda j: True, 0.0)
        else:  # expiry takes out every job whose id ends in `value` (buffered or queued)
            out += policy.remove(lambda j, v=value: j.payload % 7 == v)
        queued = list(policy._waiting())
        assert len(policy.buffer) <= groups and (not queued or len(policy.buffer) == groups)
        first_of_key = {}
        for j in queued:
            first_of_key.setdefault(policy.buffer.key_of(j), j)
        assert not any(policy.buffer.merges(j) for j in first_of_key.values())  # none left that would fit
        assert len(policy) == policy.buffer.samples + len(queued)
        assert policy.buffer.max_merge == (bound if len(queued) >= groups * max_merge else max_merge)
        assert all(e.samples <= bound or len(e.jobs) == 1 for e in policy.buffer)
    while batch := policy.next_batch(lambda j: True, 0.0):
        out += batch
    assert sorted(j.payload for j in out) == sorted(j.payload for j in pushed) and len(policy) == 0


def test_while_a_full_buffers_worth_waits_beyond_it_elements_grow_to_the_overload_bound():
    """Two groups, merges of 2, overload merges of 4: once 4 samples (an element of 2 a group) queue beyond
    the buffer, the queued samples of a bin fill its element up to 4, oldest first; with fewer queued the
    paper's 2 holds, and a profile's bound moves the threshold with it."""
    policy = StudentPolicy(max_merge=2, overload_merge=4)
    policy.resize(2)
    for n in (10, 11, 12, 13, 14, 15, 16):
        policy.push(job(n), 0.0)
    assert [[j.max_length for j in e.jobs] for e in policy.buffer] == [[10, 11], [12, 13]]
    assert [j.max_length for j in policy._waiting()] == [14, 15, 16] and policy.buffer.max_merge == 2
    policy.push(job(50), 0.0)                        # the fourth queued sample: overloaded
    assert [[j.max_length for j in e.jobs] for e in policy.buffer] == [[10, 11], [12, 13, 14, 15]]
    assert [j.max_length for j in policy._waiting()] == [16, 50] and policy.buffer.max_merge == 2   # fell back
    assert [j.max_length for j in policy.next_batch(lambda j: True, 0.0)] == [10, 11]
    assert [[j.max_length for j in e.jobs] for e in policy.buffer] == [[12, 13, 14, 15], [16]]
    assert [j.max_length for j in policy._waiting()] == [50]
    policy.set_max_merge(1)                            # a profile's bound: 2 queued are now a full buffer's worth
    assert (policy.max_merge, policy.buffer.max_merge) == (1, 1)
    policy.push(job(51), 0.0)
    assert [j.max_length for j in policy._waiting()] == [50, 51] and policy.buffer.max_merge == 4
    paper = StudentPolicy(max_merge=2, overload_merge=2)
    paper.resize(2)
    for n in (10, 11, 12, 13, 14, 15, 16, 50):
        paper.push(job(n), 0.0)
    assert [[j.max_length for j in e.jobs] for e in paper.buffer] == [[10, 11], [12, 13]]   # the ablation
    assert [j.max_length for j in paper._waiting()] == [14, 15, 16, 50]


def test_an_emptied_queue_keeps_no_references_to_jobs_taken_through_their_bin():
    policy = StudentPolicy(max_merge=4)
    policy.resize(1)
    for n in (10, 50, 70, 52):  # 52 leaves the queue through its bin when 50's element enters
        policy.push(job(n), 0.0)
    while policy.next_batch(lambda j: True, 0.0):
        pass
    assert len(policy) == 0 and not policy._jobs and not policy._by_key


def test_the_deployments_settings_reach_the_student_policys_buffer():
    """ACADEMUS_BIN_WIDTH, ACADEMUS_MAX_MERGE and ACADEMUS_MAX_LENGTH as the scheduler service builds its policy."""
    from academus.services.scheduler.server import policy_from
    from academus.shared.runtime import config as cfg

    policy = policy_from(cfg.load(cfg.SchedulerConfig, env={
        "ACADEMUS_POLICY": "student", "ACADEMUS_BIN_WIDTH": "16", "ACADEMUS_MAX_MERGE": "2",
        "ACADEMUS_MAX_LENGTH": "256"}))
    assert (policy.buffer.bin_width, policy.buffer.max_merge, policy.buffer.num_bins) == (16, 2, 16)
    assert policy.overload_merge == 0    # unset: twice max_merge while the buffer is full
    paper = policy_from(cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_POLICY": "student", "ACADEMUS_MAX_MERGE": "2",
                                                            "ACADEMUS_OVERLOAD_MERGE": "2"}))
    assert (paper.max_merge, paper.overload_merge) == (2, 2)
    with pytest.raises(cfg.ConfigError, match="ACADEMUS_OVERLOAD_MERGE=-1"):
        cfg.load(cfg.SchedulerConfig, env={"ACADEMUS_POLICY": "student", "ACADEMUS_OVERLOAD_MERGE": "-1"})
