"""STI on a user's model: `academus shard build --model NAME` cuts a user's MPNet embedding model (added with
`models add`; a relative-position bias a head, positions from 2) into shards, fits a head a submodel shape on the
bundled task (the whole model's too: a user's model brings no head), and registers `NAME-<task>-sti`. A worker
serves it with the user's tokenizer, and with time enough its answer is the user's own encoder, pooled as it is
served, under the fitted head. Models the shards cannot cut are refused before anything is written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models.model import ClassifierHead, pad_batch
from academus.shared.models.shard_store import ShardStore, shards_dir
from academus.shared.models.shards import ADAPTED_HEADS, WIDTH_ORDERED
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.user_models import ModelRefused, add_model, cache_name, open_model, remove_model
from academus.shared.models.work import Batch
from academus.shared.state.artifacts import read_manifest
from academus.shared.state.catalogue import read_catalogue
from academus.shared.training.data import fetch, file_task, load_task
from academus.shared.training.prepare import load_head
from academus.shared.training.shard_plans import main
from academus.shared.training.shards import QUICK, build
from tests.conftest import artifacts_path, write_texts
from tests.e2e.test_user_models import each_text
from tests.models import LABELS, roberta_specials, tiny_model_dir

MODEL, SERVED = "tiny-enc", "tiny-enc-sentiment-sti"
TEXTS = ["a quiet triumph of a film", "dull, long and loud"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user-shards")
    # intermediate 54: shards split the FFN's neurons evenly between the 3 heads
    tiny_model_dir("mpnet", False, root / "enc", seed=4, intermediate_size=54)
    roberta_specials(root / "enc")
    add_model(root / "artifacts", MODEL, root / "enc")
    return root / "artifacts"


@pytest.fixture(scope="module")
def summary(artifacts: Path) -> dict:
    return build(artifacts, MODEL, ["sentiment"], quick=True)


def test_the_build_registers_the_users_model_served_from_its_shards(artifacts: Path, summary: dict) -> None:
    assert summary["tasks"]["sentiment"]["served_as"] == SERVED
    entry = read_catalogue(artifacts)[SERVED]
    source = artifacts / read_catalogue(artifacts)[MODEL]["source"]
    assert (entry["shards"], entry["base"], entry["task"]) == (f"shards/{MODEL}", MODEL, "sentiment")
    assert entry["teacher"] == cache_name(MODEL, read_manifest(source))
    store = ShardStore(shards_dir(artifacts, MODEL))
    assert store.manifest.extra["config"]["model_type"] == "mpnet" and store.verify()["ok"]
    assert (store.manifest.extra["pooling"], store.manifest.extra["normalize"]) == ("mean", True)
    assert store.tasks["sentiment"].widths == [1, 2, 3] and store.tasks["sentiment"].depths == [1, 2, 3]


def test_a_worker_serves_it_with_the_users_tokenizer_and_encoder(artifacts: Path, summary: dict) -> None:
    runner = ModelRunner(artifacts, [SERVED])
    spec = runner.models[SERVED].spec
    source = artifacts / read_catalogue(artifacts)[MODEL]["source"]
    assert spec.tokenizer == read_manifest(source).files["tokenizer.json"] and spec.architecture == "MPNetModel"
    assert runner.tokenizer_file(SERVED) == source / "tokenizer.json"
    tokenizer = TeacherTokenizer(source, max_tokens=spec.max_tokens)
    encoded = tokenizer.encode(TEXTS)
    ids = [list(e.input_ids) for e in encoded]
    result = runner.run(Batch(SERVED, OUTPUT_PROBS, [t for row in ids for t in row], [len(r) for r in ids]))
    assert (result.shards.layers, result.shards.width, result.shards.mean_bits) == (3, 3, 32)   # no deadline
    encoder, _, _ = open_model(source)
    head = runner.models[SERVED].sti.model.heads[(3, 3)]
    padded, mask, types = pad_batch(ids)
    with torch.inference_mode():
        expected = torch.softmax(head(encoder(padded, mask, types)), dim=-1)
    torch.testing.assert_close(torch.from_numpy(result.values), expected, atol=1e-5, rtol=1e-5)
    runner.models[SERVED].sti.close()


def test_the_shard_cli_takes_the_users_model(artifacts: Path, summary: dict, capsys: pytest.CaptureFixture) -> None:
    assert main(["info", "--model", MODEL, "--artifacts", str(artifacts)]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["geometry"] == {"layers": 3, "heads": 3, "hidden": 36, "intermediate": 54}
    assert info["embedding_rows_bytes"] > info["resident_bytes"]


def test_models_the_shards_cannot_cut_are_refused_before_anything_is_written(artifacts: Path, summary: dict,
                                                                              tmp_path: Path) -> None:
    tiny_model_dir("bert", False, tmp_path / "odd", seed=5)         # intermediate 52 over 3 heads
    tiny_model_dir("bert", True, tmp_path / "clf", seed=5, intermediate_size=54)
    for name, directory in (("tiny-odd", "odd"), ("tiny-clf", "clf")):
        add_model(artifacts, name, tmp_path / directory)
    with pytest.raises(ValueError, match="hidden and intermediate sizes must divide by the heads"):
        build(artifacts, "tiny-odd", ["sentiment"], quick=True)
    with pytest.raises(ValueError, match="'tiny-clf' is a sequence classifier: its shards serve its own task "
                                         r"\(as tiny-clf-sti\), so --tasks sentiment does not apply"):
        build(artifacts, "tiny-clf", ["sentiment"], quick=True)
    assert not any(shards_dir(artifacts, n).exists() for n in ("tiny-odd", "tiny-clf"))
    assert not {"tiny-odd-sentiment-sti", "tiny-clf-sti"} & set(read_catalogue(artifacts))
    for name in ("tiny-odd", "tiny-clf"):
        remove_model(artifacts, name)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_a_users_classifier_is_served_from_its_shards_with_its_own_head(artifacts: Path, tmp_path: Path,
                                                                         family: str) -> None:
    """BERT's own head is its pooler and classifier; RoBERTa's a dense, tanh and projection on `<s>`: at full
    width and precision the shards answer what transformers' classifier answers. The other shapes get linear
    heads fitted on the classifier's own predictions (accuracy: agreement with the classifier)."""
    name, served = f"tiny-{family}-clf", f"tiny-{family}-clf-sti"
    reference = tiny_model_dir(family, True, tmp_path / name, seed=6, intermediate_size=54)
    if family == "roberta":
        roberta_specials(tmp_path / name)
    add_model(artifacts, name, tmp_path / name)
    summary = build(artifacts, name, quick=True)
    assert summary["tasks"][name]["served_as"] == served and summary["tasks"][name]["labels"] == LABELS
    entry = read_catalogue(artifacts)[served]
    assert (entry["kind"], entry["labels"], entry["base"], entry["task"]) == ("classification", LABELS, name, name)
    store = ShardStore(shards_dir(artifacts, name))
    assert store.tasks[name].own_head and store.manifest.extra["pooling"] == "cls" and store.verify()["ok"]
    runner = ModelRunner(artifacts, [served])
    assert runner.models[served].spec.architecture == reference.config.architectures[0]
    heads = runner.models[served].sti.model.heads
    assert isinstance(heads[(1, 1)], ClassifierHead) and not isinstance(heads[(3, 3)], ClassifierHead)
    for ids in each_text(tmp_path / name):
        row = ids[0].tolist()
        result = runner.run(Batch(served, OUTPUT_PROBS, row, [len(row)]))
        assert (result.shards.layers, result.shards.width, result.shards.mean_bits) == (3, 3, 32)   # no deadline
        with torch.no_grad():
            expected = torch.softmax(reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, dim=-1)
        torch.testing.assert_close(torch.from_numpy(result.values), expected, atol=1e-5, rtol=1e-5)
    runner.models[served].sti.close()
    with pytest.raises(ModelRefused, match=f"is cut into the shards of {served}: remove those first"):
        remove_model(artifacts, name)
    remove_model(artifacts, served)
    remove_model(artifacts, name)


