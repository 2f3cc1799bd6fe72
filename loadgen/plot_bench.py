"""PLOT benchmark: table size and build time, lookup latency against computing the lower K layers,
and the quality of `minilm-plot` against the teacher on held-out text of other domains.

    python -m academus.loadgen.plot_bench [--root-texts 2000] [--domain-texts 1000] [--layers 1 2 3]
                                          [--ngrams 2 3] [--top-percents 0.4 5 100]
                                          [--tokens 16 64 128] [--batches 1 32] [--grpc] [--out DIR]

For every K in --layers and n in --ngrams (HMI Tables 8 / 10) a root table is built from State of
the Union sentences (`minilm-k<K>`, `minilm-k<K>-n<n>` for n other than 3) and a `spam` overlay
from the spam task's train split (top --top-percent of its n-grams); quality is measured on WordNet
glosses (a domain the root never saw) and on spam test mails with and without the overlay, and, as
the ceiling, with a table built on the WordNet eval texts themselves (every window found: the
approximation alone). --top-percents builds further spam overlays (`spam-top<p>`) on the last K's
tables, one a top-p and n: entries, size, build time, coverage of the domain corpus and the spam
test cosine with each (HMI §7.7 Table 5). Latency inputs are real held-out token ids cut to exactly
N tokens ([CLS] ... [SEP]). Prints one JSON object, last; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from academus.shared.models.model import TeacherEncoder, pad_batch
from academus.shared.models.plot.hierarchical import HierarchicalEncoder
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.plot.store import PlotStore
from academus.shared.models.plot.table import PlotVersion
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.training.data import load_task
from academus.shared.training.plot_build import BuildOptions, build, corpus_texts, coverage_key


def p50_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(float(np.median(times)), 3)


def table_name(k: int, n: int) -> str:
    """minilm-k<K> for trigram windows (the name earlier runs used), minilm-k<K>-n<n> otherwise."""
    return f"minilm-k{k}" if n == 3 else f"minilm-k{k}-n{n}"


def _built(table: Path, version: str = "root") -> bool:
    return (table / version / "manifest.json").exists()


def build_tables(out: Path, k: int, n: int, root: list[str], domain: list[str], layers: SplitBert, top: float,
                 reuse: bool) -> dict:
    table = out / table_name(k, n)
    if not (reuse and _built(table) and _built(table, "domains/spam")):
        build(root, table, BuildOptions(lower_layers=k, ngram=n), layers=layers, corpus={"source": "sotu"})
        build(domain, table, BuildOptions(lower_layers=k, domain="spam", top_percent=top, ngram=n), layers=layers,
              corpus={"source": "spam"})
    store = PlotStore.open(table, lower_layers=k, ngram=n, domains=["spam"], verify=False)
    return {"root": _size(store.root), "spam_overlay": _size(store.domains["spam"])}


def _size(version: PlotVersion) -> dict:
    m = version.manifest
    return {"entries": m.counts, "mb": round(version.nbytes / 2**20, 2), "build_s": m.build_s,
            coverage_key(m.ngram): m.corpus.get(coverage_key(m.ngram))}


def teacher_embeddings(teacher: TeacherEncoder, seqs: list[list[int]], batch: int = 64) -> torch.Tensor:
    """The teacher's pooled embeddings: the reference every table's cosine is taken against."""
    with torch.inference_mode():
        return torch.cat([teacher(*pad_batch(seqs[i:i + batch])[:2]) for i in range(0, len(seqs), batch)])


def cosine_to_teacher(encoder: HierarchicalEncoder, reference: torch.Tensor, seqs: list[list[int]],
                      domain: str = "", batch: int = 64) -> dict:
    """minilm-plot's cosine to the teacher's embeddings `reference` (one row a sequence)."""
    cosines, counts = [], np.zeros(3)
    for start in range(0, len(seqs), batch):
        chunk = seqs[start:start + batch]
        flat, lengths = np.concatenate(chunk), np.array([len(s) for s in chunk])
        lookup = encoder.store.lookup(flat, lengths, domain)
        cosines.append((encoder.pool_states(lookup.states, lookup.lengths) * reference[start:start + batch]).sum(1))
        c = lookup.counts
        counts += (c.domain, c.root, c.backoff)
    cos = torch.cat(cosines)
    hit = counts / max(counts.sum(), 1)
    return {"mean_cosine": round(cos.mean().item(), 4), "min_cosine": round(cos.min().item(), 4), "texts": len(seqs),
            "windows_domain": round(hit[0], 3), "windows_root": round(hit[1], 3), "windows_backoff": round(hit[2], 3)}


def inputs_of(stream: np.ndarray, tokens: int, batch: int, cls: int = 101, sep: int = 102) -> list[np.ndarray]:
    """`batch` sequences of exactly `tokens` ids cut from a stream of held-out word pieces (reused if short)."""
    body = tokens - 2
    pieces = np.resize(stream, body * batch).reshape(batch, body)
    return [np.concatenate([[cls], row, [sep]]) for row in pieces]


def latency(store: PlotStore, layers: SplitBert, encoder: HierarchicalEncoder, teacher: TeacherEncoder,
            stream: np.ndarray, tokens: int, batch: int, repeats: int, teacher_ms: dict | None = None) -> dict:
    """p50s of one shape; `teacher_ms` caches the teacher's (it depends on neither K nor n) by shape."""
    seqs = inputs_of(stream, tokens, batch)
    flat, lengths = np.concatenate(seqs), np.full(batch, tokens)
    ids = torch.as_tensor(np.stack(seqs))
    mask = torch.ones_like(ids)
    cache = {} if teacher_ms is None else teacher_ms
    with torch.inference_mode():
        row = {
            "tokens": tokens, "batch": batch,
            "lookup_ms": p50_ms(lambda: store.lookup(flat, lengths), repeats),
            "lower_layers_ms": p50_ms(lambda: layers.lower(ids, mask), repeats),
            "minilm_plot_ms": p50_ms(lambda: encoder.pool([s.tolist() for s in seqs]), repeats),
        }
        if (tokens, batch) not in cache:
            cache[(tokens, batch)] = p50_ms(lambda: teacher(ids, mask), repeats)
    row["teacher_ms"] = cache[(tokens, batch)]
    row["lower_speedup"] = round(row["lower_layers_ms"] / max(row["lookup_ms"], 1e-9), 1)
    return row


