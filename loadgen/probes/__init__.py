"""One-off probes: each measured one mechanism in isolation, and its finding is written down in docs/benchmarks/.
They stay runnable (`python -m academus.loadgen.probes.<name>`) so a finding can be checked again; the benches a
user runs live one level up, in `academus.loadgen`."""

from __future__ import annotations

import argparse
from pathlib import Path

from academus.shared.runtime.config import offline_hub
from academus.shared.state.uploads import parse_texts_jsonl


def texts_probe_args(doc: str | None, model_help: str, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """A probe scoring a model's artifact on texts from a file: its arguments (--artifacts, --model, --texts,
    --limit) and those texts."""
    offline_hub()
    p = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    p.add_argument("--artifacts", type=Path, required=True)
    p.add_argument("--model", required=True, help=model_help)
    p.add_argument("--texts", type=Path, required=True, help='JSON lines {"text": ...}')
    p.add_argument("--limit", type=int, default=0, help="the first N texts (0: all)")
    args = p.parse_args(argv)
    texts = parse_texts_jsonl(args.texts.read_bytes(), str(args.texts))
    return args, texts[:args.limit] if args.limit else texts
