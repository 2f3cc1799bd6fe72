"""The served models as workers register them: ModelSpec and its JSON form in Redis."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# The served models a tenant's adapters may sit on (names only: the gateway checks them without torch).
# minilm-plot is HMI's hierarchical base: PLOT lookups stand in for the lower layers the adapters never
# touch, so the same adapters (layers 4-6) train and serve on it; it needs a built table (`plot build`).
ADAPTER_BASES = frozenset({"minilm", "minilm-plot"})
PLOT_BASES = frozenset({"minilm-plot"})

EMBEDDING = "embedding"
CLASSIFICATION = "classification"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str                      # EMBEDDING | CLASSIFICATION
    labels: list[str] = field(default_factory=list)
    dim: int = 384
    max_tokens: int = 256
    max_students: int = 0          # student groups: students trained (0: not a student group)
    default_students: int = 0      # student groups: the best-pruned k
    plot: str = ""                 # PLOT models: the model whose lower layers the table holds ("": none)
    lower_layers: int = 0          # PLOT models: K, the layers the lookups replace
    domain: str = ""               # PLOT models: the overlay searched before the root

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


def spec_to_pb(spec: ModelSpec, message: type) -> Any:
    """The spec as the ModelSpec proto (resource_manager.proto mirrors these fields by name)."""
    return message(**asdict(spec))


def spec_from_pb(message: Any) -> ModelSpec:
    return ModelSpec(**{f.name: (list(v) if f.name == "labels" else v)
                        for f in fields(ModelSpec) for v in [getattr(message, f.name)]})
