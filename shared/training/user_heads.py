"""`academus heads train --model NAME (--task T | --data F.jsonl) [--name HEAD]`: a linear head on a user's
embedding model (one added with `academus models add`), served as a classifier on that model's encoder.

The head is trained as `academus prepare` trains the teacher's: the frozen model embeds every text (its own
tokenizer, its own token limit), a softmax regression is fitted with L-BFGS, its weight decay chosen on the
validation split, and the test split scored once. A bundled task brings its splits; a JSONL file of
`{"text", "label"}` lines is split 80/10/10 by text hash (the same split on every run). The head lands in
`<artifacts>/heads/HEAD/` and the catalogue entry `HEAD` names its encoder's model (`encoder_model`): workers
serve both from one copy of the encoder.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from academus.shared.models.model import TeacherEncoder
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import HEAD_ON, ModelRefused, cache_name, open_model
from academus.shared.runtime.config import artifacts_dir as default_artifacts_dir
from academus.shared.runtime.config import offline_hub
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, MODEL_NAME, read_catalogue, write_entry
from academus.shared.state.uploads import parse_labelled_jsonl
from academus.shared.training.data import TASKS, DataMissing, TaskData, fetch, file_task, load_task
from academus.shared.training.prepare import SPLITS, embed_texts, log_progress, prepare_task


def train_user_head(artifacts: Path, model: str, name: str, task: str = "", data: Path | None = None,
                    data_dir: Path | None = None) -> dict[str, Any]:
    """Trains, writes and registers the head; returns its catalogue entry and metrics."""
    artifacts = Path(artifacts)
    catalogue = read_catalogue(artifacts)
    entry = _embedding_model(catalogue, model)
    if not MODEL_NAME.match(name):
        raise ModelRefused(f"head name {name!r} must be 1-63 of a-z 0-9 . _ -, starting with a letter or digit")
    if name in catalogue:
        raise ModelRefused(f"model {name!r} is already in the catalogue: choose another --name")
    examples = _examples(task, data, data_dir)
    source = artifacts / entry["source"]
    encoder, _, manifest = open_model(source)
    tokenizer = TeacherTokenizer(source, max_tokens=entry["max_tokens"])
    started = time.perf_counter()
    metrics = prepare_task(examples, artifacts, _embedder(encoder, tokenizer),
                           cache_dir=fetch(data_dir) / "cache" if task else None,
                           teacher=cache_name(model, manifest),
                           head_name=name, max_tokens=entry["max_tokens"])
    head = {"kind": CLASSIFICATION, "head": f"heads/{name}", HEAD_ON: model, "labels": examples.labels,
            "dim": entry["dim"], "max_tokens": entry["max_tokens"]}
    write_entry(artifacts, name, head)
    log_progress(f"{name}: a head on {model}, test accuracy {metrics['test']['accuracy']:.4f} "
                 f"({time.perf_counter() - started:.0f} s)")
    return {"name": name, **head, "metrics": {k: metrics[k] for k in (*SPLITS, "counts", "weight_decay")}}


def _embedding_model(catalogue: dict[str, dict[str, Any]], model: str) -> dict[str, Any]:
    entry = catalogue.get(model)
    if entry is None:
        raise ModelRefused(f"model {model!r} is not in the catalogue (academus models list)")
    if "source" not in entry or entry.get("kind") != EMBEDDING:
        raise ModelRefused(f"model {model!r} is not an embedding model added with `academus models add`: heads train "
                           "on one (the bundled teacher's heads come from `academus prepare`)")
    return entry


def _examples(task: str, data: Path | None, data_dir: Path | None) -> TaskData:
    if bool(task) == bool(data):
        raise ModelRefused("give one of --task (a bundled task) or --data (a JSONL file of {\"text\", \"label\"})")
    if task:
        if task not in TASKS:
            raise ModelRefused(f"--task {task!r} is not a bundled task; known: {', '.join(TASKS)}")
        return load_task(task, fetch(data_dir))
    try:
        texts, labels = parse_labelled_jsonl(Path(data).read_bytes(), str(data))
    except (OSError, ValueError) as e:
        raise ModelRefused(str(e)) from e
    return split_examples(Path(data).stem, texts, labels)


def split_examples(name: str, texts: list[str], labels: list[str]) -> TaskData:
    """Labels in sorted order; each text to validation, test or train by its hash, so reruns split alike."""
    try:
        return file_task(name, texts, labels, sorted(set(labels)))
    except ValueError as e:
        raise ModelRefused(str(e)) from e


def _embedder(encoder: TeacherEncoder, tokenizer: TeacherTokenizer):
    def embed(texts: list[str], desc: str):
        return embed_texts(texts, encoder, tokenizer, desc=desc)

    return embed


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    p = argparse.ArgumentParser(prog="academus heads train", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an embedding model added with `academus models add`")
    p.add_argument("--task", default="", help=f"a bundled task: {', '.join(TASKS)}")
    p.add_argument("--data", type=Path, default=None, help="JSONL lines of {\"text\", \"label\"}")
    p.add_argument("--name", default="", help="the served name (default: MODEL-TASK, or MODEL-<data file stem>)")
    p.add_argument("--artifacts", type=Path, default=None)
    p.add_argument("--data-dir", type=Path, default=None, help="dataset packages (ACADEMUS_DATA_DIR)")
    args = p.parse_args(argv)
    name = args.name or f"{args.model}-{args.task or (args.data.stem if args.data else 'head')}"
    try:
        result = train_user_head(args.artifacts or default_artifacts_dir(), args.model, name, args.task, args.data,
                                 args.data_dir)
    except (ModelRefused, DataMissing) as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


