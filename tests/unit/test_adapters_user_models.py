"""Tenant adapters on a user's model: tiny random BERT, RoBERTa and MPNet encoders (odd sizes: 3 layers, 36 wide)
as bases. The hooks sit where transformers' own modules write attention into the residual stream (checked
against a copy of the model with that module wrapped, no hooks); training's split forward equals serving's whole
one for every family and pooling; an adapter records its base's shape in its file; a user's embedding model in
the catalogue trains an adapter whose reported validation accuracy is what the serving path computes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from academus.shared.models.adapters import AdapterWeights, BatchedAdapters, encode_with_adapters, install_adapters
from academus.shared.models.model import FIRST, MEAN, TeacherEncoder, load_encoder, pad_batch
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import add_model
from academus.shared.state.catalogue import read_catalogue, write_entry
from academus.shared.training.adapters import _split, lower_states, open_base, train_adapter, upper_pooled
from academus.shared.training.data import load_task
from tests.models import SHAPE, tiny_model_dir

FAMILIES = ("bert", "roberta", "mpnet")
# Where each family's attention output projection is, named here independently of the code under test.
PROJECTION = {"bert": ("attention", "output", "dense"), "roberta": ("attention", "output", "dense"),
              "mpnet": ("attention", "attn", "o")}
TEXTS = ["a quietly devastating film", "dull", "the plot makes no sense and the jokes land with a thud",
         "a small gem, warm and sharp"]
LAYERS, HIDDEN = SHAPE["num_hidden_layers"], SHAPE["hidden_size"]


@pytest.fixture(scope="module")
def tokenizer() -> TeacherTokenizer:
    return TeacherTokenizer(teacher_dir())


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    tiny_model_dir(request.param, False, directory, seed=3)
    return request.param, directory


def random_adapter(labels: list[str], seed: int = 0) -> AdapterWeights:
    """Every tensor random: a fresh adapter's up projection is zero, which would leave the base unchanged."""
    adapter = AdapterWeights.init(labels, "tiny", rank=4, seed=seed, shape=(LAYERS, HIDDEN))
    generator = torch.Generator().manual_seed(100 + seed)
    for weights in adapter.layers.values():
        for key, tensor in weights.items():
            weights[key] = torch.randn(tensor.shape, generator=generator) * 0.3
    return adapter


