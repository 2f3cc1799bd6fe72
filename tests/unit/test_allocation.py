"""Student allocation (eq. 6), the student-number adaptation rule, the profile's choice, MPS decisions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from academus.services.resource_manager.allocation import (
    Device,
    GroupLoad,
    ProfilePoint,
    StudentNumber,
    allocate_groups,
    allocate_whole,
    choose_profile,
)
from academus.shared.runtime.gpu import mps_action, mps_plan, start_mps


def devices(g: int, capacity: int = 1) -> list[Device]:
    return [Device(f"gpu{d}", ((f"w{d}", capacity),)) for d in range(g)]


def device_of(allocation, group: int, student: int) -> str:
    return next(w for w, students in allocation[group] if student in students)


def test_eq6_places_student_i_of_group_j_on_device_i_plus_j_times_s_mod_g():
    allocation = allocate_groups(2, devices(4, capacity=2))  # 8 slots, S = 2: four groups
    assert len(allocation) == 4
    for j in range(4):
        for i in range(2):
            assert device_of(allocation, j, i) == f"w{(i + j * 2) % 4}"


def test_fewer_students_make_more_groups_on_the_same_devices():
    assert [len(allocate_groups(s, devices(2, capacity=2))) for s in (1, 2, 3, 4)] == [4, 2, 1, 1]


def test_fewer_slots_than_students_still_make_one_group_with_co_located_students():
    assert allocate_groups(3, devices(2, capacity=1)) == [[("w0", [0, 2]), ("w1", [1])]]


def test_students_of_one_group_share_a_member_call_when_they_land_on_one_worker():
    allocation = allocate_groups(3, devices(1, capacity=3))
    assert allocation == [[("w0", [0, 1, 2])]]


def test_whole_groups_take_a_slot_each_with_every_student_on_it():
    """A head that does not add over members (a sequence classifier's own): no group spans workers."""
    assert allocate_whole(3, devices(2, capacity=2)) == [[("w0", [0, 1, 2])]] * 2 + [[("w1", [0, 1, 2])]] * 2
    assert allocate_whole(2, []) == []
    with pytest.raises(ValueError, match="must be >= 1"):
        allocate_whole(0, devices(1))


def test_no_devices_means_no_groups_and_zero_students_is_refused():
    assert allocate_groups(2, []) == []
    with pytest.raises(ValueError, match="student number"):
        allocate_groups(0, devices(2))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 4), min_size=1, max_size=6))
