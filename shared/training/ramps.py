"""`academus ramps train --task sentiment|spam [--quick]`: exit ramps for a served classifier (Apparate §3.1);
`--model NAME [--data F.jsonl | --task T]` for a user's: a head trained on a user's model, or a user's sequence
classifier.

For every candidate layer k (1 .. N-1 of the teacher) a ramp pools layer k's output as the model pools its
last layer's and applies a linear head like the served one. The backbone is frozen; each ramp is fitted
(softmax regression on the model's probabilities, L-BFGS, weight decay chosen on validation) on the bootstrap
share of the training split (10 %, as the paper bootstraps; a fixed pseudo-random share, since the data files
are ordered by class) to agree with the *model's own* answer, not the gold label: accuracy here is agreement
with the unmodified model. Then, on the validation split:

- the ramp's agreement; its measured cost (pooling and head on a typical batch, as a share of the whole
  model's forward) and the saving of a release there (the share of the forward left after layer k);
- the thresholds the baselines tune once: per-ramp confidence thresholds (the same tuner Apparate runs
  online) and DeeBERT's one entropy threshold, both at the agreement constraint.

A user's model is fitted on texts of its own (`--data`: lines `{"text"}`, a label when there not read; the train
split by text hash, as `heads train` splits a file, all of it the bootstrap, since a user's file is small) or of a
bundled task (`--task`; a head trained on one: its own by default). Its ramps sit after each of its own layers,
pooled as it pools (a sequence classifier: the first token, unnormalised), and its own head, linear or not,
gives the answers they learn.

The artifact lands in `<artifacts>/ramps/<task or model>/`; workers serving that model load it within a second.
Progress on stderr, the JSON summary as the last line of stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from academus.shared.models.exits import Evidence, ExitSignals, ThresholdTuner, Tuning, tune_entropy_once
from academus.shared.models.model import ClassifierHead, TeacherEncoder, body_inputs, pad_batch, padded_positions
from academus.shared.models.ramps import ExitRamps, load_ramps, ramps_dir, save_ramps
from academus.shared.models.teacher_files import TEACHER_NAME, teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.config import artifacts_dir as default_artifacts_dir
from academus.shared.runtime.config import offline_hub
from academus.shared.state.artifacts import ArtifactError, Manifest
from academus.shared.state.uploads import parse_texts_jsonl
from academus.shared.training.data import TASKS, DataMissing, Example, fetch, file_task, load_task
from academus.shared.training.prepare import (
    EITHER,
    MAX_TOKENS,
    QUICK_WEIGHT_DECAYS,
    WEIGHT_DECAYS,
    fit_head,
    length_batches,
    load_head,
    predict,
    subsample,
)

BOOTSTRAP_SHARE = 0.10     # of the training split, a fixed pseudo-random share (the files are ordered by class)
QUICK_TEXTS = 96           # --quick: texts a split at most
COST_REPEATS = 15          # timed runs of the model that measure the ramps' costs and savings
QUICK_REPEATS = 5          # --quick's: a quick run checks the path, not the figures
CONSTRAINT = 0.99


def log(message: str) -> None:
    print(f"[ramps] {message}", file=sys.stderr, flush=True)


def layer_states(encoder: TeacherEncoder, tokenizer: TeacherTokenizer, texts: Sequence[str],
                 ramps: ExitRamps, batch_size: int = 64) -> torch.Tensor:
    """Every layer's output pooled as the ramps pool it: [n, N + 1, H] (index 0: the embeddings, N: the last
    layer, whose pooling is the served embedding)."""
    encoded = tokenizer.encode(list(texts), truncate=True)
    out: torch.Tensor | None = None
    for batch in length_batches([len(e.input_ids) for e in encoded], batch_size, tokenizer.max_tokens):
        ids, mask, types = pad_batch([encoded[i].input_ids for i in batch], [encoded[i].token_type_ids for i in batch])
        inputs = body_inputs(encoder.architecture, types, padded_positions(encoder.architecture, ids))
        with torch.inference_mode():
            hidden = encoder.body(input_ids=ids, attention_mask=mask, output_hidden_states=True, **inputs).hidden_states
            pooled = torch.stack([ramps.pool(h, mask) for h in hidden], dim=1)
        if out is None:
            out = torch.empty(len(encoded), *pooled.shape[1:])
        out[batch] = pooled.float()
    assert out is not None, "no texts"
    return out


def fit_ramp(x: torch.Tensor, target: torch.Tensor, vx: torch.Tensor, vtarget: torch.Tensor,
             labels: Sequence[str], weight_decays: Sequence[float] = WEIGHT_DECAYS) -> tuple[ClassifierHead, float]:
    """The ramp head fitted to the model's probabilities (soft targets: its confidence then follows the model's,
    which is what a threshold on it needs; hard labels make a head over-confident where the model is unsure),
    its weight decay the one with the least cross-entropy to the model on validation; and its agreement there."""
    best: tuple[float, ClassifierHead] | None = None
    for standardize, wd in itertools.product(EITHER, weight_decays):
        head = fit_head(x, target, labels, wd, standardize=standardize)   # cross-entropy takes probabilities
        with torch.no_grad():
            loss = nn.functional.cross_entropy(head(vx), vtarget).item()
        if best is None or loss < best[0]:
            best = (loss, head)
    assert best is not None
    agreement = (predict(best[1], vx) == vtarget.argmax(1)).float().mean().item()
    return best[1], agreement


def measure_costs(encoder: TeacherEncoder, ramps: ExitRamps, tokenizer: TeacherTokenizer, texts: Sequence[str],
                  batch: int = 8, repeats: int = COST_REPEATS) -> tuple[dict[int, float], dict[int, float], float]:
    """Per ramp layer: its cost and the saving of a release there, as shares of the model's forward on `batch`
    texts of median length; and that forward's time in ms. Medians of `repeats` timed runs."""
    encoded = sorted(tokenizer.encode(list(texts), truncate=True), key=lambda e: len(e.input_ids))
    n = len(encoded[len(encoded) // 2].input_ids)
    ids, mask, types = pad_batch([encoded[len(encoded) // 2].input_ids] * batch)   # the model's own vocabulary
    layers = _layers(encoder)
    stamps: list[float] = []
    hooks = [layer.register_forward_hook(lambda *_: stamps.append(time.perf_counter())) for layer in layers]
    totals, ends = [], []
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                stamps.clear()
                start = time.perf_counter()
                encoder(ids, mask, types)
                total = time.perf_counter() - start
                totals.append(total)
                ends.append([(s - start) / total for s in stamps])
    finally:
        for hook in hooks:
            hook.remove()
    reached = np.median(np.array(ends), axis=0)     # share of the forward done when layer k ends
    hidden = torch.randn(batch, n, ramps.heads[str(ramps.layers[0])].in_features)
    ramp_s = []
    with torch.inference_mode():
        for _ in range(repeats * 10):
            start = time.perf_counter()
            ramps.probs(ramps.layers[0], ramps.pool(hidden, mask)).max(dim=-1)
            ramp_s.append(time.perf_counter() - start)
    total_s = statistics.median(totals)
    cost = statistics.median(ramp_s) / total_s
    return ({k: cost for k in ramps.layers}, {k: float(1.0 - reached[k - 1]) for k in ramps.layers},
            total_s * 1e3)


def _layers(encoder: TeacherEncoder) -> list[torch.nn.Module]:
    return list(encoder.body.encoder.layer)


@dataclass
class Subject:
    """The served classifier the ramps are for: its encoder pooled as served, its head, and its tokenizer."""

    name: str           # the ramps' folder and manifest task: a bundled task, or the user's model
    teacher: str        # the manifest's teacher
    encoder: TeacherEncoder
    head: nn.Module
    tokenizer: TeacherTokenizer
    own_task: str = ""  # the bundled task its head was trained on ("": none)

    @classmethod
    def bundled(cls, artifacts: Path, task: str) -> Subject:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
        return cls(task, TEACHER_NAME, TeacherEncoder.load(), load_head(artifacts, task),
                   TeacherTokenizer(teacher_dir(), max_tokens=MAX_TOKENS), task)

    @classmethod
    def named(cls, artifacts: Path, name: str) -> Subject:
        """A bundled task's classifier when `name` is a task, else a user's."""
        return (cls.bundled if name in TASKS else cls.user)(artifacts, name)

    @classmethod
    def user(cls, artifacts: Path, name: str) -> Subject:
        """A head trained on a user's model (`heads train`), or a user's sequence classifier (`models add`): the
        distillation's teacher of that name, which has a head."""
        from academus.shared.models.user_models import HEAD_ON
        from academus.shared.state.artifacts import read_manifest
        from academus.shared.state.catalogue import CLASSIFICATION, read_catalogue
        from academus.shared.training.distill_data import Teacher

        entry = read_catalogue(artifacts).get(name, {})
        if entry.get("kind") != CLASSIFICATION or not (HEAD_ON in entry or "source" in entry):
            raise ValueError(f"--model {name!r} is neither a head trained on a user's model (`academus heads train`) "
                             "nor a sequence classifier added with `academus models add`")
        teacher = Teacher.user(artifacts, name)
        own_task = read_manifest(Path(artifacts) / entry["head"]).task if HEAD_ON in entry else ""
        return cls(name, teacher.model, teacher.encoder, teacher.head, teacher.tokenizer,
                   own_task if own_task in TASKS else "")


def ramp_texts(subject: Subject, task: str, data_dir: Path | None, data_file: Path | None
               ) -> tuple[list[Example], list[Example], str]:
    """(bootstrap, validation, where they came from): the file's, else the task's (the subject's own by
    default). A file's train split is all bootstrap: a user's file is small."""
    if data_file is not None:
        split = file_task(str(data_file), parse_texts_jsonl(Path(data_file).read_bytes(), str(data_file)))
        return split.train, split.validation, str(data_file)
    task = task or subject.own_task
    if not task:
        raise ValueError(f"--model {subject.name!r} has no bundled task of its own: give its texts (--data F.jsonl) "
                         f"or a bundled task's (--task {'|'.join(TASKS)})")
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    data = load_task(task, fetch(data_dir))
    bootstrap = subsample(data.train, max(1, round(len(data.train) * BOOTSTRAP_SHARE)))
    return bootstrap, data.validation, f"{task} ({BOOTSTRAP_SHARE:.0%} of train)"


def train_ramps(artifacts: Path, task: str = "", data_dir: Path | None = None, quick: bool = False,
                model: str = "", data_file: Path | None = None) -> dict[str, Any]:
    """Trains, measures and writes the ramps of `task`'s classifier on the teacher, or of a user's `model` (on
    `data_file`'s texts, or `task`'s); returns the summary."""
    if data_file is not None and not model:
        raise ValueError("--data gives a user's model its texts: give --model too")
    started = time.perf_counter()
    subject = Subject.user(artifacts, model) if model else Subject.bundled(artifacts, task)
    encoder, head, tokenizer = subject.encoder, subject.head, subject.tokenizer
    depth = len(_layers(encoder))
    ramps = ExitRamps(range(1, depth), encoder.architecture.hidden_size, head.labels, encoder.pooling,
                      encoder.normalize)
    bootstrap, validation, origin = ramp_texts(subject, task, data_dir, data_file)
    if quick:
        bootstrap, validation = subsample(bootstrap, QUICK_TEXTS), subsample(validation, QUICK_TEXTS)
    log(f"{subject.name}: {len(bootstrap)} bootstrap texts from {origin}, "
        f"{len(validation)} validation texts, ramps at layers {list(ramps.layers)} of {depth}")
    states = layer_states(encoder, tokenizer, [e.text for e in bootstrap], ramps)
    vstates = layer_states(encoder, tokenizer, [e.text for e in validation], ramps)
    with torch.no_grad():
        target, vtarget = (torch.softmax(head(x[:, depth]), dim=-1) for x in (states, vstates))
    agreement: dict[str, float] = {}
    for k in ramps.layers:
        fitted, agreement[str(k)] = fit_ramp(states[:, k], target, vstates[:, k], vtarget, head.labels,
                                             QUICK_WEIGHT_DECAYS if quick else WEIGHT_DECAYS)
        ramps.heads[str(k)].load_state_dict(fitted.linear.state_dict())
        log(f"{subject.name}: ramp after layer {k}: agreement {agreement[str(k)]:.4f} on validation")
    costs, savings, model_ms = measure_costs(encoder, ramps, tokenizer, [e.text for e in validation],
                                             repeats=QUICK_REPEATS if quick else COST_REPEATS)
    tuned_once, evidence = tune_once(ramps, vstates, vtarget.argmax(1).numpy(), savings)
    summary = {"task": subject.name, "layers": list(ramps.layers), "bootstrap_texts": len(bootstrap),
               "validation_texts": len(validation), "agreement": agreement,
               "cost": {str(k): round(v, 5) for k, v in costs.items()},
               "saving": {str(k): round(v, 4) for k, v in savings.items()}, "model_ms": round(model_ms, 3),
               "tuned_once": tuned_once, "quick": quick}
    directory = ramps_dir(artifacts, subject.name)
    save_ramps(directory, ramps, teacher=subject.teacher, task=subject.name, metrics={"agreement": agreement},
               evidence=evidence, extra={"cost": summary["cost"], "saving": summary["saving"],
                                         "model_ms": summary["model_ms"], "tuned_once": tuned_once,
                                         "constraint": CONSTRAINT})
    summary |= {"artifact": str(directory), "seconds": round(time.perf_counter() - started, 2)}
    log(f"{subject.name}: wrote {directory} in {summary['seconds']} s")
    return summary


def ramps_pass(artifacts: Path, subject: Subject, texts: Sequence[str]
               ) -> tuple[ExitRamps, Manifest, torch.Tensor, np.ndarray]:
    """The subject's ramps (their artifact) over `texts`: the ramps and their manifest, every layer's states pooled
    as the ramps pool them, and the model's answers."""
    ramps, manifest = load_ramps(ramps_dir(artifacts, subject.name), subject.encoder.architecture.hidden_size,
                                 list(subject.head.labels))
    states = layer_states(subject.encoder, subject.tokenizer, texts, ramps)
    with torch.no_grad():
        final = subject.head(states[:, -1]).argmax(1).numpy()
    return ramps, manifest, states, final


def ramp_signals(ramps: ExitRamps, states: torch.Tensor, layers: Sequence[int] | None = None) -> ExitSignals:
    """The ramps' signals on pooled layer states [n, N + 1, H]."""
    with torch.inference_mode():
        probs = [ramps.probs(k, states[:, k]).numpy() for k in (layers or ramps.layers)]
    return ExitSignals.from_probs(probs)


def hindsight_tuning(ramps: ExitRamps, states: torch.Tensor, final: np.ndarray, savings: dict[int, float]
                     ) -> tuple[ExitSignals, np.ndarray, Tuning]:
    """The ramps' signals on pooled layer states, whether each ramp's answer is the model's `final` one [n, R], and
    per-ramp thresholds tuned once on them at the constraint (`savings`: of a release at each ramp)."""
    signals = ramp_signals(ramps, states)
    agree = signals.preds == final[:, None]
    return signals, agree, ThresholdTuner(CONSTRAINT).tune(signals.conf, agree, [savings[k] for k in ramps.layers])


def tune_once(ramps: ExitRamps, vstates: torch.Tensor, final: np.ndarray, savings: dict[int, float]
              ) -> tuple[dict, Evidence]:
    """The baselines' thresholds, tuned once on validation at the constraint; and the ramps' signals there, the
    evidence the adaptive controller starts from."""
    signals, agree, static = hindsight_tuning(ramps, vstates, final, savings)
    entropy = tune_entropy_once(signals.entropy, agree, CONSTRAINT)
    return ({"static": {str(k): round(t, 6) for k, t in zip(ramps.layers, static.thresholds, strict=True)},
             "deebert_entropy": round(entropy, 6)}, Evidence(signals.conf, agree))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="academus ramps", description="Early-exit ramps (Apparate).")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train exit ramps for a served classifier: a bundled task's, or a user's")
    t.add_argument("--task", default="", choices=["", *TASKS],
                   help="a bundled task: its classifier on the teacher; with --model, the texts to fit on")
    t.add_argument("--model", default="", help="a head trained on a user's model, or a user's sequence classifier")
    t.add_argument("--data", type=Path, default=None, help='with --model: its texts, JSON lines {"text": ...}')
    t.add_argument("--quick", action="store_true", help=f"at most {QUICK_TEXTS} texts a split, one weight decay a ramp")
    t.add_argument("--artifacts", type=Path, default=None)
    t.add_argument("--data-dir", type=Path, default=None, help="dataset packages (ACADEMUS_DATA_DIR)")
    return p


def main(argv: list[str] | None = None) -> int:
    offline_hub()
    args = _parser().parse_args(argv)
    torch.manual_seed(0)
    if not (args.task or args.model):
        log("error: give --task (a bundled task's classifier) or --model (a user's)")
        return 2
    try:
        summary = train_ramps(args.artifacts or default_artifacts_dir(), args.task, args.data_dir, args.quick,
                              args.model, args.data)
    except (DataMissing, ArtifactError, ValueError, OSError) as e:
        log(f"error: {e}")
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
