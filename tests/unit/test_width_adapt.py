"""`shard adapt` (DynaBERT's width stage) on the real teacher: the body at full width is the body, rewiring keeps
its function and puts the chosen heads and neurons first, an unused head ranks last, training at every width
brings a narrow width's loss down while the full width stays the teacher's, and a width-trained model's shards
keep each layer in index order."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from academus.shared.models.model import TeacherEncoder
from academus.shared.models.shards import (
    LayerParts,
    LayerResident,
    LayerWeights,
    ShardGeometry,
    elastic_layer,
    key_mask,
)
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.training.data import load_task
from academus.shared.training.prepare import load_head, subsample
from academus.shared.training.shards import layers_in_index_order
from academus.shared.training.width_adapt import (
    AdaptSettings,
    TaskBatch,
    TeacherTargets,
    WidthTrainer,
    importance_scores,
    layer_at_width,
    rewire,
    states_at_width,
    task_batches,
    width_loss,
)
from tests.conftest import all_cores, artifacts_path, torch_threads


@pytest.fixture(scope="module")
def batches() -> list[TaskBatch]:
    examples = subsample(load_task("sentiment").train, 16)
    return task_batches(TeacherTokenizer(teacher_dir()), {"sentiment": examples},
                        AdaptSettings(batch=8, max_tokens=32), random.Random(0))


@pytest.fixture(scope="module")
def heads() -> dict:
    return {"sentiment": load_head(artifacts_path(), "sentiment")}


def body_of(teacher: TeacherEncoder) -> torch.nn.Module:
    return copy.deepcopy(teacher.body).eval()


def test_the_full_width_is_the_body(teacher: TeacherEncoder, batches: list[TaskBatch]) -> None:
    body, batch = teacher.body, batches[0]
    assert batch.ids.shape == (8, min(32, batch.ids.shape[1])) and batch.gold.shape == (8,)
    with torch.no_grad():
        states = states_at_width(body, ShardGeometry.of(body.config), batch, 12)
        expected = body(input_ids=batch.ids, attention_mask=batch.mask, token_type_ids=batch.types).last_hidden_state
    assert len(states) == 6
    torch.testing.assert_close(states[-1], expected, atol=1e-5, rtol=1e-5)


def test_rewiring_keeps_the_function_and_puts_the_chosen_heads_and_neurons_first(
        teacher: TeacherEncoder, batches: list[TaskBatch]) -> None:
    original, body = teacher.body, body_of(teacher)
    g = ShardGeometry.of(body.config)
    heads = torch.stack([torch.randperm(g.heads, generator=torch.Generator().manual_seed(k)) for k in range(6)])
    neurons = torch.stack([torch.randperm(g.heads * g.neurons, generator=torch.Generator().manual_seed(9 + k))
                           for k in range(6)])
    rewire(body, g, heads, neurons)
    batch = batches[0]
    with torch.no_grad():
        torch.testing.assert_close(states_at_width(body, g, batch, 12)[-1],
                                   states_at_width(original, g, batch, 12)[-1], atol=1e-4, rtol=1e-4)
        hidden = original.embeddings(input_ids=batch.ids, token_type_ids=batch.types)
        mask = key_mask(batch.mask)
        rewired = elastic_layer(hidden, mask, *layer_at_width(body.encoder.layer[0], g, 3), g)
        chosen = elastic_layer(hidden, mask, LayerResident.of(original.encoder.layer[0]),
                               chosen_shards(original.encoder.layer[0], g, heads[0][:3], neurons[0][:3 * g.neurons]),
                               g)
    torch.testing.assert_close(rewired, chosen, atol=1e-5, rtol=1e-5)


def chosen_shards(layer: torch.nn.Module, g: ShardGeometry, heads: torch.Tensor, neurons: torch.Tensor
                  ) -> LayerWeights:
    """The layer on the given heads and FFN neurons, picked out of its weights by index."""
    p = LayerParts.of(layer)
    rows = (heads[:, None] * g.head_dim + torch.arange(g.head_dim)).reshape(-1)
    return LayerWeights(p.query.weight[rows], p.key.weight[rows], p.value.weight[rows], p.output.weight[:, rows],
                        p.ffn_in.weight[neurons], p.ffn_out.weight[:, neurons], p.query.bias[rows],
                        p.key.bias[rows], p.value.bias[rows], p.ffn_in.bias[neurons], len(heads), heads)


def test_a_head_that_does_nothing_ranks_last(teacher: TeacherEncoder, batches: list[TaskBatch], heads: dict) -> None:
    body = body_of(teacher)
    g = ShardGeometry.of(body.config)
    p = LayerParts.of(body.encoder.layer[2])
    rows = slice(5 * g.head_dim, 6 * g.head_dim)
    with torch.no_grad():
        for linear in (p.query, p.key, p.value):
            linear.weight[rows] = 0
        p.output.weight[:, rows] = 0
        p.ffn_in.weight[:40] = 0
        p.ffn_out.weight[:, :40] = 0
    head_scores, neuron_scores = importance_scores(body, g, batches, heads)
    assert head_scores.shape == (6, 12) and neuron_scores.shape == (6, 1536)
    assert head_scores[2, 5] == 0 and head_scores[2].argsort(descending=True)[-1] == 5
    assert (neuron_scores[2, :40] == 0).all() and (neuron_scores[2, 40:] > 0).all()
    assert all(p.grad is None for p in body.parameters())


def test_training_at_every_width_brings_a_narrow_widths_loss_down(
        teacher: TeacherEncoder, batches: list[TaskBatch], heads: dict) -> None:
    body = body_of(teacher)
    trainer = WidthTrainer(body, heads, [3, 12], AdaptSettings())
    before = losses(trainer, batches)
    optimizer = torch.optim.AdamW(body.parameters(), lr=2e-4, weight_decay=0.0)
    with torch_threads(all_cores()):
        for _ in range(8):
            for batch in batches:
                trainer.step(batch, optimizer)
    after = losses(trainer, batches)
    assert before[12] < 1e-6 < before[3]
    assert after[3] < 0.75 * before[3], (before, after)     # measured: 1.33 -> 0.73
    assert after[12] < 0.5 * after[3], (before, after)      # the full width stays near the teacher: 0.21
    assert all(p.requires_grad is False for p in trainer.teacher.parameters())


@torch.no_grad()
def losses(trainer: WidthTrainer, batches: list[TaskBatch]) -> dict[int, float]:
    g, out = trainer.geometry, {}
    for width in trainer.widths:
        total = 0.0
        for b in batches:
            teacher = TeacherTargets.of(trainer.teacher, g, b, trainer.heads[b.task])
            total += float(width_loss(states_at_width(trainer.student, g, b, width), teacher, b.mask,
                                      trainer.heads[b.task]))
        out[width] = total / len(batches)
    return out


def test_a_width_trained_models_layers_keep_their_places_in_index_order() -> None:
    ranking = [(2, 7), (0, 3), (2, 1), (1, 0), (0, 9), (2, 4)]
    assert layers_in_index_order(ranking) == [(2, 0), (0, 0), (2, 1), (1, 0), (0, 1), (2, 2)]
