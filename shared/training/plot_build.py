"""`academus plot build`: run a model's lower K layers on every n-gram of a corpus into a PLOT table.

The model (`--model`) is the bundled teacher (`minilm`) or an embedding model the user added with `academus
models add` (BERT, RoBERTa or MPNet): its own tokenizer, framing tokens, position numbering and relative-position
bias, so the table holds what its own forward computes. The manifest records the model and, for a user's model,
its weights' digest (`teacher`): a worker refuses a table built on weights it does not serve.

Framing. A fragment is run as the shortest input the model was trained on that contains it (the
tokenizer's own framing tokens: [CLS] / [SEP] for BERT, <s> / </s> for RoBERTa and MPNet):
[CLS] is put in front unless the fragment starts with [CLS], [SEP] behind unless it ends with [SEP],
and the fragment's own tokens are stored (positions 1..n, or 0..n-1 for a leading [CLS]). Served
token ids are always [CLS] ... [SEP] framed by the tokenizer, so the first and last windows of a
text are run exactly where they sit in the text, a text of one word-piece ([CLS] w [SEP]) is run
exactly as the full model runs it (the table is exact there), and the attention of every inner
fragment still has the [CLS] / [SEP] tokens that BERT's heads lean on (a bare three-token input,
never seen in pre-training, gives states further from the in-context ones: on 60 WordNet glosses
the mean cosine of aggregated to in-context layer-K states is 0.94 / 0.90 / 0.86 for K = 1 / 2 / 3
framed, 0.85 / 0.82 / 0.77 bare). The framing tokens' own states are dropped: they belong to the
fragment's context, not to the text.

Root version: every distinct trigram of the corpus (or the `--max-entries` most frequent), every
distinct bigram, and unigrams for the whole vocabulary (`--unigrams vocab`, the default: no valid id
is ever out of the table) or only the corpus' tokens plus the specials (`corpus`, for small tests).
Domain overlay (`--domain D`, HMI §5.1): the top `--top-percent` of the domain corpus' distinct
trigrams by frequency; ties are broken by key so a rebuild gives the same table.

Window size (`--ngram`, HMI §7.10 Table 8; recorded as the manifest's `ngram`): 3 as above, or 2:
the windows are bigrams, so a root holds every distinct bigram (or the `--max-entries` most frequent)
and the unigrams, no trigram is run, and an overlay holds the domain's top bigrams. An overlay must
have its root's n (`--ngram` defaults to it for an overlay, to 3 for a root).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.plot.ngrams import pack, unpack, window_starts, windows
from academus.shared.models.plot.store import DOMAINS_DIR
from academus.shared.models.plot.table import (
    GRAMS,
    ROOT,
    WINDOW_TABLES,
    PlotError,
    PlotManifest,
    TableError,
    VersionWriter,
    read_manifest,
)
from academus.shared.models.user_models import BUNDLED_BASE, EncoderBase
from academus.shared.runtime.config import artifacts_dir, offline_hub, use_artifacts
from academus.shared.training.data import TASKS, DataMissing, data_dir, load_task
from academus.shared.training.plot_models import plot_base

GENERAL_CORPORA = ("general", "sotu", "wordnet")


@dataclass(frozen=True)
class Specials:
    cls: int
    sep: int
    unk: int
    pad: int

    def as_dict(self) -> dict[str, int]:
        return {"cls": self.cls, "sep": self.sep, "unk": self.unk, "pad": self.pad}


@dataclass(frozen=True)
class Tokenized:
    ids: np.ndarray                # every text's [CLS] ... [SEP] ids, back to back
    lengths: np.ndarray
    vocab_size: int
    specials: Specials


def default_out(model: str, lower_layers: int, ngram: int = 3) -> Path:
    """<artifacts>/plot/<model>-k<K> (trigram windows) or <model>-k<K>-n<n>."""
    return artifacts_dir() / "plot" / (f"{model}-k{lower_layers}" + (f"-n{ngram}" if ngram != 3 else ""))


def corpus_texts(spec: str, data: Path | None = None, limit: int | None = None) -> list[str]:
    """A text file (one text a line; .jsonl: its "text" fields), a task's train split, or general English;
    several joined by commas (`spam,general`), `limit` texts from each."""
    if not Path(spec).is_file() and "," in spec:
        return [t for part in spec.split(",") if part for t in corpus_texts(part, data, limit)]
    path = Path(spec)
    if path.is_file():
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        texts = [json.loads(line)["text"] for line in lines] if path.suffix == ".jsonl" else lines
    elif spec in TASKS:
        texts = [e.text for e in load_task(spec, data).train]
    elif spec in GENERAL_CORPORA:
        texts = _general(spec, Path(data or data_dir()))
    else:
        raise PlotError(f"--corpus {spec!r} is neither a file nor one of {', '.join((*TASKS, *GENERAL_CORPORA))}")
    return texts[:limit] if limit else texts


def _general(spec: str, directory: Path) -> list[str]:
    from academus.shared.training.corpus import fetch_general, sotu_sentences, wordnet_texts

    sotu_pkg, wordnet_pkg = fetch_general(directory)
    sotu = sotu_sentences(sotu_pkg) if spec != "wordnet" else []
    wordnet = wordnet_texts(wordnet_pkg) if spec != "sotu" else []
    return sotu + wordnet


def tokenize(texts: list[str], base: EncoderBase | None = None, pad: int = 0, chunk: int = 2048) -> Tokenized:
    """Every text as the base's tokenizer frames it (the bundled teacher's by default); `pad`: its model's
    padding id."""
    base = base or EncoderBase.bundled()
    tokenizer = base.tokenizer()
    ids: list[int] = []
    lengths: list[int] = []
    for start in tqdm(range(0, len(texts), chunk), desc="tokenizing", unit="chunk", file=sys.stderr, leave=False):
        for encoded in tokenizer.encode(texts[start:start + chunk]):
            ids.extend(encoded.input_ids)
            lengths.append(len(encoded.input_ids))
    vocab = Tokenizer.from_file(str(base.directory / "tokenizer.json"))
    vocab.no_padding()   # a file's fixed padding would end every framed text in [PAD]
    return Tokenized(np.asarray(ids, np.int64), np.asarray(lengths, np.int64), vocab.get_vocab_size(),
                     specials_of(vocab, pad, base.directory / "tokenizer.json"))


def specials_of(vocab: Tokenizer, pad: int, source: Path) -> Specials:
    """The framing tokens the tokenizer puts around a text ([CLS] ... [SEP], <s> ... </s>), its unknown token
    (the lookup's fallback for an id the table lacks) and the model's padding id."""
    framed = vocab.encode("").ids
    if len(framed) < 2:
        raise PlotError(f"{source} puts no framing tokens around a text (its post-processor gives {framed}): "
                        "a PLOT table frames its fragments as the model's texts are framed")
    unknown = [getattr(vocab.model, "unk_token", None), "[UNK]", "<unk>"]
    unk = next((i for t in unknown if t and (i := vocab.token_to_id(t)) is not None), None)
    if unk is None:
        raise PlotError(f"{source} has no unknown token ([UNK] or <unk>): the lookup would have no fallback")
    return Specials(framed[0], framed[-1], unk, pad)


def count_ngrams(tokens: Tokenized, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct keys of the corpus' n-grams and how often each occurs."""
    keys = pack(windows(tokens.ids, window_starts(tokens.lengths, n), n))
    return np.unique(keys, return_counts=True)


def most_frequent(keys: np.ndarray, counts: np.ndarray, keep: int) -> tuple[np.ndarray, float]:
    """The `keep` most frequent keys (sorted again for the index) and the share of occurrences they cover."""
    order = np.lexsort((keys, -counts))[:keep]
    coverage = float(counts[order].sum() / max(int(counts.sum()), 1))
    return np.sort(keys[order]), coverage


def encode_ngrams(layers: SplitBert, grams: np.ndarray, specials: Specials, out: np.ndarray,
                  batch_size: int = 256, desc: str = "") -> None:
    """Fills `out[i]` (n, hidden) with the layer-K states of fragment `grams[i]`, framed as documented above."""
    n = grams.shape[1]
    need_cls, need_sep = grams[:, 0] != specials.cls, grams[:, -1] != specials.sep
    groups = [np.flatnonzero((need_cls == c) & (need_sep == s)) for c in (False, True) for s in (False, True)]
    with tqdm(total=len(grams), desc=desc, unit="gram", file=sys.stderr, leave=False) as bar:
        for rows in groups:
            if not len(rows):
                continue
            front, back = bool(need_cls[rows[0]]), bool(need_sep[rows[0]])
            for start in range(0, len(rows), batch_size):
                batch = rows[start:start + batch_size]
                framed = _frame(grams[batch], specials, front, back)
                states = layers.lower(torch.from_numpy(framed))[:, int(front):int(front) + n]
                out[batch] = states.to(torch.float16).numpy()
                bar.update(len(batch))


def _frame(grams: np.ndarray, specials: Specials, front: bool, back: bool) -> np.ndarray:
    columns = [np.full((len(grams), 1), specials.cls)] if front else []
    columns.append(grams)
    if back:
        columns.append(np.full((len(grams), 1), specials.sep))
    return np.concatenate(columns, axis=1).astype(np.int64)


def unigram_keys(tokens: Tokenized, mode: str) -> np.ndarray:
    if mode == "vocab":
        return np.arange(tokens.vocab_size, dtype=np.uint64)
    if mode != "corpus":
        raise PlotError(f"--unigrams {mode!r} must be 'vocab' or 'corpus'")
    specials = np.asarray(list(tokens.specials.as_dict().values()), np.int64)
    return np.unique(np.concatenate([tokens.ids, specials])).astype(np.uint64)


def _write_table(writer: VersionWriter, name: str, keys: np.ndarray, layers: SplitBert,
                 tokens: Tokenized, batch_size: int) -> None:
    states = writer.table(name, keys, layers.hidden)
    encode_ngrams(layers, unpack(keys, GRAMS[name]), tokens.specials, states, batch_size, desc=name)
    states.flush()
    del states


@dataclass(frozen=True)
class BuildOptions:
    model: str = "minilm"
    lower_layers: int = 3
    domain: str = ""               # empty: the root version
    top_percent: float = 10.0      # overlays only
    max_entries: int = 0           # root windows (trigrams, or bigrams for ngram=2); 0: all
    max_bigrams: int = 0           # root bigrams (the back-off of ngram=3), the most frequent; 0: all
    unigrams: str = "vocab"
    batch_size: int = 256
    ngram: int = 3                 # window size n: 3 (trigrams) or 2 (bigrams); an overlay's must be its root's


def build(texts: list[str], out: Path, options: BuildOptions, layers: SplitBert | None = None,
          corpus: dict | None = None) -> dict:
    """Builds the root version (or a domain overlay) under `out`; returns the JSON summary."""
    started = time.perf_counter()
    base = plot_base(options.model)
    if options.ngram not in WINDOW_TABLES:
        raise PlotError(f"--ngram {options.ngram!r} must be one of {sorted(WINDOW_TABLES)}")
    if options.ngram == 2 and options.max_bigrams:
        raise PlotError("--max-bigrams limits the back-off of trigram tables; with --ngram 2 the bigrams are "
                        "the windows: use --max-entries")
    if options.domain:
        _check_root_for_overlay(Path(out), options)
    layers = layers or SplitBert(base.encoder(), options.lower_layers)
    if layers.lower_layers != options.lower_layers:
        raise PlotError(f"the encoder runs {layers.lower_layers} lower layers, the options say {options.lower_layers}")
    tokens = tokenize(texts, base, int(layers.bert.config.pad_token_id or 0))
    target = Path(out) / (DOMAINS_DIR + "/" + options.domain if options.domain else ROOT)
    writer = VersionWriter(target)
    try:
        coverage = _fill(writer, tokens, layers, options)
        manifest = writer.publish(
            model=options.model, teacher=base.identity(), lower_layers=options.lower_layers,
            hidden=layers.hidden, vocab_size=tokens.vocab_size, special_ids=tokens.specials.as_dict(),
            version=options.domain or ROOT, created=datetime.now(UTC).isoformat(timespec="seconds"),
            build_s=round(time.perf_counter() - started, 2),
            top_percent=options.top_percent if options.domain else 100.0, ngram=options.ngram,
            corpus={**(corpus or {}), "texts": len(texts), "tokens": len(tokens.ids),
                    coverage_key(options.ngram): round(coverage, 4)},
        )
    except BaseException:
        writer.discard()
        raise
    return _summary(target, manifest)


def coverage_key(ngram: int) -> str:
    """The manifest's corpus field with the share of the corpus' n-gram occurrences the windows' table holds."""
    return f"{WINDOW_TABLES[ngram]}_coverage"


def _fill(writer: VersionWriter, tokens: Tokenized, layers: SplitBert, options: BuildOptions) -> float:
    """Writes the version's tables; returns the share of the corpus' n-gram occurrences the windows hold."""
    keys, counts = count_ngrams(tokens, options.ngram)
    top_share = math.ceil(len(keys) * options.top_percent / 100)
    keep = top_share if options.domain else options.max_entries or len(keys)
    grams, coverage = most_frequent(keys, counts, min(keep, len(keys)))
    _write_table(writer, WINDOW_TABLES[options.ngram], grams, layers, tokens, options.batch_size)
    if not options.domain and options.ngram == 3:
        bigrams, bigram_counts = count_ngrams(tokens, 2)
        keep = min(options.max_bigrams or len(bigrams), len(bigrams))
        _write_table(writer, "bigram", most_frequent(bigrams, bigram_counts, keep)[0], layers, tokens,
                     options.batch_size)
    if not options.domain:
        _write_table(writer, "unigram", unigram_keys(tokens, options.unigrams), layers, tokens, options.batch_size)
    return coverage


def _check_root_for_overlay(out: Path, options: BuildOptions) -> None:
    root = read_manifest(out / ROOT)
    if (root.model, root.lower_layers) != (options.model, options.lower_layers):
        raise PlotError(f"the root at {out / ROOT} is {root.model} K={root.lower_layers}; an overlay for "
                        f"{options.model} K={options.lower_layers} cannot extend it")
    if root.ngram != options.ngram:
        raise TableError(f"the root at {out / ROOT} holds {root.ngram}-gram windows; an overlay of "
                         f"{options.ngram}-grams cannot extend it (build it with --ngram {root.ngram})")


def _summary(target: Path, manifest: PlotManifest) -> dict:
    size = sum((target / name).stat().st_size for name in manifest.files)
    return {"version": manifest.version, "out": str(target), "model": manifest.model,
            "lower_layers": manifest.lower_layers, "ngram": manifest.ngram, "entries": manifest.counts, "bytes": size,
            "build_s": manifest.build_s, **manifest.corpus}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="academus plot", description="PLOT tables: precomputed lower-layer states")
    sub = p.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="build the root table or a domain overlay")
    b.add_argument("--model", default=BUNDLED_BASE, help=f"the model whose lower layers are tabled: {BUNDLED_BASE} "
                   "(default) or an embedding model added with `academus models add`")
    b.add_argument("--lower-layers", type=int, default=3, help="K: layers replaced by the table (default 3 of 6)")
    b.add_argument("--corpus", required=True, help="a text file (one text a line, or .jsonl), "
                   f"a task ({', '.join(TASKS)}: its train split) or {', '.join(GENERAL_CORPORA)}; "
                   "several joined by commas")
    b.add_argument("--limit", type=int, default=0, help="use only the first N texts of each corpus")
    b.add_argument("--domain", default="", help="build this domain's overlay instead of the root")
    b.add_argument("--ngram", type=int, choices=sorted(WINDOW_TABLES), default=None,
                   help="n: window size, 3 (trigrams, bigram/unigram back-off) or 2 (bigrams, unigram back-off); "
                   "default 3 for a root, the root's n for an overlay")
    b.add_argument("--top-percent", type=float, default=10.0, help="overlay: share of distinct n-grams kept")
    b.add_argument("--max-entries", type=int, default=0,
                   help="root: keep the N most frequent windows (trigrams; bigrams with --ngram 2) (0: all)")
    b.add_argument("--max-bigrams", type=int, default=0,
                   help="root, --ngram 3: keep the N most frequent back-off bigrams (0: all)")
    b.add_argument("--unigrams", choices=["vocab", "corpus"], default="vocab")
    b.add_argument("--batch-size", type=int, default=256)
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    b.add_argument("--data", type=Path, default=None, help="data directory (ACADEMUS_DATA_DIR)")
    b.add_argument("--out", type=Path, default=None,
                   help="table directory (default artifacts/plot/<model>-k<K>, <model>-k<K>-n2 for --ngram 2)")
    b.add_argument("--artifacts", type=Path, default=None, help="artifacts to build into and register in "
                   "(default ACADEMUS_ARTIFACTS; `academus plot` on a running mesh: the mesh's)")
    i = sub.add_parser("info", help="print the manifests of a table directory")
    i.add_argument("--out", type=Path, required=True)
    h = sub.add_parser("head", help="train <task>-plot: a linear head on the hierarchical model (PLOT lower "
                       "layers + teacher upper layers), scored against the teacher's head; registers it")
    h.add_argument("--task", required=True, choices=TASKS)
    h.add_argument("--plot", type=Path, default=None, help="table directory (default artifacts/plot/minilm-k3)")
    h.add_argument("--domain", default="", help="look up in this overlay first (and serve with it)")
    h.add_argument("--name", default="", help="served name (default <task>-plot)")
    h.add_argument("--limit", type=int, default=0, help="use only N examples of each split (quick runs)")
    h.add_argument("--batch-size", type=int, default=64)
    h.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    h.add_argument("--data", type=Path, default=None, help="data directory (ACADEMUS_DATA_DIR)")
    h.add_argument("--artifacts", type=Path, default=None, help="artifacts holding the table and the head's entry "
                   "(default ACADEMUS_ARTIFACTS; `academus plot` on a running mesh: the mesh's)")
    return p


