"""Artifact directories: round trip, checksum and shape checks, format versions, atomic writes."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest
import torch

from academus.shared.state import artifacts
from academus.shared.state.artifacts import (
    MANIFEST,
    WEIGHTS,
    ArtifactError,
    Manifest,
    load_artifact,
    read_manifest,
    write_artifact,
)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"linear.weight": torch.randn(2, 384, generator=generator),
            "linear.bias": torch.randn(2, generator=generator)}


def _write(directory: Path, **overrides: object) -> Manifest:
    kwargs = {"teacher": "all-MiniLM-L6-v2", "task": "spam", "labels": ["ham", "spam"],
              "metrics": {"test": {"accuracy": 0.9}}, "extra": {"max_tokens": 256}, **overrides}
    return write_artifact(directory, "teacher-head", _tensors(), **kwargs)


def test_round_trip(tmp_path: Path) -> None:
    written = _write(tmp_path / "head")
    manifest, tensors = load_artifact(tmp_path / "head")
    assert manifest == written == read_manifest(tmp_path / "head")
    assert manifest.format_version == 1 and manifest.kind == "teacher-head" and manifest.task == "spam"
    assert manifest.shapes == {"linear.weight": [2, 384], "linear.bias": [2]}
    assert manifest.labels == ["ham", "spam"] and manifest.extra == {"max_tokens": 256}
    assert set(manifest.files) == {WEIGHTS} and len(manifest.files[WEIGHTS]) == 64
    for name, tensor in _tensors().items():
        assert torch.allclose(tensors[name], tensor)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert (tmp_path / "head" / WEIGHTS).stat().st_mode & 0o044 == 0o044   # readable by a worker user


def test_tampered_weights_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "head")
    weights = tmp_path / "head" / WEIGHTS
    blob = bytearray(weights.read_bytes())
    blob[-1] ^= 0xFF                                  # flip one byte of tensor data
    weights.write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match=rf"{WEIGHTS}.*sha256"):
        load_artifact(tmp_path / "head")


def test_missing_weights_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "head")
    (tmp_path / "head" / WEIGHTS).unlink()
    with pytest.raises(ArtifactError, match="missing"):
        load_artifact(tmp_path / "head")


def _edit_manifest(directory: Path, **changes: object) -> None:
    path = directory / MANIFEST
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def test_shape_mismatch_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "head")
    _edit_manifest(tmp_path / "head", shapes={"linear.weight": [3, 384], "linear.bias": [2]})
    with pytest.raises(ArtifactError, match=r"linear\.weight has shape \[2, 384\]"):
        load_artifact(tmp_path / "head")


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_unsupported_format_version_is_refused(tmp_path: Path, version: object) -> None:
    _write(tmp_path / "head")
    _edit_manifest(tmp_path / "head", format_version=version)
    with pytest.raises(ArtifactError, match="format_version"):
        read_manifest(tmp_path / "head")


def test_missing_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="academus prepare"):
        read_manifest(tmp_path)


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(path: Path) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(artifacts, "sha256_file", crash)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path / "head")
    assert list(tmp_path.iterdir()) == []


def test_failed_rewrite_keeps_the_old_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _write(tmp_path / "head", metrics={"run": 1})
    monkeypatch.setattr(artifacts, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError, match="crash"):
        _write(tmp_path / "head", metrics={"run": 2})
    assert load_artifact(tmp_path / "head")[0] == first
    assert [p.name for p in tmp_path.iterdir()] == ["head"]


def test_rewrite_replaces(tmp_path: Path) -> None:
    _write(tmp_path / "head", metrics={"run": 1})
    _write(tmp_path / "head", metrics={"run": 2})
    assert load_artifact(tmp_path / "head")[0].metrics == {"run": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["head"]


def test_a_node_can_mount_its_own_teacher_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from academus.shared.models.teacher_files import TeacherMissing, teacher_dir

    bundled = teacher_dir()
    mounted = tmp_path / "teacher"
    mounted.mkdir()
    monkeypatch.setenv("ACADEMUS_TEACHER_DIR", str(mounted))
    with pytest.raises(TeacherMissing, match=r"lacks config.json, tokenizer.json: \$ACADEMUS_TEACHER_DIR"):
        teacher_dir()
    for name in ("config.json", "tokenizer.json"):
        (mounted / name).symlink_to(bundled / name)
    assert teacher_dir() == mounted
    monkeypatch.delenv("ACADEMUS_TEACHER_DIR")
    assert teacher_dir() == bundled


def test_an_atomic_write_replaces_whole_with_its_mode_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = artifacts.write_atomic(tmp_path / "sub" / "state.json", '{"a": 1}', mode=0o600)
    assert path.read_text() == '{"a": 1}' and path.stat().st_mode & 0o777 == 0o600
    artifacts.write_atomic(path, b"second")
    assert path.read_bytes() == b"second" and path.stat().st_mode & 0o777 == 0o644
    with pytest.raises(TypeError):
        artifacts.write_atomic(path, 42)   # type: ignore[arg-type]   # fails inside the write
    assert path.read_bytes() == b"second", "a failed write keeps the old file"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_writers_of_the_catalogue_at_once_lose_none_of_each_others_entries(tmp_path: Path) -> None:
    """`models add` (write_entry) beside `distill` and `prepare` rewriting their own entries of models.json."""
    from concurrent.futures import ThreadPoolExecutor

    from academus.shared.state.catalogue import read_catalogue, write_entry
    from academus.shared.training.prepare import write_catalogue
    from academus.shared.training.student_artifacts import write_student_catalogue

    def add(writer: int) -> None:
        for n in range(25):
            write_entry(tmp_path, f"user-{writer}-{n}", {"kind": "embedding"})

    def rewrite(_: int) -> None:
        for _ in range(25):
            write_student_catalogue(tmp_path)
            write_catalogue(tmp_path)

    with ThreadPoolExecutor(6) as pool:
        for done in [pool.submit(add, w) for w in range(4)] + [pool.submit(rewrite, r) for r in range(2)]:
            done.result()
    catalogue = read_catalogue(tmp_path)
    assert {f"user-{w}-{n}" for w in range(4) for n in range(25)} <= set(catalogue)
    assert {"minilm", "null"} <= set(catalogue)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 589_824])
def test_crc32_is_zlibs(size: int) -> None:
    """Manifests written with zlib's CRC-32 (any built before ISA-L computed it) still check."""
    data = random.Random(size).randbytes(size)
    assert artifacts.crc32(data) == zlib.crc32(data)
    assert artifacts.crc32(memoryview(data)) == zlib.crc32(data)
