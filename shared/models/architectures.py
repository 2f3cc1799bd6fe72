"""The encoder families Academus serves, read from a model's config.json: BERT, RoBERTa and MPNet, as a bare
encoder or with transformers' sequence-classification head. Everything else about a model (widths, layers,
heads, vocabulary) comes from its config; what differs between the families is here:

- how positions are numbered: BERT from 0; RoBERTa and MPNet from the padding index + 1 (a packed request's
  positions restart there, not at 0);
- token types: MPNet has none (a text pair is told apart by its separators only);
- attention: MPNet adds a learned bias by relative position bucket (shared by its layers) to the scores;
- the classification head: BERT's pooler (dense + tanh on the first token) then a linear layer; RoBERTa's and
  MPNet's own dense + tanh + projection on the first token.

Torch-free: `academus models add | list | remove` and the tests read a directory's family (and the
pooling names) before loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEAN, FIRST = "mean", "cls"   # pooling: the mean over real tokens, or the first token's hidden state
POOLINGS = (MEAN, FIRST)


class UnsupportedArchitecture(ValueError):
    """A config.json names an architecture this build cannot serve."""


@dataclass(frozen=True)
class Family:
    name: str
    body: str                  # transformers class of the bare encoder
    classifier: str            # transformers class with the sequence-classification head
    body_attribute: str        # the classifier's attribute holding the bare encoder
    token_types: bool          # the embeddings add token-type vectors
    relative_attention: bool   # the scores get a relative-position bias (MPNet)


FAMILIES: dict[str, Family] = {
    "bert": Family("bert", "BertModel", "BertForSequenceClassification", "bert", True, False),
    "roberta": Family("roberta", "RobertaModel", "RobertaForSequenceClassification", "roberta", True, False),
    "mpnet": Family("mpnet", "MPNetModel", "MPNetForSequenceClassification", "mpnet", False, True),
}
SUPPORTED = ", ".join(f"{f.body}/{f.classifier}" for f in FAMILIES.values())


def family_module(family: Family, part: str) -> type:
    """A part of the family's transformers implementation: "Embeddings", "Encoder", "Layer"."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family.name}.modeling_{family.name}")
    return getattr(module, f"{family.body.removesuffix('Model')}{part}")


@dataclass(frozen=True)
class Architecture:
    """A model's family and shape, as its config.json gives them."""

    family: Family
    classifier: bool           # a …ForSequenceClassification checkpoint: served with its own head
    name: str                  # config.json's architectures[0] (or the family's encoder class)
    hidden_size: int
    layers: int
    heads: int
    vocab_size: int
    max_positions: int         # position-embedding rows
    pad_token_id: int
    type_vocab_size: int

    @property
    def position_offset(self) -> int:
        """The first real token's position id: 0 for BERT; padding index + 1 for RoBERTa and MPNet."""
        if self.family.name == "bert":
            return 0
        return (1 if self.family.name == "mpnet" else self.pad_token_id) + 1   # MPNet's padding index is fixed at 1

    @property
    def max_tokens(self) -> int:
        """The longest input the position embeddings can number."""
        return self.max_positions - self.position_offset

    @property
    def uses_token_types(self) -> bool:
        """Pairs get type 1 on their second text only where the embeddings hold a second type."""
        return self.family.token_types and self.type_vocab_size > 1


def read_architecture(config: dict[str, Any], source: str = "config.json") -> Architecture:
    """The family and shape of a config.json (as a dict); UnsupportedArchitecture names what it found."""
    names = config.get("architectures") or []
    name = str(names[0]) if names else ""
    model_type = str(config.get("model_type", ""))
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedArchitecture(f"{source}: architecture {name or '(none)'!r} (model_type {model_type!r}) is "
                                      f"not supported; supported: {SUPPORTED}")
    classifier = name.endswith("ForSequenceClassification")
    if name and not classifier and not name.startswith(family.body[: -len("Model")]):
        raise UnsupportedArchitecture(f"{source}: architecture {name!r} is not a {family.body} encoder")
    try:
        return Architecture(
            family, classifier, name or family.body, int(config["hidden_size"]), int(config["num_hidden_layers"]),
            int(config["num_attention_heads"]), int(config["vocab_size"]), int(config["max_position_embeddings"]),
            int(config.get("pad_token_id") if config.get("pad_token_id") is not None else 0),
            int(config.get("type_vocab_size", 0 if family.name == "mpnet" else 2)))
    except KeyError as e:
        raise UnsupportedArchitecture(f"{source} lacks {e.args[0]!r}") from e
