"""Request texts for load: real labelled texts from a task's test split, or synthetic texts whose
token counts follow `normal,mean=M,var=V,min=A,max=B` (TCB §6.2's length distributions)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    text: str
    label: str | None = None
    query: str = ""   # a pair's first text (a reranker's query), read with `text`; "": the text alone

    @property
    def key(self) -> str:
        """What was sent, as one string: runs' answers to the same texts are compared by it."""
        return f"{self.query}\x00{self.text}" if self.query else self.text


def paired(samples: list[Sample], query: str) -> list[Sample]:
    """Each text as the second of a pair after `query` (a cross-encoder's or a bi-encoder's reranking): the texts'
    labels are not the pairs' answers, so none is kept."""
    return [Sample(s.text, None, query) for s in samples]


def from_task(task: str, limit: int | None = None) -> list[Sample]:
    from academus.shared.training.data import load_task

    data = load_task(task)
    samples = [Sample(e.text, data.labels[e.label]) for e in data.test]
    return samples[:limit] if limit else samples


def normal_lengths(spec: str, count: int, seed: int = 0) -> list[Sample]:
    """`normal,mean=20,var=100,min=3,max=100`: texts of that many tokens ([CLS] and [SEP] included)."""
    kind, *pairs = spec.split(",")
    if kind != "normal":
        raise ValueError(f"bad length distribution {spec!r}: expected normal,mean=M,var=V,min=A,max=B")
    try:
        params = {k: float(v) for k, v in (p.split("=") for p in pairs)}
        mean, var, low, high = params["mean"], params["var"], int(params["min"]), int(params["max"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"bad length distribution {spec!r}: {e}") from e
    rng = random.Random(seed)
    lengths = [min(high, max(low, round(rng.gauss(mean, var ** 0.5)))) for _ in range(count)]
    return [Sample(" ".join(["word"] * max(1, n - 2))) for n in lengths]


def parse(spec: str, count: int, seed: int = 0) -> list[Sample]:
    """`task:sentiment`, `task:spam` or a `normal,...` length distribution."""
    if spec.startswith("task:"):
        return from_task(spec.removeprefix("task:"))
    return normal_lengths(spec, count, seed)