def top_percent_sweep(out: Path, k: int, n: int, domain: list[str], layers: SplitBert, teacher: TeacherEncoder,
                      reference: torch.Tensor, seqs: list[list[int]], percents: list[float], reuse: bool) -> dict:
    """A spam overlay of the top p % of the domain's n-grams for each p, on the K, n table: its size,
    build time, coverage of the domain corpus, and minilm-plot's spam test cosine with it."""
    table = out / table_name(k, n)
    rows = {}
    for percent in percents:
        name = f"spam-top{percent:g}"
        if not (reuse and _built(table, f"domains/{name}")):
            build(domain, table, BuildOptions(lower_layers=k, domain=name, top_percent=percent, ngram=n),
                  layers=layers, corpus={"source": "spam"})
        store = PlotStore.open(table, lower_layers=k, ngram=n, domains=[name], verify=False)
        overlay = store.domains[name]
        rows[f"{percent:g}"] = {
            "domain": name, **_size(overlay), "windows": overlay.manifest.counts[store.window_table],
            "spam_test": cosine_to_teacher(HierarchicalEncoder(store, teacher), reference, seqs, name)}
        _log(json.dumps({f"top-p K={k} n={n}": {f"{percent:g}": rows[f"{percent:g}"]}}))
    return rows


async def grpc_latency(table: Path, k: int, stream: np.ndarray, shapes: list[tuple[int, int]], repeats: int) -> list:
    """Lookup RPC p50 over loopback, the service in this process (it shares the CPU with the client)."""
    import grpc

    from academus.services.plot.server import build as plot_build
    from academus.shared.cli.redis_server import RedisServer
    from academus.shared.models.plot.wire import lookup_from_pb, request_to_pb
    from academus.shared.runtime.serving import CHANNEL_OPTIONS, RunningService
    from academus.v1 import plot_pb2_grpc

    redis = RedisServer(Path(tempfile.mkdtemp(prefix="plot-bench-redis-"))).start()  # the service registers there
    os.environ.update({"ACADEMUS_PLOT_DIR": str(table), "ACADEMUS_LOWER_LAYERS": str(k), "ACADEMUS_PORT": "0",
                       "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_VERIFY": "0", "ACADEMUS_REDIS_URL": redis.url})
    service = RunningService(await plot_build())
    await service.start()
    rows = []
    try:
        async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            stub = plot_pb2_grpc.PlotStub(channel)
            for tokens, batch in shapes:
                seqs = inputs_of(stream, tokens, batch)
                request = request_to_pb(np.concatenate(seqs), np.full(batch, tokens))
                times = []
                for i in range(repeats + 3):
                    start = time.perf_counter()
                    lookup_from_pb(await stub.Lookup(request, timeout=10))
                    if i >= 3:
                        times.append((time.perf_counter() - start) * 1e3)
                rows.append({"tokens": tokens, "batch": batch, "grpc_lookup_ms": round(float(np.median(times)), 3)})
    finally:
        await service.stop()
        redis.stop()
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root-texts", type=int, default=2000, help="SOTU sentences in the root table")
    p.add_argument("--domain-texts", type=int, default=1000, help="spam train mails for the overlay")
    p.add_argument("--top-percent", type=float, default=10.0, help="the `spam` overlay's share of the domain's n-grams")
    p.add_argument("--top-percents", type=float, nargs="*", default=[],
                   help="also build spam overlays of these top-p %% on the last K's tables (every n): size vs coverage")
    p.add_argument("--eval-texts", type=int, default=300)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--ngrams", type=int, nargs="+", default=[3], choices=[2, 3], help="window sizes n to sweep")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grpc", action="store_true", help="also time the Lookup RPC over loopback")
    p.add_argument("--out", type=Path, default=None, help="where the tables go (default: a temporary directory)")
    p.add_argument("--reuse", action="store_true", help="keep tables already built under --out")
    p.add_argument("--eval-table", type=Path, default=None,
                   help="only score this built table (e.g. artifacts/plot/minilm-k3) on the held-out texts")
    return p


