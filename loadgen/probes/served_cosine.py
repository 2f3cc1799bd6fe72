"""The served `minilm-students` against the served teacher `minilm` (issue 3's evidence): both through a
local mesh, on texts the distillation never saw, mean and minimum cosine of their embeddings.

    python -m academus.loadgen.probes.served_cosine [--texts 300] [--out .academus/results/served_cosine]

Texts: WordNet glosses past the distillation's held-out slice (the first 2,000, only scored there), and
the sentiment and spam test splits (scored, never trained on). The last line printed is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from academus.client import Client
from academus.shared.cli.mesh import ADMIN_KEY_FILE, MeshOptions, down, up
from academus.shared.training.corpus import fetch_general, wordnet_texts
from academus.shared.training.data import data_dir, load_task
from academus.shared.training.distill_data import EMBEDDING_SIZES

BATCH = 32


def unseen_texts(count: int) -> dict[str, list[str]]:
    _, wordnet = fetch_general(data_dir())
    heldout = EMBEDDING_SIZES["heldout"]
    texts = {"wordnet": wordnet_texts(wordnet)[heldout:heldout + count]}
    for task in ("sentiment", "spam"):
        texts[task] = [e.text for e in load_task(task).test[:count]]
    return texts


def embeddings(client: Client, model: str, texts: list[str]) -> tuple[torch.Tensor, set[int]]:
    rows, counts = [], set()
    for i in range(0, len(texts), BATCH):
        answer = client.infer(model, texts[i:i + BATCH], "embedding", timeout=60)
        rows += [p.embedding for p in answer.predictions]
        counts.add(answer.metadata.student_count)
    return torch.tensor(rows), counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=int, default=300, help="texts a domain")
    p.add_argument("--out", type=Path, default=Path(".academus/results/served_cosine"))
    args = p.parse_args(argv)
    run_dir = args.out / "run"
    state = up(MeshOptions(run_dir=run_dir, gateway_port=0, env={"ACADEMUS_MODELS": "minilm,minilm-students"}))
    summary: dict = {}
    try:
        key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
        with Client(state.gateway, api_key=key) as client:
            for domain, texts in unseen_texts(args.texts).items():
                teacher, _ = embeddings(client, "minilm", texts)
                students, counts = embeddings(client, "minilm-students", texts)
                cosine = torch.nn.functional.cosine_similarity(students, teacher, dim=-1)
                summary[domain] = {"texts": len(texts), "mean_cosine": round(cosine.mean().item(), 4),
                                   "min_cosine": round(cosine.min().item(), 4), "student_count": sorted(counts)}
    finally:
        down(run_dir)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
