"""Every served path of every family (BERT, RoBERTa, MPNet; encoder and sequence classifier) against transformers'
own forward on each text alone: padded, packed with HF layers, packed with our SDPA layers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from academus.shared.models.architectures import UnsupportedArchitecture, read_architecture
from academus.shared.models.model import FIRST, MEAN, load_encoder, mean_pool, pad_batch, probabilities
from academus.shared.models.packing import PackingPlan, encode_packed, pack
from academus.shared.models.students import from_teacher
from tests.models import CONFIGS, LABELS, SHAPE, tiny_model

TOLERANCE = 1e-4


def texts(vocab: int = 101, n: int = 7, seed: int = 1) -> list[list[int]]:
    """Token ids clear of the special ids (0-2: no RoBERTa/MPNet padding id inside a text)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 17))] for _ in range(n)]


def reference(model: nn.Module, classifier: bool, seq: list[int]) -> torch.Tensor:
    """transformers' forward on one text alone: the classifier's probabilities, or the normalised mean pool."""
    ids = torch.tensor([seq])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if classifier:
            return torch.softmax(model(input_ids=ids, attention_mask=mask).logits, dim=-1)[0]
        pooled = mean_pool(model(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
        return nn.functional.normalize(pooled, dim=1)[0]


PLANS = {
    "padded": None,
    "concat": PackingPlan.concat([[0, 1, 2], [3, 4], [5, 6]], row_length=48),
    "slotted": PackingPlan.slotted([[[0, 1], [2]], [[3], [4, 5]], [[6]]], row_length=48, slot_size=24),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("classifier", [False, True], ids=["encoder", "classifier"])
@pytest.mark.parametrize("path", ["padded", "concat-hf", "concat-sdpa", "slotted-hf", "slotted-sdpa"])
def test_every_path_equals_transformers_forward(tmp_path: Path, family: str, classifier: bool, path: str) -> None:
    model = tiny_model(family, classifier, tmp_path)
    encoder, head = load_encoder(tmp_path)
    assert (head is not None) == classifier
    assert encoder.pooling == (FIRST if classifier else MEAN)
    seqs = texts()
    expected = torch.stack([reference(model, classifier, s) for s in seqs])
    with torch.inference_mode():
        if path == "padded":
            ids, mask, types = pad_batch(seqs)
            pooled = encoder(ids, mask, types)
        else:
            layout, attention = path.split("-")
            pooled = encode_packed(encoder, pack(seqs, PLANS[layout]), attention)
        got = torch.softmax(head(pooled), dim=-1) if classifier else pooled
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_classifier_keeps_its_labels_in_id_order(tmp_path: Path) -> None:
    tiny_model("roberta", True, tmp_path)
    assert load_encoder(tmp_path)[1].labels == LABELS


@pytest.mark.parametrize("family,offset", [("bert", 0), ("roberta", 2), ("mpnet", 2)])
def test_positions_are_numbered_as_each_family_numbers_them(family: str, offset: int) -> None:
    architecture = read_architecture(CONFIGS[family]().to_dict())
    assert architecture.position_offset == offset
    assert architecture.max_tokens == SHAPE["max_position_embeddings"] - offset


def test_a_head_of_one_label_answers_its_sigmoid_and_wider_ones_their_softmax() -> None:
    """A reranker's one logit is a relevance: softmax over one label would answer 1.0 for every pair."""
    logits = torch.tensor([[2.0], [-1.0]])
    assert torch.allclose(probabilities(logits), torch.sigmoid(logits))
    wide = torch.tensor([[2.0, 0.5, -1.0]])
    assert torch.allclose(probabilities(wide), torch.softmax(wide, dim=-1))


def test_an_unsupported_architecture_is_named() -> None:
    config = {"architectures": ["DistilBertModel"], "model_type": "distilbert", "dim": 768}
    with pytest.raises(UnsupportedArchitecture, match=r"'DistilBertModel'.*supported: BertModel"):
        read_architecture(config)


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("path", ["padded", "concat-hf", "concat-sdpa", "slotted-sdpa"])
def test_a_student_cut_from_the_whole_teacher_answers_as_the_teacher(tmp_path: Path, family: str, path: str) -> None:
    """Students are layers of the teacher's own family: one cut from all its layers is the teacher (mean-pooled),
    and a group of two (α = 1 each) is twice it, on every path."""
    model = tiny_model(family, False, tmp_path)
    group = from_teacher(model, layers=SHAPE["num_hidden_layers"])
    group.add_student()
    group.eval()
    seqs = texts()
    expected = torch.stack([reference_mean(model, s) for s in seqs])
    with torch.inference_mode():
        for k in (1, 2):
            if path == "padded":
                got = group(*pad_batch(seqs), num_students=k)
            else:
                layout, attention = path.split("-")
                got = encode_packed(group, pack(seqs, PLANS[layout]), attention, num_students=k)
            assert (got - k * expected).abs().max().item() <= TOLERANCE, k


def reference_mean(model: nn.Module, seq: list[int]) -> torch.Tensor:
    ids = torch.tensor([seq])
    with torch.no_grad():
        return mean_pool(model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state,
                         torch.ones_like(ids))[0]
