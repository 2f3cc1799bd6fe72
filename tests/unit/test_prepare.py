"""`academus prepare`: helpers on synthetic data, then one small real run (the real teacher)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from academus.shared.state.artifacts import WEIGHTS, ArtifactError
from academus.shared.training.data import Example
from academus.shared.training.prepare import (
    cached_embeddings,
    classification_metrics,
    fit_head,
    head_dir,
    length_batches,
    load_head,
    main,
    prepare,
)

LIMIT = 120   # examples a split: the whole module runs in well under a minute on 2 cores


def test_length_batches_cover_everything_within_budget() -> None:
    lengths = [5, 256, 17, 3, 256, 40, 90, 1] * 20
    batches = list(length_batches(lengths, batch_size=4, max_tokens=256))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert longest * len(batch) <= 4 * 256
        assert [lengths[i] for i in batch] == sorted((lengths[i] for i in batch), reverse=True)


def test_metrics_match_hand_computation() -> None:
    gold = torch.tensor([0, 0, 0, 1, 1, 1])
    pred = torch.tensor([0, 0, 1, 1, 1, 0])
    # class 0: tp 2, fp 1, fn 1 -> f1 2/3; class 1 the same
    assert classification_metrics(pred, gold, 2) == {"accuracy": round(4 / 6, 4), "f1": round(2 / 3, 4)}
    constant = classification_metrics(torch.zeros(6, dtype=torch.long), gold, 2)
    assert constant == {"accuracy": 0.5, "f1": round((2 * 3 / 9) / 2, 4)}


def test_fit_head_separates_separable_data() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.nn.functional.normalize(torch.randn(200, 384, generator=generator), dim=1)
    y = (x[:, 0] > 0).long()
    head = fit_head(x, y, ["neg", "pos"], weight_decay=1e-6)
    assert (head(x).argmax(1) == y).float().mean().item() > 0.97


class CountingEmbedder:
    """A stand-in teacher: each text's embedding is a function of the text; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, texts: list[str], _desc: str) -> torch.Tensor:
        self.asked += texts
        return torch.tensor([[float(len(t)), float(sum(map(ord, t)) % 97)] for t in texts]).reshape(-1, 2)


def splits_of(texts: list[str]) -> dict[str, list[Example]]:
    return {"train": [Example(t, 0) for t in texts[:-2]], "validation": [Example(texts[-2], 0)],
            "test": [Example(texts[-1], 1)]}


def test_subsets_share_one_text_store_and_each_text_is_embedded_once(tmp_path: Path) -> None:
    embed = CountingEmbedder()
    texts = [f"review number {i}" + "!" * i for i in range(12)]
    first = cached_embeddings(tmp_path, "sentiment", splits_of(texts[:6]), embed, whole=False)
    again = cached_embeddings(tmp_path, "sentiment", splits_of(texts[2:10]), embed, whole=False)
    assert embed.asked == texts[:6] + texts[6:10]         # the second subset embeds only its new texts
    expected = embed(texts[2:10], "")
    assert torch.equal(torch.cat([again["train"], again["validation"], again["test"]]), expected)
    assert torch.equal(first["test"], embed([texts[5]], ""))
    assert not (tmp_path / "sentiment.safetensors").exists()      # the whole splits' cache is never touched
    embed.asked.clear()
    cached_embeddings(tmp_path, "sentiment", splits_of(texts[:4]), embed, max_tokens=128, whole=False)
    assert embed.asked == texts[:4]                       # another token limit: other embeddings, a new store
    (tmp_path / "sentiment-texts.safetensors").write_bytes(b"broken")
    embed.asked.clear()
    cached_embeddings(tmp_path, "sentiment", splits_of(texts[:4]), embed, max_tokens=128, whole=False)
    assert embed.asked == texts[:4]                       # a broken store is rebuilt, not an error


def test_whole_splits_are_cached_by_their_key(tmp_path: Path) -> None:
    embed = CountingEmbedder()
    texts = [f"email {i}" for i in range(5)]
    first = cached_embeddings(tmp_path, "spam", splits_of(texts), embed)
    again = cached_embeddings(tmp_path, "spam", splits_of(texts), embed)
    assert embed.asked == texts and all(torch.equal(first[s], again[s]) for s in first)
    cached_embeddings(tmp_path, "spam", splits_of(texts[1:]), embed)
    assert embed.asked == texts + texts[1:]               # other splits: another key, embedded again


def still_states() -> tuple[torch.Tensor, torch.Tensor]:
    """An inner layer's first-token states as the critic classifier's measured: spreads near 5e-4 around fixed
    values, one dimension near 9.7; labels a noisy linear function of the spreads, 60 / 40."""
    g = torch.Generator().manual_seed(0)
    states = torch.randn(384, generator=g) * 0.05 + torch.randn(3000, 384, generator=g) * 5e-4
    states[:, 0] = 9.66 + torch.randn(3000, generator=g) * 4e-5
    direction = torch.randn(384, generator=g)
    direction[0] = 0
    score = (states - states.mean(0)) @ direction
    score = score + 0.3 * score.std() * torch.randn(3000, generator=g)
    return states, (score > score.quantile(0.4)).long()