def test_allocation_never_oversubscribes_a_worker_and_every_group_is_complete(students, capacities):
    devs = [Device(f"d{k}", ((f"w{k}", c),)) for k, c in enumerate(capacities)]
    allocation = allocate_groups(students, devs)
    total = sum(capacities)
    assert len(allocation) == (max(1, total // students) if total else 0)
    used: dict[str, int] = {}
    for group in allocation:
        assert sorted(i for _, s in group for i in s) == list(range(students))
        for worker, s in group:
            used[worker] = used.get(worker, 0) + len(s)
    for k, c in enumerate(capacities):
        assert used.get(f"w{k}", 0) <= c or total < students  # co-location only when slots are short


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_buffer_reaching_the_group_count_drops_the_last_trained_student():
    clock = Clock()
    number = StudentNumber(current=4, ceiling=4, window_s=120, cooldown_s=1, clock=clock)
    assert number.observe(GroupLoad(buffer=1, groups=2, idle=0, busy=2)) is None
    assert number.observe(GroupLoad(buffer=2, groups=2, idle=0, busy=2)) == 3


def test_no_change_within_the_cooldown_and_never_below_one_student():
    clock = Clock()
    number = StudentNumber(current=2, ceiling=4, window_s=120, cooldown_s=1, clock=clock)
    burst = GroupLoad(buffer=9, groups=2, idle=0, busy=2)
    assert number.observe(burst) == 1
    clock.now = 0.5
    assert number.observe(burst) is None
    clock.now = 5
    assert number.observe(burst) is None and number.current == 1


def test_an_operators_number_is_clamped_and_the_cooldown_follows_it():
    clock = Clock()
    number = StudentNumber(current=2, ceiling=4, window_s=120, cooldown_s=10, clock=clock)
    burst = GroupLoad(buffer=9, groups=1, idle=0, busy=1)
    clock.now = 100
    assert number.adopt(7) == 4 and number.current == 4
    clock.now = 105
    assert number.observe(burst) is None          # within the cooldown of the operator's change
    clock.now = 111
    assert number.observe(burst) == 3
    assert number.adopt(0) == 1


def test_signals_of_groups_not_yet_re_formed_are_not_judged():
    """After a drop, the next one waits for groups of the new number, not for a fixed time: a burst sheds
    students as fast as the schedulers re-form (App. B.4.1: the buffer's wait must not exceed a pass)."""
    clock = Clock()
    number = StudentNumber(current=4, ceiling=4, window_s=120, cooldown_s=0.2, clock=clock)
    assert number.observe(GroupLoad(buffer=9, groups=1, idle=0, busy=1, students=4)) == 3
    clock.now = 0.4
    assert number.observe(GroupLoad(buffer=9, groups=1, idle=0, busy=1, students=4)) is None  # the old groups
    assert number.observe(GroupLoad(buffer=9, groups=1, idle=0, busy=1, students=0)) is None  # not all re-formed
    assert number.observe(GroupLoad(buffer=9, groups=1, idle=0, busy=1, students=3)) == 2
    clock.now = 0.5
    assert number.observe(GroupLoad(buffer=9, groups=1, idle=0, busy=1, students=2)) is None  # the cooldown


def test_a_student_is_added_back_only_after_a_whole_quiet_window():
    clock = Clock()
    number = StudentNumber(current=1, ceiling=3, window_s=120, cooldown_s=1, clock=clock)
    quiet = GroupLoad(buffer=0, groups=4, idle=3, busy=1)  # idle students (3×1) > busy groups (1)
    assert number.observe(quiet) is None
    clock.now = 119
    assert number.observe(quiet) is None
    clock.now = 121
    assert number.observe(quiet) == 2


def test_any_buffered_sample_restarts_the_quiet_window():
    clock = Clock()
    number = StudentNumber(current=1, ceiling=3, window_s=10, cooldown_s=0, clock=clock)
    quiet, busy = GroupLoad(0, 4, 3, 1), GroupLoad(1, 4, 0, 4)
    number.observe(quiet)
    clock.now = 8
    number.observe(busy)
    clock.now = 12
    assert number.observe(quiet) is None
    clock.now = 23
    assert number.observe(quiet) == 2


def test_the_ceiling_and_a_busy_node_stop_additions():
    clock = Clock()
    capped = StudentNumber(current=2, ceiling=2, window_s=0, cooldown_s=0, clock=clock)
    assert capped.observe(GroupLoad(0, 4, 4, 0)) is None
    loaded = StudentNumber(current=1, ceiling=3, window_s=0, cooldown_s=0, clock=clock)
    assert loaded.observe(GroupLoad(0, 4, 1, 3)) is None  # 1 idle student <= 3 busy groups


def test_profile_choice_is_the_most_throughput_within_the_latency_tolerance():
    points = [ProfilePoint(1, 1, 100, 10), ProfilePoint(1, 4, 300, 14), ProfilePoint(2, 1, 180, 11),
              ProfilePoint(2, 4, 500, 30), ProfilePoint(4, 1, 190, 21)]
    assert choose_profile(points, tolerance=1.5) == ProfilePoint(1, 4, 300, 14)
    assert choose_profile(points, tolerance=3.0) == ProfilePoint(2, 4, 500, 30)
    with pytest.raises(ValueError):
        choose_profile([])


def test_mps_is_skipped_without_gpus_and_started_only_when_absent():
    assert mps_action(0, "auto", False, True) == "skip"
    assert mps_action(2, "off", False, True) == "skip"
    assert mps_action(2, "auto", True, True) == "running"
    assert mps_action(2, "auto", False, True) == "start"
    assert mps_action(2, "auto", False, False) == "missing"


def test_mps_plan_pins_each_worker_to_a_gpu_with_an_equal_thread_share():
    plan = mps_plan(2, 4)
    assert len(plan) == 8
    assert [p["CUDA_VISIBLE_DEVICES"] for p in plan] == ["0"] * 4 + ["1"] * 4
    assert {p["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] for p in plan} == {"25"}
    assert mps_plan(0, 4) == []


def test_start_mps_does_nothing_without_gpus():
    assert start_mps("auto", gpus=0) == "skip"


FAKE_MPS_CONTROL = """#!/bin/sh
# The front end's contract: -d starts the daemon; a command on stdin is answered only while one runs.
here=$(dirname "$0")
if [ "$1" = "-d" ]; then echo start >> "$here/calls"; touch "$here/running"; exit 0; fi
[ -f "$here/running" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
read cmd
case "$cmd" in get_server_list) echo 4242;; "get_client_list 4242") printf "101\\n102\\n";; esac
"""


def test_start_mps_asks_the_daemon_and_starts_it_only_when_none_answers(tmp_path, monkeypatch):
    from academus.loadgen.probes.mps_check import mps_servers

    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(FAKE_MPS_CONTROL)
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert mps_servers() == {}                     # no daemon: nothing to list
    assert start_mps("auto", gpus=1) == "start"
    assert start_mps("auto", gpus=1) == "running"  # a second mesh on the node finds it
    assert start_mps("off", gpus=1) == "skip"
    assert (tmp_path / "calls").read_text().split() == ["start"]
    assert mps_servers() == {4242: [101, 102]}


def test_mps_check_reads_the_control_daemons_pids_and_each_workers_real_environment(tmp_path):
    import subprocess
    import sys

    from academus.loadgen.probes.mps_check import pids, process_env
    from academus.shared.runtime.logs import logged_events

    assert pids("1234\n5678\n") == [1234, 5678]
    assert pids("") == [] and pids("Server 77 ready") == [77]
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             env={"CUDA_VISIBLE_DEVICES": "3", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "OTHER": "x"},
                             stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # exec'd: before that, /proc shows the forking parent's environment
        assert process_env(child.pid) == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"}
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    log = tmp_path / "resource_manager.log"
    log.write_text('not json\n{"event": "mps", "action": "start"}\n{"event": "other"}\n')
    assert [e["action"] for e in logged_events(log, "mps")] == ["start"]
    assert logged_events(tmp_path / "absent.log", "mps") == []
