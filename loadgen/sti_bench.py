"""Elastic loading from shards under a latency target (STI §7), every arm through one IO source.

`python -m academus.loadgen.sti_bench --io file|cold|throttled:<MB/s> [--task sentiment --task spam]
[--model minilm|NAME] [--targets 0.5,0.75,1,1.5] [--preload-mb 1,4] [--runs 30] [--out DIR]`

`--model NAME`: a user's model's shards, read with its tokenizer; for a user's classifier, `--task NAME` is its
own task, scored on the bundled tasks' test texts labelled by the unmodified classifier (agreement with it).

Arms (§7.1), planned from one profile of this machine taken at the start of the run:
- load&exec: the full-precision submodel loaded whole, then run; stdpl-2/6/32: a layer pipeline with every
  shard at one bit width; preload-6/32: the whole model held in memory at that width (compute only);
- sti (each preload size), sti-0 (no preload), sti-random (the upgrades of §5.4's second pass in a random order
  instead of the upgrade order; each layer still runs its most important shards, which the heads were fitted on);
- sti-<size>-paced: the sti plan run with a pace (`Planner.pace`): a run behind its target answers from the layers
  it has. Its accuracy is what its runs computed: each run's plan truncated to the layers it ran, weighted by runs.

Targets T are multiples of the whole model's compute on one text of the task's length bucket (its test
split's median, padded). Accuracy per plan is exact, over the whole test split, with the plan's weights as
stored. Latency: `--runs` cold runs of each arm and target through the real pipeline (loader thread,
checksums, decoding, the IO source), in rounds whose arm order alternates. Memory: parameter bytes held
between requests (the preload buffer; the whole model for preload-X) and at a request's peak (what it
loads); the embeddings, biases and norms every arm holds alike are reported once, as `common_bytes`.

The upgrade study (§7.3's case study, the paper's Table 7; `--study-orders N`, 8 by default, 0 for none): a
submodel of each of three shapes with every shard at 2 (then 3) bits, a quarter (then half) of its shards raised
to 6 bits in the planner's upgrade order, in §5.2's importance order and in N random orders, accuracy over the
whole test split. `--study-only` runs it alone: accuracy only, no timing, so no IO source.

Prints one JSON line a task, then the summary as the last line; writes `<out>/<io>.json`, `.md` and `.png`
(`--study-only`: `<out>/upgrade_study.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from academus.loadgen.code_arms import round_orders
from academus.shared.models.model import pad_batch
from academus.shared.models.shard_io import io_source
from academus.shared.models.shard_store import ShardStore, TaskShards, shards_dir
from academus.shared.models.shards import FULL
from academus.shared.models.sti_pipeline import ElasticModel, ShardPipeline
from academus.shared.models.sti_planner import HardwareProfile, Pace, Plan, Planner
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import open_model
from academus.shared.runtime.config import artifacts_dir, offline_hub
from academus.shared.runtime.heap import keep_freed_pages
from academus.shared.state.artifacts import ArtifactError
from academus.shared.training.data import TASKS, TaskData, fetch, load_task
from academus.shared.training.prepare import subsample
from academus.shared.training.shard_plans import load_profile, planner_for, save_profile
from academus.shared.training.shards import (
    Evaluator,
    accuracy,
    decoded_bank,
    encoder_base,
    measure_profile,
    own_task,
    own_texts,
)

BASELINES = ("load&exec", "stdpl-2", "stdpl-6", "stdpl-32", "preload-6", "preload-32")


def arm_plans(planner: Planner, target_ms: float, length: int, preload_sizes: list[int], seed: int
              ) -> dict[str, Plan]:
    plans = {"load&exec": planner.load_and_exec(target_ms, length)}
    for bits in (2, 6, FULL):
        plans[f"stdpl-{bits}"] = planner.standard_pipeline(target_ms, length, bits)
    for bits in (6, FULL):
        plans[f"preload-{bits}"] = planner.preload_model(target_ms, length, bits)
    plans["sti-0"] = planner.plan(target_ms, length, 0, arm="sti-0")
    shuffled = list(planner.importance)
    random.Random(seed).shuffle(shuffled)
    for size in preload_sizes:
        plans[f"sti-{size >> 10}k"] = planner.plan(target_ms, length, size, arm=f"sti-{size >> 10}k")
        plans[f"sti-random-{size >> 10}k"] = planner.plan(target_ms, length, size, importance=shuffled,
                                                          arm=f"sti-random-{size >> 10}k")
    return plans


# The upgrade study (§7.3's case study, Table 7): a submodel with every shard at the low version, then a share of its
# shards raised to the high one, in one order or another, the same number of upgrades in each.
STUDY_BITS = ((2, 6), (3, 6))
STUDY_SHARES = (0.25, 0.5)


def study_shapes(info: TaskShards) -> list[tuple[int, int]]:
    """The paper's 5×3 (of 12×12) for a small submodel, then the whole depth at half width and the whole model."""
    depth, widths = max(info.depths), sorted(info.widths)
    shapes = [(max(1, depth - 1), widths[0]), (depth, widths[(len(widths) - 1) // 2]), (depth, widths[-1])]
    return list(dict.fromkeys(shapes))


def upgrade_study(info: TaskShards, score: Callable[[Plan], float], orders: int,
                  shapes: list[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """Accuracy with the same number of shards upgraded in the planner's upgrade order, in §5.2's importance order
    and in `orders` random orders (seeded), for each shape, version pair and share of STUDY_SHARES. A shape's
    layers run their most important shards, which its head was fitted on; only which of them are upgraded differs."""
    rows = []
    for depth, width in shapes or study_shapes(info):
        shape = Plan("upgrade-study", depth, width, [info.layer_order(k)[:width] for k in range(depth)])
        for low, high in STUDY_BITS:
            rows += study_case(info, score, orders, shape, low, high)
    return rows


def study_case(info: TaskShards, score: Callable[[Plan], float], orders: int, shape: Plan, low: int, high: int
               ) -> list[dict[str, Any]]:
    members = [(k, s) for k, layer in enumerate(shape.shards) for s in layer]
    base = dict.fromkeys(members, low)

    def upgraded(order: list[tuple[int, int]], n: int) -> float:
        chosen = [x for x in order if x in base][:n]
        return score(replace(shape, bits=base | dict.fromkeys(chosen, high)))

    rows = []
    for share in STUDY_SHARES:
        n = round(share * len(members))
        randoms = [upgraded(random.Random(seed).sample(members, len(members)), n) for seed in range(orders)]
        rows.append({"shape": f"{shape.depth}x{shape.width}", "from_bits": low, "to_bits": high, "share": share,
                     "upgrades": n, "base": round(upgraded([], 0), 4),
                     "all_upgraded": round(upgraded(members, len(members)), 4),
                     "upgrade_order": round(upgraded(info.upgrades, n), 4),
                     "importance": round(upgraded(info.importance, n), 4),
                     "random_mean": round(statistics.mean(randoms), 4), "random_min": round(min(randoms), 4),
                     "random_max": round(max(randoms), 4), "random_orders": orders})
    return rows


def study_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each order's mean gain over the random orders' mean, pp, and in how many cases it was ahead."""
    figures: dict[str, Any] = {}
    for order in ("upgrade_order", "importance") if rows else ():
        gains = [100 * (r[order] - r["random_mean"]) for r in rows]
        figures[f"{order}_over_random_pp"] = round(statistics.mean(gains), 2)
        figures[f"{order}_ahead_of_random"] = f"{sum(g > 0 for g in gains)} of {len(rows)}"
    return figures


def held_and_peak(plan: Plan, store: ShardStore) -> tuple[int, int]:
    """Parameter bytes held between requests, and at a request's peak (held + loaded)."""
    sizes = {x: store.shard_bytes(x[0], x[1], b) for x, b in plan.bits.items()}
    if plan.arm.startswith("preload-"):
        whole = sum(store.shard_bytes(k, s, plan.bits[next(iter(plan.bits))])
                    for k in range(store.geometry.layers) for s in range(store.geometry.heads))
        return whole, whole
    held = plan.buffer_bytes or sum(sizes[x] for x in plan.preload)
    return held, held + sum(v for x, v in sizes.items() if x not in plan.preload)


def request_batch(tokenizer: TeacherTokenizer, text: str, length: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One text cut or padded to the bucket's length (a pad token where it is short), all positions attended:
    the compute of a request of that length."""
    ids = tokenizer.encode([text], truncate=True)[0].input_ids[:length]
    ids = ids + [0] * (length - len(ids))
    return pad_batch([ids])


def latency_runs(pipeline: ShardPipeline, model: ElasticModel, bank: dict, plans: dict[str, Plan],
                 batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], runs: int, rounds: int,
                 paces: dict[str, Pace] | None = None) -> dict[str, list[dict[str, float]]]:
    """`runs` timed runs a plan, split over `rounds` whose arm order alternates; `paces`: the arms run paced."""
    out: dict[str, list[dict[str, float]]] = {name: [] for name in plans}
    names = list(plans)
    per_round = max(1, runs // rounds)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            plan = plans[name]
            if name.startswith("preload-"):        # held decoded and assembled: compute only
                layers = model.assemble_plan(plan, bank)
                for i in range(per_round):
                    ids, mask, types = batches[(r * per_round + i) % len(batches)]
                    started = time.perf_counter()
                    model.run(ids, mask, layers, types)
                    total = (time.perf_counter() - started) * 1e3
                    out[name].append({"total_ms": total, "io_ms": 0.0, "stall_ms": 0.0, "compute_ms": total,
                                      "depth": plan.depth})
                continue
            pipeline.preload(plan)
            for i in range(per_round):
                ids, mask, types = batches[(r * per_round + i) % len(batches)]
                result = pipeline.run(plan, ids, mask, types, pace=(paces or {}).get(name))
                out[name].append({"total_ms": result.total_ms, "io_ms": result.io_ms, "stall_ms": result.stall_ms,
                                  "compute_ms": result.compute_ms, "depth": result.depth})
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class AccuracyCache:
    """Test accuracy by task and plan weights (depth, width, every shard's version): exact and the same whatever
    the IO source, so runs of other sources reuse it (`<out>/accuracy_cache.json`)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.known: dict[str, float] = json.loads(path.read_text()) if path and path.is_file() else {}

    def get(self, task: str, plan: Plan, evaluate: Any) -> float:
        key = f"{task}|{plan.key()}"
        if key not in self.known:
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or 1)     # evaluations are not timed: every core
            try:
                self.known[key] = evaluate(plan)
            finally:
                torch.set_num_threads(threads)
            if self.path:
                self.path.write_text(json.dumps(self.known))
        return self.known[key]


def task_data(artifacts: Path, model: str, task: str, store: ShardStore) -> TaskData:
    """A bundled task's splits, or a user's classifier's own task: the test texts of what its shards were built on
    (its user's file, or the bundled tasks'), each labelled with the unmodified classifier's prediction."""
    if task in TASKS:
        return load_task(task, fetch(None))
    base = encoder_base(artifacts, model)
    encoder, head, _ = open_model(base.directory)
    origin = store.manifest.extra.get("own_texts", "bundled")
    texts = own_texts({"test": None}, None if origin == "bundled" else Path(origin), None)
    return own_task(task, encoder, head, base.tokenizer(), texts)


def scorer(task: str, evaluator: Evaluator, gold: torch.Tensor, cache: AccuracyCache) -> Callable[[Plan], float]:
    """A plan's exact test accuracy, through the cache."""
    return lambda plan: cache.get(task, plan, lambda p: accuracy(evaluator.probs(p), gold)[0])


def study_task(task: str, data: TaskData, store: ShardStore, tokenizer: TeacherTokenizer, quick: bool,
               cache: AccuracyCache, orders: int) -> list[dict[str, Any]]:
    """The upgrade study alone (`--study-only`), on the task's whole test split (64 texts with `quick`); a full run
    studies in `bench_task`, with the evaluator it has."""
    test = subsample(data.test, 64) if quick else data.test
    evaluator = Evaluator(ElasticModel(store, task), decoded_bank(store), tokenizer, [e.text for e in test])
    return upgrade_study(store.tasks[task], scorer(task, evaluator, torch.tensor([e.label for e in test]), cache),
                         orders)


def bench_task(task: str, data: TaskData, store: ShardStore, profile: HardwareProfile, tokenizer: TeacherTokenizer,
               targets: list[float], preload_sizes: list[int], runs: int, rounds: int, io: str,
               quick: bool, cache: AccuracyCache, study_orders: int = 0) -> dict[str, Any]:
    test = subsample(data.test, 64) if quick else data.test
    lengths = sorted(len(e.input_ids) for e in tokenizer.encode([e.text for e in test], truncate=True))
    length = profile.bucket(lengths[len(lengths) // 2])
    planner = planner_for(store, task, profile)
    full_ms = store.geometry.layers * profile.layer_ms(store.geometry.heads, length) + profile.rest_ms(length)
    model = ElasticModel(store, task)
    bank = decoded_bank(store)
    evaluator = Evaluator(model, bank, tokenizer, [e.text for e in test])
    gold = torch.tensor([e.label for e in test])
    texts = [e.text for e in test[:64]]
    batches = [request_batch(tokenizer, t, length) for t in texts]
    pipeline = ShardPipeline(model, io_source(io))
    rows = []
    score = scorer(task, evaluator, gold, cache)
    try:
        for multiple in targets:
            target = multiple * full_ms
            plans = arm_plans(planner, target, length, preload_sizes, seed=len(rows))
            paces = {f"{name}-paced": planner.pace(plans[name], length) for name in list(plans)
                     if name.startswith("sti-") and not name.startswith(("sti-0", "sti-random"))}
            plans |= {name: plans[name.removesuffix("-paced")] for name in paces}
            scores = {name: score(plan) for name, plan in plans.items() if name not in paces}
            timings = latency_runs(pipeline, model, bank, plans, batches, runs, rounds, paces)
            for name in paces:   # what the paced runs computed: each run's plan cut to the layers it ran
                ran = Counter(t["depth"] for t in timings[name])
                scores[name] = sum(n * score(plans[name].truncated(d)) for d, n in ran.items()) / ran.total()
            for name, plan in plans.items():
                totals = [t["total_ms"] for t in timings[name]]
                depths = [t["depth"] for t in timings[name]]
                held, peak = held_and_peak(plan, store)
                rows.append({"task": task, "target_x": multiple, "target_ms": round(target, 3), **plan.summary(),
                             "arm": name, "accuracy": round(scores[name], 4),
                             "p50_ms": round(statistics.median(totals), 3), "p95_ms": round(_quantile(totals, 0.95), 3),
                             "p95_over_target": round(_quantile(totals, 0.95) / target, 3),
                             "stall_share": round(sum(t["stall_ms"] for t in timings[name]) / sum(totals), 4),
                             "io_ms": round(statistics.median(t["io_ms"] for t in timings[name]), 3),
                             "held_bytes": held, "peak_bytes": peak, "runs": len(totals),
                             "cut_short": round(sum(d < plan.depth for d in depths) / len(depths), 4),
                             "mean_depth": round(statistics.mean(depths), 3)})
    finally:
        pipeline.close()
    study = upgrade_study(store.tasks[task], score, study_orders) if study_orders else []
    return {"task": task, "length": length, "full_model_ms": round(full_ms, 3), "test_texts": len(test),
            "rows": rows, "upgrade_study": study}


def figures(results: list[dict[str, Any]], preload_sizes: list[int]) -> dict[str, Any]:
    """The issue's targets: STI against each baseline, preload against none, and the planner's upgrade order
    (§5.2's importance on a store built without one) against random orders."""
    main = f"sti-{max(preload_sizes) >> 10}k" if preload_sizes else "sti-0"
    by = {(r["task"], r["target_x"], r["arm"]): r for res in results for r in res["rows"]}
    keys = sorted({(t, x) for (t, x, _) in by})

    def mean_gain(arm: str, other: str, keep: Any = lambda x: True) -> float:
        gains = [by[(t, x, arm)]["accuracy"] - by[(t, x, other)]["accuracy"] for t, x in keys if keep(x)]
        return round(100 * statistics.mean(gains), 2) if gains else float("nan")

    random_arm = main.replace("sti-", "sti-random-") if main != "sti-0" else main
    high = [(t, x) for t, x in keys if x >= 0.75]

    def held_ratio(whole: str, arm: str) -> float | None:
        return round(statistics.mean(by[(t, x, whole)]["held_bytes"] / max(1, by[(t, x, arm)]["held_bytes"])
                                     for t, x in high), 1) if high else None

    return {
        "sti_arm": main,
        "sti_minus_whole_model_pp_at_T>=0.75": mean_gain(main, "preload-32", lambda x: x >= 0.75),
        "held_bytes_whole_over_sti": held_ratio("preload-32", main),
        "held_bytes_6bit_over_sti": held_ratio("preload-6", main),
        "by_preload": {f"sti-{size >> 10}k": {   # the memory target is met by the buffer that keeps the accuracy
            "minus_whole_model_pp_at_T>=0.75": mean_gain(f"sti-{size >> 10}k", "preload-32", lambda x: x >= 0.75),
            "held_bytes_whole_over_sti": held_ratio("preload-32", f"sti-{size >> 10}k"),
            "held_bytes_6bit_over_sti": held_ratio("preload-6", f"sti-{size >> 10}k")} for size in preload_sizes},
        **{f"sti_over_{b}_pp": mean_gain(main, b) for b in ("load&exec", "stdpl-32", "stdpl-2", "stdpl-6")},
        "preload_over_none_pp": mean_gain(main, "sti-0"),
        "planner_order_over_random_pp": mean_gain(main, random_arm),
        "upgrade_study": study_figures([r for res in results for r in res.get("upgrade_study", [])]),
        "sti_p95_over_target_max": max(by[(t, x, main)]["p95_over_target"] for t, x in keys),
        "sti_stall_share_max": max(by[(t, x, main)]["stall_share"] for t, x in keys),
        "stdpl32_stall_share_mean": round(statistics.mean(by[(t, x, "stdpl-32")]["stall_share"] for t, x in keys), 4),
        **({"paced_minus_sti_pp": mean_gain(f"{main}-paced", main),
            "paced_p95_over_target_max": max(by[(t, x, f"{main}-paced")]["p95_over_target"] for t, x in keys),
            "paced_cut_short_mean": round(statistics.mean(by[(t, x, f"{main}-paced")]["cut_short"]
                                                          for t, x in keys), 4)}
           if main != "sti-0" else {}),
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| task | T (× model) | arm | shape | mean bits | accuracy | p50 ms | p95/T | stall | held KB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            lines.append(f"| {r['task']} | {r['target_x']} | {r['arm']} | {r['depth']}×{r['width']}"
                         f"{'' if r['feasible'] else ' (over T)'} | {r['mean_bits']} | {r['accuracy']:.4f} | "
                         f"{r['p50_ms']} | {r['p95_over_target']} | {r['stall_share']:.2f} | "
                         f"{r['held_bytes'] >> 10} |")
    return "\n".join(lines)


def study_table(results: list[dict[str, Any]]) -> str:
    """The upgrade study's rows; empty when no task was studied (`--study-orders 0`)."""
    lines = []
    for res in results:
        for r in res.get("upgrade_study", []):
            spread = f"{r['random_mean']:.4f} ({r['random_min']:.4f}–{r['random_max']:.4f})"
            lines.append(f"| {res['task']} | {r['shape']} | {r['from_bits']} → {r['to_bits']} | {r['upgrades']} "
                         f"({r['share']:.0%}) | {r['base']:.4f} | {r['all_upgraded']:.4f} | "
                         f"{r['upgrade_order']:.4f} | {r['importance']:.4f} | {spread} |")
    if not lines:
        return ""
    return "\n".join(["| task | shape | bits | upgraded | base | all upgraded | upgrade order | importance (§5.2) | "
                      "random: mean (min–max) |", "|---|---|---|---|---|---|---|---|---|", *lines])


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        arms = sorted({r["arm"] for r in res["rows"]})
        for arm in arms:
            rows = [r for r in res["rows"] if r["arm"] == arm]
            ax.plot([r["target_x"] for r in rows], [r["accuracy"] for r in rows], marker="o", label=arm)
        ax.set_title(f"{res['task']} (length {res['length']})")
        ax.set_xlabel("target T (× the whole model's compute)")
        ax.set_ylabel("test accuracy")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


COLD_START_IDS = [101, 2023, 3185, 2001, 2307, 102]   # "this movie was great"
# The model code (transformers' BERT) is imported before the clock starts, in every arm: a worker imports its code
# once, when it starts, not per model it loads.
COLD_START = """
import json, sys, time
started = time.perf_counter()
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.services.worker.sti import StiSettings
from academus.shared.models.work import Batch
import transformers.models.bert.modeling_bert
imported = time.perf_counter()
settings = StiSettings(io="cold", target_ms=float(sys.argv[4]))
runner = ModelRunner(sys.argv[1], [sys.argv[2]], sti_settings=settings, traced=sys.argv[3] == "1")
ready = time.perf_counter()
ids = json.loads(sys.argv[5])
result = runner.run(Batch(sys.argv[2], OUTPUT_PROBS, ids, [len(ids)]))
answered = time.perf_counter()
print(json.dumps({"import_ms": (imported - started) * 1e3, "ready_ms": (ready - imported) * 1e3,
                  "first_answer_ms": (answered - imported) * 1e3}))
"""


def load_profile_or_none(artifacts: Path, model: str, source: str) -> HardwareProfile | None:
    try:
        return load_profile(artifacts, model, source)
    except ArtifactError:
        return None


def drop_page_cache(paths: list[Path]) -> None:
    import os

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cold_start(artifacts: Path, model: str, task: str, rounds: int, teacher: str = "") -> dict[str, Any]:
    """A worker's loading of one model, then its first answer, in a fresh process with the model's files out of
    the page cache: the whole model served for the task (`teacher`: the task's classifier on the bundled teacher,
    or a head on a user's model), traced as served and untraced, against `<task>-sti` (`<model>-<task>-sti`) from
    shards (cold reads): without a target, so that the first answer is the whole model at full precision, and with
    a target T of the whole model's compute, as a worker plans it under a deadline. Rounds alternate the order."""
    import subprocess
    import sys
    import tempfile

    from academus.shared.models.user_models import HEAD_ON
    from academus.shared.state.catalogue import read_catalogue, write_entry
    from academus.shared.training.shards import sti_model_name

    catalogue = read_catalogue(artifacts)
    teacher, sti = teacher or task, sti_model_name(task, model)
    store = ShardStore(shards_dir(artifacts, model))
    entries = {name: catalogue[name] for name in (teacher, catalogue[teacher].get(HEAD_ON), sti) if name}
    teacher_paths = [artifacts / e[k] for e in entries.values() if "shards" not in e for k in ("head", "source")
                     if k in e] + ([] if {HEAD_ON, "source"} & catalogue[teacher].keys() else [teacher_dir()])
    teacher_files = [f for path in teacher_paths for f in path.rglob("*") if f.is_file()]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for part in ("heads", "models", "shard-profiles"):
            if (artifacts / part).is_dir():
                (root / part).symlink_to(artifacts / part)
        (root / "shards").mkdir()
        (root / "shards" / model).symlink_to(store.directory)
        profile = load_profile_or_none(artifacts, model, "cold")  # what `academus shard profile --io cold` writes
        if profile is None:
            profile = measure_profile(store, "cold")
            save_profile(artifacts, model, profile)
            if not (root / "shard-profiles").exists():
                (root / "shard-profiles").symlink_to(artifacts / "shard-profiles")
        tokens = len(COLD_START_IDS)
        whole_ms = store.geometry.layers * profile.layer_ms(store.geometry.heads, tokens) + profile.rest_ms(tokens)
        for name, entry in entries.items():
            write_entry(root, name, entry)
        shard_files = [*store.directory.iterdir()]
        arms = {teacher: (teacher, "1", 0.0, teacher_files), f"{teacher} untraced": (teacher, "0", 0.0, teacher_files),
                sti: (sti, "1", 0.0, shard_files), f"{sti}, T = 1": (sti, "1", whole_ms, shard_files)}
        out: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
        for order in round_orders(rounds, list(arms)):
            for name in order:
                served, traced, target_ms, files = arms[name]
                drop_page_cache(files)
                done = subprocess.run([sys.executable, "-c", COLD_START, str(root), served, traced, str(target_ms),
                                       json.dumps(COLD_START_IDS)], capture_output=True, text=True, check=True)
                out[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {name: {k: round(statistics.median(run[k] for run in runs), 1) for k in runs[0]}
               for name, runs in out.items()}
    ratios = {f"{a} / {b}": {k: round(medians[a][k] / medians[b][k], 3) for k in ("ready_ms", "first_answer_ms")}
              for a in (sti, f"{sti}, T = 1") for b in (teacher, f"{teacher} untraced")}
    return {"task": task, "model": model, "teacher": teacher, "rounds": rounds,
            "teacher_file_bytes": sum(f.stat().st_size for f in teacher_files),
            "whole_model_ms": round(whole_ms, 2), "median_ms": medians, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="sti_bench", description=__doc__.split("\n")[0])
    p.add_argument("--io", default="file", help="file | cold | throttled:<MB/s>")
    p.add_argument("--task", action="append", default=None,
                   help=f"{', '.join(TASKS)}, or a user's classifier's name (its own task); default: the shards' tasks")
    p.add_argument("--targets", default="0.5,0.75,1,1.5,2,3", help="multiples of the whole model's compute")
    p.add_argument("--preload-mb", default="1,4", help="preload buffer sizes of the sti arms, MB")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="minilm", help="the shards' model: minilm or a user's model")
    p.add_argument("--teacher", default="", help="--cold-start: the whole model to compare with (default: the task's "
                   "classifier; for a user's model, a head on it such as mpnet-sentiment)")
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="64 test texts (a smoke run)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cold-start", type=int, default=0, metavar="ROUNDS",
                   help="only the cold start: a fresh worker process loading the teacher, or the shards, to its "
                        "first answer, this many rounds")
    p.add_argument("--study-orders", type=int, default=8, metavar="N",
                   help="the upgrade study (§7.3, Table 7): N random orders against the planner's (0: no study)")
    p.add_argument("--study-only", action="store_true",
                   help="only the upgrade study: accuracy, no timed runs (the same whatever the IO source)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="torch threads of the compute (default: the cores but one, which the loader takes)")
    args = p.parse_args(argv)
    keep_freed_pages()    # as a worker does: each run's layers in pages the heap kept
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    artifacts = (args.artifacts or artifacts_dir()).resolve()
    if args.cold_start:
        result = [cold_start(artifacts, args.model, task, args.cold_start, args.teacher)
                  for task in args.task or ["sentiment"]]
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "cold_start.json").write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))
        return 0
    store = ShardStore(shards_dir(artifacts, args.model))
    tokenizer = encoder_base(artifacts, args.model).tokenizer()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    cache = AccuracyCache(args.out / "accuracy_cache.json" if args.out and not args.quick else None)
    if args.study_only:
        return study_only(args, artifacts, store, tokenizer, cache)
    profile = measure_profile(store, args.io)
    targets = [float(x) for x in args.targets.split(",")]
    preload_sizes = [int(float(x) * (1 << 20)) for x in args.preload_mb.split(",") if x]
    results = []
    for task in args.task or list(store.tasks):
        res = bench_task(task, task_data(artifacts, args.model, task, store), store, profile, tokenizer, targets,
                         preload_sizes, args.runs, args.rounds, args.io, args.quick, cache, args.study_orders)
        print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
        results.append(res)
    summary = {"io": profile.source, "threads": args.threads, "profile": json.loads(profile.to_json()),
               "common_bytes": store.resident_bytes, "targets": targets,
               "preload_bytes": preload_sizes, "runs": args.runs, "rounds": args.rounds,
               "figures": figures(results, preload_sizes), "results": results}
    if args.out:
        stem = args.out / profile.source.replace(":", "-")
        stem.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
        stem.with_suffix(".md").write_text("\n\n".join(filter(None, (table(results), study_table(results)))) + "\n")
        plot(results, stem.with_suffix(".png"))
    print(table(results))
    if study := study_table(results):
        print(study)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    return 0


def study_only(args: argparse.Namespace, artifacts: Path, store: ShardStore, tokenizer: TeacherTokenizer,
               cache: AccuracyCache) -> int:
    """`--study-only`: the upgrade study of each task, its table and figures; writes `<out>/upgrade_study.json`."""
    results = [{"task": task, "upgrade_study": study_task(task, task_data(artifacts, args.model, task, store), store,
                                                          tokenizer, args.quick, cache, args.study_orders)}
               for task in args.task or list(store.tasks)]
    summary = {"random_orders": args.study_orders, "figures": study_figures(
        [r for res in results for r in res["upgrade_study"]]), "results": results}
    if args.out:
        (args.out / "upgrade_study.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(study_table(results))
    print(json.dumps(summary["figures"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
