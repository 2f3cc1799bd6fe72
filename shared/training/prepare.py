"""`academus prepare`: embeds each task with the frozen teacher, trains its linear head, writes artifacts.

Layout under the artifacts directory:
  heads/<task>/      weights.safetensors (linear.weight, linear.bias) + manifest.json (labels, metrics)
  models.json        the served catalogue: `minilm` (embedding) and one classification model per head

Texts are tokenized exactly as serving does (max 256 tokens, truncated). Teacher embeddings are
cached under <data dir>/cache, keyed by the texts and the teacher, so retraining (--force) skips
the slow encoder pass; a --limit run's subsets go to the task's text store there, where every
quick run (distill --quick, plot head --limit) finds the texts an earlier one embedded. The head
is a softmax regression fitted full-batch with L-BFGS; its L2 weight decay is picked on the
validation split (macro F1), and the test split is scored once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import nn
from tqdm import tqdm

from academus.shared.models.model import HIDDEN_SIZE, ClassifierHead, TeacherEncoder, pad_batch
from academus.shared.models.teacher_files import TEACHER_NAME, teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.config import artifacts_dir as default_artifacts_dir
from academus.shared.runtime.config import offline_hub
from academus.shared.state.artifacts import ArtifactError, load_artifact, write_artifact
from academus.shared.state.catalogue import update_catalogue
from academus.shared.state.uploads import write_upload
from academus.shared.training.data import TASKS, DataMissing, Example, TaskData, fetch, load_task

HEAD_KIND = "teacher-head"
MAX_TOKENS = 256                          # the serving limit: heads see what the workers will see
NULL_MODEL = "null"
DEFAULT_BATCH_SIZE = 64                   # sequences per batch at full length; shorter texts pack more
WEIGHT_DECAYS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)  # L2 on the weight matrix, chosen on validation
# quick runs (`shard build`, `ramps train`): the served heads' usual pick alone. A few dozen validation texts cannot
# tell the five apart, and fitting every one was a quarter to a third of those runs
QUICK_WEIGHT_DECAYS = (1e-3,)
RAW, EITHER = (False,), (False, True)   # states as they are; or standardized as well, chosen on validation
SEED = 0
SPLITS = ("train", "validation", "test")


def log_progress(message: str) -> None:
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def head_dir(artifacts_dir: Path, task: str) -> Path:
    return Path(artifacts_dir) / "heads" / task


# --- embedding ---------------------------------------------------------------------------------

def length_batches(
    lengths: Sequence[int], batch_size: int, max_tokens: int = MAX_TOKENS
) -> Iterator[list[int]]:
    """Indices longest first, cut so each padded batch stays within batch_size * max_tokens tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    budget, batch = batch_size * max_tokens, []
    for i in order:
        if batch and (len(batch) + 1) * lengths[batch[0]] > budget:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def padded_batches(tokenizer: TeacherTokenizer, texts: Sequence[str], batch_size: int
                   ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The texts tokenized (truncated) and padded in `length_batches`: (rows of `texts`, ids, mask, types)."""
    encoded = tokenizer.encode(list(texts), truncate=True)
    for rows in length_batches([len(e.input_ids) for e in encoded], batch_size, tokenizer.max_tokens):
        yield rows, *pad_batch([encoded[i].input_ids for i in rows], [encoded[i].token_type_ids for i in rows])


@torch.inference_mode()
def in_text_order(batches: Sequence[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]], n: int,
                  run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`run(ids, mask, types)` on each of `padded_batches`' batches, its rows put back in the texts' order: [n, ...]
    (float32)."""
    out: torch.Tensor | None = None
    for rows, ids, mask, types in batches:
        values = run(ids, mask, types).float()
        if out is None:
            out = torch.empty(n, *values.shape[1:])
        out[rows] = values
    return out if out is not None else torch.empty(0)


def bundled_texts(split: str, limit: int | None, data_dir: Path | None = None) -> list[str]:
    """The bundled tasks' texts of one split in equal shares, `limit` in all (None: every one): real text for
    what has no task of its own (a user's classifier, an embedding group)."""
    share = None if limit is None else limit // len(TASKS)
    return [e.text for task in TASKS for e in subsample(getattr(load_task(task, data_dir), split), share)]


def embed_texts(
    texts: Sequence[str],
    encoder: TeacherEncoder,
    tokenizer: TeacherTokenizer,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str | torch.device = "cpu",
    desc: str = "embed",
) -> torch.Tensor:
    """Pooled embeddings (len(texts) x the encoder's width, float32, CPU) in the order of `texts`."""
    encoded = tokenizer.encode(list(texts), truncate=True)
    out = torch.empty(len(encoded), encoder.architecture.hidden_size)
    with tqdm(total=len(encoded), desc=desc, unit="text", file=sys.stderr, leave=False) as bar:
        for batch in length_batches([len(e.input_ids) for e in encoded], batch_size, tokenizer.max_tokens):
            ids, mask, types = pad_batch([encoded[i].input_ids for i in batch],
                                         [encoded[i].token_type_ids for i in batch])
            with torch.inference_mode():
                pooled = encoder(ids.to(device), mask.to(device), types.to(device))
            out[batch] = pooled.float().cpu()
            bar.update(len(batch))
    return out


def _cache_key(task: str, splits: dict[str, list[Example]], max_tokens: int, teacher: str = TEACHER_NAME) -> str:
    digest = hashlib.sha256(f"{teacher}|{max_tokens}|{task}".encode())
    for name in SPLITS:
        for ex in splits[name]:
            digest.update(b"\0" + name.encode() + b"\0" + ex.text.encode("utf-8"))
    return digest.hexdigest()


def cached_embeddings(
    cache_dir: Path | None, task: str, splits: dict[str, list[Example]],
    embed: Callable[[list[str], str], torch.Tensor], teacher: str = TEACHER_NAME, max_tokens: int = MAX_TOKENS,
    *, whole: bool = True,
) -> dict[str, torch.Tensor]:
    """Each split's embeddings, from <cache_dir>/<task>.safetensors when its key matches. `teacher`: what
    embeds (another model's cache goes in a file of its own, `<task>-<teacher>.safetensors`). Subsets of a task
    (`whole` off: quick runs, `--limit`) go to the task's text store instead, so they never evict the whole
    splits' cache and each text is embedded once whichever subsets it falls in."""
    name = task if teacher == TEACHER_NAME else f"{task}-{teacher}"
    if not whole:
        return _stored_embeddings(cache_dir / f"{name}-texts.safetensors" if cache_dir else None, task, splits,
                                  embed, f"{teacher}|{max_tokens}")
    key = _cache_key(task, splits, max_tokens, teacher)
    path = cache_dir / f"{name}.safetensors" if cache_dir else None
    if path and path.is_file():
        try:
            with safe_open(str(path), framework="pt") as cached:
                if (cached.metadata() or {}).get("key") == key:
                    log_progress(f"{task}: teacher embeddings from cache {path}")
                    return {name: cached.get_tensor(name) for name in SPLITS}
        except (SafetensorError, OSError):
            pass                          # a broken cache is recomputed
    result = {name: embed([ex.text for ex in splits[name]], f"{task}/{name}") for name in SPLITS}
    if path:
        _save_atomically(result, path, key)
    return result


def _save_atomically(tensors: dict[str, torch.Tensor], path: Path, key: str) -> None:
    write_upload(path.parent, path.name, save(tensors, metadata={"key": key}))


def _stored_embeddings(path: Path | None, task: str, splits: dict[str, list[Example]],
                       embed: Callable[[list[str], str], torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """Embeddings looked up text by text (SHA-256) in a store of [digests, embeddings]; texts it lacks are
    embedded in one pass and added. A store made under another teacher or token limit (`key`) starts over."""
    wanted = {name: [_digest(ex.text) for ex in exs] for name, exs in splits.items()}
    texts = {d: ex.text for name, exs in splits.items() for d, ex in zip(wanted[name], exs, strict=True)}
    if not texts:
        return {name: embed([], f"{task}/{name}") for name in splits}
    digests, rows = _read_store(path, key)
    raw = digests.numpy().tobytes()
    index = {raw[i:i + DIGEST_BYTES]: n for n, i in enumerate(range(0, len(raw), DIGEST_BYTES))}
    missing = [d for d in texts if d not in index]
    if missing:
        added = embed([texts[d] for d in missing], f"{task}/{len(missing)} new texts")
        index.update((d, n) for n, d in enumerate(missing, start=len(index)))
        digests = torch.cat([digests, torch.frombuffer(bytearray(b"".join(missing)), dtype=torch.uint8)
                             .view(-1, DIGEST_BYTES)])
        rows = added if rows is None else torch.cat([rows, added])
        if path:
            _save_atomically({"digests": digests, "embeddings": rows}, path, key)
    log_progress(f"{task}: {len(texts) - len(missing)} of {len(texts)} texts' teacher embeddings from "
                 f"{path}, {len(missing)} embedded")
    return {name: rows[[index[d] for d in digests_of]] for name, digests_of in wanted.items()}


DIGEST_BYTES = 32


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _read_store(path: Path | None, key: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if path and path.is_file():
        try:
            with safe_open(str(path), framework="pt") as store:
                if (store.metadata() or {}).get("key") == key:
                    return store.get_tensor("digests"), store.get_tensor("embeddings")
        except (SafetensorError, OSError):
            pass                          # a broken store starts over
    return torch.empty(0, DIGEST_BYTES, dtype=torch.uint8), None


# --- head training -----------------------------------------------------------------------------

def classification_metrics(pred: torch.Tensor, gold: torch.Tensor, num_classes: int) -> dict[str, float]:
    """Accuracy and macro F1 (a class never predicted nor present counts as F1 0)."""
    accuracy = (pred == gold).float().mean().item() if len(gold) else 0.0
    f1s = []
    for c in range(num_classes):
        tp = ((pred == c) & (gold == c)).sum().item()
        denominator = (pred == c).sum().item() + (gold == c).sum().item()
        f1s.append(2 * tp / denominator if denominator else 0.0)
    return {"accuracy": round(accuracy, 4), "f1": round(sum(f1s) / num_classes, 4)}


def fit_head(x: torch.Tensor, y: torch.Tensor, labels: Sequence[str], weight_decay: float,
             max_iter: int = 500, standardize: bool = False) -> ClassifierHead:
    """Softmax regression, full batch L-BFGS: convex, so the result does not depend on the start. `y`: class
    indices, or [n, C] probabilities (soft targets: the exit ramps fit the model's own). `standardize`: fitted on
    `x` standardized, then folded back into the weights (the head still takes raw states): a first-token state
    of an inner layer barely moves between texts (spreads near 1e-3) beside one dimension near 10, and L-BFGS on
    such raw states stops at the majority label."""
    if standardize:
        mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)
        head = fit_head((x - mean) / scale, y, labels, weight_decay, max_iter)
        with torch.no_grad():   # w·(x − mean)/scale + b = (w/scale)·x + (b − (w/scale)·mean)
            head.linear.weight /= scale
            head.linear.bias -= head.linear.weight @ mean
        return head
    torch.manual_seed(SEED)
    head = ClassifierHead(labels, x.shape[1])
    nn.init.zeros_(head.linear.weight)
    nn.init.zeros_(head.linear.bias)
    optimizer = torch.optim.LBFGS(head.parameters(), lr=1.0, max_iter=max_iter, history_size=20,
                                  tolerance_grad=1e-7, tolerance_change=1e-10, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(head(x), y) + weight_decay * head.linear.weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return head.eval()


def predict(head: ClassifierHead, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return head(x).argmax(dim=1)


def train_head(
    data: dict[str, tuple[torch.Tensor, torch.Tensor]], labels: Sequence[str],
    weight_decays: Sequence[float] = WEIGHT_DECAYS, scalings: Sequence[bool] = RAW,
) -> tuple[ClassifierHead, float, dict[str, Any]]:
    """Fits one head per weight decay (and per scaling: raw, standardized) on train, keeps the best on validation,
    scores it on test."""
    (x, y), (vx, vy) = data["train"], data["validation"]
    best: tuple[float, float, ClassifierHead] | None = None
    search = {}
    for standardize in scalings:
        for wd in weight_decays:
            head = fit_head(x, y, labels, wd, standardize=standardize)
            scores = classification_metrics(predict(head, vx), vy, len(labels))
            search[f"{wd} standardized" if standardize else str(wd)] = scores
            if best is None or scores["f1"] > best[0]:    # ties keep the smaller decay, and raw states
                best = (scores["f1"], wd, head)
    assert best is not None, "weight_decays is empty"
    _, wd, head = best
    metrics = {name: classification_metrics(predict(head, data[name][0]), data[name][1], len(labels))
               for name in ("train", "validation", "test")}
    return head, wd, {**metrics, "weight_decay_search": search}


# --- one task ----------------------------------------------------------------------------------

def subsample(examples: list[Example], limit: int | None) -> list[Example]:
    """A fixed pseudo-random subset (ordered by text hash, so both classes appear)."""
    if limit is None or len(examples) <= limit:
        return examples
    return sorted(examples, key=lambda e: hashlib.sha1(e.text.encode()).hexdigest())[:limit]


def existing_head(artifacts_dir: Path, task: str) -> dict[str, Any] | None:
    """The metrics of a head that is already there and verifies, else None."""
    try:
        manifest, _ = load_artifact(head_dir(artifacts_dir, task))
    except ArtifactError:
        return None
    return manifest.metrics if manifest.kind == HEAD_KIND and manifest.task == task else None


def prepare_task(
    task: TaskData, artifacts_dir: Path, embed: Callable[[list[str], str], torch.Tensor], *,
    cache_dir: Path | None = None, limit: int | None = None, teacher: str = TEACHER_NAME, head_name: str = "",
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """Embeds, trains and writes one task's head; returns its summary (metrics + phase seconds). `teacher`
    names what `embed` runs (the bundled teacher, or a user's model) and `head_name` the head's directory
    (default: the task's)."""
    splits = {name: subsample(task.splits()[name], limit) for name in SPLITS}
    counts = {name: len(splits[name]) for name in SPLITS}
    t0 = time.perf_counter()
    embeddings = cached_embeddings(cache_dir, task.name, splits, embed, teacher, max_tokens, whole=limit is None)
    t1 = time.perf_counter()
    data = {name: (embeddings[name].clone(), torch.tensor([ex.label for ex in splits[name]]))
            for name in SPLITS}
    head, wd, metrics = train_head(data, task.labels)
    t2 = time.perf_counter()
    metrics = {**metrics, "counts": counts, "weight_decay": wd}
    write_artifact(head_dir(artifacts_dir, head_name or task.name), HEAD_KIND,
                   dict(head.state_dict()), teacher=teacher, task=task.name,
                   labels=task.labels, metrics=metrics, extra={"max_tokens": max_tokens, "limit": limit})
    seconds = {"embed": t1 - t0, "train": t2 - t1, "write": time.perf_counter() - t2}
    log_progress(f"{task.name}: test accuracy {metrics['test']['accuracy']:.4f} f1 {metrics['test']['f1']:.4f} "
         f"(weight decay {wd}; embed {seconds['embed']:.1f}s, train {seconds['train']:.1f}s)")
    return {"status": "trained", **metrics, "seconds": {k: round(v, 2) for k, v in seconds.items()}}


# --- catalogue and the whole run -----------------------------------------------------------------

def write_catalogue(artifacts_dir: Path) -> dict[str, Any]:
    """models.json from every head that verifies; `minilm` (the bare embedding) and `null` (no model: the
    stack alone) are always served.
    Entries other commands added (student groups from `academus distill`) are kept."""
    served: dict[str, Any] = {
        "minilm": {"kind": "embedding", "teacher": TEACHER_NAME, "dim": HIDDEN_SIZE, "max_tokens": MAX_TOKENS},
        # computes nothing and goes through every hop: what the serving stack costs alone (stack_bench)
        NULL_MODEL: {"kind": "embedding", "null": True, "dim": HIDDEN_SIZE, "max_tokens": MAX_TOKENS}}
    for task in TASKS:
        try:
            manifest, _ = load_artifact(head_dir(artifacts_dir, task))
        except ArtifactError:
            continue
        served[task] = {"kind": "classification", "task": task, "head": f"heads/{task}",
                        "labels": manifest.labels, "teacher": manifest.teacher}

    def change(previous: dict[str, Any]) -> dict[str, Any]:
        return {name: entry for name, entry in previous.items()   # PLOT models keep their heads
                if ("head" not in entry or "plot" in entry) and name not in served} | served

    return update_catalogue(artifacts_dir, change)


def _device(wanted: str) -> torch.device:
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        log_progress(f"{wanted} is not available; using cpu")
        return torch.device("cpu")
    return torch.device(wanted)


def prepare(
    artifacts_dir: Path,
    data_dir: Path | None = None,
    tasks: Sequence[str] = TASKS,
    force: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str = "cpu",
    limit: int | None = None,
) -> dict[str, Any]:
    """Trains and writes the heads of `tasks` (skipping verified ones unless force), then models.json."""
    started = time.perf_counter()
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known tasks: {', '.join(TASKS)}")
    artifacts_dir = Path(artifacts_dir)
    summary: dict[str, Any] = {"artifacts": str(artifacts_dir), "tasks": {}, "seconds": {}}
    todo = []
    for t in tasks:
        metrics = None if force else existing_head(artifacts_dir, t)
        if metrics is None:
            todo.append(t)
        else:
            log_progress(f"{t}: {head_dir(artifacts_dir, t)} exists and verifies; skipped (--force retrains)")
            summary["tasks"][t] = {"status": "skipped", **metrics}
    if todo:
        _run_tasks(todo, artifacts_dir, data_dir, batch_size, _device(device), limit, summary)
    write_catalogue(artifacts_dir)
    summary["seconds"]["total"] = round(time.perf_counter() - started, 2)
    return summary


def _run_tasks(tasks: Sequence[str], artifacts_dir: Path, data_dir: Path | None, batch_size: int,
               device: torch.device, limit: int | None, summary: dict[str, Any]) -> None:
    clock = time.perf_counter()
    directory = fetch(data_dir)
    summary["seconds"]["fetch"] = round(time.perf_counter() - clock, 2)
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    clock = time.perf_counter()
    encoder = TeacherEncoder.load(device=device)
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=MAX_TOKENS)
    summary["seconds"]["load_teacher"] = round(time.perf_counter() - clock, 2)

    def embed(texts: list[str], desc: str) -> torch.Tensor:
        return embed_texts(texts, encoder, tokenizer, batch_size=batch_size, device=device, desc=desc)

    for t in tasks:
        clock = time.perf_counter()
        task = load_task(t, directory)
        load_s = round(time.perf_counter() - clock, 2)
        log_progress(f"{t}: {sum(len(v) for v in task.splits().values())} examples loaded in {load_s}s")
        result = prepare_task(task, artifacts_dir, embed, cache_dir=directory / "cache", limit=limit)
        result["seconds"] = {"load_data": load_s, **result["seconds"]}
        summary["tasks"][t] = result


def load_head(artifacts_dir: Path, task: str, device: str | torch.device = "cpu") -> ClassifierHead:
    """A task's trained head, weights verified and loaded, in eval mode."""
    return load_head_at(head_dir(artifacts_dir, task), device)


def load_head_at(directory: Path, device: str | torch.device = "cpu") -> ClassifierHead:
    """The head artifact in `directory` (a task's, or a PLOT model's), verified, in eval mode."""
    manifest, tensors = load_artifact(directory)
    if manifest.kind != HEAD_KIND:
        raise ArtifactError(f"{directory} holds a {manifest.kind!r} artifact, not a {HEAD_KIND!r}")
    head = ClassifierHead(manifest.labels, hidden_size=manifest.shapes["linear.weight"][1])
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise ArtifactError(f"{directory}: weights do not fit a ClassifierHead: {e}") from e
    return head.to(device).eval()


# --- command line ------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="academus prepare", description=__doc__.split("\n")[0])
    p.add_argument("--artifacts", type=Path, default=None,
                   help=f"output directory (ACADEMUS_ARTIFACTS; default {default_artifacts_dir()})")
    p.add_argument("--data", type=Path, default=None, help="dataset packages (ACADEMUS_DATA_DIR)")
    p.add_argument("--task", action="append", choices=TASKS, help="repeatable; default: all")
    p.add_argument("--force", action="store_true", help="retrain heads that already exist")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--limit", type=int, default=None, help="at most N examples a split (quick runs)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs prepare; progress on stderr, the JSON summary as the last line of stdout."""
    offline_hub()
    args = _parser().parse_args(argv)
    try:
        summary = prepare(args.artifacts or default_artifacts_dir(), args.data, tuple(args.task or TASKS),
                          force=args.force, batch_size=args.batch_size, device=args.device, limit=args.limit)
    except (DataMissing, ArtifactError) as e:
        log_progress(f"error: {e}")
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
