"""PLOT models in the catalogue: `minilm-plot` (registered by `academus plot build` for a root table
under the artifacts; `<model>-plot` for a table on a user's embedding model) and `<task>-plot` (`academus plot
head --task T`: a linear head retrained on the hierarchical model's pooled output, HMI §3.3.2, compared with the
teacher's head on the same splits when the table is the teacher's).

A catalogue entry with `"plot": "<table dir, relative to the artifacts>"` is served by a worker as
the hierarchical model in process (services/worker/core.py `ModelRunner._load_plot`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from academus.shared.models.model import TeacherEncoder
from academus.shared.models.plot.hierarchical import HierarchicalEncoder
from academus.shared.models.plot.store import PlotStore
from academus.shared.models.plot.table import ROOT, PlotError, PlotManifest, read_manifest
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import BUNDLED_BASE, EncoderBase
from academus.shared.runtime.config import artifacts_dir
from academus.shared.state.catalogue import EMBEDDING, read_catalogue, write_entry
from academus.shared.training.data import TASKS, TaskData, fetch, load_task

EMBEDDING_MODEL = "minilm-plot"
PLOT_HEAD_KIND = "teacher-head"   # the same artifact kind as the teacher's heads: load_head_at reads both


def plot_base(model: str, artifacts: Path | None = None) -> EncoderBase:
    """The bundled teacher, or a user's embedding model in the catalogue under `artifacts`; anything else is
    refused naming what it is."""
    if model == BUNDLED_BASE:
        return EncoderBase.bundled()
    artifacts = Path(artifacts or artifacts_dir())
    entry = read_catalogue(artifacts).get(model)
    if entry is None or "source" not in entry or entry.get("kind") != EMBEDDING:
        what = "not in the catalogue" if entry is None else f"a {entry.get('kind', 'bundled')} model, not a user's " \
            "embedding model"
        raise PlotError(f"--model {model!r} is {what} ({artifacts / 'models.json'}): PLOT tables are built on "
                        f"{BUNDLED_BASE} or on an embedding model added with `academus models add`")
    return EncoderBase.of_entry(model, artifacts, entry)


def table_ref(artifacts: Path, table: Path) -> str | None:
    """The table as the catalogue names it (relative to the artifacts), None when it lies outside."""
    try:
        return str(Path(table).resolve().relative_to(Path(artifacts).resolve()))
    except ValueError:
        return None


def register(artifacts: Path, name: str, entry: dict[str, Any]) -> None:
    """Adds or replaces one models.json entry, keeping the others."""
    write_entry(artifacts, name, entry)


def embedding_entry(artifacts: Path, ref: str, manifest: PlotManifest) -> dict[str, Any]:
    """A PLOT model's entry: its table, the model it was built on, and that model's width and token limit."""
    return {"kind": "embedding", "plot": ref, "base": manifest.model, "lower_layers": manifest.lower_layers,
            "teacher": manifest.teacher, "dim": manifest.hidden,
            "max_tokens": plot_base(manifest.model, artifacts).max_tokens}


def embedding_name(model: str) -> str:
    """`minilm-plot` for the teacher's table, `<model>-plot` for a user's model's."""
    return EMBEDDING_MODEL if model == BUNDLED_BASE else f"{model}-plot"


def register_embedding(artifacts: Path, table: Path) -> str | None:
    """Registers the table's embedding model (`minilm-plot`, or `<model>-plot` on a user's model) for a root
    table under the artifacts; None (nothing written) otherwise."""
    ref = table_ref(artifacts, table)
    if ref is None:
        return None
    manifest = read_manifest(Path(table) / ROOT)
    name = embedding_name(manifest.model)
    register(artifacts, name, embedding_entry(artifacts, ref, manifest))
    return name


def open_plot_base(artifacts: Path, base: str) -> PlotStore:
    """The table a served PLOT base (minilm-plot) looks up, as its catalogue entry names it, with every
    overlay built so far: tenant adapters train on exactly what the workers serve."""
    path = Path(artifacts) / "models.json"
    entry = (json.loads(path.read_text()) if path.is_file() else {}).get(base)
    if not entry or "plot" not in entry:
        raise PlotError(f"base {base!r} is not in the catalogue {path}: build its PLOT table first "
                        "(academus plot build)")
    return PlotStore.open(Path(artifacts) / entry["plot"], model=entry.get("base", "minilm"),
                          lower_layers=entry.get("lower_layers"), verify=False)


# --- <task>-plot: the head on the hierarchical model --------------------------------------------

