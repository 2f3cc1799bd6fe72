"""`academus models add/list/remove` without a mesh: every refusal names the file (or model) and the problem and
registers nothing; each family is copied, checksummed and catalogued; pooling, normalisation and the tokenizer
built from vocab.txt come from the directory's own files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from tokenizers import Tokenizer

from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.user_models import (
    ModelRefused,
    add_model,
    inspect_model_dir,
    list_models,
    refuse_pairs,
    remove_model,
    verify_model_files,
)
from academus.shared.state.artifacts import ArtifactError, load_file, save_file
from academus.shared.state.catalogue import read_catalogue, write_entry
from tests.models import CONFIGS, LABELS, json_vocab_size, tiny_model, tiny_model_dir

BUNDLED = {"kind": "embedding"}   # stands in for `academus prepare`'s minilm: no "source", so not a user model
ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    """Builds each tiny model once; tests copy it, since most of them break their copy on purpose."""
    root = tmp_path_factory.mktemp("templates")
    built: dict[tuple[str, bool], Path] = {}

    def template(family: str, classifier: bool) -> Path:
        if (family, classifier) not in built:
            built[family, classifier] = root / f"{family}-{classifier}"
            tiny_model_dir(family, classifier, built[family, classifier])
        return built[family, classifier]

    return template


@pytest.fixture
def model_dir(tmp_path: Path, templates: Callable[[str, bool], Path]) -> Callable[..., Path]:
    def copy(family: str = "bert", classifier: bool = False) -> Path:
        return Path(shutil.copytree(templates(family, classifier), tmp_path / f"src-{family}-{classifier}"))

    return copy


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    """Artifacts whose catalogue already holds a bundled model: a refused add must leave it exactly so."""
    path = tmp_path / "artifacts"
    write_entry(path, "minilm", BUNDLED)
    return path


def edit_config(directory: Path, **changes: Any) -> None:
    """Sets (value not None) or drops (None) config.json keys."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def assert_refused(artifacts: Path, directory: Path, match: str, **options: str) -> None:
    """`add` refused with `match`, and nothing registered half-way: neither an entry nor a (staging) directory."""
    before = (artifacts / "models.json").read_text()
    with pytest.raises(ModelRefused, match=match):
        add_model(artifacts, "mine", directory, **options)
    assert (artifacts / "models.json").read_text() == before
    assert read_catalogue(artifacts) == {"minilm": BUNDLED}
    models = artifacts / "models"
    assert not models.exists() or list(models.iterdir()) == []


# --- refusals --------------------------------------------------------------------------------------------------

