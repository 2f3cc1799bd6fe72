"""PLOT tables on a user's embedding model (BERT, RoBERTa, MPNet), built by the real command: the table holds what
the model's own transformers forward computes at layer K (its framing tokens, position numbering, MPNet's
relative-position bias), the worker serves `<model>-plot` on the model's upper layers, pooling and tokenizer, and
a table, a model and the catalogue stay consistent (weights replaced, removal).

Expected states come from transformers' own forward (output_hidden_states), never from the code under test."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from torch import nn

from academus.services.plot.core import PlotLookup
from academus.services.worker.core import OUTPUT_EMBEDDING, ModelRunner
from academus.shared.models.plot import PlotStore
from academus.shared.models.plot.hierarchical import HierarchicalEncoder
from academus.shared.models.plot.table import ROOT, PlotError, read_manifest
from academus.shared.models.user_models import (
    TOKENIZER,
    ModelRefused,
    add_model,
    cache_name,
    open_model,
    remove_model,
)
from academus.shared.models.work import Batch, PlotStates
from academus.shared.runtime.errors import InvalidArgument
from academus.shared.state.artifacts import ArtifactError
from academus.shared.state.artifacts import read_manifest as read_model_manifest
from academus.shared.state.catalogue import read_catalogue, write_entry
from academus.shared.training.plot_build import main as plot_main
from academus.shared.training.plot_build import tokenize
from academus.shared.training.plot_models import plot_base, register_embedding, train_plot_head
from tests.conftest import env
from tests.models import permute_vocabulary, roberta_specials, tiny_model_dir

K = 2
CORPUS = ["the cat sat on the mat", "a red apple fell from the tree", "the design of this phone is great",
          "markets fell sharply today", "hello"]
TEXTS = ["the cat sat on the mat", "hello", "the tree fell on the phone", "great apple"]
# family -> (its tokenizer made RoBERTa-like, vocabulary renumbered, pooling given at `models add`)
FAMILIES = {"bert": (False, False, ""), "roberta": (True, False, "cls"), "mpnet": (True, True, "")}


def build_cli(artifacts: Path, model: str, corpus: Path) -> int:
    with env(ACADEMUS_ARTIFACTS=str(artifacts)):
        return plot_main(["build", "--model", model, "--corpus", str(corpus), "--lower-layers", str(K),
                          "--unigrams", "corpus", "--threads", "1", "--artifacts", str(artifacts)])


@dataclass
class Built:
    family: str
    name: str
    artifacts: Path
    source: Path               # the model's directory as the user gave it
    model: nn.Module           # transformers' own model
    table: Path

    def tokenizer(self) -> Tokenizer:
        tokenizer = Tokenizer.from_file(str(self.source / "tokenizer.json"))
        tokenizer.no_padding()
        return tokenizer

    def ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer().encode_batch(texts)]

    def store(self) -> PlotStore:
        return PlotStore.open(self.table, model=self.name, lower_layers=K)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    family = request.param
    specials, permuted, pooling = FAMILIES[family]
    root = tmp_path_factory.mktemp(f"plot-{family}")
    source, artifacts, name = root / "model", root / "artifacts", f"tiny-{family}"
    model = tiny_model_dir(family, False, source, seed=3)
    if specials:
        roberta_specials(source)
    if permuted:
        permute_vocabulary(source)
    add_model(artifacts, name, source, pooling=pooling)
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n")
    assert build_cli(artifacts, name, corpus) == 0
    return Built(family, name, artifacts, source, model, artifacts / "plot" / f"{name}-k{K}")


def layer_k_states(built: Built, framed: list[int]) -> np.ndarray:
    """transformers' own layer-K output for one framed input."""
    with torch.no_grad():
        out = built.model(input_ids=torch.tensor([framed]), attention_mask=torch.ones(1, len(framed), dtype=torch.long),
                          output_hidden_states=True)
    return out.hidden_states[K][0].numpy()


