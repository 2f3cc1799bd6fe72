"""The queue's wait bound under DAS, on a simulated clock: what the policy does, without a noisy machine.

    python -m academus.loadgen.wait_bound_sim [--task sentiment|spam] [--load 2] [--duration 120] [--seeds 3]

The scheduler's own Dispatcher (admission with its wait bound) and ConcatPolicy (DAS, the latency model it
learns) run on an asyncio loop whose clock moves only when nothing is ready. A group is a sleep of the
batch's time, `overhead + full · tokens / (rows · L)`. Requests arrive Poisson at --load times the groups'
capacity with full rows, one text each, of the task's test texts' token counts, with --deadline. Each seed
runs both arms on the same arrivals: `due_first` (the policy holds the bound, ACADEMUS_CONCAT_DUE_FIRST) and
DAS alone (admission keeps the bound, the policy is not told). The last line printed is the summary JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import selectors
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from academus.loadgen.stats import percentile
from academus.services.scheduler.core import Dispatcher, Group, Job
from academus.services.scheduler.policies import ConcatPolicy, LatencyModel
from academus.shared.runtime.errors import DeadlineExceeded, ResourceExhausted

MODEL = "sim"


class _VirtualSelector(selectors.SelectSelector):
    """Never blocks: waiting for the next timer moves the loop's clock to it instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(0)
        if not ready and timeout:      # None: nothing scheduled; 0: something is ready now
            self.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time: timers fire in order, at once."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


@dataclass(frozen=True)
class Scenario:
    lengths: Sequence[int]         # the texts' tokens to draw from
    row_length: int = 128
    rows: int = 8
    groups: int = 2
    full_batch_s: float = 0.2      # a batch of rows · L tokens, beyond the overhead
    overhead_s: float = 0.02
    bound_s: float = 1.0
    deadline_s: float = 5.0
    load: float = 2.0
    duration_s: float = 120.0
    jitter: float = 0.0            # σ of a log-normal factor of mean 1 on each batch's time
    stall_share: float = 0.0       # the share of batches that stall (a pause, a core taken away) ...
    stall_factor: float = 1.0      # ... and take this many times their time

    def batch_s(self, tokens: int) -> float:
        return self.overhead_s + self.full_batch_s * tokens / (self.rows * self.row_length)

    def jittered(self, seconds: float, rng: random.Random) -> float:
        """A batch's time on a machine that varies: the model's time times a factor of mean 1, and now and then
        a stall."""
        if self.jitter:
            seconds *= math.exp(rng.gauss(-self.jitter ** 2 / 2, self.jitter))
        if self.stall_share and rng.random() < self.stall_share:
            seconds *= self.stall_factor
        return seconds

    @property
    def capacity_rps(self) -> float:
        """Requests a second with every row full of texts of the mean length."""
        mean = statistics.fmean(min(n, self.row_length) for n in self.lengths)
        return self.groups * (self.rows * self.row_length / mean) / self.batch_s(self.rows * self.row_length)


@dataclass
class Outcomes:
    waits: list[tuple[int, float]] = field(default_factory=list)    # (tokens, wait to first dispatch) of answers
    refused: int = 0               # at admission: RESOURCE_EXHAUSTED or DEADLINE_EXCEEDED, at once
    expired: int = 0               # admitted, then DEADLINE_EXCEEDED (DAS or the dispatcher found it late)


async def _simulate(scenario: Scenario, due_first: bool, seed: int) -> Outcomes:
    loop = asyncio.get_running_loop()
    policy = ConcatPolicy(scenario.row_length, scenario.rows, latency=LatencyModel(), due_first=due_first)
    machine = random.Random(-1 - seed)   # the batches' jitter, apart from the arrivals

    async def send(group: Group, batch: Sequence[Job]) -> list[None]:
        plan = batch[0].plan
        tokens = plan.computed_tokens if plan else scenario.rows * scenario.row_length
        await asyncio.sleep(scenario.jittered(scenario.batch_s(tokens), machine))
        return [None] * len(batch)

    dispatcher = Dispatcher(policy, send, 1 << 20, clock=loop.time, max_queue_wait_s=scenario.bound_s,
                            policy_name="concat")
    dispatcher.update_workers({f"w{k}": (f"sim:{k}", frozenset({MODEL})) for k in range(scenario.groups)})
    outcomes, rng, running = Outcomes(), random.Random(seed), set()
    rate = scenario.load * scenario.capacity_rps

    async def one(job: Job) -> None:
        try:
            await dispatcher.submit(job)
            outcomes.waits.append((job.num_tokens, job.started_at - job.enqueued_at))
        except (ResourceExhausted, DeadlineExceeded):
            if job.future is None:
                outcomes.refused += 1
            else:
                outcomes.expired += 1

    while loop.time() < scenario.duration_s:
        await asyncio.sleep(rng.expovariate(rate))
        n, now = rng.choice(scenario.lengths), loop.time()
        job = Job(MODEL, None, 1, n, now + scenario.deadline_s, now, (MODEL,), max_length=n, lengths=(n,))
        task = loop.create_task(one(job))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    return outcomes


