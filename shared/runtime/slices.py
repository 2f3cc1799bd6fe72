"""The serving threads' EEVDF slice: a hop's thread runs as soon as it wakes, not after a forward pass's slice.

On a CPU node the event loops and gRPC threads of gateway, scheduler and workers share the cores with
the workers' forward passes. Each of a request's hops is a few wake-ups of some 0.1-1 ms of work. Under
EEVDF (Linux 6.6+) a thread that wakes on a core held by a compute thread is picked by its virtual
deadline, its eligible time plus its slice; with the kernel's slice (1.4 ms on a 2-core box) a thread
that has just worked a little waits for the running one to reach parity. Measured on this project's
2-core box (two processes spinning, a thread waking every 2 ms to work 0.5-1 ms): 9-20 % of its
wake-ups waited 3.6-3.9 ms; with a 0.1 ms slice, 0.1-0.3 % did. Since Linux 6.12 a thread may ask for
its own slice (`sched_attr.sched_runtime`, 0.1-100 ms), and a waking thread with a shorter slice than
the running one preempts it; the measurement above ran each process in its own session, so this holds
across autogroups too. The slice changes who runs first, not the CPU shares: a saturated node
splits its cores as before.

With ACADEMUS_HOP_SLICE_US set, every service (and the load generator) puts its threads on that slice
before it starts a server (threads and child processes inherit it), and the workers' compute
threads take the kernel's default back (`reset_slice`). On older kernels the field is ignored; where the
call is refused (a seccomp filter, not Linux) nothing changes and serving goes on.

It is an opt-in: in the mesh it did not shorten the students' tail. `python -m
academus.loadgen.half_load_bench --rate 67 --ablate hop_slice --rounds 3` (docs/benchmarks/scheduling.md)
gave the students' p95
32.3 / 26.1 / 26.9 ms with 0.1 ms against 24.1 / 25.5 / 26.7 ms with the kernel's, their tail's compute
longer (10.1-13.2 against 8.9-11.0 ms): the hops preempt the forward passes more often, and what the
hops gain the forward passes lose.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import struct
import threading
from pathlib import Path

log = logging.getLogger(__name__)

# x86_64 and aarch64 syscall numbers of sched_setattr / sched_getattr
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
# struct sched_attr, SCHED_ATTR_SIZE_VER1: size, policy, flags, nice, priority, runtime, deadline, period,
# util_min, util_max
_ATTR = struct.Struct("IIQiIQQQII")
_RUNTIME = 5   # sched_runtime's index in the struct: for a fair-class thread, its slice in ns (0: the default)
MIN_SLICE_US, MAX_SLICE_US = 100, 100_000   # the kernel clamps a slice to 0.1-100 ms
_asked = False   # whether this process set a slice of its own: only then has a compute thread one to undo


@functools.cache
def _syscalls() -> tuple[ctypes.CDLL, int, int] | None:
    numbers = _SYSCALLS.get(platform.machine())
    if platform.system() != "Linux" or numbers is None:
        return None
    return ctypes.CDLL(None, use_errno=True), *numbers


def set_thread_slice(slice_us: int, tid: int = 0) -> bool:
    """Sets a thread's slice (0: the kernel's default; tid 0: the calling thread), keeping its policy and
    nice value. False where the OS refused or has no such call."""
    calls = _syscalls()
    if calls is None:
        return False
    libc, set_nr, get_nr = calls
    buf = ctypes.create_string_buffer(_ATTR.size)
    if libc.syscall(get_nr, tid, buf, _ATTR.size, 0) != 0:
        return _refused("sched_getattr", slice_us)
    attr = list(_ATTR.unpack(buf.raw))
    attr[0], attr[2], attr[_RUNTIME] = _ATTR.size, 0, slice_us * 1000
    if libc.syscall(set_nr, tid, ctypes.create_string_buffer(_ATTR.pack(*attr)), 0) != 0:
        return _refused("sched_setattr", slice_us)
    global _asked
    _asked = _asked or bool(slice_us)
    return True


def set_process_slice(slice_us: int) -> bool:
    """Every thread of this process on that slice, and so every thread started from now on: the native
    libraries start theirs at import (a BLAS pool), before the service's code runs. 0 (the setting's
    default) leaves the kernel's slice alone."""
    if not slice_us or _syscalls() is None:
        return False
    return all([set_thread_slice(slice_us, tid) for tid in thread_ids()])


