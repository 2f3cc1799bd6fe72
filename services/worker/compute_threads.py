"""The compute threads' Linux scheduling policy (WorkerConfig.compute_sched).

On a CPU node a forward pass shares the cores with every serving thread of the node: the event loops
and gRPC threads of gateway, scheduler and workers, whose work for a request is a few short bursts, one
a hop. Under the fair scheduler a thread that wakes on a core held by a compute thread may wait for
that thread's slice (EEVDF lets the running task reach parity first): once a hop, on every request.
A SCHED_IDLE compute thread is preempted by any other thread at once, so a hop never waits behind a
forward pass, and the forward pass still has the core whenever nothing else wants it. Its process's
CPU share against other processes is unchanged where each service runs in its own autogroup or cgroup
(`academus up` starts each in its own session; Kubernetes, each in its own container). On a GPU the
compute threads mostly wait for the device, and the policy changes little.

The default is `normal`: on this project's 2-core box `idle` bought 0-6 % of the students' latency at
half load and 3 % of goodput at 3x overload (loadgen/half_load_bench, overload_bench --ablate
compute_sched; docs/benchmarks/scheduling.md), inside the noise between runs, while where autogroups are off
and services
share one cgroup a front end saturating the cores would starve SCHED_IDLE compute outright.
"""

from __future__ import annotations

import os

import torch

from academus.shared.runtime.slices import reset_slice

POLICIES = {"idle": "SCHED_IDLE", "batch": "SCHED_BATCH", "normal": "SCHED_OTHER"}


def policy_of_this_thread() -> str:
    """The calling thread's policy, by its config name ("normal" where the OS cannot say)."""
    if not hasattr(os, "sched_getscheduler"):
        return "normal"
    current = os.sched_getscheduler(0)
    return next((name for name, const in POLICIES.items() if getattr(os, const, None) == current), "normal")


def apply_compute_policy(name: str) -> str:
    """Sets the calling thread's policy (pid 0 is this thread on Linux); returns the one now in force:
    "normal" where the OS has no such policy."""
    policy = getattr(os, POLICIES[name], None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return "normal"
    os.sched_setscheduler(0, policy, os.sched_param(0))
    return policy_of_this_thread()


def start_compute_thread(sched: str, device: torch.device) -> None:
    """A compute thread's initializer: the kernel's default slice (it inherited the serving threads'
    short one, shared/runtime/slices.py), its scheduling policy and, on a GPU, a CUDA stream of its own.
    PyTorch's current stream is per thread, so the instances of one worker overlap on the device instead
    of queueing on the default stream (under MPS, worker processes overlap anyway)."""
    reset_slice()
    apply_compute_policy(sched)
    if device.type == "cuda":
        torch.cuda.set_stream(torch.cuda.Stream(device))
