"""Student groups on disk: <artifacts>/students/<task>/ (weights.safetensors + manifest.json) written and
verified, and their entries in the model catalogue (`<task>-students`, `<task>-2l`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from academus.shared.models.students import (
    LINEAR,
    AbsentStudent,
    Student,
    StudentGroup,
    config_keys,
    student_config,
)
from academus.shared.models.teacher_files import TEACHER_NAME
from academus.shared.models.user_models import STUDENTS_OF
from academus.shared.state.artifacts import (
    WEIGHTS,
    ArtifactError,
    Manifest,
    load_artifact,
    read_manifest,
    verify_files,
    write_artifact,
)
from academus.shared.state.catalogue import update_catalogue, write_entry
from academus.shared.training.distill_data import SERVED_NAMES
from academus.shared.training.prepare import (
    MAX_TOKENS,
)

STUDENT_KIND = "student-group"


def students_dir(artifacts: Path, task: str) -> Path:
    return Path(artifacts) / "students" / task


# --- writing, loading and the catalogue ----------------------------------------------------------

def write_student_group(artifacts: Path, key: str, group: StudentGroup, metrics: dict[str, Any],
                        extra: dict[str, Any] | None = None, teacher: str = TEACHER_NAME, task: str = "",
                        max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """Writes the group atomically (temp dir, then rename) under students/<key> (the task's name for the bundled
    teacher's groups, the teacher model's for a user's); returns the manifest extra."""
    extra = {**(extra or {}), "layers": group.layers, "num_students": group.max_students, "best_k": group.best_k,
             "alpha": [round(a, 6) for a in group.alphas().tolist()], "normalize": group.normalize,
             "head": group.head_kind,
             "encoder_config": config_keys(group.config), "max_tokens": max_tokens,
             "embeddings": (extra or {}).get("embeddings", "the teacher's, frozen, one copy shared by all students")}
    tensors = {k: v for k, v in group.state_dict().items()}
    tensors["alpha"] = group.alphas().detach()           # α_0 stored as the 1 it is
    write_artifact(students_dir(artifacts, key), STUDENT_KIND, tensors, teacher=teacher, task=task or key,
                   labels=group.labels, metrics=metrics, extra=extra)
    return extra


def load_student_group(artifacts: Path, key: str, device: str | torch.device = "cpu", teacher: str = TEACHER_NAME,
                       task: str = "") -> StudentGroup:
    """A verified student-group artifact as a StudentGroup in eval mode (best_k, max_students, head, labels)."""
    directory, task = students_dir(artifacts, key), task or key
    manifest, tensors = load_artifact(directory)     # checks format version, checksums and shapes
    _check_group(directory, manifest, teacher, task)
    return _group(directory, manifest, tensors, int(manifest.extra.get("num_students", 0))).to(device).eval()


def load_student_shell(artifacts: Path, key: str, device: str | torch.device = "cpu", teacher: str = TEACHER_NAME,
                       task: str = "") -> tuple[StudentGroup, Path]:
    """The group without its students (each an AbsentStudent): the shared embeddings, α and head, for a worker
    that holds only some students; and the verified weights file the students are read from."""
    directory, task = students_dir(artifacts, key), task or key
    manifest = read_manifest(directory)
    _check_group(directory, manifest, teacher, task)
    verify_files(directory, manifest)
    path = directory / WEIGHTS
    with safe_open(str(path), framework="pt") as weights:
        names = weights.keys()   # a safe_open handle is not iterable
        tensors = {name: weights.get_tensor(name) for name in names if not name.startswith("students.")}
    group = _group(directory, manifest, tensors, 0)
    return group.to(device).eval(), path


def load_student(path: Path, group: StudentGroup, index: int, device: str | torch.device = "cpu") -> Student:
    """Student `index` of the group whose weights are at `path` (read alone, not the whole file)."""
    prefix = f"students.{index}."
    student = Student(group.config)
    with safe_open(str(path), framework="pt") as weights:
        names = weights.keys()
        state = {name.removeprefix(prefix): weights.get_tensor(name) for name in names if name.startswith(prefix)}
    student.load_state_dict(state, strict=True)
    return student.to(device).eval()


def _check_group(directory: Path, manifest: Manifest, teacher: str, task: str) -> None:
    if manifest.kind != STUDENT_KIND:
        raise ArtifactError(f"{directory} holds a {manifest.kind!r} artifact, not a {STUDENT_KIND!r}")
    if manifest.teacher != teacher:
        raise ArtifactError(f"{directory} was distilled from {manifest.teacher!r}, not {teacher!r} (re-run "
                            f"`academus distill`)")
    if manifest.task != task:
        raise ArtifactError(f"{directory} is for task {manifest.task!r}, not {task!r}")


def _group(directory: Path, manifest: Manifest, tensors: dict[str, torch.Tensor], held: int) -> StudentGroup:
    """The manifest's group with `tensors` loaded; with fewer students `held` than it has, the rest absent."""
    extra = manifest.extra
    try:   # groups written before students took the teacher's family are BERT ("bert_config")
        config = student_config(extra.get("encoder_config") or extra["bert_config"], int(extra["layers"]))
        count = int(extra["num_students"])
        group = StudentGroup(config, max(1, held), manifest.labels, normalize=bool(extra["normalize"]),
                             best_k=int(extra["best_k"]), head=extra.get("head", LINEAR))
        if held < count:
            group.students = nn.ModuleList(AbsentStudent(i) for i in range(count))
            group.alpha = nn.Parameter(torch.ones(count))
        group.load_state_dict(tensors, strict=held == count)
        group.check_count(group.best_k)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{directory}: the weights do not fit the manifest's student group: {e}") from e
    return group


def register_user_group(artifacts: Path, key: str, teacher_model: str) -> list[str]:
    """Catalogue entries `<key>-students` and `<key>-2l` for a group distilled from a user's model (or a head
    on one): workers serve them with that model's tokenizer. Returns the names."""
    manifest, _ = load_artifact(students_dir(artifacts, key))
    name = f"{key}-students"
    entry = {"kind": "classification" if manifest.labels else "embedding", "task": manifest.task,
             "students": f"students/{key}", "labels": manifest.labels, "teacher": manifest.teacher,
             STUDENTS_OF: teacher_model, "max_students": manifest.extra.get("num_students"),
             "best_k": manifest.extra.get("best_k"), "max_tokens": manifest.extra.get("max_tokens", MAX_TOKENS)}
    write_entry(artifacts, name, entry)
    write_entry(artifacts, f"{key}-2l", entry | {"limit_students": 1})
    return [name, f"{key}-2l"]


def write_student_catalogue(artifacts: Path) -> dict[str, Any]:
    """Adds `<task>-students` / `minilm-students` to models.json for every student group that verifies, and
    drops those of groups that no longer do."""
    served: dict[str, dict[str, Any]] = {}
    for task, name in SERVED_NAMES.items():
        try:
            manifest, _ = load_artifact(students_dir(artifacts, task))
        except ArtifactError:
            continue
        if manifest.kind != STUDENT_KIND:
            continue
        served[name] = {"kind": "classification" if manifest.labels else "embedding", "task": task,
                        "students": f"students/{task}", "labels": manifest.labels,
                        "teacher": manifest.teacher, "max_students": manifest.extra.get("num_students"),
                        "best_k": manifest.extra.get("best_k")}
        # the single 2-layer baseline: the group's first student alone, with the pruned head
        served[f"{name.removesuffix('-students')}-2l"] = served[name] | {"limit_students": 1}
    ours = {n for name in SERVED_NAMES.values() for n in (name, f"{name.removesuffix('-students')}-2l")}
    return update_catalogue(artifacts, lambda catalogue: {n: e for n, e in catalogue.items() if n not in ours}
                            | served)
