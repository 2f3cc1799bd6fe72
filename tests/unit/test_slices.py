"""The serving threads ask for a short EEVDF slice; the compute threads take the kernel's back."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from academus.services.worker.server import WorkerServicer
from academus.shared.runtime import config as cfg
from academus.shared.runtime.slices import autogroup_nice, reset_slice, set_thread_slice, thread_slice_ns
from tests.unit.test_compute_threads import in_new_thread

# Linux 6.6+ shows a thread's slice in /proc; elsewhere there is nothing to check
slices_shown = pytest.mark.skipif(thread_slice_ns() is None, reason="the kernel shows no se.slice")


def kernel_slice_ns() -> int | None:
    return in_new_thread(lambda: (reset_slice(), thread_slice_ns())[1])


@slices_shown
def test_a_thread_gets_the_slice_it_asks_for_and_its_threads_inherit_it() -> None:
    def ask_then_spawn() -> tuple[bool, int | None, int | None]:
        asked = set_thread_slice(250)
        return asked, thread_slice_ns(), in_new_thread(thread_slice_ns)

    before = thread_slice_ns()
    assert in_new_thread(ask_then_spawn) == (True, 250_000, 250_000)
    assert thread_slice_ns() == before, "only the asking thread (and what it starts) changed"


@slices_shown
def test_reset_gives_the_kernels_slice_back() -> None:
    def ask_then_reset() -> tuple[int | None, int | None]:
        set_thread_slice(100)
        short = thread_slice_ns()
        reset_slice()
        return short, thread_slice_ns()

    short, back = in_new_thread(ask_then_reset)
    assert short == 100_000 and back == kernel_slice_ns() and back != 100_000


@slices_shown
def test_the_workers_compute_threads_run_on_the_kernels_slice() -> None:
    """A worker's threads inherit the serving threads' short slice; a forward pass must not preempt the
    hops' threads as if it were one of them."""
    def servicer_threads() -> tuple[int | None, int | None]:
        set_thread_slice(100)
        servicer = WorkerServicer(SimpleNamespace(device=torch.device("cpu")), "w", instances=1)
        return thread_slice_ns(), asyncio.run(servicer.compute.run(thread_slice_ns))

    serving, compute = in_new_thread(servicer_threads)
    assert serving == 100_000 and compute == kernel_slice_ns()


def test_the_hop_slice_is_opt_in_and_checked_against_the_kernels_range() -> None:
    assert cfg.load(cfg.CommonConfig, env={}).hop_slice_us == 0
    assert cfg.load(cfg.CommonConfig, env={"ACADEMUS_HOP_SLICE_US": "100"}).hop_slice_us == 100
    for bad in ("50", "200000"):
        with pytest.raises(cfg.ConfigError, match=re.escape(f"ACADEMUS_HOP_SLICE_US={bad} must be 0 (the kernel's "
                                                            "default) or in 100..100000")):
            cfg.load(cfg.GatewayConfig, env={"ACADEMUS_HOP_SLICE_US": bad})


@slices_shown
def test_the_wake_probe_measures_both_slices(tmp_path) -> None:
    """`python -m academus.loadgen.probes.wake_probe`, shortened (a process of its own: it starts a session and
    spinners): a row a slice, each its own wake-up delays."""
    out = tmp_path / "probe.json"
    probe = [sys.executable, "-m", "academus.loadgen.probes.wake_probe", "--wakes", "40", "--work-ms", "0.1"]
    done = subprocess.run([*probe, "--out", str(out)], capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(out.read_text())["rows"]
    assert [r["slice_us"] for r in rows] == [0, 100]
    assert all(0 <= r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"] for r in rows), rows
    assert json.loads(done.stdout.splitlines()[-1])["rows"] == rows


AUTOGROUP_PROBE = """
import json
from academus.shared.runtime.slices import autogroup_nice, hold_autogroup, release_autogroup, set_autogroup_nice
seen = [set_autogroup_nice(19), set_autogroup_nice(0)]
seen += [hold_autogroup(19), set_autogroup_nice(7), autogroup_nice(), release_autogroup()]   # a built standby
seen += [hold_autogroup(19), release_autogroup()]   # a standby whose service sets none
print(json.dumps(seen))
"""


@pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="the kernel has no autogroups")
def test_a_session_leader_lowers_its_autogroup_and_raises_it_back_without_privilege() -> None:
    """What a standby process counts on: nice 19 while it waits, whatever its service sets meanwhile (the
    worker's ACADEMUS_COMPUTE_NICE), and the service's value, else the one before, once it serves."""
    done = subprocess.run([sys.executable, "-c", AUTOGROUP_PROBE], capture_output=True, text=True, check=True,
                          start_new_session=True)
    assert json.loads(done.stdout) == [19, 0, 19, 7, 19, 7, 19, 7]


@pytest.mark.skipif(not Path("/proc/1/autogroup").exists(), reason="the kernel has no autogroups")
def test_the_root_autogroup_and_a_process_that_is_gone_have_no_autogroup_nice_value() -> None:
    """The root group's file is empty (init's, and a container's processes' that never left its session)."""
    if Path("/proc/1/autogroup").read_text().strip():
        pytest.skip("init is in an autogroup of its own here")
    assert autogroup_nice(1) is None
    assert autogroup_nice(2**22 + 1) is None   # above the kernel's largest pid