def thread_ids(pid: int | str = "self") -> list[int]:
    """The native ids of a process's threads (by default this process's), from /proc."""
    return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]


def autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of a process's autogroup (its CPU share against other sessions'); None where it has none:
    no autogroups, or the root group (a container's processes, or ones never in a session of their own),
    whose file is empty."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
        return int(fields[-1]) if fields else None
    except (OSError, ValueError):   # no autogroups, or not this kernel's file format
        return None


def set_autogroup_nice(nice: int) -> int | None:
    """This process's autogroup at `nice`; the value now (None: no autogroups, or not a session leader, see
    `_write_autogroup`). Raising it, and lowering it back as far as 0, needs no privilege. While the group is
    held (`hold_autogroup`) the value is kept for the release, and returned."""
    with _hold_lock:
        if _release_to:
            _release_to[0] = nice
            return nice
        return _write_autogroup(nice)


def hold_autogroup(nice: int) -> int | None:
    """This process's autogroup at `nice` until `release_autogroup`, whatever the process sets meanwhile
    (a standby's wait: shared/cli/standby.py); the value now."""
    with _hold_lock:
        if not _release_to:
            _release_to.append(autogroup_nice())
        return _write_autogroup(nice)


def release_autogroup() -> int | None:
    """The autogroup at the last value the process set while it was held, else at the one before the hold."""
    with _hold_lock:
        if not _release_to:
            return autogroup_nice()
        nice = _release_to.pop()
        return autogroup_nice() if nice is None else _write_autogroup(nice)


def owns_autogroup() -> bool:
    """Whether this process may move its autogroup: it has one, and leads its session. The autogroup is the whole
    session's, and in a terminal's session it would change the terminal's share too. `academus up` starts each
    service in a session of its own."""
    return _leads_session() and autogroup_nice() is not None


def _leads_session() -> bool:
    return os.getsid(0) == os.getpid()


def _write_autogroup(nice: int) -> int | None:
    """Written by a session leader only (`owns_autogroup`)."""
    if not _leads_session():
        return None
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
    except OSError:
        return None
    return autogroup_nice()


_hold_lock = threading.Lock()
_release_to: list[int | None] = []   # while held: the value to release to


def _refused(call: str, slice_us: int) -> bool:
    if slice_us:   # a reset that fails leaves the kernel's slice, which it is there to restore
        log.warning("%s refused (errno %d): the serving threads keep the kernel's slice", call, ctypes.get_errno())
    return False


def reset_slice() -> bool:
    """The kernel's default slice for the calling thread: a forward pass is not a hop. Nothing to do (no
    syscall) in a process that never set a slice, as with the setting off."""
    return _asked and set_thread_slice(0)


def thread_slice_ns(native_id: int | None = None, pid: int | str = "self") -> int | None:
    """The slice the kernel gives a thread (`se.slice` in /proc; by default the calling thread), None where
    it says none."""
    tid = threading.get_native_id() if native_id is None else native_id
    try:
        lines = Path(f"/proc/{pid}/task/{tid}/sched").read_text().splitlines()
    except OSError:
        return None
    return next((int(float(line.split(":")[1])) for line in lines if line.startswith("se.slice")), None)


def process_slices_ns(pid: int) -> list[int | None]:
    """Every thread's slice in process `pid`."""
    return [thread_slice_ns(tid, pid) for tid in thread_ids(pid)]
