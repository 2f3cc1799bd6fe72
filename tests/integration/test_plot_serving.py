"""`minilm-plot` and `spam-plot` served by the worker in process (HMI's hierarchical model): a tiny
table the real teacher builds, registered by the real commands, served through gateway -> scheduler
-> worker over real gRPC with a real Redis; answers equal HierarchicalEncoder's."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from academus.services.worker.core import OUTPUT_EMBEDDING, OUTPUT_PROBS, ModelRunner
from academus.shared.models.packing import PackingPlan
from academus.shared.models.plot import PlotStore
from academus.shared.models.plot.hierarchical import HierarchicalEncoder, PlotStates
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.models.work import Batch
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.errors import DeadlineExceeded, InvalidArgument
from academus.shared.training.plot_build import BuildOptions, build
from academus.shared.training.plot_models import register_embedding, train_plot_head
from academus.shared.training.prepare import load_head_at

pytestmark = pytest.mark.integration
K = 3
CORPUS = ["the cat sat on the mat", "win a free cruise now", "click here to claim your prize",
          "lunch at noon tomorrow?", "the meeting moved to friday"]
TEXTS = ["the cat sat on the mat", "win a free cruise today", "hello", "zebra crossings at noon"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, teacher):
    """The prepared catalogue and heads, plus a tiny K=3 table registered as minilm-plot and a
    spam-plot head trained on a few examples of each split by the real command."""
    root = tmp_path_factory.mktemp("plot-artifacts")
    shutil.copy(artifacts_dir() / "models.json", root / "models.json")
    shutil.copytree(artifacts_dir() / "heads", root / "heads")
    table = root / "plot" / "minilm-k3"
    build(CORPUS, table, BuildOptions(lower_layers=K, unigrams="corpus"), layers=SplitBert(teacher.body, K))
    assert register_embedding(root, table) == "minilm-plot"
    assert register_embedding(root, tmp_path_factory.mktemp("elsewhere")) is None  # outside: not served
    summary = train_plot_head(root, "spam", table, limit=12, batch_size=8)
    assert summary["model"] == "spam-plot" and set(summary["teacher"]) == {"validation", "test"}
    return root


@pytest.fixture(scope="module")
def encoder(artifacts, teacher) -> HierarchicalEncoder:
    return HierarchicalEncoder(PlotStore.open(artifacts / "plot" / "minilm-k3", lower_layers=K), teacher)


def token_lists(texts: list[str]) -> list[list[int]]:
    return [e.input_ids for e in TeacherTokenizer(teacher_dir()).encode(texts)]


def flat(texts: list[str]) -> tuple[list[int], list[int]]:
    seqs = token_lists(texts)
    return [t for s in seqs for t in s], [len(s) for s in seqs]


def head_probs(artifacts, pooled: torch.Tensor) -> torch.Tensor:
    head = load_head_at(artifacts / "heads" / "spam-plot")
    with torch.inference_mode():
        return torch.softmax(head(pooled), -1)


def test_the_commands_register_both_models(artifacts):
    catalogue = json.loads((artifacts / "models.json").read_text())
    embedding, spam = catalogue["minilm-plot"], catalogue["spam-plot"]
    assert (embedding["kind"], embedding["plot"], embedding["lower_layers"]) == ("embedding", "plot/minilm-k3", K)
    assert (spam["kind"], spam["head"], spam["labels"]) == ("classification", "heads/spam-plot", ["ham", "spam"])
    assert catalogue["spam"]["head"] == "heads/spam"   # the teacher's entries stay


def test_worker_serves_the_hierarchical_model_in_process(artifacts, encoder):
    runner = ModelRunner(artifacts, ["minilm-plot", "spam-plot", "minilm"])
    assert {name: (s.pooling, s.normalized) for name, s in runner.specs.items()} == {
        "minilm-plot": ("mean", True), "spam-plot": ("", False), "minilm": ("mean", True)}   # pooled as its encoder
    ids, lengths = flat(TEXTS)
    served = runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths))
    expected = encoder.pool(token_lists(TEXTS))
    torch.testing.assert_close(torch.from_numpy(served.values), expected, rtol=0, atol=1e-5)
    teacher = runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths)).values
    assert not np.allclose(served.values, teacher, atol=1e-3)   # really the lookups, not the teacher
    probs = runner.run(Batch("spam-plot", OUTPUT_PROBS, ids, lengths))
    assert probs.labels == ["ham", "spam"]
    torch.testing.assert_close(torch.from_numpy(probs.values), head_probs(artifacts, expected), rtol=0, atol=1e-5)


def test_a_packing_plan_runs_padded_with_the_same_answers(artifacts):
    runner = ModelRunner(artifacts, ["minilm-plot"])
    ids, lengths = flat(TEXTS)
    padded = runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths))
    planned = runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths,
                               plan=PackingPlan.concat([[0, 1, 2, 3]], 64)))
    np.testing.assert_array_equal(planned.values, padded.values)
    assert planned.padded_tokens == len(lengths) * max(lengths)


def test_the_deadline_stops_between_the_upper_layers(artifacts):
    """The first hooked layer that runs is layer K: the lower ones are lookups, never run."""
    calls = iter([0.0] + [100.0] * 50)   # in time when the batch starts, late at the first layer
    runner = ModelRunner(artifacts, ["minilm-plot"], clock=lambda: next(calls))
    ids, lengths = flat(TEXTS[:1])
    with pytest.raises(DeadlineExceeded, match=f"encoder.layer.{K}; the rest"):
        runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths), deadline=1.0)


def test_sentence_pairs_are_refused_naming_the_field(artifacts):
    runner = ModelRunner(artifacts, ["minilm-plot"])
    ids, lengths = flat(TEXTS[:1])
    with pytest.raises(InvalidArgument, match="token_type_ids"):
        runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths, token_type_ids=[0] * 4 + [1] * (len(ids) - 4)))


async def test_minilm_plot_through_gateway_scheduler_worker(artifacts, encoder, redis_server):
    from academus.client import AsyncClient
    from tests.integration.test_inprocess_mesh import KEY, start_services

    running = await start_services(redis_server.url, "plot-serving", ACADEMUS_ARTIFACTS=str(artifacts),
                                   ACADEMUS_MODELS="minilm-plot,spam-plot")
    try:
        async with AsyncClient(running[-1].address, api_key=KEY) as client:
            embedded = await client.infer("minilm-plot", TEXTS, output="embedding")
            labelled = await client.infer("spam-plot", TEXTS)
    finally:
        for service in reversed(running):
            await service.stop()
    expected = encoder.pool(token_lists(TEXTS))
    got = torch.tensor([p.embedding for p in embedded.predictions])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    probs = head_probs(artifacts, expected)
    for p, row in zip(labelled.predictions, probs, strict=True):
        assert p.label == ["ham", "spam"][int(row.argmax())]
        assert p.probs["spam"] == pytest.approx(float(row[1]), abs=1e-5)


def fp16_route(encoder: HierarchicalEncoder, texts: list[str]) -> torch.Tensor:
    """What a prefetched batch computes: the lookup rounded to the wire's float16, then the upper layers."""
    ids, lengths = flat(texts)
    lookup = encoder.store.lookup(np.array(ids), np.array(lengths))
    return encoder.pool_states(lookup.states.astype(np.float16).astype(np.float32), lookup.lengths)