def pool_texts(encoder: HierarchicalEncoder, tokenizer: TeacherTokenizer, texts: list[str], domain: str,
               batch_size: int, desc: str) -> torch.Tensor:
    """Pooled hierarchical embeddings (len(texts) x hidden) in the order of `texts`."""
    from academus.shared.training.prepare import length_batches

    encoded = tokenizer.encode(texts, truncate=True)
    out = torch.empty(len(encoded), encoder.split.hidden)
    with tqdm(total=len(encoded), desc=desc, unit="text", file=sys.stderr, leave=False) as bar:
        for batch in length_batches([len(e.input_ids) for e in encoded], batch_size, tokenizer.max_tokens):
            out[batch] = encoder.pool([encoded[i].input_ids for i in batch], domain).float().cpu()
            bar.update(len(batch))
    return out


def teacher_reference(task: TaskData, splits: dict, artifacts: Path, teacher: TeacherEncoder,
                      tokenizer: TeacherTokenizer, cache: Path | None, batch_size: int, whole: bool = True,
                      ) -> dict[str, Any]:
    """The teacher head's validation/test scores on exactly these splits (embeddings from the cache
    `academus prepare` wrote when the splits are whole, else from the task's text store)."""
    from academus.shared.training.prepare import (
        cached_embeddings,
        classification_metrics,
        embed_texts,
        load_head,
        predict,
    )

    def embed(texts: list[str], desc: str) -> torch.Tensor:
        return embed_texts(texts, teacher, tokenizer, batch_size=batch_size, desc=f"teacher {desc}")

    scored = splits if whole else {name: splits[name] for name in ("validation", "test")}
    embeddings = cached_embeddings(cache, task.name, scored, embed, whole=whole)
    head = load_head(artifacts, task.name)
    return {name: classification_metrics(predict(head, embeddings[name]),
                                         torch.tensor([e.label for e in splits[name]]), len(task.labels))
            for name in ("validation", "test")}


def train_plot_head(artifacts: Path, task_name: str, table: Path, *, domain: str = "", name: str = "",
                    data: Path | None = None, limit: int | None = None, batch_size: int = 64) -> dict[str, Any]:
    """Trains `<task>-plot`, writes heads/<task>-plot, registers it; returns the JSON summary. The teacher's head
    is the reference on the teacher's table; a table on a user's model has none (`teacher`: null)."""
    from academus.shared.state.artifacts import write_artifact
    from academus.shared.training.prepare import SPLITS, subsample, train_head

    if task_name not in TASKS:
        raise PlotError(f"--task {task_name!r} is not one of {', '.join(TASKS)}")
    ref = table_ref(artifacts, table)
    if ref is None:
        raise PlotError(f"the table {table} is not under the artifacts {artifacts}: workers could not find it")
    name = name or f"{task_name}-plot"
    started = time.perf_counter()
    directory = fetch(data)
    task = load_task(task_name, directory)
    splits = {s: subsample(task.splits()[s], limit) for s in SPLITS}
    store = PlotStore.open(table, verify=False)
    if domain and domain not in store.domains:
        raise PlotError(f"--domain {domain!r}: the table at {table} has overlays {sorted(store.domains) or 'none'}")
    base = plot_base(store.model, artifacts)
    teacher, tokenizer = base.encoder(), base.tokenizer()
    encoder = HierarchicalEncoder(store, teacher)
    features = {s: (pool_texts(encoder, tokenizer, [e.text for e in splits[s]], domain, batch_size, s),
                    torch.tensor([e.label for e in splits[s]])) for s in SPLITS}
    pooled_s = time.perf_counter() - started
    head, weight_decay, metrics = train_head(features, task.labels)
    reference = None if base.user else teacher_reference(task, splits, artifacts, teacher, tokenizer,
                                                          directory / "cache", batch_size, whole=limit is None)
    out = Path(artifacts) / "heads" / name
    manifest = store.root.manifest
    write_artifact(out, PLOT_HEAD_KIND, dict(head.state_dict()), teacher=manifest.teacher, task=task_name,
                   labels=task.labels, metrics={**metrics, "teacher": reference, "weight_decay": weight_decay},
                   extra={"plot": ref, "domain": domain, "lower_layers": manifest.lower_layers, "limit": limit})
    register(artifacts, name, {**embedding_entry(artifacts, ref, manifest), "kind": "classification", "task": task_name,
                               "head": f"heads/{name}", "labels": task.labels, "domain": domain})
    return {"model": name, "task": task_name, "plot": ref, "domain": domain, "lower_layers": manifest.lower_layers,
            "counts": {s: len(v) for s, v in splits.items()},
            "validation": metrics["validation"], "test": metrics["test"], "teacher": reference,
            "test_f1_vs_teacher": round(metrics["test"]["f1"] - reference["test"]["f1"], 4) if reference else None,
            "weight_decay": weight_decay, "pool_s": round(pooled_s, 1),
            "total_s": round(time.perf_counter() - started, 1)}
