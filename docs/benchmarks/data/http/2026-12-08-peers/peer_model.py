"""The model both peers serve, as their users would write it: all-MiniLM-L6-v2 through transformers, a batch padded
to its longest text (at most 256 tokens, as Academus cuts), mean-pooled over the real tokens and L2-normalised
(sentence-transformers' embedding). `PEER_NULL=1`: each text tokenized as ever, then answered with zeros, no forward
pass, as Academus's `null` model answers: the server alone."""

import os

import torch
from transformers import AutoModel, AutoTokenizer

MODEL_DIR = os.environ["PEER_MODEL_DIR"]
NULL = os.environ.get("PEER_NULL") == "1"
BATCH = int(os.environ.get("PEER_BATCH", "32"))   # requests a batch; 1: no batching
tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
model = AutoModel.from_pretrained(MODEL_DIR).eval()


def embed(texts: list[str]) -> list[list[float]]:
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    if NULL:
        return [[0.0] * 384 for _ in texts]
    with torch.inference_mode():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
    pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1).tolist()
