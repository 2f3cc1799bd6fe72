"""Student allocation and adaptation (Student Parallelism §3.3.1, App. B.4.1, B.4.3) — pure logic.

- `allocate_groups`: eq. 6, student i of group j on device (i + j·S) % G, as many groups as the
  devices' instance slots hold; `allocate_whole`: a group a slot, for heads that do not add over members.
- `StudentNumber`: drops the last-trained student when the buffer reaches the group count (again as soon
  as the schedulers report groups of the new number, while the buffer still reaches their count); adds one
  back when the buffer stayed empty and idle students outnumbered busy groups for a whole window.
- `choose_profile`: the grid search's pick, most throughput without raising latency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from academus.shared.state.groups import Groups


@dataclass(frozen=True)
class Device:
    """A GPU (or, on CPU, one worker process) and the workers on it with their instance slots."""

    name: str
    workers: tuple[tuple[str, int], ...]   # (worker_id, capacity)

    @property
    def slots(self) -> int:
        return sum(c for _, c in self.workers)


Allocation = Groups  # group -> members (worker_id, student indices), as `groups:<model>` holds them


def allocate_groups(students: int, devices: Sequence[Device]) -> Allocation:
    """Eq. 6: student i of group j goes to device (i + j·S) % G; groups = ⌊slots / S⌋. Within a
    device, instances fill its workers' slots in order. A device whose slots ran out (uneven
    capacities) passes the student to the next device with room. With fewer slots than S there is
    still one group: its co-located students run one after another in their worker's call."""
    if students < 1:
        raise ValueError(f"the student number must be >= 1, not {students}")
    devices = [d for d in devices if d.slots > 0]
    total = sum(d.slots for d in devices)
    free = [list(d.workers) for d in devices]
    groups: Allocation = []
    for j in range(max(1, total // students) if devices else 0):
        members: dict[str, list[int]] = {}
        for i in range(students):
            worker = _take_slot(free, (i + j * students) % len(devices))
            members.setdefault(worker, []).append(i)
        groups.append(list(members.items()))
    return groups


def allocate_whole(students: int, devices: Sequence[Device]) -> Allocation:
    """One group a worker instance slot, all `students` on it (run one after another in its call): for a group
    whose head does not add over members, so no scheduler could combine students placed apart."""
    if students < 1:
        raise ValueError(f"the student number must be >= 1, not {students}")
    return [[(worker, list(range(students)))] for d in devices for worker, slots in d.workers for _ in range(slots)]


def _take_slot(free: list[list[tuple[str, int]]], device: int) -> str:
    for step in range(len(free)):
        slots = free[(device + step) % len(free)]
        for k, (worker, left) in enumerate(slots):
            if left > 0:
                slots[k] = (worker, left - 1)
                return worker
    return free[device][0][0]  # fewer slots than students: co-locate on eq. 6's device


@dataclass(frozen=True)
class GroupLoad:
    """One scheduler tick's signals for a model, summed over schedulers."""

    buffer: int          # waiting elements (length-aware buffer + admission queue)
    groups: int
    idle: int
    busy: int
    students: int | None = None  # the number every scheduler's groups run; 0: not the same yet; None: unknown


@dataclass
class StudentNumber:
    """The adaptation rule of App. B.4.1/B.4.3 for one student model, with an injected clock."""

    current: int
    ceiling: int
    window_s: float = 120.0
    cooldown_s: float = 0.2
    clock: Callable[[], float] = field(default=lambda: 0.0)
    _quiet_since: float | None = None
    _changed_at: float = float("-inf")

    def observe(self, load: GroupLoad) -> int | None:
        """The new student number when it should change now, else None."""
        now = self.clock()
        if now - self._changed_at < self.cooldown_s or load.students not in (None, self.current):
            return None  # the schedulers have not re-formed their groups yet: these signals are the old groups'
        if load.groups and load.buffer >= load.groups and self.current > 1:
            return self._set(self.current - 1, now)  # burst: fewer students, more groups
        if load.buffer == 0 and load.idle * self.current > load.busy and self.current < self.ceiling:
            if self._quiet_since is None:
                self._quiet_since = now
            elif now - self._quiet_since >= self.window_s:
                return self._set(self.current + 1, now)  # quiet: spend idle students on accuracy
        else:
            self._quiet_since = None
        return None

    def adopt(self, value: int) -> int:
        """An operator's number (within 1..ceiling): a change like the rule's, so the cooldown follows it too."""
        return self._set(min(max(1, value), self.ceiling), self.clock())

    def _set(self, value: int, now: float) -> int:
        self.current, self._changed_at, self._quiet_since = value, now, None
        return value


@dataclass(frozen=True)
class ProfilePoint:
    instances: int
    merge: int
    throughput: float    # samples/s over all instances
    latency_ms: float    # mean batch latency


def choose_profile(points: Sequence[ProfilePoint], tolerance: float = 1.5) -> ProfilePoint:
    """The most throughput among settings whose batch latency stays within `tolerance` × the single
    instance, single sample latency: more instances or merges only while the device keeps up."""
    if not points:
        raise ValueError("an empty profile has nothing to choose from")
    base = min(points, key=lambda p: (p.instances, p.merge))
    fitting = [p for p in points if p.latency_ms <= tolerance * base.latency_ms]
    return max(fitting, key=lambda p: (p.throughput, -p.instances, -p.merge))