def test_a_width_trained_model_keeps_its_shards_in_index_order_and_the_teachers_heads(artifacts: Path,
                                                                                       tmp_path: Path) -> None:
    """`shard adapt` trains a width-m layer on its first m shards and names the tasks whose served heads scored its
    logits. The build ranks each layer's shards in index order (a random 3-layer, 3-head model's profile gives
    that 1 time in 216 a task) and keeps those tasks' served heads at the full shape; another task's is fitted. A
    model whose states are not the heads' width is refused by name before anything is written."""
    shutil.copytree(artifacts_path() / "heads", artifacts / "heads", dirs_exist_ok=True)   # the teacher's
    tiny_model_dir("bert", False, tmp_path / "wide", seed=7, hidden_size=384, intermediate_size=54)
    config = json.loads((tmp_path / "wide" / "config.json").read_text())
    (tmp_path / "wide" / "config.json").write_text(json.dumps({**config, WIDTH_ORDERED: [1, 2, 3],
                                                               ADAPTED_HEADS: ["sentiment"]}))
    add_model(artifacts, "tiny-wide", tmp_path / "wide")
    build(artifacts, "tiny-wide", ["sentiment", "spam"], quick=True)
    store = ShardStore(shards_dir(artifacts, "tiny-wide"))
    whole = (store.geometry.layers, store.geometry.heads)
    for task, kept in (("sentiment", True), ("spam", False)):
        shards = store.tasks[task]
        assert sorted(shards.importance) == [(k, s) for k in range(3) for s in range(3)]
        assert [shards.layer_order(k) for k in range(3)] == [[0, 1, 2]] * 3
        served, built = load_head(artifacts, task), store.heads(task)[whole]
        assert torch.equal(built.linear.weight, served.linear.weight) is kept, task
        assert list(built.labels) == list(served.labels)
    for name in ("tiny-wide-sentiment-sti", "tiny-wide-spam-sti", "tiny-wide"):
        remove_model(artifacts, name)
    tiny_model_dir("bert", False, tmp_path / "narrow", seed=7, intermediate_size=54)
    config = json.loads((tmp_path / "narrow" / "config.json").read_text())
    (tmp_path / "narrow" / "config.json").write_text(json.dumps({**config, ADAPTED_HEADS: ["sentiment"]}))
    add_model(artifacts, "tiny-narrow", tmp_path / "narrow")
    with pytest.raises(ValueError, match=f"'sentiment' among the tasks trained under the teacher's heads "
                                         f"\\({ADAPTED_HEADS}\\), but its states have {config['hidden_size']} "
                                         f"features and the head reads 384"):
        build(artifacts, "tiny-narrow", ["sentiment"], quick=True)
    assert "tiny-narrow-sentiment-sti" not in read_catalogue(artifacts)
    assert not shards_dir(artifacts, "tiny-narrow").exists()
    remove_model(artifacts, "tiny-narrow")