def test_heads_on_still_states_learn_them_standardized_and_answer_them_raw() -> None:
    """On such states L-BFGS stops at the majority label; fitted on them standardized (the scaling folded back
    into the weights, so the head takes raw states) it learns the label. The shape heads and the exit ramps choose
    it on validation."""
    from academus.shared.training.ramps import fit_ramp
    from academus.shared.training.shards import fit_head as fit_shape_head

    states, labels = still_states()
    (x, y), (vx, vy) = (states[:2000], labels[:2000]), (states[2000:], labels[2000:])
    majority = max(vy.float().mean().item(), 1 - vy.float().mean().item())

    def agreement(head: torch.nn.Module) -> float:
        return (head(vx).argmax(1) == vy).float().mean().item()

    assert agreement(fit_head(x, y, ["a", "b"], 1e-6)) == pytest.approx(majority)
    assert agreement(fit_head(x, y, ["a", "b"], 1e-6, standardize=True)) > majority + 0.2
    assert agreement(fit_shape_head(x, y, vx, vy, ["a", "b"])) > majority + 0.2
    soft = torch.nn.functional.one_hot(labels, 2).float() * 0.8 + 0.1
    assert fit_ramp(x, soft[:2000], vx, soft[2000:], ["a", "b"])[1] > majority + 0.2


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory, dataset_dir: Path) -> tuple[Path, dict[str, Any]]:
    artifacts = tmp_path_factory.mktemp("artifacts")
    return artifacts, prepare(artifacts, dataset_dir, limit=LIMIT)


def test_small_run_beats_chance(small_run: tuple[Path, dict[str, Any]]) -> None:
    _, summary = small_run
    sentiment, spam = summary["tasks"]["sentiment"], summary["tasks"]["spam"]
    assert sentiment["status"] == spam["status"] == "trained"
    assert sentiment["counts"] == spam["counts"] == {"train": LIMIT, "validation": LIMIT, "test": LIMIT}
    # A constant guess has macro F1 <= 0.5 (and spam is ~70% ham, sentiment ~58% fresh).
    assert sentiment["test"]["f1"] > 0.55 and sentiment["test"]["accuracy"] > 0.6
    assert spam["test"]["f1"] > 0.8 and spam["test"]["accuracy"] > 0.85
    for task in (sentiment, spam):   # embedding may take no time: `make test`'s own run stored these texts
        assert set(task["seconds"]) == {"load_data", "embed", "train", "write"} and task["weight_decay"] > 0


def test_small_run_artifacts_load(small_run: tuple[Path, dict[str, Any]]) -> None:
    artifacts, _ = small_run
    head = load_head(artifacts, "spam")
    assert head.labels == ["ham", "spam"] and not head.training
    assert head.linear.weight.shape == (2, 384) and head.linear.weight.abs().sum() > 0
    catalogue = json.loads((artifacts / "models.json").read_text())
    assert catalogue["minilm"]["kind"] == "embedding"
    assert catalogue["sentiment"] == {
        "kind": "classification", "task": "sentiment", "head": "heads/sentiment",
        "labels": ["rotten", "fresh"], "teacher": "all-MiniLM-L6-v2",
    }
    assert catalogue["spam"]["labels"] == ["ham", "spam"]


def test_second_run_skips_and_prints_json_last(small_run: tuple[Path, dict[str, Any]],
                                               dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    artifacts, first = small_run
    assert main(["--artifacts", str(artifacts), "--data", str(dataset_dir)]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("sentiment", "spam"):
        assert last["tasks"][name]["status"] == "skipped"
        assert last["tasks"][name]["test"] == first["tasks"][name]["test"]


def test_tampered_head_is_refused(small_run: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    artifacts, _ = small_run
    copy = tmp_path / "heads" / "sentiment"
    copy.mkdir(parents=True)
    for f in head_dir(artifacts, "sentiment").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / WEIGHTS).write_bytes((copy / WEIGHTS).read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(ArtifactError, match="sha256"):
        load_head(tmp_path, "sentiment")


def test_unknown_task_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known tasks"):
        prepare(tmp_path, tasks=("imdb",))


def test_catalogue_rewrite_keeps_student_groups_and_drops_heads_that_no_longer_verify(tmp_path):
    from academus.shared.training.prepare import write_catalogue

    (tmp_path / "models.json").write_text(json.dumps({
        "sentiment-students": {"kind": "classification", "students": "students/sentiment"},
        "spam-plot": {"kind": "classification", "head": "heads/spam-plot", "plot": "plot/minilm-k3"},
        "spam": {"kind": "classification", "head": "heads/spam"}}))
    catalogue = write_catalogue(tmp_path)
    assert set(catalogue) == {"minilm", "null", "sentiment-students", "spam-plot"}  # `plot head` owns spam-plot
    assert catalogue["null"] == {"kind": "embedding", "null": True, "dim": 384, "max_tokens": 256}  # no weights
    assert json.loads((tmp_path / "models.json").read_text()) == catalogue