def eval_table(table: Path, teacher: TeacherEncoder, evals: dict[str, list[list[int]]]) -> dict:
    """minilm-plot's cosine to the teacher with an existing table (root, then each overlay it has)."""
    store = PlotStore.open(table, verify=False)
    encoder = HierarchicalEncoder(store, teacher)
    result = {"table": str(table), "lower_layers": store.lower_layers, "ngram": store.ngram, "quality": {}}
    for name, seqs in evals.items():
        reference = teacher_embeddings(teacher, seqs)
        for domain in ["", *sorted(store.domains)]:
            label = f"{name} ({domain or 'root'})"
            result["quality"][label] = cosine_to_teacher(encoder, reference, seqs, domain)
    return result


_STARTED = time.perf_counter()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    teacher = TeacherEncoder.load()
    tokenizer = TeacherTokenizer(teacher_dir(), max_tokens=256)
    root = corpus_texts("sotu", limit=args.root_texts)
    spam = load_task("spam")
    domain_texts = [e.text for e in spam.train[:args.domain_texts]]
    heldout = {"wordnet": corpus_texts("wordnet")[-args.eval_texts:],
               "spam_test": [e.text for e in spam.test[:args.eval_texts]]}
    evals = {name: [e.input_ids for e in tokenizer.encode(texts)] for name, texts in heldout.items()}
    stream = np.concatenate([s[1:-1] for s in evals["wordnet"]])
    if args.eval_table:
        print(json.dumps(eval_table(args.eval_table, teacher, evals)))
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="plot-bench-"))
    result: dict = {"threads": args.threads, "root_texts": len(root), "domain_texts": len(domain_texts),
                    "eval_texts": {name: len(seqs) for name, seqs in evals.items()}, "top_percent": args.top_percent,
                    "tables": {}, "quality": {}, "latency": {}}
    references = {name: teacher_embeddings(teacher, seqs) for name, seqs in evals.items()}
    _log("teacher reference embeddings done")
    teacher_ms: dict = {}
    for k in args.layers:
        layers = SplitBert(teacher.body, k)
        for n in args.ngrams:
            key = f"K={k} n={n}"
            result["tables"][key] = build_tables(out, k, n, root, domain_texts, layers, args.top_percent, args.reuse)
            _log(json.dumps({key: result["tables"][key]}))
            store = PlotStore.open(out / table_name(k, n), lower_layers=k, ngram=n, domains=["spam"], verify=False)
            encoder = HierarchicalEncoder(store, teacher)
            result["quality"][key] = {
                "wordnet (root only)": cosine_to_teacher(encoder, references["wordnet"], evals["wordnet"]),
                "spam_test (root only)": cosine_to_teacher(encoder, references["spam_test"], evals["spam_test"]),
                "spam_test (spam overlay)": cosine_to_teacher(encoder, references["spam_test"], evals["spam_test"],
                                                              "spam"),
            }
            oracle = out / (f"oracle-k{k}" + ("" if n == 3 else f"-n{n}"))   # every eval window present
            if not (args.reuse and _built(oracle)):
                build(heldout["wordnet"], oracle, BuildOptions(lower_layers=k, unigrams="corpus", ngram=n),
                      layers=layers)
            result["quality"][key]["wordnet (oracle: table of the eval texts)"] = cosine_to_teacher(
                HierarchicalEncoder(PlotStore.open(oracle, lower_layers=k, ngram=n, verify=False), teacher),
                references["wordnet"], evals["wordnet"])
            _log(json.dumps({key: result["quality"][key]}))
            result["latency"][key] = [latency(store, layers, encoder, teacher, stream, t, b, args.repeats, teacher_ms)
                                      for t in args.tokens for b in args.batches]
            _log(json.dumps({key: result["latency"][key]}))
    if args.top_percents:
        k = args.layers[-1]
        layers = SplitBert(teacher.body, k)
        result["top_percents"] = {
            f"K={k} n={n}": top_percent_sweep(out, k, n, domain_texts, layers, teacher, references["spam_test"],
                                              evals["spam_test"], args.top_percents, args.reuse)
            for n in args.ngrams}
    if args.grpc:
        k = args.layers[-1]
        shapes = [(t, b) for t in args.tokens for b in args.batches]
        result["grpc"] = asyncio.run(grpc_latency(out / table_name(k, args.ngrams[-1]), k, stream, shapes,
                                                  args.repeats))
    result["tables_dir"] = str(out)
    result["wall_s"] = round(time.perf_counter() - _STARTED, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
