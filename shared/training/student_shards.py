"""`academus shard build --model <task>-students`: a student group's students cut into quantized shards.

Every student's layers are quantized as the teacher's are (one shard a head, 2–6 bits and full precision).
The floor bit width is then measured on a dev share of validation texts: each student in turn runs from its
shards at b bits while the others run at full precision (what a worker serves while that student loads), and
the floor is the fewest bits whose every such group stays within 1 pp of the full-precision group: of its
accuracy and its agreement with the teacher for a classifier group (the task's validation split), of its mean
cosine to the teacher's embeddings and to its own full-precision output for an embedding group (the bundled
tasks' validation texts). The catalogue entry of the group gains `student_shards`, which a worker with a
student memory budget serves from.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from academus.shared.models.shard_io import FileSource
from academus.shared.models.shard_store import shards_dir, write_shard_artifact
from academus.shared.models.shards import BITS, FIDELITY_TOLERANCE, FULL, ShardGeometry, quantize_layers
from academus.shared.models.student_shards import (
    STUDENT_SHARDS,
    STUDENT_SHARDS_KIND,
    StudentShards,
    relative_bias_key,
)
from academus.shared.models.students import Members, StudentGroup
from academus.shared.models.user_models import STUDENTS_OF
from academus.shared.state.artifacts import WEIGHTS, read_manifest, write_manifest
from academus.shared.state.catalogue import EMBEDDING, read_catalogue, write_entry
from academus.shared.training.data import Example, fetch, load_task
from academus.shared.training.distill_data import Teacher
from academus.shared.training.prepare import bundled_texts, in_text_order, load_head, padded_batches, subsample
from academus.shared.training.student_artifacts import load_student_group, students_dir

DEV_TEXTS, QUICK_DEV_TEXTS = 500, 48


def log(message: str) -> None:
    print(f"[shard] {message}", file=sys.stderr, flush=True)


def group_entry(artifacts: Path, model: str) -> dict[str, Any]:
    """The catalogue entry of a student group, or a ValueError saying what `--model` takes."""
    entry = read_catalogue(artifacts).get(model)
    if entry is None or "students" not in entry:
        raise ValueError(f"--model {model!r} is neither minilm, a user's embedding model nor a student group in the "
                         f"catalogue")
    return entry


def group_teacher(artifacts: Path, entry: dict[str, Any]) -> Teacher:
    """The teacher a group was distilled from, with its tokenizer and the task's head: the bundled teacher, or a
    user's model (a head on one, or its own classifier's head); no head for an embedding group."""
    if entry.get(STUDENTS_OF):
        return Teacher.user(artifacts, entry["teacher"])
    if entry.get("kind") == EMBEDDING:
        return Teacher.bundled()
    return replace(Teacher.bundled(), head=load_head(artifacts, entry.get("task", "")))


def build_students(artifacts: Path, model: str, data_dir: Path | None = None, quick: bool = False) -> dict[str, Any]:
    """Writes `shards/<model>/` from the group `model` serves and points its catalogue entry at it."""
    artifacts = Path(artifacts).resolve()
    entry = group_entry(artifacts, model)
    started = time.perf_counter()
    key, task = Path(entry["students"]).name, entry.get("task", model)
    group = load_student_group(artifacts, key, "cpu", entry["teacher"], task)
    layers = [layer for student in group.students for layer in student.encoder.layer]
    config = group.config
    geometry = ShardGeometry(len(layers), config.num_attention_heads, config.hidden_size, config.intermediate_size)
    blobs, resident = quantize_layers(layers, geometry, log)
    extra = {"model": model, "of": STUDENT_SHARDS_KIND, "students": group.max_students,
             "student_layers": group.layers, "min_bits": FULL, "quick": quick}
    if group.architecture.family.relative_attention:   # each student's own bias table (MPNet)
        resident |= {relative_bias_key(m): student.encoder.relative_attention_bias.weight.detach()
                     for m, student in enumerate(group.students)}
        extra["relative_attention"] = {"model_type": config.model_type,
                                       "relative_attention_num_buckets": config.relative_attention_num_buckets}
    directory = shards_dir(artifacts, model)
    group_manifest = read_manifest(students_dir(artifacts, key))
    extra["group_sha256"] = group_manifest.files[WEIGHTS]
    write_shard_artifact(directory, teacher=group_manifest.teacher, geometry=geometry,
                         layer_norm_eps=config.layer_norm_eps, blobs=blobs, resident=resident, heads={}, tasks={},
                         extra=extra)
    shards = StudentShards(directory)
    fidelity = measure_fidelity(group, shards, artifacts, entry, data_dir, quick)
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


class GroupEvaluation:
    """A group's predictions on labelled texts, with students standing in (`members`), scored against the gold
    labels and against the teacher's own predictions (the agreement distillation reports)."""

    def __init__(self, group: StudentGroup, teacher: Teacher, examples: Sequence[Example]) -> None:
        self.group, self.n = group, len(examples)
        self.batches = list(padded_batches(teacher.tokenizer, [e.text for e in examples], 64))
        self.gold = torch.tensor([int(e.label) for e in examples])
        encoder, head = teacher.encoder, teacher.head
        self.teacher = self._each(lambda ids, mask, types: head(encoder(ids, mask, types)))

    def _each(self, logits: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return in_text_order(self.batches, self.n, logits).argmax(1)

    def predictions(self, members: Members | None = None) -> torch.Tensor:
        k = self.group.max_students
        return self._each(lambda ids, mask, types: self.group.head(
            self.group(ids, mask, types, num_students=k, members=members)))

    def scores(self, predictions: torch.Tensor) -> dict[str, float]:
        return {"accuracy": round((predictions == self.gold).float().mean().item(), 4),
                "teacher_agreement": round((predictions == self.teacher).float().mean().item(), 4)}

    def fidelity(self, members: Members | None = None) -> dict[str, float]:
        """What the floor keeps within FIDELITY_TOLERANCE of the full-precision group's."""
        return self.scores(self.predictions(members))


class EmbeddingEvaluation:
    """An embedding group's output on texts, with students standing in, against the teacher's embeddings and
    against the full-precision group's own output (mean cosines)."""

    def __init__(self, group: StudentGroup, teacher: Teacher, texts: Sequence[str]) -> None:
        self.group = group
        self.batches = list(padded_batches(teacher.tokenizer, list(texts), 64))
        self.teacher = teacher.embed(list(texts), "floor/teacher")
        self.full = self.outputs()

    def outputs(self, members: Members | None = None) -> torch.Tensor:
        k = self.group.max_students
        return in_text_order(self.batches, len(self.teacher),
                             lambda ids, mask, types: self.group(ids, mask, types, num_students=k, members=members))

    def fidelity(self, members: Members | None = None) -> dict[str, float]:
        out = self.outputs(members)
        cosine = torch.nn.functional.cosine_similarity
        return {"teacher_cosine": round(cosine(out, self.teacher).mean().item(), 4),
                "cosine_to_full": round(cosine(out, self.full).mean().item(), 4)}


def measure_fidelity(group: StudentGroup, shards: StudentShards, artifacts: Path, entry: dict[str, Any],
                     data_dir: Path | None, quick: bool) -> dict[str, Any]:
    """The whole group at full precision on dev texts, and the group with each student in turn at b bits; the
    floor: the fewest bits whose every such group keeps each figure of `fidelity` within FIDELITY_TOLERANCE of
    full precision's."""
    evaluation, dev_texts = dev_evaluation(group, group_teacher(artifacts, entry), entry, data_dir, quick)
    full = evaluation.fidelity()
    by_bits: dict[str, list[dict[str, float]]] = {}
    floor, source = FULL, FileSource()
    try:
        for bits in sorted(BITS, reverse=True):
            by_bits[str(bits)] = [evaluation.fidelity({m: shards.load(m, bits, source)})
                                  for m in range(group.max_students)]
            worst = {key: min(s[key] for s in by_bits[str(bits)]) for key in full}
            log(f"{entry.get('task', '')}: one student at {bits} bits: worst {worst} (full precision {full})")
            if any(full[key] - worst[key] > FIDELITY_TOLERANCE for key in full):
                break
            floor = bits
    finally:
        source.close()
    return {"min_bits": floor, "dev_texts": dev_texts, "full": full, "each_student_at": by_bits}


def dev_evaluation(group: StudentGroup, teacher: Teacher, entry: dict[str, Any], data_dir: Path | None,
                   quick: bool) -> tuple[GroupEvaluation | EmbeddingEvaluation, int]:
    """What the floor is measured on, and how many texts: a classifier group's task's validation split; an
    embedding group's, the bundled tasks' validation texts in equal shares (real text whatever it was
    distilled on)."""
    size = QUICK_DEV_TEXTS if quick else DEV_TEXTS
    root = fetch(data_dir)
    if group.head is not None:
        dev = subsample(load_task(entry.get("task", ""), root).validation, size)
        return GroupEvaluation(group, teacher, dev), len(dev)
    texts = bundled_texts("validation", size, root)
    return EmbeddingEvaluation(group, teacher, texts), len(texts)
