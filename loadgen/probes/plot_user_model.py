"""PLOT on a user's embedding model (e.g. all-mpnet-base-v2, 12 layers): for each K, a root table of State of the
Union sentences built by `plot build --model`'s code, then `<model>-plot`'s mean cosine to the model's own
embeddings on WordNet glosses (another domain) and on held-out SOTU sentences, and the lookup's time against
the lower K layers' and the hierarchical model's against the full model's.

    python -m academus.loadgen.probes.plot_user_model --model mpnet [--layers 1 3] [--root-texts 500]
                                                      [--eval-texts 200] [--tokens 64] [--batch 8]

The model must be in the catalogue (`academus models add NAME --from DIR`). One torch thread (--threads).
Prints one JSON object, last; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from academus.loadgen.plot_bench import cosine_to_teacher, inputs_of, p50_ms, teacher_embeddings
from academus.shared.models.plot.hierarchical import HierarchicalEncoder
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.plot.store import PlotStore
from academus.shared.runtime.config import offline_hub
from academus.shared.training.data import data_dir
from academus.shared.training.plot_build import BuildOptions, build, corpus_texts
from academus.shared.training.plot_models import plot_base


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@torch.inference_mode()
def times(store: PlotStore, layers: SplitBert, hierarchical: HierarchicalEncoder, seqs: list[np.ndarray],
          repeats: int) -> dict[str, float]:
    """p50s of the lookup, of the lower K layers it replaces, and of the whole hierarchical model."""
    flat, lengths = np.concatenate(seqs), np.array([len(s) for s in seqs])
    ids = torch.as_tensor(np.stack(seqs))
    return {"lookup_ms": p50_ms(lambda: store.lookup(flat, lengths), repeats),
            "lower_layers_ms": p50_ms(lambda: layers.lower(ids, torch.ones_like(ids)), repeats),
            "plot_model_ms": p50_ms(lambda: hierarchical.pool([s.tolist() for s in seqs]), repeats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an embedding model in the catalogue")
    p.add_argument("--layers", type=int, nargs="+", default=[1, 3])
    p.add_argument("--root-texts", type=int, default=500)
    p.add_argument("--eval-texts", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="where the tables go (default: a temporary directory)")
    args = p.parse_args(argv)
    offline_hub()
    torch.set_num_threads(args.threads)
    base = plot_base(args.model)
    encoder, tokenizer = base.encoder(), base.tokenizer()
    sotu = corpus_texts("sotu", data_dir())
    root, held_out = sotu[:args.root_texts], sotu[-args.eval_texts:]
    wordnet = corpus_texts("wordnet", data_dir())[:args.eval_texts]
    evals = {name: [e.input_ids for e in tokenizer.encode(texts)] for name, texts in
             (("wordnet", wordnet), ("sotu_held_out", held_out))}
    references = {name: teacher_embeddings(encoder, seqs) for name, seqs in evals.items()}
    framed = evals["sotu_held_out"][0]
    stream = np.concatenate([s[1:-1] for s in evals["sotu_held_out"]])
    seqs = inputs_of(stream, args.tokens, args.batch, framed[0], framed[-1])
    ids = torch.as_tensor(np.stack(seqs))
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        full_ms = p50_ms(lambda: encoder(ids, mask), args.repeats)
    out = args.out or Path(tempfile.mkdtemp(prefix="plot-user-model-"))
    rows = {}
    for k in args.layers:
        layers = SplitBert(encoder, k)
        started = time.perf_counter()
        summary = build(root, out / f"{args.model}-k{k}", BuildOptions(model=args.model, lower_layers=k), layers=layers,
                        corpus={"source": "sotu", "limit": args.root_texts})
        build_s = round(time.perf_counter() - started, 1)
        store = PlotStore.open(out / f"{args.model}-k{k}", model=args.model, lower_layers=k, verify=False)
        hierarchical = HierarchicalEncoder(store, encoder)
        timing = {**times(store, layers, hierarchical, seqs, args.repeats), "full_model_ms": full_ms}
        timing["plot_model_vs_full"] = round(timing["plot_model_ms"] / full_ms, 3)
        rows[f"K={k}"] = {"build_s": build_s, "entries": summary["entries"], "mb": round(summary["bytes"] / 2**20, 1),
                          **{name: cosine_to_teacher(hierarchical, references[name], evals[name])
                             for name in evals}, f"{args.tokens} tokens x {args.batch}": timing}
        _log(json.dumps({f"K={k}": rows[f"K={k}"]}))
    print(json.dumps({"model": args.model, "layers": len(encoder.body.encoder.layer), "root_texts": len(root),
                      "eval_texts": args.eval_texts, "threads": args.threads, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
