"""`academus shard build --model <task>-students`: a student group's students cut into quantized shards.

Every student's layers are quantized as the teacher's are (one shard a head, 2–6 bits and full precision).
The floor bit width is then measured on a dev share of the task's validation split: each student in turn runs
from its shards at b bits while the others run at full precision (what a worker serves while that student
loads), and the floor is the fewest bits whose every such group stays within 1 pp of the full-precision
group's accuracy. The catalogue entry of the group gains `student_shards`, which a worker with a student
memory budget serves from.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from academus.shared.models.model import pad_batch
from academus.shared.models.shard_store import shards_dir, write_shard_artifact
from academus.shared.models.shards import BITS, FIDELITY_TOLERANCE, FULL, ShardGeometry, quantize_layers
from academus.shared.models.sti_pipeline import FileSource
from academus.shared.models.student_shards import STUDENT_SHARDS, STUDENT_SHARDS_KIND, StudentShards
from academus.shared.models.students import StudentGroup
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import STUDENTS_OF
from academus.shared.state.artifacts import WEIGHTS, read_manifest, write_manifest
from academus.shared.state.catalogue import read_catalogue, write_entry
from academus.shared.training.data import fetch, load_task
from academus.shared.training.prepare import MAX_TOKENS, length_batches, subsample
from academus.shared.training.student_artifacts import load_student_group, students_dir

DEV_TEXTS, QUICK_DEV_TEXTS = 500, 48


def log(message: str) -> None:
    print(f"[shard] {message}", file=sys.stderr, flush=True)


def group_entry(artifacts: Path, model: str) -> dict[str, Any]:
    """The catalogue entry of a bundled task's student group, or a ValueError saying what `--model` takes."""
    entry = read_catalogue(artifacts).get(model)
    if entry is None or "students" not in entry:
        raise ValueError(f"--model {model!r} is neither minilm nor a student group in the catalogue")
    if entry.get(STUDENTS_OF):
        raise ValueError(f"--model {model!r}: shards are built for the bundled teacher's student groups; "
                         f"{model} was distilled from the user's model {entry[STUDENTS_OF]!r}")
    return entry


def build_students(artifacts: Path, model: str, data_dir: Path | None = None, quick: bool = False) -> dict[str, Any]:
    """Writes `shards/<model>/` from the group `model` serves and points its catalogue entry at it."""
    artifacts = Path(artifacts).resolve()
    entry = group_entry(artifacts, model)
    started = time.perf_counter()
    key, task = Path(entry["students"]).name, entry.get("task", model)
    group = load_student_group(artifacts, key, "cpu", entry["teacher"], task)
    layers = [layer for student in group.students for layer in student.encoder.layer]
    if not hasattr(layers[0], "attention") or group.architecture.family.relative_attention:
        raise ValueError(f"--model {model!r}: its students are {group.architecture.name} layers; shards cut BERT "
                         f"and RoBERTa layers")
    config = group.config
    geometry = ShardGeometry(len(layers), config.num_attention_heads, config.hidden_size, config.intermediate_size)
    blobs, resident = quantize_layers(layers, geometry, log)
    directory = shards_dir(artifacts, model)
    group_manifest = read_manifest(students_dir(artifacts, key))
    extra = {"model": model, "of": STUDENT_SHARDS_KIND, "students": group.max_students,
             "student_layers": group.layers, "group_sha256": group_manifest.files[WEIGHTS], "min_bits": FULL,
             "quick": quick}
    write_shard_artifact(directory, teacher=group_manifest.teacher, geometry=geometry,
                         layer_norm_eps=config.layer_norm_eps, blobs=blobs, resident=resident, heads={}, tasks={},
                         extra=extra)
    shards = StudentShards(directory)
    fidelity = measure_fidelity(group, shards, task, data_dir, quick)
    manifest = read_manifest(directory)
    write_manifest(directory, replace(manifest, extra={**manifest.extra, "min_bits": fidelity["min_bits"],
                                                       "fidelity": fidelity}))
    write_entry(artifacts, model, {**entry, STUDENT_SHARDS: str(directory.relative_to(artifacts))})
    summary = {"model": model, "artifact": str(directory), "geometry": geometry.__dict__,
               "students": group.max_students, "student_layers": group.layers, **fidelity,
               "student_bytes": {str(b): shards.stored_bytes(0, b) for b in shards.store.versions},
               "quick": quick, "seconds": round(time.perf_counter() - started, 1)}
    log(f"wrote {directory} in {summary['seconds']} s; floor {fidelity['min_bits']} bits")
    return summary


@torch.inference_mode()
def measure_fidelity(group: StudentGroup, shards: StudentShards, task: str, data_dir: Path | None,
                     quick: bool) -> dict[str, Any]:
    """Accuracy on dev texts of the whole group at full precision, and of the group with each student in turn
    at b bits; the floor: the fewest bits whose worst such group is within FIDELITY_TOLERANCE of full."""
    if group.head is None:
        raise ValueError(f"task {task!r} has no labels: a floor bit width is measured on a classifier's accuracy")
    dev = subsample(load_task(task, fetch(data_dir)).validation, QUICK_DEV_TEXTS if quick else DEV_TEXTS)
    batches = _batches([e.text for e in dev])
    gold = torch.tensor([int(e.label) for e in dev])
    k, source = group.max_students, FileSource()

    def predictions(members: dict[int, torch.nn.Module] | None = None) -> torch.Tensor:
        out = torch.empty(len(dev), dtype=torch.long)
        for rows, ids, mask, types in batches:
            out[rows] = group.head(group(ids, mask, types, num_students=k, members=members)).argmax(1)
        return out

    full = predictions()
    full_accuracy = (full == gold).float().mean().item()
    by_bits: dict[str, dict[str, float]] = {}
    floor = FULL
    try:
        for bits in sorted(BITS, reverse=True):
            runs = [predictions({m: shards.load(m, bits, source)}) for m in range(k)]
            worst = min((p == gold).float().mean().item() for p in runs)
            agreement = min((p == full).float().mean().item() for p in runs)
            by_bits[str(bits)] = {"worst_accuracy": round(worst, 4), "worst_agreement": round(agreement, 4)}
            log(f"{task}: one student at {bits} bits: worst accuracy {worst:.4f} (full {full_accuracy:.4f}), "
                f"agreement with the full group {agreement:.4f}")
            if full_accuracy - worst > FIDELITY_TOLERANCE:
                break
            floor = bits
    finally:
        source.close()
    return {"min_bits": floor, "dev_texts": len(dev), "full_accuracy": round(full_accuracy, 4),
            "one_student_at": by_bits}


def _batches(texts: list[str]) -> list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=MAX_TOKENS)
    encoded = tokenizer.encode(texts, truncate=True)
    out = []
    for rows in length_batches([len(e.input_ids) for e in encoded], 64, MAX_TOKENS):
        ids, mask, types = pad_batch([encoded[i].input_ids for i in rows], [encoded[i].token_type_ids for i in rows])
        out.append((rows, ids, mask, types))
    return out