def test_refuses_a_directory_without_config(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    (source / "config.json").unlink()
    assert_refused(artifacts, source, r"src-bert-False/config\.json is missing")


def test_refuses_a_config_that_is_not_json(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    (source / "config.json").write_text('{"model_type": "bert",')
    assert_refused(artifacts, source, r"config\.json is not valid JSON")


def test_refuses_a_directory_without_weights(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    (source / "model.safetensors").unlink()
    assert_refused(artifacts, source, r"src-bert-False has no weights: expected model\.safetensors")


def test_refuses_pickled_weights(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    # unpickling runs code: refused even though transformers would load it
    source = model_dir()
    (source / "model.safetensors").unlink()
    (source / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    assert_refused(artifacts, source, r"pytorch_model\.bin\) only: Academus loads safetensors")


def test_refuses_a_directory_without_tokenizer(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    (source / "tokenizer.json").unlink()
    assert_refused(artifacts, source, r"src-bert-False has no tokenizer: expected tokenizer\.json, or vocab\.txt")


def test_refuses_an_unsupported_architecture(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    edit_config(source, model_type="distilbert", architectures=["DistilBertModel"])
    assert_refused(artifacts, source, r"config\.json: architecture 'DistilBertModel' .* is not supported")


def test_refuses_a_tokenizer_larger_than_the_embeddings(artifacts: Path, tmp_path: Path) -> None:
    # the teacher's 30522 ids on a model of 101 rows: an index error at the first request otherwise
    source = tmp_path / "small"
    tiny_model("bert", False, source)
    shutil.copyfile(teacher_dir() / "tokenizer.json", source / "tokenizer.json")
    top = json_vocab_size() - 1
    assert_refused(artifacts, source, rf"small/tokenizer\.json has token ids up to {top}; config\.json's vocab_size "
                                      r"\(the embeddings' rows\) is 101")


def test_refuses_a_classifier_without_labels(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir("roberta", classifier=True)
    edit_config(source, id2label=None, label2id=None)
    assert_refused(artifacts, source, r"src-roberta-True/config\.json has no id2label")


@pytest.mark.parametrize("damage", ["truncated", "garbage header"])
def test_refuses_a_corrupted_safetensors_file(artifacts: Path, model_dir: Callable[..., Path], damage: str) -> None:
    source = model_dir()
    weights = source / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    else:   # the first 8 bytes are the header's length
        weights.write_bytes(b"\xff" * 8 + data[8:])
    assert_refused(artifacts, source, r"src-bert-False/model\.safetensors is not a readable safetensors file")


def test_refuses_weights_that_do_not_load(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    # passes every header check, fails only when the staged copy is loaded: the staging dir must go too
    source = model_dir()
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["encoder.layer.0.attention.self.query.weight"]
    save_file(tensors, str(source / "model.safetensors"))
    assert_refused(artifacts, source, r"src-bert-False: the weights do not load as BertModel: .*weights missing.*"
                                      r"encoder\.layer\.0\.attention\.self\.query\.weight")


def test_refuses_embeddings_that_do_not_match_the_config(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    edit_config(source, vocab_size=40000)
    rows = json_vocab_size()
    assert_refused(artifacts, source, rf"model\.safetensors: the word embeddings are \[{rows}, 36\], config\.json "
                                      r"says vocab_size x hidden_size = \[40000, 36\]")


def test_refuses_classify_on_an_encoder(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    assert_refused(artifacts, model_dir(), r"config\.json: BertModel has no classification head", task="classify")


def test_refuses_pooling_for_a_classifier(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    # the head was trained on the first token: another pooling would serve wrong answers
    source = model_dir("roberta", classifier=True)
    assert_refused(artifacts, source, r"--pooling applies to embedding models; .*src-roberta-True is served as a "
                                      r"classifier", pooling="mean")


def test_refuses_pairs_for_an_embedding_model(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    # an embedding model scores a pair by its two texts' embeddings: it reads no text pair
    assert_refused(artifacts, model_dir(), r"--pairs applies to classifiers; .* is served as an embedding model",
                   pairs=True)


def test_a_pair_classifier_is_registered_as_one_and_refuses_what_learns_from_single_texts(
        artifacts: Path, model_dir: Callable[..., Path]) -> None:
    entry = add_model(artifacts, "rr", model_dir("bert", classifier=True), pairs=True)
    assert entry["pairs"] is True and read_catalogue(artifacts)["rr"]["pairs"] is True
    assert "pairs" not in add_model(artifacts, "single", model_dir("roberta", classifier=True))
    for built in ("students and exit ramps", "shards"):
        with pytest.raises(ModelRefused, match=rf"model 'rr' classifies text pairs \(a cross-encoder, `models add "
                                               rf"--pairs`\): {built} learn from single texts"):
            refuse_pairs(artifacts, "rr", built)
    refuse_pairs(artifacts, "single", "shards")   # a classifier of single texts: built as before
    from academus.shared.training import shards
    from academus.shared.training.distill_data import Teacher

    with pytest.raises(ModelRefused, match="students and exit ramps learn from single texts"):
        Teacher.user(artifacts, "rr")   # distillation's and `ramps train --model`'s teacher
    with pytest.raises(ModelRefused, match="shards learn from single texts"):
        shards.build(artifacts, "rr")


def test_refuses_a_bad_name(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    before = (artifacts / "models.json").read_text()
    with pytest.raises(ModelRefused, match=r"model name 'Bad Name!' must be 1-63 of a-z 0-9"):
        add_model(artifacts, "Bad Name!", model_dir())
    assert (artifacts / "models.json").read_text() == before
    assert not (artifacts / "models").exists()


def test_refuses_a_name_already_in_the_catalogue(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    add_model(artifacts, "mine", source)
    before = (artifacts / "models.json").read_text()
    for name in ("minilm", "mine"):
        with pytest.raises(ModelRefused, match=rf"model '{name}' is already in the catalogue: remove it first"):
            add_model(artifacts, name, source)
    assert (artifacts / "models.json").read_text() == before
    assert sorted(p.name for p in (artifacts / "models").iterdir()) == ["mine"]


# --- adding ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "classifier", "architecture", "max_tokens"), [
    ("bert", False, "BertModel", 48),                          # positions from 0: all 48 rows
    ("roberta", True, "RobertaForSequenceClassification", 46),  # positions from padding index + 1
    ("mpnet", False, "MPNetModel", 46),
])
def test_adds_each_family(artifacts: Path, model_dir: Callable[..., Path], family: str, classifier: bool,
                          architecture: str, max_tokens: int) -> None:
    entry = add_model(artifacts, "mine", model_dir(family, classifier))
    expected = {"kind": "classification" if classifier else "embedding", "source": "models/mine",
                "architecture": architecture, "dim": 36, "layers": 3, "max_tokens": max_tokens,
                "pooling": "cls" if classifier else "mean", "normalize": not classifier,
                "labels": LABELS if classifier else [], "added": entry["added"]}
    assert entry == {"name": "mine", **expected}
    assert read_catalogue(artifacts) == {"minilm": BUNDLED, "mine": expected}
    copy = artifacts / "models" / "mine"
    assert sorted(p.name for p in copy.iterdir()) == ["config.json", "manifest.json", "model.safetensors",
                                                      "tokenizer.json"]
    assert sorted(p.name for p in (artifacts / "models").iterdir()) == ["mine"]   # no staging left
    manifest = verify_model_files(copy)
    assert sorted(manifest.files) == ["config.json", "model.safetensors", "tokenizer.json"]

    # a worker must refuse a copy damaged after it was added
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"mine/model\.safetensors does not match its sha256"):
        verify_model_files(copy)


def test_adds_a_sharded_model(artifacts: Path, tmp_path: Path) -> None:
    # the index must travel with its shards: without it transformers looks for model.safetensors and fails
    config = CONFIGS["bert"]()
    config.vocab_size = json_vocab_size()
    source = tmp_path / "sharded"
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(source, max_shard_size="1MB")
    shutil.copyfile(teacher_dir() / "tokenizer.json", source / "tokenizer.json")
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))
    assert len(shards) > 1
    add_model(artifacts, "mine", source)
    manifest = verify_model_files(artifacts / "models" / "mine")
    assert sorted(manifest.files) == sorted(["config.json", "model.safetensors.index.json", "tokenizer.json",
                                             *shards])


def test_builds_tokenizer_json_from_vocab_txt(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    (source / "tokenizer.json").unlink()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(teacher_dir() / name, source / name)
    add_model(artifacts, "mine", source)
    built = Tokenizer.from_file(str(artifacts / "models" / "mine" / "tokenizer.json"))
    teacher = Tokenizer.from_file(str(teacher_dir() / "tokenizer.json"))
    teacher.no_padding()   # the teacher's file pads to 128; serving pads batches itself
    ids = built.encode("hello world").ids
    assert ids == teacher.encode("hello world").ids
    assert len(ids) == 4   # [CLS] hello world [SEP]: a tokenizer without its post-processor would give 2


# --- pooling and normalisation ---------------------------------------------------------------------------------

def write_pooling(directory: Path, **modes: bool) -> Path:
    path = directory / "1_Pooling" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"word_embedding_dimension": 36, **modes}))
    return path


def test_pooling_from_sentence_transformers_config(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    write_pooling(source, pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    assert inspect_model_dir(source).pooling == "cls"
    assert inspect_model_dir(source, pooling="mean").pooling == "mean"
    assert add_model(artifacts, "mine", source)["pooling"] == "cls"


def test_refuses_an_unserved_pooling(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    write_pooling(source, pooling_mode_max_tokens=True)
    assert_refused(artifacts, source, r"src-bert-False/1_Pooling/config\.json asks for pooling_mode_max_tokens")
    # --pooling is the way out the message offers
    assert inspect_model_dir(source, pooling="mean").pooling == "mean"


def test_refuses_an_unknown_pooling_option(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    assert_refused(artifacts, model_dir(), r"--pooling 'max' is not one of mean, cls", pooling="max")


def test_normalize_follows_modules_json(model_dir: Callable[..., Path]) -> None:
    source = model_dir()
    assert inspect_model_dir(source).normalize is True   # no modules.json: normalised, as the teacher is
    (source / "modules.json").write_text(json.dumps(ST_MODULES))
    assert inspect_model_dir(source).normalize is False
    shutil.copyfile(teacher_dir() / "modules.json", source / "modules.json")   # ends with Normalize
    assert inspect_model_dir(source).normalize is True


def test_a_worker_serves_each_model_pooled_and_normalised_as_added(artifacts: Path,
                                                                     model_dir: Callable[..., Path]) -> None:
    """What ListModels and /info tell a client: the first token's state, not unit length, as the files ask."""
    from academus.services.worker.core import OUTPUT_EMBEDDING, ModelRunner
    from academus.shared.models.work import Batch

    source = model_dir()
    write_pooling(source, pooling_mode_cls_token=True)
    (source / "modules.json").write_text(json.dumps(ST_MODULES))   # no Normalize module
    add_model(artifacts, "mine", source)
    add_model(artifacts, "clf", model_dir("roberta", True))
    runner = ModelRunner(artifacts, ["mine", "clf"])
    assert {name: (s.pooling, s.normalized) for name, s in runner.specs.items()} == {
        "mine": ("cls", False), "clf": ("", False)}
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.no_padding()
    ids = tokenizer.encode("a fine film").ids
    served = runner.run(Batch("mine", OUTPUT_EMBEDDING, ids, [len(ids)])).values[0]
    body = transformers.BertModel.from_pretrained(source, add_pooling_layer=False).eval()
    with torch.no_grad():
        first = body(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
    torch.testing.assert_close(torch.from_numpy(served), first, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("text", "problem"), [("[{", "is not valid JSON"), ("{}", "is not a JSON list")])
def test_refuses_an_unreadable_modules_json(artifacts: Path, model_dir: Callable[..., Path], text: str,
                                            problem: str) -> None:
    source = model_dir()
    (source / "modules.json").write_text(text)
    assert_refused(artifacts, source, rf"src-bert-False/modules\.json {problem}")


# --- removing and listing --------------------------------------------------------------------------------------

def test_remove_refusals_keep_the_model(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    add_model(artifacts, "mine", model_dir())
    before = (artifacts / "models.json").read_text()
    with pytest.raises(ModelRefused, match=r"model 'minilm' is built by `academus prepare`"):
        remove_model(artifacts, "minilm")
    with pytest.raises(ModelRefused, match=r"model 'mine' is the base of tenant models of acme, zeta: delete"):
        remove_model(artifacts, "mine", tenants_on_it=["zeta", "acme"])
    with pytest.raises(ModelRefused, match=r"model 'nope' is not in the catalogue .*models\.json"):
        remove_model(artifacts, "nope")
    assert (artifacts / "models.json").read_text() == before
    verify_model_files(artifacts / "models" / "mine")


def test_remove_drops_entry_and_files(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    add_model(artifacts, "mine", model_dir())
    remove_model(artifacts, "mine")
    assert read_catalogue(artifacts) == {"minilm": BUNDLED}
    assert list((artifacts / "models").iterdir()) == []


def test_list_models(artifacts: Path, model_dir: Callable[..., Path]) -> None:
    add_model(artifacts, "mine", model_dir("roberta", classifier=True))
    mine, bundled = list_models(artifacts)   # sorted by name: "mine" < "minilm"
    assert bundled == {"name": "minilm", "kind": "embedding", "user": False}
    on_disk = sum(p.stat().st_size for p in (artifacts / "models" / "mine").iterdir())
    assert mine == {"name": "mine", "kind": "classification", "user": True,
                    "architecture": "RobertaForSequenceClassification", "dim": 36, "layers": 3, "max_tokens": 46,
                    "pooling": "cls", "labels": LABELS, "pairs": False, "bytes": on_disk}
    assert on_disk > (artifacts / "models" / "mine" / "model.safetensors").stat().st_size > 0
