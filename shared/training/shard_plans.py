"""`academus shard build | adapt | info | verify | profile | plan` (STI), and what reads a shard artifact without the
model code: the saved hardware profiles and the planner for a task.

`info`, `verify` and `plan` import no model code: transformers (and the torch._dynamo it imports) would add
seconds to every call. A worker reads its profile and planner from here too. `build` and `profile` load
`shards.py` (their docs are there); `shards.py` never imports this module, so the two form no circle.
`plan --task T --target-ms T --preload-bytes M [--length L]` prints the plan for a request of L tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.sti_planner import HardwareProfile, Planner
from academus.shared.runtime.config import artifacts_dir as default_artifacts_dir
from academus.shared.runtime.config import offline_hub
from academus.shared.state.artifacts import ArtifactError, write_atomic
from academus.shared.training.data import TASKS, DataMissing

STUDENT_INFO = ("students", "student_layers", "min_bits", "fidelity")   # what `info` adds for a group's shards


def profiles_dir(artifacts: Path, model: str) -> Path:
    return Path(artifacts) / "shard-profiles" / model


def profile_path(artifacts: Path, model: str, source: str) -> Path:
    return profiles_dir(artifacts, model) / f"{source.replace(':', '-')}.json"


def planner_for(store: ShardStore, task: str, profile: HardwareProfile) -> Planner:
    if task not in store.tasks:
        raise ArtifactError(f"{store.directory}: no shards profiled for task {task!r} "
                            f"(run `academus shard build --tasks {task}`)")
    info = store.tasks[task]
    return Planner(profile, info.depths, info.widths, info.layer_order, info.upgrades, store.shard_bytes,
                   min_bits=info.min_bits)


def save_profile(artifacts: Path, model: str, profile: HardwareProfile) -> Path | None:
    """Writes the profile where `load_profile` reads it (atomically); None when the artifacts are read-only."""
    path = profile_path(artifacts, model, profile.source)
    try:
        write_atomic(path, profile.to_json() + "\n")
    except OSError:
        return None
    return path


def load_profile(artifacts: Path, model: str, source: str) -> HardwareProfile:
    path = profile_path(artifacts, model, source)
    if not path.is_file():
        raise ArtifactError(f"no profile {path} (run `academus shard profile --io {source}`)")
    saved = json.loads(path.read_text())
    if "finish_ms" not in saved:   # its rest was timed in a loop, a third of what runs pay
        raise ArtifactError(f"{path} was measured before runs timed their rest (run `academus shard profile --io "
                            f"{source}` again)")
    return HardwareProfile.from_dict(saved)


# --- command line ---------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--artifacts", type=Path, default=None)
    common.add_argument("--model", default="minilm",
                        help="minilm (the teacher), a user's BERT, RoBERTa or MPNet embedding model or sequence "
                             "classifier, or a student group such as sentiment-students (build, info, verify)")
    p = argparse.ArgumentParser(prog="academus shard", description="Elastic shards of the teacher (STI).")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", parents=[common], help="quantized shards, importance per task, heads per shape")
    b.add_argument("--tasks", default="", help=f"comma-separated (default {','.join(TASKS)}; a user's classifier has "
                                               "only its own task)")
    b.add_argument("--quick", action="store_true", help="a few texts a split, for tests")
    b.add_argument("--data", type=Path, default=None, help='a user\'s classifier: its own texts, JSON lines '
                   '{"text": ...}, labelled by the classifier itself (default: the bundled tasks\' texts)')
    b.add_argument("--data-dir", type=Path, default=None, help="dataset packages (ACADEMUS_DATA_DIR)")
    a = sub.add_parser("adapt", parents=[common], help="the teacher trained to run at any width (DynaBERT), added as "
                                                        "a user's embedding model to build shards of")
    a.add_argument("--name", required=True, help="the catalogue name of the trained model")
    a.add_argument("--tasks", default="", help=f"comma-separated (default {','.join(TASKS)})")
    a.add_argument("--epochs", type=float, default=1.0)
    a.add_argument("--texts", type=int, default=None, help="training texts a task (default: its whole train split)")
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--lr", type=float, default=5e-5, help="AdamW's learning rate, decayed linearly to 0")
    a.add_argument("--data-dir", type=Path, default=None, help="dataset packages (ACADEMUS_DATA_DIR)")
    sub.add_parser("info", parents=[common], help="the artifact's geometry, sizes and tasks")
    sub.add_parser("verify", parents=[common], help="every file and every shard against its sha256")
    f = sub.add_parser("profile", parents=[common], help="load and compute times on this machine (§5.2)")
    f.add_argument("--io", default="file", help="file | cold | throttled:<MB/s>")
    f.add_argument("--repeats", type=int, default=20)
    pl = sub.add_parser("plan", parents=[common], help="the plan for a target and a preload buffer")
    pl.add_argument("--task", required=True, help="a bundled task, or a user's classifier's name (its own task)")
    pl.add_argument("--target-ms", type=float, required=True)
    pl.add_argument("--preload-bytes", type=int, default=0)
    pl.add_argument("--length", type=int, default=32, help="tokens in the request")
    pl.add_argument("--io", default="file", help="the profiled IO source to plan for")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    artifacts = args.artifacts or default_artifacts_dir()
    if args.command == "build":
        return _build(args, artifacts)
    if args.command == "adapt":
        return _adapt(args, artifacts)
    store = ShardStore(shards_dir(artifacts, args.model))
    if args.command in ("profile", "plan") and "config" not in store.manifest.extra:
        raise ValueError(f"--model {args.model!r}: profile and plan are for an encoder's shards (minilm or a user's "
                         f"model), not a student group's")
    if args.command == "info":
        return {"model": args.model, "directory": str(store.directory), "geometry": store.geometry.__dict__,
                "versions": list(store.versions), "bytes": store.bytes_by_version(),
                "shard_bytes": {str(b): store.shard_bytes(0, 0, b) for b in store.versions},
                "resident_bytes": store.resident_bytes,
                "embedding_rows_bytes": store.rows.stored_bytes if store.rows else 0,
                "tasks": {t: {"labels": i.labels, "widths": i.widths, "depths": i.depths,
                              "importance_top": i.importance[:8],
                              "upgrade_order_top": i.upgrades[:8]} for t, i in store.tasks.items()},
                **{k: v for k, v in store.manifest.extra.items() if k in STUDENT_INFO}}
    if args.command == "verify":
        return {"directory": str(store.directory), **store.verify()}
    if args.command == "profile":
        from academus.shared.training.shards import measure_profile

        profile = measure_profile(store, args.io, args.repeats)
        return {"profile": str(save_profile(artifacts, args.model, profile)), **json.loads(profile.to_json())}
    planner = planner_for(store, args.task, load_profile(artifacts, args.model, args.io))
    plan = planner.plan(args.target_ms, args.length, args.preload_bytes)
    if not plan.feasible:
        smallest = plan.compute_ms + planner.profile.rest_ms(args.length, plan.depth, plan.width)
        raise PlanError(f"--target-ms {args.target_ms:g}: no submodel fits; the smallest needs "
                        f"{math.ceil(smallest * 100) / 100:g} ms of compute alone")
    return {**plan.summary(), "io": planner.profile.source, "length": args.length,
            "preload_bytes": planner.preload_bytes_of(plan),
            "layers": [{"layer": k, "shards": [[s, plan.bits[(k, s)], (k, s) in plan.preload] for s in layer]}
                       for k, layer in enumerate(plan.shards)]}


def _build(args: argparse.Namespace, artifacts: Path) -> dict[str, Any]:
    import numpy as np
    import torch

    from academus.shared.training.shards import build, encoder_base

    torch.manual_seed(0)
    np.random.seed(0)
    if encoder_base(artifacts, args.model) is None:
        from academus.shared.training.student_shards import build_students

        if args.data is not None:
            raise ValueError(f"--data gives a sequence classifier's own texts, not {args.model!r}'s: a student "
                             f"group's shards are measured on the bundled tasks")
        return build_students(artifacts, args.model, args.data_dir, args.quick)
    return build(artifacts, args.model, [t for t in args.tasks.split(",") if t] or None, args.data_dir,
                 args.quick, args.data)


def _adapt(args: argparse.Namespace, artifacts: Path) -> dict[str, Any]:
    from academus.shared.training.width_adapt import AdaptSettings, adapt

    if args.model != "minilm":
        raise ValueError(f"--model {args.model!r}: `shard adapt` trains the bundled teacher (minilm) at every width")
    if min(args.epochs, args.batch, args.lr, args.texts or 1) <= 0:
        raise ValueError(f"--epochs {args.epochs:g}, --batch {args.batch}, --lr {args.lr:g} and --texts {args.texts} "
                         f"must be positive")
    settings = AdaptSettings(epochs=args.epochs, batch=args.batch, lr=args.lr, texts_per_task=args.texts)
    return adapt(artifacts, args.name, [t for t in args.tasks.split(",") if t] or None, args.data_dir, settings,
                 log=lambda message: print(f"[shard] {message}", file=sys.stderr, flush=True))


class PlanError(ValueError):
    """No plan meets the target."""


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    args = _parser().parse_args(argv)
    try:
        summary = run(args)
    except (DataMissing, ArtifactError, ValueError) as e:
        print(f"[shard] error: {e}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps(summary, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
