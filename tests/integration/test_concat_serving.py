"""The `concat` policy (TCB DAS + ConcatBatching) over real gRPC, real Redis and the real teacher, on
in-process services: two deployments (concat and fifo) share one worker; packed answers must equal the
unbatched ones, and requests DAS cannot serve in time are answered DEADLINE_EXCEEDED, never computed."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from academus.client import AsyncClient
from academus.services.worker.core import OUTPUT_PROBS, ModelRunner
from academus.shared.models.work import Batch
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService
from academus.shared.state.keys import Keys
from academus.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import NO_WAIT_BOUND, env
from tests.integration.test_inprocess_mesh import KEY
from tests.integration.test_student_groups import MODEL as GROUP_MODEL
from tests.integration.test_student_groups import TEXTS as GROUP_TEXTS
from tests.integration.test_student_groups import groups_of
from tests.integration.test_student_groups import start as start_groups
from tests.integration.test_student_serving import artifacts, tokens  # noqa: F401  (module fixture)

pytestmark = pytest.mark.integration
ROW = 64
TEXTS = ["hi", "win a FREE cruise now, reply YES", "lunch at noon?", "meeting moved to 3pm, same room",
         "URGENT: your account is suspended, verify your password at this link today",
         "thanks!", "can you send me the slides from yesterday's talk about the new budget and hiring plan",
         "ok", "congratulations, you have been selected for a cash prize of one million dollars, call now",
         "see you tomorrow", "the build is green again", "click here to unsubscribe"]
LONG = "the quarterly report covers revenue, costs, hiring and the outlook for next year " * 12   # > 64 tokens


async def start(redis_url: str, prefix: str, schedulers: list[dict[str, str]]) -> list[RunningService]:
    """Resource manager, one worker (spam + minilm), one scheduler a settings dict, the gateway."""
    from academus.services.gateway.server import build as gateway
    from academus.services.resource_manager.server import build as resource_manager
    from academus.services.scheduler.server import build as scheduler
    from academus.services.worker.server import build as worker

    redis = connect(redis_url)
    await redis.hset(Keys(prefix).api_key(KEY), mapping={"tenant": "it", "role": "tenant"})
    await redis.aclose()
    common = {"ACADEMUS_REDIS_URL": redis_url, "ACADEMUS_KEY_PREFIX": prefix, "ACADEMUS_PORT": "0",
              "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_ARTIFACTS": str(artifacts_dir()),
              "ACADEMUS_WORKER_ID": f"{prefix}-worker", "ACADEMUS_MODELS": "spam,minilm", "ACADEMUS_GRACE_S": "5",
              **NO_WAIT_BOUND}
    running = []
    with env(**common):
        for build, settings in [(resource_manager, {}), (worker, {}),
                                *((scheduler, {"ACADEMUS_SCHEDULER_ID": f"{prefix}-{s['ACADEMUS_POLICY']}", **s})
                                  for s in schedulers), (gateway, {})]:
            with env(**settings):
                running.append(RunningService(await build()))
                await running[-1].start()
    return running


@pytest.fixture(scope="module")
async def mesh(redis_server):
    concat = {"ACADEMUS_POLICY": "concat", "ACADEMUS_CONCAT_ROW_LENGTH": str(ROW), "ACADEMUS_CONCAT_ROWS": "4"}
    running = await start(redis_server.url, "it-concat", [concat, {"ACADEMUS_POLICY": "fifo"}])
    yield running[-1].address
    for service in reversed(running):
        await service.stop()


@pytest.fixture(scope="module")
async def strict_mesh(redis_server):
    """Oversize texts refused; a latency model whose batch takes 5 s, so DAS drops any shorter deadline."""
    concat = {"ACADEMUS_POLICY": "concat", "ACADEMUS_CONCAT_ROW_LENGTH": str(ROW), "ACADEMUS_CONCAT_OVERSIZE": "reject",
              "ACADEMUS_BATCH_OVERHEAD_MS": "5000"}
    running = await start(redis_server.url, "it-concat-strict", [concat])
    yield running[-1].address
    for service in reversed(running):
        await service.stop()


async def infer(address: str, texts: list[str], policy: str, model: str = "spam", timeout: float = 60,
                output: int = inference_pb2.OUTPUT_UNSPECIFIED) -> inference_pb2.InferResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        request = inference_pb2.InferRequest(model=model, policy=policy, output=output,
                                             inputs=[inference_pb2.TextInput(text=t) for t in texts])
        return await inference_pb2_grpc.InferenceStub(channel).Infer(request, timeout=timeout,
                                                                     metadata=(("x-api-key", KEY),))


def values(response: inference_pb2.InferResponse) -> np.ndarray:
    return np.array([list(p.probs) or list(p.embedding) for p in response.predictions])


def worker_batches(model: str) -> float:
    return REGISTRY.get_sample_value("academus_worker_batches_total", {"model": model}) or 0.0


@pytest.mark.parametrize(("model", "output"), [("spam", inference_pb2.OUTPUT_LABEL),
                                               ("minilm", inference_pb2.OUTPUT_EMBEDDING)])
async def test_packed_answers_equal_the_fifo_answers(mesh, model, output):
    alone = [await infer(mesh, [t], "fifo", model, output=output) for t in [*TEXTS, LONG]]
    assert {r.metadata.policy for r in alone} == {"fifo"} and {r.metadata.batch_size for r in alone} == {1}
    packed = await asyncio.gather(*(infer(mesh, [t], "concat", model, output=output) for t in [*TEXTS, LONG]))
    assert {r.metadata.policy for r in packed} == {"concat"}
    for a, p in zip(alone, packed, strict=True):
        assert np.abs(values(a) - values(p)).max() <= 1e-4
        assert [x.label for x in a.predictions] == [x.label for x in p.predictions]
    merged = [r.metadata for r in packed if r.metadata.batch_size > 1]
    assert merged, "concurrent requests should share a packed batch"
    lengths = [p.num_tokens for r in alone for p in r.predictions]
    for meta in merged:
        # the tokens computed stay close to the real ones, far below padding to the longest
        assert meta.real_tokens <= meta.padded_tokens <= 1.5 * meta.real_tokens
        assert meta.padded_tokens < meta.batch_size * max(lengths)
    long_answer = packed[-1]
    assert long_answer.predictions[0].num_tokens > ROW and not long_answer.predictions[0].truncated


async def test_a_request_with_several_texts_keeps_them_in_order(mesh):
    texts = [TEXTS[4], TEXTS[0], LONG, TEXTS[8]]
    alone = await infer(mesh, texts, "fifo")
    together = await asyncio.gather(*(infer(mesh, texts, "concat") for _ in range(3)))
    for response in together:
        assert np.abs(values(response) - values(alone)).max() <= 1e-4


async def test_deadline_das_cannot_meet_is_answered_and_never_computed(strict_mesh):
    before = worker_batches("spam")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await infer(strict_mesh, [TEXTS[1]], "concat", timeout=2.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "not computed" in info.value.details()
    assert worker_batches("spam") == before
    answered = await infer(strict_mesh, [TEXTS[1]], "concat", timeout=30)   # room for a 5 s batch: served
    assert answered.predictions[0].label == "spam" and worker_batches("spam") == before + 1


async def test_oversize_reject_names_the_limit_and_computes_nothing(strict_mesh):
    before = worker_batches("spam")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await infer(strict_mesh, [TEXTS[0], LONG], "concat", timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"L={ROW} (ACADEMUS_CONCAT_ROW_LENGTH)" in info.value.details()
    assert worker_batches("spam") == before


async def test_concat_packs_a_student_group_split_across_workers(redis_server, artifacts):  # noqa: F811
    """Concat applies to any model: the members of a group on two workers each run their packed share,
    and the scheduler's sum equals the whole group run padded on one worker."""
    # the burst must not change the group under test: a loaded machine queues it long enough for the resource
    # manager's burst rule to take a student away, so the adaptation loop does not run here
    running = await start_groups(redis_server.url, artifacts, ACADEMUS_POLICY="concat",
                                 ACADEMUS_ADAPT_INTERVAL_S="3600")
    try:
        await groups_of(redis_server.url, students=2, count=1)
        texts = [*GROUP_TEXTS, LONG]
        async with AsyncClient(running[-1].address, api_key=KEY, timeout=60) as client:
            answers = await asyncio.gather(*(client.infer(GROUP_MODEL, [t]) for t in texts))
    finally:
        for service in reversed(running):
            await service.stop()
    assert {a.metadata.policy for a in answers} == {"concat"} and {a.metadata.student_count for a in answers} == {2}
    assert max(a.metadata.batch_size for a in answers) > 1
    runner = ModelRunner(artifacts, [GROUP_MODEL])
    ids, lengths = tokens(texts)
    whole = runner.run(Batch(GROUP_MODEL, OUTPUT_PROBS, ids, lengths, num_students=2)).values
    served = np.array([[a.predictions[0].probs["rotten"], a.predictions[0].probs["fresh"]] for a in answers])
    assert np.abs(served - whole).max() <= 1e-4
