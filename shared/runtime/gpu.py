"""GPU placement helpers shared by the resource manager and `academus up`: how many GPUs, how each
worker is pinned to one and shares it under MPS (Student Parallelism App. B.4), and whether the MPS
control daemon must be started. Every function has a CPU answer: no GPUs, nothing to do."""

from __future__ import annotations

import shutil
import subprocess


def gpu_count() -> int:
    import torch  # only here: the gateway and scheduler never need torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


MPS_SETTING = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"   # a worker's share of its GPU under MPS


def mps_plan(gpus: int, instances_per_gpu: int) -> list[dict[str, str]]:
    """The environment of each GPU worker: pinned to its GPU, sharing it under MPS with an equal
    active-thread percentage. No GPUs: no plan (the CPU path starts plain workers)."""
    if gpus < 1:
        return []
    if instances_per_gpu < 1:
        raise ValueError(f"instances per GPU must be >= 1, not {instances_per_gpu}")
    share = str(max(1, 100 // instances_per_gpu))
    return [{"CUDA_VISIBLE_DEVICES": str(g), MPS_SETTING: share,
             "ACADEMUS_DEVICE": "cuda:0"}  # the one visible GPU
            for g in range(gpus) for _ in range(instances_per_gpu)]


def mps_action(gpus: int, mode: str, daemon_running: bool, binary_found: bool) -> str:
    """What the resource manager does about MPS at start: skip | running | start | missing."""
    if mode == "off" or gpus < 1:
        return "skip"
    if daemon_running:
        return "running"
    return "start" if binary_found else "missing"


MPS_CONTROL = "nvidia-cuda-mps-control"


def mps_control(command: str) -> str | None:
    """One command to the MPS control daemon through its front end; its answer, or None where there is no
    binary or no daemon (the front end exits non-zero when it cannot reach one)."""
    binary = shutil.which(MPS_CONTROL)
    if binary is None:
        return None
    try:
        done = subprocess.run([binary], input=command + "\n", capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def start_mps(mode: str, gpus: int | None = None) -> str:
    """Starts `nvidia-cuda-mps-control -d` on a GPU node when no daemon answers; returns the action.
    Asking the daemon, not the process table, also works where the node has no pgrep."""
    gpus = gpu_count() if gpus is None else gpus
    binary = shutil.which(MPS_CONTROL)
    running = bool(gpus) and mps_control("get_server_list") is not None
    action = mps_action(gpus, mode, running, binary is not None)
    if action == "start":
        subprocess.run([binary, "-d"], check=True, timeout=30)
    return action
