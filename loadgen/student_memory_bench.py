"""A student added where it is not held, under a memory budget: its first answer from its shards (what a worker
with `ACADEMUS_STUDENT_BUDGET_BYTES` does) against loading the whole student first, and the group's accuracy
while it runs from its shards.

    python -m academus.loadgen.student_memory_bench [--model sentiment-students] [--io file cold throttled:200]
        [--rounds 10] [--out DIR] [--mesh [--mesh-rounds 3] [--students 3] [--rate 20] [--duration 20]]

For each IO source and round (the arms' order alternating): the time from the batch that asks for the student to
its answer (one text), (a) reading its shards at the artifact's floor bit width through the source, decoding and
running; (b) the same at full precision (what a batch with time to spare reads); (c) reading its full-precision
weights whole (the same source's cost: the page cache dropped for `cold`, the bandwidth's time for `throttled`)
and running. Then, on the whole test split, the group's accuracy and agreement
with the teacher with each student in turn at the floor bit width, against all at full precision. Needs
`academus shard build --model MODEL`.
With --mesh, also on the mesh: two one-slot workers serve the group at --students − 1 students under Poisson load;
at --change-at the student number goes to --students, which places a student on a worker that lacks it. Arms:
`budget` (each worker's budget holds the students placed on it at the new number) and `whole` (every student
held), on fresh meshes, the order alternating. Figures: latency before and in the --window after the change,
the first answer with the new number, errors, loads, and the labels' agreement between the arms on the texts
both answered with the new number in the window. Prints one JSON object (also DIR/student_memory.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import torch

from academus.client import AcademusError, AsyncClient
from academus.loadgen.texts import Sample, from_task
from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up
from academus.shared.models.model import pad_batch, weight_bytes
from academus.shared.models.shard_io import ColdSource, FileSource, ThrottledSource, io_source
from academus.shared.models.shards import FULL
from academus.shared.models.student_shards import StudentShards, open_student_shards
from academus.shared.models.students import Student
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.runtime.metrics import scrape
from academus.shared.state.catalogue import read_catalogue
from academus.shared.state.keys import Keys
from academus.shared.training.data import fetch, load_task
from academus.shared.training.distill_data import Teacher
from academus.shared.training.student_artifacts import load_student, load_student_shell
from academus.shared.training.student_shards import GroupEvaluation, group_teacher

TEXT = "a warm and funny film whose cast makes every scene feel new"
SHARD_ARMS = ("shards", "shards-full")          # the floor bit width; full precision from the shards
FIRST_ANSWER_ARMS = (*SHARD_ARMS, "whole")


def whole_load(weights: Path, group, index: int, source: FileSource, student_bytes: int):
    """The full-precision student as a worker would read it whole, charged the source's cost."""
    if isinstance(source, ColdSource):
        fd = os.open(weights, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    started = time.perf_counter()
    student = load_student(weights, group, index)
    if isinstance(source, ThrottledSource) and (wait := student_bytes / source.bytes_per_s
                                                - (time.perf_counter() - started)) > 0:
        time.sleep(wait)
    return student


def first_answer_ms(arm: str, shards: StudentShards, weights: Path, group, index: int, io: str,
                    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    source = io_source(io)
    source.before_run(shards.store.paths())
    started = time.perf_counter()
    if arm in SHARD_ARMS:
        student = shards.load(index, shards.min_bits if arm == "shards" else FULL, source)
    else:
        student = whole_load(weights, group, index, source, shards.stored_bytes(index, FULL))
    with torch.inference_mode():
        group.partial(*batch, [index], members={index: student})
    elapsed = (time.perf_counter() - started) * 1e3
    source.close()
    return elapsed


def accuracy_while_loading(group, shards: StudentShards, weights: Path, teacher: Teacher, task: str
                           ) -> dict[str, Any]:
    """The test split: the whole group at full precision, and with each student in turn at the floor bits."""
    evaluation = GroupEvaluation(group, teacher, load_task(task, fetch()).test)
    full = {i: load_student(weights, group, i) for i in range(group.max_students)}
    whole = evaluation.predictions(full)
    out: dict[str, Any] = {"texts": evaluation.n, "floor_bits": shards.min_bits, "full": evaluation.scores(whole),
                           "each_student_at_floor": []}
    source = FileSource()
    for i in range(group.max_students):
        predictions = evaluation.predictions({**full, i: shards.load(i, shards.min_bits, source)})
        out["each_student_at_floor"].append({"student": i, **evaluation.scores(predictions),
                                             "agreement_with_full": round((predictions == whole).float().mean()
                                                                          .item(), 4)})
    source.close()
    return out


async def poisson_load(state: MeshState, model: str, samples: list[Sample], rate: float, duration_s: float,
                       change_at_s: float, change: Callable[[], None], seed: int) -> list[dict[str, Any]]:
    """Open-loop Poisson requests of one text each (text i is sample i in every arm); `change` runs at
    `change_at_s`. Each record: when it was sent (s from the start), its latency, status, students and label."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        arrivals.append(t)
    records: list[dict[str, Any]] = []
    async with AsyncClient(state.gateway, api_key=state.key, timeout=10) as client:
        start = time.perf_counter()

        async def one(i: int, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            sent = time.perf_counter()
            record = {"i": i, "sent_s": round(sent - start, 4)}
            try:
                answer = await client.infer(model, [samples[i % len(samples)].text])
                record |= {"ms": round((time.perf_counter() - sent) * 1e3, 2), "status": "OK",
                           "students": answer.metadata.student_count, "label": answer.predictions[0].label}
            except AcademusError as e:
                record |= {"ms": round((time.perf_counter() - sent) * 1e3, 2), "status": e.code}
            records.append(record)

        async def changer() -> None:
            await asyncio.sleep(change_at_s)
            change()

        await asyncio.gather(changer(), *(one(i, at) for i, at in enumerate(arrivals)))
    return sorted(records, key=lambda r: r["i"])


def mesh_round(arm: str, args: argparse.Namespace, artifacts: Path, budget: int, seed: int) -> dict[str, Any]:
    """A fresh mesh of two one-slot workers serving the group at args.students − 1 students; at the change
    the student number goes to args.students, which places a student on a worker that lacks it."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"student-memory-{arm}-"))
    # the number only changes where the bench sets it: no addition (window) and, after each set, no drop (cooldown)
    env = {"ACADEMUS_MODELS": args.model, "ACADEMUS_ADAPT_WINDOW_S": "3600", "ACADEMUS_ADAPT_COOLDOWN_S": "3600",
           "ACADEMUS_ADAPT_INTERVAL_S": "0.1"}
    env |= dict(setting.split("=", 1) for setting in args.env)
    if arm == "budget":
        env["ACADEMUS_STUDENT_BUDGET_BYTES"] = str(budget)
    state = up(MeshOptions(run_dir=run_dir, artifacts=artifacts, gateway_port=0, workers=2, worker_threads=1,
                           instances=1, deployments=[Deployment("student", args.model)], env=env))
    state.key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
    keys = Keys(state.key_prefix)
    r = redis.Redis.from_url(state.redis_url, decode_responses=True)
    def settle(number: int) -> None:
        r.set(keys.students(args.model), number)
        deadline = time.monotonic() + 60
        while json.loads(r.get(keys.groups(args.model)) or "{}").get("students") != number:
            assert time.monotonic() < deadline, "the groups never re-formed"
            time.sleep(0.1)

    try:
        settle(int(json.loads(wait_for_groups(r, keys.groups(args.model)))["students"]))
        if int(r.get(keys.students(args.model))) == args.students - 1:
            settle(args.students)   # a number the resource manager adopts is one its cooldown then holds
        settle(args.students - 1)
        time.sleep(2)   # the workers read the placement and hold their students
        samples = from_task(args.task)
        records = asyncio.run(poisson_load(state, args.model, samples, args.rate, args.duration, args.change_at,
                                           lambda: r.set(keys.students(args.model), args.students), seed))
        loads = {w.name: scrape_loads(w.metrics_port, args.model) for w in state.services
                 if w.name.startswith("worker-")}
    finally:
        down(run_dir)
    return {"arm": arm, "seed": seed, "records": records, "loads": loads,
            "labels": {str(i): s.label for i, s in enumerate(samples)}}


def wait_for_groups(r: redis.Redis, key: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while (raw := r.get(key)) is None:
        assert time.monotonic() < deadline, "the resource manager never wrote the groups"
        time.sleep(0.1)
    return raw


def scrape_loads(port: int, model: str) -> dict[str, float]:
    """A worker's student loads by where they read from and at what bits: {"shards-6": n, "whole-32": n}."""
    return {f"{s.labels['source']}-{s.labels['bits']}": s.value for s in scrape(port)
            if s.name == "academus_worker_student_loads_total" and s.labels.get("model") == model}


def window_figures(run: dict[str, Any], change_at: float, window_s: float, students: int) -> dict[str, Any]:
    """Latency before the change and in the window after it, the first answer with the new student number, and
    the errors."""
    def q(values: list[float], p: float) -> float | None:
        return round(sorted(values)[min(len(values) - 1, int(p * len(values)))], 2) if values else None

    records = run["records"]
    before = [x["ms"] for x in records if x["status"] == "OK" and x["sent_s"] < change_at]
    after = [x for x in records if change_at <= x["sent_s"] < change_at + window_s]
    first = min((x["sent_s"] + x["ms"] / 1e3 for x in records if x.get("students") == students), default=None)
    return {"requests": len(records), "errors": sum(x["status"] != "OK" for x in records),
            "p50_before_ms": q(before, 0.5), "p99_before_ms": q(before, 0.99),
            "p50_window_ms": q([x["ms"] for x in after if x["status"] == "OK"], 0.5),
            "p99_window_ms": q([x["ms"] for x in after if x["status"] == "OK"], 0.99),
            "max_window_ms": max((x["ms"] for x in after), default=None),
            "first_new_number_s": None if first is None else round(first - change_at, 3),
            "loads": run["loads"]}


def agreement(budget: dict[str, Any], whole: dict[str, Any], students: int, change_at: float,
              window_s: float) -> dict[str, Any]:
    """Over the texts both arms answered with the new student number in the window after the change: how often
    the budget arm's label is the whole arm's, and each arm's accuracy on them."""
    def labels(run: dict[str, Any]) -> dict[int, str]:
        return {x["i"]: x["label"] for x in run["records"] if x.get("students") == students
                and change_at <= x["sent_s"] < change_at + window_s}

    a, b = labels(budget), labels(whole)
    both = sorted(set(a) & set(b))
    gold = budget["labels"]
    if not both:
        return {"texts": 0}
    acc = {name: sum(run[i] == gold[str(i % len(gold))] for i in both) / len(both) for name, run in
           (("budget", a), ("whole", b))}
    return {"texts": len(both), "agreement": round(sum(a[i] == b[i] for i in both) / len(both), 4),
            "accuracy_budget": round(acc["budget"], 4), "accuracy_whole": round(acc["whole"], 4)}


def mesh_bench(args: argparse.Namespace, artifacts: Path, shards: StudentShards, group) -> dict[str, Any]:
    """args.mesh_rounds rounds of both arms on fresh meshes, the order alternating."""
    with torch.device("meta"):
        student_bytes = weight_bytes(Student(group.config))
    # each worker's students at the new number: eq. 6 puts student i on worker i % 2
    budget = weight_bytes(group) + -(-args.students // 2) * student_bytes
    rounds = []
    for r in range(args.mesh_rounds):
        runs = {arm: mesh_round(arm, args, artifacts, budget, seed=r)
                for arm in (("budget", "whole") if r % 2 == 0 else ("whole", "budget"))}
        rounds.append({"round": r, **{arm: window_figures(run, args.change_at, args.window, args.students)
                                      for arm, run in runs.items()},
                       "agreement": agreement(runs["budget"], runs["whole"], args.students, args.change_at,
                                              args.window)})
        if args.out:
            for arm, run in runs.items():
                (args.out / f"mesh-{r}-{arm}.json").write_text(json.dumps(run) + "\n")
    return {"budget_bytes": budget, "student_bytes": student_bytes, "students": args.students,
            "rate": args.rate, "duration_s": args.duration, "change_at_s": args.change_at, "window_s": args.window,
            "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="python -m academus.loadgen.student_memory_bench")
    p.add_argument("--model", default="sentiment-students")
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--io", nargs="+", default=["file", "cold", "throttled:200"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--mesh", action="store_true", help="also the mesh arms: a student added under load")
    p.add_argument("--mesh-rounds", type=int, default=3)
    p.add_argument("--task", default="sentiment", help="the texts' task (its test split)")
    p.add_argument("--students", type=int, default=3, help="the student number the change goes to")
    p.add_argument("--rate", type=float, default=20.0, help="Poisson requests a second")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--change-at", type=float, default=8.0)
    p.add_argument("--window", type=float, default=2.0, help="seconds after the change the figures cover")
    p.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="settings of both arms' meshes")
    args = p.parse_args(argv)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    artifacts = args.artifacts or artifacts_dir()
    entry = read_catalogue(artifacts)[args.model]
    shards = open_student_shards(artifacts, entry)
    group, weights = load_student_shell(artifacts, Path(entry["students"]).name, "cpu", entry["teacher"],
                                        entry.get("task", args.model))
    teacher = group_teacher(artifacts, entry)
    encoded = teacher.tokenizer.encode([TEXT])
    batch = pad_batch([encoded[0].input_ids], [encoded[0].token_type_ids])
    index = group.max_students - 1
    timings: dict[str, dict[str, list[float]]] = {}
    for io in args.io:
        runs: dict[str, list[float]] = {arm: [] for arm in FIRST_ANSWER_ARMS}
        for r in range(args.rounds):
            for arm in (FIRST_ANSWER_ARMS if r % 2 == 0 else FIRST_ANSWER_ARMS[::-1]):
                runs[arm].append(first_answer_ms(arm, shards, weights, group, index, io, batch))
        timings[io] = runs
    summary = {
        "model": args.model, "student": index, "floor_bits": shards.min_bits, "rounds": args.rounds,
        "bytes": {"floor": shards.stored_bytes(index, shards.min_bits), "full": shards.stored_bytes(index, FULL)},
        "first_answer_ms": {io: {arm: {"median": round(statistics.median(v), 2), "p95": round(sorted(v)[
            max(0, round(0.95 * len(v)) - 1)], 2), "runs": [round(x, 2) for x in v]} for arm, v in runs.items()}
            for io, runs in timings.items()},
        "ratio_to_whole": {io: {arm: round(statistics.median(runs[arm]) / statistics.median(runs["whole"]), 3)
                                for arm in SHARD_ARMS} for io, runs in timings.items()},
        "accuracy": accuracy_while_loading(group, shards, weights, teacher, entry.get("task", args.model)),
    }
    if args.mesh:
        summary["mesh"] = mesh_bench(args, artifacts, shards, group)
    if args.out:
        (args.out / "student_memory.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