def test_prefetched_states_run_only_the_upper_layers_and_foreign_ones_are_refused(artifacts, encoder):
    runner = ModelRunner(artifacts, ["minilm-plot", "minilm"])
    ids, lengths = flat(TEXTS)
    lookup = encoder.store.lookup(np.array(ids), np.array(lengths))
    states = PlotStates(lookup.states.astype(np.float16).astype(np.float32), lookup.lengths, "minilm", K)
    served = runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths, plot_states=states))
    torch.testing.assert_close(torch.from_numpy(served.values), fp16_route(encoder, TEXTS), rtol=0, atol=1e-5)
    with pytest.raises(InvalidArgument, match=r"plot_states come from a 'minilm' K=2 table; this model serves "
                                              r"'minilm' K=3"):
        runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths, plot_states=replace(states, lower_layers=2)))
    with pytest.raises(InvalidArgument, match=r"plot_states has shape \(\d+, 384\); the texts need"):
        runner.run(Batch("minilm-plot", OUTPUT_EMBEDDING, ids, lengths,
                         plot_states=replace(states, states=states.states[1:])))
    with pytest.raises(InvalidArgument, match="plot_states set for 'minilm', which computes its lower layers"):
        runner.run(Batch("minilm", OUTPUT_EMBEDDING, ids, lengths, plot_states=states))