def _options(args: argparse.Namespace, out: Path) -> BuildOptions:
    if not 0 < args.top_percent <= 100:
        raise PlotError(f"--top-percent {args.top_percent} must be in (0, 100]")
    ngram = args.ngram or (read_manifest(out / ROOT).ngram if args.domain else 3)
    return BuildOptions(args.model, args.lower_layers, args.domain, args.top_percent, args.max_entries,
                        args.max_bigrams, args.unigrams, args.batch_size, ngram)


def _info(out: Path) -> dict:
    from academus.shared.models.plot.store import available_domains

    versions = [out / ROOT, *(out / DOMAINS_DIR / d for d in available_domains(out))]
    return {str(v.relative_to(out)): json.loads(read_manifest(v).to_json()) for v in versions}


def _build(args: argparse.Namespace) -> dict:
    """Builds; a root table under the artifacts is registered as `minilm-plot` in models.json."""
    from academus.shared.training.plot_models import register_embedding

    out = args.out or default_out(args.model, args.lower_layers, args.ngram or 3)
    options = _options(args, out)
    texts = corpus_texts(args.corpus, args.data, args.limit or None)
    summary = build(texts, out, options, corpus={"source": args.corpus})
    if not options.domain:
        summary["registered"] = register_embedding(artifacts_dir(), out)
    return summary


def _head(args: argparse.Namespace) -> dict:
    from academus.shared.training.plot_models import train_plot_head

    table = args.plot or default_out("minilm", 3)
    return train_plot_head(artifacts_dir(), args.task, table, domain=args.domain, name=args.name, data=args.data,
                           limit=args.limit or None, batch_size=args.batch_size)


def main(argv: list[str] | None = None) -> int:
    """Progress bars on stderr; the JSON summary is the last line of stdout."""
    offline_hub()
    args = _parser().parse_args(argv)
    if getattr(args, "artifacts", None):
        use_artifacts(args.artifacts)
    try:
        if args.action == "info":
            summary = _info(args.out)
        else:
            torch.set_num_threads(args.threads or os.cpu_count() or 1)
            summary = _head(args) if args.action == "head" else _build(args)
    except (PlotError, DataMissing, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