def test_the_table_holds_each_fragment_as_the_models_own_forward_computes_it(built: Built) -> None:
    framed = built.ids(["the cat sat on the mat"])[0]
    cls, sep = framed[0], framed[-1]
    store = built.store()
    for start in (1, 2, 3):   # inner trigrams: run as [CLS] a b c [SEP], in the model's own framing tokens
        fragment = framed[start:start + 3]
        expected = layer_k_states(built, [cls, *fragment, sep])[1:4]
        got = store.lookup(np.array(fragment), np.array([3])).states
        np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)   # the table stores fp16
    # a text's first and last windows hold its framing tokens: run with the missing one, at their own positions
    for fragment, framed_fragment, kept in ((framed[:3], [*framed[:3], sep], slice(0, 3)),
                                            (framed[-3:], [cls, *framed[-3:]], slice(1, 4))):
        expected = layer_k_states(built, framed_fragment)[kept]
        got = store.lookup(np.array(fragment), np.array([3])).states
        np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)


def test_the_manifest_records_the_model_its_weights_and_its_framing(built: Built) -> None:
    manifest = read_manifest(built.table / ROOT)
    framed = built.ids([""])[0]
    directory = built.artifacts / "models" / built.name
    assert (manifest.model, manifest.hidden, manifest.lower_layers) == (built.name, 36, K)
    assert manifest.teacher == cache_name(built.name, read_model_manifest(directory))
    assert (manifest.special_ids["cls"], manifest.special_ids["sep"]) == (framed[0], framed[-1])
    assert (framed[0], framed[-1]) == ((101, 102) if built.family == "bert" else (0, 2))
    assert manifest.special_ids["unk"] == built.tokenizer().token_to_id("<unk>" if FAMILIES[built.family][0]
                                                                         else "[UNK]")
    entry = read_catalogue(built.artifacts)[f"{built.name}-plot"]
    assert (entry["base"], entry["dim"], entry["lower_layers"], entry["plot"]) == (
        built.name, 36, K, f"plot/{built.name}-k{K}")
    assert entry["max_tokens"] == read_catalogue(built.artifacts)[built.name]["max_tokens"]


def test_a_text_the_table_holds_whole_gets_the_models_own_embedding(built: Built) -> None:
    """[CLS] w [SEP] is run exactly as the model runs it: the hierarchical model equals the full one there,
    pooled as the model pools (RoBERTa here at its first token, unnormalised or not as added)."""
    encoder = open_model(built.artifacts / "models" / built.name)[0]
    ids = built.ids(["hello"])
    assert len(ids[0]) == 3
    got = HierarchicalEncoder(built.store(), encoder).pool(ids)
    with torch.no_grad():
        expected = encoder(torch.tensor(ids), torch.ones(1, 3, dtype=torch.long))
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("traced", [False, True])
def test_the_worker_serves_it_on_the_models_upper_layers_and_tokenizer(built: Built, traced: bool) -> None:
    runner = ModelRunner(built.artifacts, [f"{built.name}-plot"], traced=traced)
    spec = runner.specs[f"{built.name}-plot"]
    directory = built.artifacts / "models" / built.name
    assert (spec.dim, spec.plot, spec.lower_layers, spec.layers) == (36, built.name, K, 3)
    assert spec.tokenizer == read_model_manifest(directory).files[TOKENIZER]
    assert runner.tokenizer_file(f"{built.name}-plot") == directory / "tokenizer.json"
    seqs = built.ids(TEXTS)
    served = runner.run(Batch(f"{built.name}-plot", OUTPUT_EMBEDDING, [t for s in seqs for t in s],
                              [len(s) for s in seqs]))
    encoder = open_model(directory)[0]
    expected = HierarchicalEncoder(built.store(), encoder).pool(seqs)
    torch.testing.assert_close(torch.from_numpy(served.values), expected, rtol=0, atol=1e-5)
    with torch.no_grad():   # really the lookups, not the model's own lower layers
        full = torch.stack([encoder(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0] for s in seqs])
    assert not torch.allclose(expected, full, atol=1e-3)


def test_prefetched_states_of_its_table_serve_and_the_teachers_are_refused(built: Built) -> None:
    """The plot service's lookups (the scheduler's prefetch) of the user's table run only its upper layers; states
    of the teacher's table are refused naming both."""
    runner = ModelRunner(built.artifacts, [f"{built.name}-plot"], traced=False)
    seqs = built.ids(TEXTS)
    ids, lengths = [t for s in seqs for t in s], [len(s) for s in seqs]
    lookup = PlotLookup(built.store(), max_tokens=1024).lookup(np.array(ids), np.array(lengths))
    states = PlotStates(lookup.states.astype(np.float16).astype(np.float32), lookup.lengths, built.name, K)
    served = runner.run(Batch(f"{built.name}-plot", OUTPUT_EMBEDDING, ids, lengths, plot_states=states))
    hierarchical = HierarchicalEncoder(built.store(), open_model(built.artifacts / "models" / built.name)[0])
    expected = hierarchical.pool_states(states.states, states.lengths)
    torch.testing.assert_close(torch.from_numpy(served.values), expected, rtol=0, atol=1e-5)
    with pytest.raises(InvalidArgument, match=f"plot_states come from a 'minilm' K={K} table; this model serves "
                                              f"'{built.name}' K={K}"):
        runner.run(Batch(f"{built.name}-plot", OUTPUT_EMBEDDING, ids, lengths,
                         plot_states=replace(states, model="minilm")))