class Adapted(nn.Module):
    """A projection followed by one adapter layer, as a module in place of the projection (the reference)."""

    def __init__(self, projection: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.projection, self.weights = projection, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.projection(x)
        w = self.weights
        return out + nn.functional.linear(torch.relu(nn.functional.linear(out, w["down.weight"], w["down.bias"])),
                                          w["up.weight"], w["up.bias"])


def reference(encoder: TeacherEncoder, family: str, adapter: AdapterWeights, ids, mask, types) -> torch.Tensor:
    """The encoder with the adapter wired into a copy of its modules: no hooks involved."""
    wired = copy.deepcopy(encoder)
    for i, weights in adapter.layers.items():
        *path, last = PROJECTION[family]
        owner = wired.body.encoder.layer[i]
        for name in path:
            owner = getattr(owner, name)
        setattr(owner, last, Adapted(getattr(owner, last), weights))
    return wired(ids, mask, types)


def batch(tokenizer: TeacherTokenizer, texts: list[str]):
    encoded = tokenizer.encode(texts)
    return pad_batch([e.input_ids for e in encoded], [e.token_type_ids for e in encoded])


@pytest.mark.parametrize("pooling", [MEAN, FIRST])
def test_adapters_sit_where_each_family_writes_attention(family_dir, tokenizer, pooling):
    family, directory = family_dir
    encoder = load_encoder(directory, pooling=pooling)[0]
    adapter = random_adapter(["a", "b"])
    ids, mask, types = batch(tokenizer, TEXTS)
    with torch.no_grad():
        base = encoder(ids, mask, types)
        pooled, probs = encode_with_adapters(encoder, ids, mask, types, [adapter] * len(TEXTS))
        expected = reference(encoder, family, adapter, ids, mask, types)
        assert (pooled - base).abs().max() > 1e-3                      # the adapter acts
        assert (pooled - expected).abs().max() <= 1e-5, family          # ... where the reference puts it
        assert torch.equal(encoder(ids, mask, types), base)              # and the hooks idle afterwards
    head = torch.softmax(nn.functional.linear(expected, adapter.head_weight, adapter.head_bias), dim=1)
    assert (probs - head).abs().max() <= 1e-5


@pytest.mark.parametrize("pooling", [MEAN, FIRST])
def test_training_split_forward_equals_the_served_forward(family_dir, tokenizer, pooling):
    family, directory = family_dir
    encoder = load_encoder(directory, pooling=pooling, normalize=pooling == MEAN)[0]
    adapter = random_adapter(["a", "b", "c"], seed=1)
    ids, mask, types = batch(tokenizer, TEXTS)
    first = min(adapter.layer_ids)
    with torch.no_grad():
        served, _ = encode_with_adapters(encoder, ids, mask, types, [adapter] * len(TEXTS))
        states = lower_states(encoder, tokenizer.encode(TEXTS), first, batch_size=3)
        with install_adapters(encoder).active(BatchedAdapters([adapter] * len(TEXTS), batched=False)):
            split = upper_pooled(encoder, states, first)
    assert (served - split).abs().max() <= 1e-5, family


def test_an_adapter_file_carries_its_bases_shape():
    adapter = random_adapter(["x", "y"])
    assert (adapter.base_layers, adapter.hidden, adapter.layer_ids) == (LAYERS, HIDDEN, (1, 2))
    loaded = AdapterWeights.from_bytes(adapter.to_bytes())
    assert (loaded.base, loaded.base_layers, loaded.hidden) == ("tiny", LAYERS, HIDDEN)
    assert all(torch.equal(a, b) for a, b in zip(adapter.tensors(), loaded.tensors(), strict=True))
    piece = AdapterWeights.from_bytes(adapter.to_bytes(layers=[2], head=False))
    assert (piece.base_layers, piece.hidden, sorted(piece.layers)) == (LAYERS, HIDDEN, [2])
    with pytest.raises(ValueError, match=r"layers \[1, 2, 3\] must be a non-empty subset of 0..2"):
        AdapterWeights.init(["x", "y"], "tiny", layers=[1, 2, 3], shape=(LAYERS, HIDDEN))
    with pytest.raises(ValueError, match="unknown adapter base 'tiny'"):
        AdapterWeights.init(["x", "y"], "tiny")


def test_a_file_from_before_bases_had_their_shape_in_it_still_loads():
    bundled = AdapterWeights.init(["x", "y"], "minilm", rank=2)
    meta = bundled.metadata()
    del meta["base_layers"]
    loaded = AdapterWeights.from_bytes(st_save({k: v.contiguous() for k, v in st_load(bundled.to_bytes()).items()},
                                               metadata=meta))
    assert (loaded.base_layers, loaded.hidden, loaded.layer_ids) == (6, 384, (3, 4, 5))


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifacts folder with a tiny MPNet added as the user's model `tiny-mpnet`, and a head on it."""
    root = tmp_path_factory.mktemp("user-base")
    tiny_model_dir("mpnet", False, root / "mpnet", seed=4)
    tiny_model_dir("bert", True, root / "classifier", seed=5)
    artifacts = root / "artifacts"
    add_model(artifacts, "tiny-mpnet", root / "mpnet")
    add_model(artifacts, "tiny-classifier", root / "classifier")
    write_entry(artifacts, "a-head", {"kind": "classification", "head": "heads/a-head", "encoder_model": "tiny-mpnet",
                                      "labels": ["a", "b"], "dim": HIDDEN, "max_tokens": 64})
    return artifacts


def test_a_users_embedding_model_is_a_base_and_trains_what_it_serves(catalogue, monkeypatch):
    monkeypatch.setenv("ACADEMUS_ARTIFACTS", str(catalogue))
    task = load_task("sentiment")
    examples = task.train[:120]
    texts, labels = [e.text for e in examples], [task.labels[e.label] for e in examples]
    adapter, summary = train_adapter(texts, labels, base="tiny-mpnet", epochs=2, validation_fraction=0.25,
                                     progress=False)
    assert (adapter.base, adapter.base_layers, adapter.hidden, adapter.layer_ids) == ("tiny-mpnet", 3, HIDDEN, (1, 2))
    assert summary["layers"] == [1, 2] and summary["counts"] == {"train": 90, "validation": 30}

    # The validation accuracy training reports is the serving path's, on the model's own tokenizer.
    encoder, tokenizer = open_base("tiny-mpnet")
    _, validation = _split(len(texts), 0.25, 0)
    encoded = tokenizer.encode([texts[i] for i in validation])
    ids, mask, types = pad_batch([e.input_ids for e in encoded], [e.token_type_ids for e in encoded])
    with torch.no_grad():
        _, probs = encode_with_adapters(encoder, ids, mask, types, [adapter] * len(validation))
    predicted = [adapter.labels[i] for i in probs.argmax(1).tolist()]
    accuracy = sum(p == labels[i] for p, i in zip(predicted, validation, strict=True)) / len(validation)
    assert round(accuracy, 4) == summary["validation"]["accuracy"]   # the summary keeps 4 digits


@pytest.mark.parametrize("base", ["tiny-classifier", "a-head", "not-there"])
def test_a_classifier_a_head_or_an_unknown_name_is_no_base(catalogue, monkeypatch, base):
    monkeypatch.setenv("ACADEMUS_ARTIFACTS", str(catalogue))
    assert read_catalogue(catalogue).get(base, {"kind": "classification"})["kind"] == "classification"
    with pytest.raises(ValueError, match=f"unknown adapter base {base!r}: tenant models sit on minilm, minilm-plot "
                                         "or on an embedding model added with `academus models add`"):
        train_adapter(["a", "b", "c", "d"], ["x", "y", "x", "y"], base=base, progress=False)


def test_the_bundled_bases_shape_is_checked_against_the_encoder(family_dir):
    _, directory = family_dir
    encoder = load_encoder(directory)[0]
    with pytest.raises(ValueError, match="base 'minilm' has 6 layers of hidden size 384, not 3 of 36"):
        train_adapter(["a", "b", "c", "d"], ["x", "y", "x", "y"], base="minilm", encoder=encoder,
                      tokenizer=TeacherTokenizer(teacher_dir()), progress=False)


def test_an_adapter_for_another_width_is_refused_by_the_encoder(family_dir, tokenizer):
    _, directory = family_dir
    encoder = load_encoder(directory)[0]
    wide = AdapterWeights.init(["x", "y"], "minilm")
    ids, mask, types = batch(tokenizer, TEXTS[:1])
    with pytest.raises(ValueError, match="adapter for base 'minilm' has hidden size 384; the encoder has 36"):
        encode_with_adapters(encoder, ids, mask, types, [wide])
    assert json.loads(wide.metadata()["layers"]) == [3, 4, 5]
