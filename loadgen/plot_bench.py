"""PLOT benchmark: table size and build time, lookup latency against computing the lower K layers,
and the quality of `minilm-plot` against the teacher on held-out text of other domains.

    python -m academus.loadgen.plot_bench [--root-texts 2000] [--domain-texts 1000] [--layers 1 2 3]
                                          [--tokens 16 64 128] [--batches 1 32] [--grpc] [--out DIR]

The root table is built from State of the Union sentences, the `spam` overlay from the spam task's
train split (top --top-percent of its trigrams); quality is measured on WordNet glosses (a domain
the root never saw) and on spam test mails with and without the overlay, and, as the ceiling, with
a table built on the WordNet eval texts themselves (every trigram found: the approximation alone).
Latency inputs are real held-out token ids cut to exactly N tokens ([CLS] ... [SEP]). Prints one
JSON object, last.
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

from academus.shared.data import load_task
from academus.shared.model import TeacherEncoder, pad_batch, teacher_dir
from academus.shared.plot.build import BuildOptions, build, corpus_texts
from academus.shared.plot.hierarchical import HierarchicalEncoder
from academus.shared.plot.layers import SplitBert
from academus.shared.plot.store import PlotStore
from academus.shared.plot.table import PlotVersion
from academus.shared.tokenization import TeacherTokenizer


def p50_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return round(float(np.median(times)), 3)


def build_tables(out: Path, k: int, root: list[str], domain: list[str], layers: SplitBert, top: float,
                 reuse: bool) -> dict:
    table = out / f"minilm-k{k}"
    if not (reuse and (table / "root" / "manifest.json").exists()):
        build(root, table, BuildOptions(lower_layers=k), layers=layers, corpus={"source": "sotu"})
        build(domain, table, BuildOptions(lower_layers=k, domain="spam", top_percent=top), layers=layers,
              corpus={"source": "spam"})
    store = PlotStore.open(table, lower_layers=k, verify=False)
    return {"root": _size(store.root), "spam_overlay": _size(store.domains["spam"])}


def _size(version: PlotVersion) -> dict:
    m = version.manifest
    return {"entries": m.counts, "mb": round(version.nbytes / 2**20, 2), "build_s": m.build_s,
            "trigram_coverage": m.corpus.get("trigram_coverage")}


def cosine_to_teacher(encoder: HierarchicalEncoder, teacher: TeacherEncoder, seqs: list[list[int]],
                      domain: str = "", batch: int = 64) -> dict:
    cosines, counts = [], np.zeros(3)
    for start in range(0, len(seqs), batch):
        chunk = seqs[start:start + batch]
        with torch.inference_mode():
            reference = teacher(*pad_batch(chunk)[:2])
        cosines.append((encoder.pool(chunk, domain) * reference).sum(1))
        flat, lengths = np.concatenate(chunk), np.array([len(s) for s in chunk])
        c = encoder.store.lookup(flat, lengths, domain).counts
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
            stream: np.ndarray, tokens: int, batch: int, repeats: int) -> dict:
    seqs = inputs_of(stream, tokens, batch)
    flat, lengths = np.concatenate(seqs), np.full(batch, tokens)
    ids = torch.as_tensor(np.stack(seqs))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        return {
            "tokens": tokens, "batch": batch,
            "lookup_ms": p50_ms(lambda: store.lookup(flat, lengths), repeats),
            "lower_layers_ms": p50_ms(lambda: layers.lower(ids, mask), repeats),
            "minilm_plot_ms": p50_ms(lambda: encoder.pool([s.tolist() for s in seqs]), repeats),
            "teacher_ms": p50_ms(lambda: teacher(ids, mask), repeats),
        }


async def grpc_latency(table: Path, k: int, stream: np.ndarray, shapes: list[tuple[int, int]], repeats: int) -> list:
    """Lookup RPC p50 over loopback, the service in this process (it shares the CPU with the client)."""
    import grpc

    from academus.services.plot.server import build as plot_build
    from academus.shared.plot.wire import lookup_from_pb, request_to_pb
    from academus.shared.redis_server import RedisServer
    from academus.shared.serving import CHANNEL_OPTIONS, RunningService
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
    p.add_argument("--top-percent", type=float, default=10.0)
    p.add_argument("--eval-texts", type=int, default=300)
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2, 3])
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
    result = {"table": str(table), "lower_layers": store.lower_layers, "quality": {}}
    for name, seqs in evals.items():
        for domain in ["", *sorted(store.domains)]:
            label = f"{name} ({domain or 'root'})"
            result["quality"][label] = cosine_to_teacher(encoder, teacher, seqs, domain)
    return result


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
                    "tables": {}, "quality": {}, "latency": {}}
    for k in args.layers:
        layers = SplitBert(teacher.bert, k)
        result["tables"][f"K={k}"] = build_tables(out, k, root, domain_texts, layers, args.top_percent,
                                                    args.reuse)
        store = PlotStore.open(out / f"minilm-k{k}", lower_layers=k, verify=False)
        encoder = HierarchicalEncoder(store, teacher)
        result["quality"][f"K={k}"] = {
            "wordnet (root only)": cosine_to_teacher(encoder, teacher, evals["wordnet"]),
            "spam_test (root only)": cosine_to_teacher(encoder, teacher, evals["spam_test"]),
            "spam_test (spam overlay)": cosine_to_teacher(encoder, teacher, evals["spam_test"], "spam"),
        }
        oracle = out / f"oracle-k{k}"          # every eval trigram present: the approximation error alone
        build(heldout["wordnet"], oracle, BuildOptions(lower_layers=k, unigrams="corpus"), layers=layers)
        result["quality"][f"K={k}"]["wordnet (oracle: table of the eval texts)"] = cosine_to_teacher(
            HierarchicalEncoder(PlotStore.open(oracle, lower_layers=k, verify=False), teacher), teacher,
            evals["wordnet"])
        result["latency"][f"K={k}"] = [latency(store, layers, encoder, teacher, stream, t, b, args.repeats)
                                       for t in args.tokens for b in args.batches]
        _log(json.dumps({f"K={k}": [result["tables"][f"K={k}"], result["quality"][f"K={k}"]]}))
    if args.grpc:
        k = args.layers[-1]
        shapes = [(t, b) for t in args.tokens for b in args.batches]
        result["grpc"] = asyncio.run(grpc_latency(out / f"minilm-k{k}", k, stream, shapes, args.repeats))
    result["tables_dir"] = str(out)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