@pytest.mark.parametrize("built", ["mpnet"], indirect=True)   # one family: the rest is the same
def test_a_head_on_its_table_trains_without_the_teachers_reference(built: Built, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.artifacts, artifacts)
    with env(ACADEMUS_ARTIFACTS=str(artifacts)):
        summary = train_plot_head(artifacts, "sentiment", artifacts / "plot" / f"{built.name}-k{K}", limit=16,
                                  batch_size=8)
    assert (summary["model"], summary["teacher"], summary["test_f1_vs_teacher"]) == ("sentiment-plot", None, None)
    entry = read_catalogue(artifacts)["sentiment-plot"]
    assert (entry["base"], entry["dim"], entry["kind"]) == (built.name, 36, "classification")
    runner = ModelRunner(artifacts, ["sentiment-plot"])
    assert runner.specs["sentiment-plot"].labels == ["rotten", "fresh"]


@pytest.mark.parametrize("built", ["bert"], indirect=True)   # one family: the rest is the same
def test_a_table_built_on_other_weights_is_refused_at_load_naming_the_rebuild(built: Built, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.artifacts, artifacts)
    write_entry(artifacts, f"{built.name}-plot", None)   # the table stays on disk
    remove_model(artifacts, built.name)
    tiny_model_dir("bert", False, tmp_path / "other", seed=11)
    add_model(artifacts, built.name, tmp_path / "other")   # the same name, other weights
    assert register_embedding(artifacts, artifacts / "plot" / f"{built.name}-k{K}") == f"{built.name}-plot"
    with pytest.raises(ArtifactError, match=f"rebuild it \\(academus plot build --model {built.name}\\)"):
        ModelRunner(artifacts, [f"{built.name}-plot"])


@pytest.mark.parametrize("built", ["roberta"], indirect=True)   # one family: the rest is the same
def test_its_base_is_not_removed_under_it_and_its_table_goes_with_it(built: Built, tmp_path: Path) -> None:
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.artifacts, artifacts)
    with pytest.raises(ModelRefused, match=f"is the base of the PLOT models {built.name}-plot: remove those first"):
        remove_model(artifacts, built.name)
    remove_model(artifacts, f"{built.name}-plot")
    assert f"{built.name}-plot" not in read_catalogue(artifacts)
    assert not (artifacts / "plot" / f"{built.name}-k{K}").exists()
    remove_model(artifacts, built.name)
    assert built.name not in read_catalogue(artifacts)


@pytest.mark.parametrize("built", ["bert"], indirect=True)   # one family: the rest is the same
def test_a_classifier_an_unknown_model_or_a_framingless_tokenizer_is_refused(built: Built, tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    artifacts = tmp_path / "artifacts"
    shutil.copytree(built.artifacts, artifacts)
    tiny_model_dir("bert", True, tmp_path / "classifier")
    add_model(artifacts, "a-classifier", tmp_path / "classifier")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello there\n")
    for model, what in (("a-classifier", "is a classification model, not a user's embedding model"),
                        ("nowhere", "is not in the catalogue")):
        assert build_cli(artifacts, model, corpus) == 1
        error = capsys.readouterr().err
        assert f"--model {model!r} {what}" in error and "or on an embedding model added with `academus models add`" \
            in error
    raw = json.loads((artifacts / "models" / built.name / "tokenizer.json").read_text())
    raw["post_processor"] = None   # no [CLS] / [SEP] around a text
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_text(json.dumps(raw))
    bare = replace(plot_base(built.name, artifacts), directory=tmp_path / "bare")
    with pytest.raises(PlotError, match=r"tokenizer\.json puts no framing tokens around a text"):
        tokenize(["hello"], bare)
    assert not (artifacts / "plot" / "a-classifier-k2").exists() and not (artifacts / "plot" / "nowhere-k2").exists()
