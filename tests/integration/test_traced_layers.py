"""Traced layers (services/worker/traced.py) with the real teacher and a student group: the answers of
the layers' own forwards on every padded path, and the layers' own forwards wherever a graph would not
see what the call needs (hooks inside a layer, gradients)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.services.worker.traced import TracedLayer
from academus.shared.models.work import Batch
from tests.integration.test_student_serving import artifacts  # noqa: F401  (module fixture)

pytestmark = pytest.mark.integration
MODELS = ["sentiment", "minilm", "sentiment-students"]


@pytest.fixture(scope="module")
def runners(artifacts):  # noqa: F811
    return ModelRunner(artifacts, MODELS, traced=False), ModelRunner(artifacts, MODELS, traced=True)


def random_batch(rng: random.Random) -> tuple[list[int], list[int]]:
    lengths = [rng.randint(2, 60) for _ in range(rng.choice([1, 2, 5]))]  # rows of unequal length: padding
    return [rng.randint(1000, 20000) for _ in range(sum(lengths))], lengths


def test_traced_layers_answer_as_the_layers_own_forwards(runners):
    eager, traced = runners
    rng = random.Random(7)
    for _ in range(12):
        ids, lengths = random_batch(rng)
        for model in MODELS:
            output = OUTPUT_EMBEDDING if model == "minilm" else OUTPUT_PROBS
            k = rng.choice([1, 2]) if model.endswith("students") else 0
            want = eager.run(Batch(model, output, ids, lengths, num_students=k)).values
            got = traced.run(Batch(model, output, ids, lengths, num_students=k)).values
            np.testing.assert_allclose(got, want, atol=1e-5)
    first = traced.teacher().body.encoder.layer[0]
    assert isinstance(first.forward, TracedLayer) and not isinstance(eager.teacher().body.encoder.layer[0].forward,
                                                                     TracedLayer)
    # One graph for unpadded batches (no mask) and one for padded ones, traced at load and reused for every
    # shape; a serving call goes through them (cleared, they are traced again by the next batches).
    assert None in first.forward.graphs and len(first.forward.graphs) == 2
    first.forward.graphs.clear()
    traced.run(Batch("sentiment", OUTPUT_PROBS, [2023, 2003, 2307, 2143, 2023, 2003], [4, 2]))  # padded
    traced.run(Batch("sentiment", OUTPUT_PROBS, [2023, 2003, 2307], [3]))                        # unpadded
    assert None in first.forward.graphs and len(first.forward.graphs) == 2


def test_a_layer_runs_its_own_forward_where_a_graph_would_miss_a_hook_or_a_gradient(runners):
    _, traced = runners
    layer = traced.models["sentiment-students"].encoder.students[0].encoder.layer[0]
    hidden = torch.randn(1, 9, 384)
    with torch.no_grad():
        plain = layer(hidden)
    seen = []
    handle = layer.attention.output.dense.register_forward_hook(lambda m, i, o: seen.append(o.shape) or o * 0)
    try:
        with torch.no_grad():
            hooked = layer(hidden)
    finally:
        handle.remove()
    assert seen == [torch.Size([1, 9, 384])] and not torch.allclose(hooked, plain)  # the hook ran and mattered
    with torch.enable_grad():
        assert layer(hidden.requires_grad_()).requires_grad                        # training sees the graph


def test_a_plain_batch_stays_traced_beside_the_tenant_adapters_hooks(runners):
    from academus.shared.models.adapters import encode_with_adapters, install_adapters, remove_adapters
    from tests.unit.test_adapters import make_adapter

    eager, traced = runners
    teacher = traced.teacher()
    first = teacher.body.encoder.layer[0].forward
    ids, lengths = [2023, 2003, 2307, 2143, 2023, 2003], [4, 2]
    install_adapters(teacher)   # what a worker's first tenant batch leaves behind: hooks in every layer
    try:
        first.graphs.clear()
        plain = traced.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths)).values
        assert len(first.graphs) == 1                       # no tenant batch in this thread: still traced
        np.testing.assert_allclose(plain, eager.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths)).values, atol=1e-5)
        padded = [torch.tensor([ids[:4], [*ids[4:], 0, 0]]), torch.tensor([[1] * 4, [1, 1, 0, 0]])]
        with torch.inference_mode():
            adapted, _ = encode_with_adapters(teacher, *padded, None, [make_adapter(1, ["no", "yes"])] * 2)
        assert np.abs(adapted.numpy() - plain).max() > 1e-3  # a tenant batch runs the hooks (eager)
    finally:
        remove_adapters(teacher)


def test_mpnet_layers_run_traced_with_their_position_bias(tmp_path):
    """A user's MPNet (relative-position bias in every layer's call) answers traced as its layers' own forwards
    do, padded and unpadded, with graphs that take the bias."""
    from academus.shared.models.user_models import add_model
    from tests.models import tiny_model_dir

    tiny_model_dir("mpnet", False, tmp_path / "mpnet", seed=2)
    add_model(tmp_path / "artifacts", "tiny-mpnet", tmp_path / "mpnet")
    eager = ModelRunner(tmp_path / "artifacts", ["tiny-mpnet"], traced=False)
    traced = ModelRunner(tmp_path / "artifacts", ["tiny-mpnet"], traced=True)
    rng = random.Random(3)
    for _ in range(6):
        lengths = [rng.randint(2, 30) for _ in range(rng.choice([1, 3]))]
        ids = [rng.randint(1000, 20000) for _ in range(sum(lengths))]
        want = eager.run(Batch("tiny-mpnet", OUTPUT_EMBEDDING, ids, lengths)).values
        got = traced.run(Batch("tiny-mpnet", OUTPUT_EMBEDDING, ids, lengths)).values
        np.testing.assert_allclose(got, want, atol=1e-5)
    layer = traced.models["tiny-mpnet"].encoder.body.encoder.layer[1]
    assert isinstance(layer.forward, TracedLayer)
    assert layer.forward.graphs and all(key[1] == "bias" for key in layer.forward.graphs)

    hidden, bias = torch.randn(2, 7, 36), torch.randn(1, 3, 7, 7)
    mask = torch.zeros(2, 1, 7, 7)
    with torch.no_grad():
        own = layer.forward.own_forward(hidden, mask, bias)[0]
        positional = layer(hidden, mask, bias, output_attentions=False)[0]   # as MPNet's encoder calls it
        named = layer(hidden, mask, position_bias=bias)[0]                   # as the packed path calls it
        looked = layer(hidden, mask, bias, output_attentions=True)           # not covered: its own forward
    torch.testing.assert_close(positional, own, atol=1e-5, rtol=0)
    torch.testing.assert_close(named, own, atol=1e-5, rtol=0)
    assert len(looked) == 2   # the attention probabilities came back: the eager forward ran
