"""The served models as workers register them: ModelSpec and its JSON form in Redis."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from academus.shared.state.artifacts import file_stamp, update_json

# The bundled models a tenant's adapters may sit on (names only: the gateway checks them without torch); a
# user's embedding model is a base too (`adapter_base`). minilm-plot is HMI's hierarchical base: PLOT lookups
# stand in for the lower layers the adapters never touch, so the same adapters (layers 4-6) train and serve
# on it; it needs a built table (`plot build`).
ADAPTER_BASES = frozenset({"minilm", "minilm-plot"})
PLOT_BASES = frozenset({"minilm-plot"})

EMBEDDING = "embedding"
CLASSIFICATION = "classification"
CATALOGUE_FILE = "models.json"   # under the artifacts: the served catalogue, on disk so it outlives Redis
MODEL_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")   # a name a user gives a model (models add, heads train)


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
    tokenizer: str = ""            # a user's model: sha256 of its tokenizer.json, in Redis ("": the teacher's)
    architecture: str = ""         # the transformers class it was saved as ("": the bundled teacher's)
    layers: int = 0                # transformer layers computed for one text (0: not reported)
    memory_bytes: int = 0          # its weights in the worker's memory (shared weights counted once a model)
    whole_groups: bool = False     # student groups whose head does not add over members (a classifier's own,
                                   # nonlinear): each group runs on one worker
    pairs: bool = False            # a classifier of text pairs (a cross-encoder: a reranker, NLI): each input is a text
                                   # and its pair, read together
    pooling: str = ""              # an embedding model's: "mean" or "cls", as its encoder pools ("": a classifier)
    normalized: bool = False       # an embedding model's vectors have unit length

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> ModelSpec:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


def adapter_base(spec: ModelSpec) -> bool:
    """Tenant adapters sit on a bundled base or on a user's embedding model, which runs its own layers; not on a
    head, a classifier, a student group, a PLOT model or the null model."""
    user_encoder = spec.kind == EMBEDDING and bool(spec.architecture) and not spec.max_students and not spec.plot
    return spec.name in ADAPTER_BASES or user_encoder


def spec_to_pb(spec: ModelSpec, message: type) -> Any:
    """The spec as the ModelSpec proto (resource_manager.proto mirrors these fields by name)."""
    return message(**asdict(spec))


def spec_from_pb(message: Any) -> ModelSpec:
    return ModelSpec(**{f.name: (list(v) if f.name == "labels" else v)
                        for f in fields(ModelSpec) for v in [getattr(message, f.name)]})


def catalogue_stamp(artifacts: str | Path) -> tuple[int, int] | None:
    """models.json's stamp (`file_stamp`)."""
    return file_stamp(Path(artifacts) / CATALOGUE_FILE)


def read_catalogue(artifacts: str | Path) -> dict[str, dict[str, Any]]:
    """models.json under the artifacts ({} when there is none yet)."""
    path = Path(artifacts) / CATALOGUE_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def update_catalogue(artifacts: str | Path,
                     change: Callable[[dict[str, dict[str, Any]]], dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Rewrites models.json as `change` makes it from the file as it is now (`update_json`): a `plot build`, a
    `models add` and a `distill` at once lose none of each other's entries."""
    return update_json(Path(artifacts) / CATALOGUE_FILE, change)


def write_entry(artifacts: str | Path, name: str, entry: dict[str, Any] | None) -> None:
    """Adds, replaces or (entry None) removes one models.json entry, keeping the others."""
    def change(catalogue: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        catalogue.pop(name, None)
        return catalogue if entry is None else catalogue | {name: entry}

    update_catalogue(artifacts, change)
