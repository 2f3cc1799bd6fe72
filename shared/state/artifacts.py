"""Artifact directories: safetensors weights plus a `manifest.json` that checks them.

A directory holds `weights.safetensors` and `manifest.json` (format_version, kind, teacher, task,
created, shapes, files -> sha256, labels, metrics, extra). It is written to a temporary sibling
and renamed into place, so a crash never leaves a half-written artifact under the final name.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isal import isal_zlib
from safetensors import SafetensorError

# torch is imported where weights are read or written: a scheduler (which reads manifests and checksums only)
# then starts, and restarts, without a second of importing it
if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


def save_file(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file as save

    save(tensors, path)


def load_file(path: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file as load

    return load(path, device=device)


class ArtifactError(Exception):
    """An artifact is missing, of an unsupported format, or does not match its manifest."""


@dataclass(frozen=True)
class Manifest:
    kind: str
    teacher: str
    task: str
    created: str                              # ISO 8601, UTC
    shapes: dict[str, list[int]]
    files: dict[str, str]                     # file name -> sha256 hex
    labels: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str, source: str = "manifest") -> Manifest:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{source} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ArtifactError(f"{source} is not a JSON object")
        version = data.get("format_version")
        if version not in SUPPORTED_VERSIONS:
            raise ArtifactError(f"{source} has format_version {version!r}; this build reads "
                                f"{list(SUPPORTED_VERSIONS)} (re-run `academus prepare --force`)")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:                # a required field is missing
            raise ArtifactError(f"{source} is incomplete: {e}") from e


def file_stamp(path: Path) -> tuple[int, int] | None:
    """What changes when a file is written again or replaced by a rename (a manifest, models.json): its inode
    and mtime; None where it cannot be seen."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def crc32(data: bytes | memoryview) -> int:
    """zlib's CRC-32, the checksum a shard or an embedding block is read against, computed with ISA-L's carry-less
    multiplies: 7 us for a 590 KB MiniLM shard against zlib's 115 us (docs/benchmarks/sti.md)."""
    return isal_zlib.crc32(data)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_artifact(
    directory: Path,
    kind: str,
    tensors: dict[str, torch.Tensor],
    *,
    teacher: str,
    task: str,
    labels: list[str],
    metrics: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Manifest:
    """Writes weights + manifest atomically, replacing any artifact already at `directory`."""
    with staged(directory) as staging:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(staging / WEIGHTS))
        manifest = Manifest(
            kind=kind, teacher=teacher, task=task, created=now_iso(),
            shapes={k: list(v.shape) for k, v in tensors.items()},
            files=checksums(staging), labels=list(labels), metrics=metrics, extra=dict(extra or {}),
        )
        write_manifest(staging, manifest)
    return manifest


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@contextmanager
def staged(directory: Path) -> Iterator[Path]:
    """A staging sibling of `directory` to write an artifact into; renamed into place (replacing what was there)
    when the block ends without an error, removed in any case. Its files are made readable by every user:
    safetensors writes 0600, and workers may run as another user."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        staging.mkdir()
        yield staging
        for path in staging.iterdir():
            os.chmod(path, 0o644)
        swap_in(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def checksums(directory: Path) -> dict[str, str]:
    """Every file's sha256 in `directory` but the manifest, as a manifest lists them."""
    return {p.name: sha256_file(p) for p in sorted(Path(directory).iterdir()) if p.name != MANIFEST}


def write_atomic(path: Path, data: bytes | str, mode: int = 0o644) -> Path:
    """Writes `data` to `path` whole or not at all: a temporary file of this writer's own beside it, synced, then
    renamed over it, the directory synced too. A reader sees the old file or the new one; two writers never share
    a temporary file; a failed write leaves the old file and no temporary one; after a crash the file is the old
    or the new one whole (an adapter's version is recorded in Redis only after its file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), mode)
            out.write(data.encode() if isinstance(data, str) else data)
            out.flush()
            os.fsync(out.fileno())   # a rename that outlives a crash names the whole file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)   # the rename itself
    finally:
        os.close(directory)
    return path


def update_json(path: Path, change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Rewrites the JSON object at `path` as `change` makes it from the file as it is now ({} when there is none);
    returns what was written. Writers take a lock beside it, so writers at once lose none of each other's
    changes; readers see the old file or the new one whole (`write_atomic`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = change(json.loads(path.read_text()) if path.is_file() else {})
        write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Writes (or replaces, atomically) the manifest of the artifact at `directory`."""
    write_atomic(Path(directory) / MANIFEST, manifest.to_json() + "\n")


def swap_in(staging: Path, directory: Path) -> None:
    """Renames `staging` to `directory`; an old artifact is moved aside first, then removed."""
    old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
    if directory.exists():
        os.replace(directory, old)
    try:
        os.replace(staging, directory)
    except OSError:
        if old.exists():
            os.replace(old, directory)       # put the previous artifact back
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"no {MANIFEST} in {directory} (run `academus prepare`)")
    return Manifest.from_json(path.read_text(), source=str(path))


def verify_files(directory: Path, manifest: Manifest) -> None:
    """Every file the manifest lists is there and matches its sha256 (read through, not held)."""
    for name, expected in manifest.files.items():
        path = Path(directory) / name
        if not path.is_file():
            raise ArtifactError(f"{path} is listed in the manifest but missing")
        if sha256_file(path) != expected:
            raise ArtifactError(f"{path} does not match its sha256 in {MANIFEST} (corrupt or modified)")


def load_artifact(
    directory: Path, device: str | torch.device = "cpu"
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest and tensors, after checking every file's sha256 and every tensor's shape."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    if WEIGHTS not in manifest.files:
        raise ArtifactError(f"{directory}/{MANIFEST} lists no {WEIGHTS}")
    try:
        tensors = load_file(str(directory / WEIGHTS), device=str(device))
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{directory / WEIGHTS} cannot be read: {e}") from e
    _check_shapes(directory / WEIGHTS, manifest.shapes, tensors)
    return manifest, tensors


def _check_shapes(path: Path, shapes: dict[str, list[int]], tensors: dict[str, torch.Tensor]) -> None:
    if set(shapes) != set(tensors):
        raise ArtifactError(f"{path} holds tensors {sorted(tensors)}; the manifest lists {sorted(shapes)}")
    for name, shape in shapes.items():
        if list(tensors[name].shape) != list(shape):
            raise ArtifactError(f"{path}: tensor {name} has shape {list(tensors[name].shape)}, "
                                f"the manifest says {list(shape)}")
