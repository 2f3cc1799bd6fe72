"""One run's load from several load-generator processes (`academus loadgen --procs N`).

One Python process sends about a thousand requests a second (each costs it ~1 ms of CPU: the client's
gRPC call and its accounting). A GPU node answers more than that: on an H200 the padded teacher's
closed-loop capacity was 921 req/s, so (c)'s 3× burst cannot come from one process. With --procs N,
request i of the schedule goes to process i % N with the text it would have had; every process starts
its share at one wall-clock instant, so the shares interleave into the schedule, and the records are
merged into one run (one histogram, one timeline) as if one process had sent them. A closed loop
splits its callers the same way.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from academus.loadgen.runner import GatewaySpread, RunResult, send_load
from academus.loadgen.texts import Sample

START_MARGIN_S = 3.0   # spawning a process and importing the client takes about a second


@dataclass(frozen=True)
class Share:
    """What one process sends: its arrivals with their texts, or its callers of a closed loop."""

    arrivals: list[float]
    samples: list[Sample]
    concurrency: int | None = None


def split(arrivals: Sequence[float], samples: Sequence[Sample], procs: int,
          concurrency: int | None = None) -> list[Share]:
    """Request i to share i % procs with samples[i % len(samples)], the text one process would send;
    a closed loop's callers split as evenly as they go."""
    if procs < 1:
        raise ValueError(f"--procs must be >= 1, not {procs}")
    if concurrency is not None:
        callers = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
        return [Share([], list(samples), c) for c in callers if c]
    return [Share(list(arrivals[k::procs]), [samples[i % len(samples)] for i in range(k, len(arrivals), procs)])
            for k in range(min(procs, max(1, len(arrivals))))]


def merge(parts: Sequence[RunResult], offered_rps: float | None, concurrency: int | None) -> RunResult:
    """The shares' records as one run, in the order they were sent."""
    first = parts[0]
    records = sorted((r for p in parts for r in p.records), key=lambda r: r.sent_at)
    return RunResult(first.model, next((p.policy for p in parts if p.policy), first.policy), offered_rps,
                     max(p.duration_s for p in parts), records, first.deadline_ms, first.requested_policy,
                     concurrency, first.early_exit)


def run_share(gateways: list[str], key: str | None, model: str, policy: str, share: Share, timeout_s: float,
              duration_s: float, start_at: float, streams: bool = False, first_gateway: int = 0,
              early_exit: bool = False) -> RunResult:
    """A child process: wait for the common start, then send this share, starting at gateways[first_gateway]."""
    from academus.shared.runtime.heap import freeze_start_up_heap

    freeze_start_up_heap("loadgen")

    async def go() -> RunResult:
        async with GatewaySpread(gateways, key, timeout_s, streams, first_gateway) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await send_load(client, model, policy, share.arrivals, share.samples, timeout_s, duration_s,
                                   share.concurrency, early_exit)

    return asyncio.run(go())


def run_in_processes(gateways: list[str], key: str | None, model: str, policy: str, arrivals: Sequence[float],
                     samples: Sequence[Sample], procs: int, timeout_s: float, duration_s: float,
                     concurrency: int | None = None, streams: bool = False, early_exit: bool = False) -> RunResult:
    """One run whose load `procs` processes send together (spawned: no gRPC state is forked)."""
    shares = split(arrivals, samples, procs, concurrency)
    start_at = time.time() + START_MARGIN_S
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        futures = [pool.submit(run_share, gateways, key, model, policy, s, timeout_s, duration_s, start_at, streams, k,
                               early_exit) for k, s in enumerate(shares)]
        parts = [f.result() for f in futures]
    offered = None if concurrency else (len(arrivals) / duration_s if duration_s else 0.0)
    return merge(parts, offered, concurrency)