def test_the_users_model_is_removed_only_after_its_shards(artifacts: Path, summary: dict) -> None:
    with pytest.raises(ModelRefused, match=f"is cut into the shards of {SERVED}: remove those first"):
        remove_model(artifacts, MODEL)
    remove_model(artifacts, SERVED)
    assert not shards_dir(artifacts, MODEL).exists() and SERVED not in read_catalogue(artifacts)
    remove_model(artifacts, MODEL)


def test_a_classifiers_shards_learn_its_own_task_from_its_users_texts(artifacts: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """`--data F.jsonl`: the classifier labels its user's texts (split by text hash) and the shapes' heads and the
    importance are fitted on them, not on the bundled tasks'. Bad files are refused before anything is written."""
    name, served = "tiny-own-clf", "tiny-own-clf-sti"
    tiny_model_dir("bert", True, tmp_path / name, seed=7, intermediate_size=54)
    add_model(artifacts, name, tmp_path / name)
    texts = [e.text for e in load_task("spam", fetch(None)).train[:250]]   # real emails as the user's own texts
    own = write_texts(tmp_path / "own.jsonl", texts)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text"}\n')
    for model, data, message in ((name, bad, "bad.jsonl:2: missing field 'text'"),
                                 (name, tmp_path, "not a directory .*--data-dir"),
                                 (name, tmp_path / "none.jsonl", "none.jsonl: no such file"),
                                 ("sentiment-students", own, "not 'sentiment-students''s: a student group's")):
        assert main(["build", "--model", model, "--quick", "--data", str(data), "--artifacts", str(artifacts)]) == 1
        assert re.search(message, capsys.readouterr().err)
    tiny_model_dir("bert", False, tmp_path / "encoder", seed=8, intermediate_size=54)
    add_model(artifacts, "tiny-own-enc", tmp_path / "encoder")
    with pytest.raises(ValueError, match="--data gives a sequence classifier's own texts; 'tiny-own-enc' is not one"):
        build(artifacts, "tiny-own-enc", ["sentiment"], quick=True, texts_file=own)
    remove_model(artifacts, "tiny-own-enc")
    assert not shards_dir(artifacts, name).exists() and served not in read_catalogue(artifacts)
    summary = build(artifacts, name, quick=True, texts_file=own)
    store = ShardStore(shards_dir(artifacts, name))
    assert store.manifest.extra["own_texts"] == str(own) and summary["tasks"][name]["served_as"] == served
    validation = file_task(str(own), texts).validation           # the file's own split: fewer than --quick's 64
    metrics = store.tasks[name].metrics
    assert metrics["validation_texts"] == len(validation) < QUICK[1] and metrics["dev_texts"] == QUICK[2]
    assert set(store.tasks[name].metrics["validation_accuracy"]) and store.tasks[name].own_head
    remove_model(artifacts, served)
    remove_model(artifacts, name)
