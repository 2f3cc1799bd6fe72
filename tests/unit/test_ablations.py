"""Ablation pieces (Table 3 + BERT-2L): bootstrap sampling, the λ = 0 loss, mean ensembles, prefix-M-only
pruning, the cross-entropy baseline; on a tiny randomly initialised group (fast; no teacher needed)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from academus.shared.models.students import StudentGroup, student_config
from academus.shared.models.tokenization import Encoded
from academus.shared.training.ablations import (
    bagging_training,
    bootstrap_sample,
    hard_cross_entropy,
    train_direct,
    write_ablations,
)
from academus.shared.training.distill import (
    boost_loss,
    distill_loss,
    prefix_loss,
    prefix_sums,
    soft_cross_entropy,
    stack_loss,
    train_student,
)
from academus.shared.training.distill_data import DistillConfig, DistillData, Split

TINY = {"vocab_size": 50, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": 32, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}
CFG = DistillConfig(max_students=3, boost_epochs=2.0, prune_epochs=1.0, lr=3e-3, head_lr=1e-2,
                    tokens_per_batch=64, max_rows=8)


def toy_split(n: int, seed: int, dim: int = 16) -> Split:
    """Texts of 3–6 tokens; label 1 when token 7 occurs; target a fixed function of the label."""
    g = torch.Generator().manual_seed(seed)
    encoded, labels = [], []
    for _ in range(n):
        body = torch.randint(3, 20, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        label = int(torch.rand(1, generator=g).item() < 0.5)
        if label:
            body[0] = 7
        encoded.append(Encoded([1, *body, 2], [0] * (len(body) + 2)))
        labels.append(label)
    y = torch.tensor(labels)
    target = torch.stack([torch.full((dim,), 1.0), torch.full((dim,), -1.0)])[y]
    return Split(encoded, target, y)


def tiny_group(students: int = 1, seed: int = 0) -> StudentGroup:
    torch.manual_seed(seed)
    group = StudentGroup(student_config(TINY, 2), 1, ("neg", "pos"))
    for _ in range(1, students):
        group.add_student(alpha=0.5)
    return group


# --- sampling and losses ---------------------------------------------------------------------------

def test_bootstrap_sample_draws_with_replacement() -> None:
    picked = bootstrap_sample(1000, torch.Generator().manual_seed(0))
    assert len(picked) == 1000 and picked == sorted(picked)
    assert picked[0] >= 0 and picked[-1] < 1000
    assert 0.58 < len(set(picked)) / 1000 < 0.68               # 1 − 1/e ≈ 0.632 distinct
    assert picked == bootstrap_sample(1000, torch.Generator().manual_seed(0))
    assert picked != bootstrap_sample(1000, torch.Generator().manual_seed(1))


def test_lambda_zero_drops_the_stacking_term() -> None:
    target = torch.tensor([[1.0, 0.0]])
    previous = torch.tensor([[0.5, 0.5]])
    current = torch.tensor([[0.25, 0.0]])
    middle = torch.tensor([[2.0, -1.0]])
    boost = boost_loss(target, previous, current).item()       # ½(0.25² + 0.5²) = 0.15625
    assert boost == pytest.approx(0.15625)
    assert distill_loss(target, previous, current, middle, lam=0.0, first=False).item() == boost
    stacked = boost + 0.5 * stack_loss(previous, middle).item()  # ½(1.5² + 1.5²) = 2.25
    assert distill_loss(target, previous, current, middle, lam=0.5, first=False).item() == pytest.approx(stacked)
    assert distill_loss(target, previous, current, middle, lam=1.0, first=True).item() == boost


def test_hard_cross_entropy_by_hand() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(3.0), 0.0]])   # softmax (¼, ¾), (¾, ¼)
    labels = torch.tensor([1, 1])
    expected = -(math.log(0.75) + math.log(0.25)) / 2
    assert hard_cross_entropy(logits, labels).item() == pytest.approx(expected, rel=1e-6)
    one_hot = torch.nn.functional.one_hot(labels, 2).float()
    assert hard_cross_entropy(logits, labels).item() == pytest.approx(soft_cross_entropy(logits, one_hot).item())


def test_prefix_means_for_bagging() -> None:
    finals = torch.tensor([[[2.0]], [[4.0]], [[9.0]]])            # (M=3, n=1, d=1)
    alphas = torch.tensor([1.0, 0.5, 0.1])
    assert prefix_sums(finals, alphas).flatten().tolist() == pytest.approx([2.0, 4.0, 4.9])
    assert prefix_sums(finals, alphas, average=True).flatten().tolist() == pytest.approx([2.0, 3.0, 5.0])


def test_no_pruning_trains_only_the_full_group() -> None:
    group = tiny_group(3).eval()
    split = toy_split(6, seed=1)
    data = DistillData("t", ["neg", "pos"], {"train": split}, None)
    soft = torch.softmax(torch.randn(6, 2, generator=torch.Generator().manual_seed(2)), dim=-1)
    batch = list(range(6))
    with torch.no_grad():
        all_k = prefix_loss(group, data, split, batch, soft).item()
        full = prefix_loss(group, data, split, batch, soft, full_only=True).item()
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(e.input_ids) for e in split.encoded], batch_first=True)
        mask = (ids != 0).long()
        per_k = [soft_cross_entropy(group.head(group(ids, mask, None, num_students=k)), soft).item()
                 for k in (1, 2, 3)]
    assert full == pytest.approx(per_k[2], rel=1e-5)
    assert all_k == pytest.approx(sum(per_k), rel=1e-5)


# --- training variants -----------------------------------------------------------------------------

def test_bagging_trains_independent_students_with_equal_weights() -> None:
    group = tiny_group(1)
    start = [p.detach().clone() for p in group.students[0].parameters()]
    data = DistillData("t", ["neg", "pos"], {"train": toy_split(48, 3), "validation": toy_split(16, 4)}, None)
    history = bagging_training(group, data, CFG, torch.Generator().manual_seed(0))
    kept = [r for r in history if not r.get("dropped")]
    assert group.max_students == len(kept) >= 1
    assert all(r["samples"] == 48 and r["unique"] < 48 for r in history)
    assert group.alphas().tolist() == [1.0] * group.max_students       # α never trained
    moved = [max((p - s).abs().max().item() for p, s in zip(st.parameters(), start, strict=True))
             for st in group.students]
    assert min(moved) > 0                                               # every student trained


@pytest.mark.parametrize("train_alpha", [False, True])
def test_train_student_leaves_alpha_alone_when_told(train_alpha: bool) -> None:
    group = tiny_group(2)
    split = toy_split(16, 6)
    train_student(group, split, torch.zeros_like(split.target), list(range(16)), CFG,
                  torch.Generator().manual_seed(0), "t", train_alpha=train_alpha)
    assert (group.alphas()[1].item() != 0.5) == train_alpha


def test_bert_2l_learns_the_labels_with_cross_entropy() -> None:
    group = tiny_group(1)
    split = toy_split(64, 5)
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(e.input_ids) for e in split.encoded], batch_first=True)
    mask = (ids != 0).long()

    def loss() -> float:
        with torch.no_grad():
            return hard_cross_entropy(group.head(group.eval()(ids, mask, None, 1)), split.labels).item()

    before = loss()
    train_direct(group, split, CFG, torch.Generator().manual_seed(0), epochs=8.0)
    assert loss() < 0.5 * before


def test_runs_written_at_once_keep_each_others_variants(tmp_path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "ablations" / "spam.json"
    summaries = [{"task": "spam", "variants": {f"variant-{n}": {"accuracy": n / 10}}} for n in range(8)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda s: write_ablations(path, s), summaries))
    merged = json.loads(path.read_text())
    assert merged["variants"] == {f"variant-{n}": {"accuracy": n / 10} for n in range(8)}