def simulate(scenario: Scenario, due_first: bool, seed: int) -> Outcomes:
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(_simulate(scenario, due_first, seed))
    finally:
        loop.close()


def figures(scenario: Scenario, outcomes: Outcomes) -> dict[str, Any]:
    waits = [w for _, w in outcomes.waits]
    longest = sorted(outcomes.waits)[-max(1, len(outcomes.waits) // 4):]   # the longest quarter of the answered
    return {"answered_rps": round(len(waits) / scenario.duration_s, 1),
            "tokens_per_s": round(sum(n for n, _ in outcomes.waits) / scenario.duration_s),
            "refused": outcomes.refused, "expired_after_admission": outcomes.expired,
            "wait_p50_s": round(percentile(waits, 50), 3), "wait_p99_s": round(percentile(waits, 99), 3),
            "wait_max_s": round(max(waits, default=0.0), 3),
            "longest_quarter_wait_p99_s": round(percentile([w for _, w in longest], 99), 3),
            "over_bound": round(sum(w > scenario.bound_s for w in waits) / max(1, len(waits)), 4),
            "over_twice_bound": round(sum(w > 2 * scenario.bound_s for w in waits) / max(1, len(waits)), 4)}


def task_lengths(task: str, max_tokens: int) -> list[int]:
    """The token counts of a task's test texts, as the gateway tokenizes them (truncated to max_tokens)."""
    from academus.loadgen.texts import from_task
    from academus.shared.models.teacher_files import teacher_dir
    from academus.shared.models.tokenization import TeacherTokenizer

    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=max_tokens)
    return [len(e.input_ids) for e in tokenizer.encode([s.text for s in from_task(task)], truncate=True)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = task_lengths(args.task, args.max_tokens)
    scenario = Scenario(lengths, args.row_length, args.rows, args.groups, args.full_batch_ms / 1e3,
                        args.overhead_ms / 1e3, args.bound_ms / 1e3, args.deadline, args.load, args.duration,
                        args.jitter, *args.stalls)
    arms: dict[str, list[dict[str, Any]]] = {"due_first": [], "das_alone": []}
    for seed in range(args.seeds):
        for arm, due_first in (("due_first", True), ("das_alone", False)):
            arms[arm].append(figures(scenario, simulate(scenario, due_first, seed)))
            print(json.dumps({"seed": seed, "arm": arm, **arms[arm][-1]}), flush=True)
    ratio = [a["answered_rps"] / b["answered_rps"] for a, b in zip(arms["due_first"], arms["das_alone"], strict=True)]
    return {"task": args.task, "lengths": {"mean": round(statistics.fmean(lengths), 1), "max": max(lengths)},
            "capacity_rps": round(scenario.capacity_rps, 1), "rate_rps": round(args.load * scenario.capacity_rps, 1),
            "scenario": {k: v for k, v in vars(scenario).items() if k != "lengths"},
            "answered_ratio_due_first_over_das_alone": round(math.exp(statistics.fmean(map(math.log, ratio))), 3),
            "arms": arms}


def _stalls(text: str) -> tuple[float, float]:
    share, factor = (float(x) for x in text.split(":"))
    if not 0 <= share <= 1 or factor < 1:
        raise argparse.ArgumentTypeError(f"--stalls {text!r}: a share in [0, 1] and a factor of at least 1")
    return share, factor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.wait_bound_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="sentiment", help="whose test texts' lengths (sentiment, spam)")
    p.add_argument("--max-tokens", type=int, default=256, help="texts truncated to this (the serving limit)")
    p.add_argument("--row-length", type=int, default=128, help="L (256 for spam's long emails)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--full-batch-ms", type=float, default=200.0, help="a full batch's time beyond the overhead")
    p.add_argument("--overhead-ms", type=float, default=20.0)
    p.add_argument("--bound-ms", type=float, default=1000.0, help="the queue's wait bound")
    p.add_argument("--deadline", type=float, default=5.0, help="each request's deadline (s)")
    p.add_argument("--load", type=float, default=2.0, help="offered rate over the capacity with full rows")
    p.add_argument("--duration", type=float, default=120.0, help="simulated seconds of arrivals")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jitter", type=float, default=0.0,
                   help="σ of a log-normal factor (mean 1) on each batch's time: a machine that varies")
    p.add_argument("--stalls", type=_stalls, default=(0.0, 1.0), metavar="SHARE:FACTOR",
                   help="that share of the batches take FACTOR times their time (e.g. 0.01:10)")
    print(json.dumps(run(p.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
