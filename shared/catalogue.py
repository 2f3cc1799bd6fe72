"""The served models as workers register them: ModelSpec and its JSON form in Redis."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

EMBEDDING = "embedding"
CLASSIFICATION = "classification"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str                      # EMBEDDING | CLASSIFICATION
    labels: list[str] = field(default_factory=list)
    dim: int = 384
    max_tokens: int = 256

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> ModelSpec:
        return cls(**json.loads(raw))