async def test_the_scheduler_prefetches_plot_states_while_requests_wait(artifacts, encoder, redis_server):
    """HMI §6.1: requests waiting for a padded batch to fill are looked up in the plot service meanwhile;
    the batch carries the states and the worker runs only the upper layers on them."""
    from academus.client import AsyncClient
    from academus.services.plot.server import build as plot_build
    from academus.shared.runtime.redis_conn import connect
    from academus.shared.runtime.serving import RunningService
    from academus.shared.state.keys import Keys
    from tests.conftest import env
    from tests.integration.test_inprocess_mesh import KEY, start_services

    prefix = "plot-prefetch"
    with env(ACADEMUS_REDIS_URL=redis_server.url, ACADEMUS_KEY_PREFIX=prefix, ACADEMUS_PORT="0",
             ACADEMUS_METRICS_PORT="-1", ACADEMUS_PLOT_DIR=str(artifacts / "plot" / "minilm-k3"),
             ACADEMUS_LOWER_LAYERS=str(K), ACADEMUS_GRACE_S="1"):
        plot = RunningService(await plot_build())
        await plot.start()
    # a batch leaves after its delay whether or not its lookups are back (then the worker looks up): 1.5 s
    # leaves them time on a loaded machine, where a lookup can take longer than 0.3 s
    running = [plot, *await start_services(redis_server.url, prefix, ACADEMUS_ARTIFACTS=str(artifacts),
                                           ACADEMUS_MODELS="minilm-plot,spam-plot", ACADEMUS_POLICY="padded",
                                           ACADEMUS_MAX_BATCH="64", ACADEMUS_MAX_DELAY_MS="1500")]
    redis = connect(redis_server.url)
    try:
        async with AsyncClient(running[-1].address, api_key=KEY) as client:
            embedded = await asyncio.gather(*(client.infer("minilm-plot", [t], output="embedding") for t in TEXTS))
            labelled = await client.infer("spam-plot", TEXTS)
        [scheduler] = await redis.smembers(Keys(prefix).schedulers())
        for _ in range(50):   # the scheduler writes its load signals every 0.1 s
            load = await redis.hgetall(Keys(prefix).load(scheduler))
            if int(load.get("plot_prefetch_used", 0)) + int(load.get("plot_prefetch_missed", 0)) >= len(TEXTS) + 1:
                break
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()
        for service in reversed(running):
            await service.stop()
    assert all(a.metadata.plot_prefetched for a in [*embedded, labelled])
    assert int(load["plot_prefetch_used"]) == len(TEXTS) + 1 and int(load["plot_prefetch_missed"]) == 0
    assert max(a.metadata.batch_size for a in embedded) > 1   # the waiting requests shared one batch
    got = torch.tensor([a.predictions[0].embedding for a in embedded])
    expected = fp16_route(encoder, TEXTS)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert torch.nn.functional.cosine_similarity(got, encoder.pool(token_lists(TEXTS))).min() > 0.999
    probs = head_probs(artifacts, expected)
    assert [p.probs["spam"] for p in labelled.predictions] == pytest.approx(probs[:, 1].tolist(), abs=1e-5)
