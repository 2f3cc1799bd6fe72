"""The plot service's real build() on an in-process grpc.aio server (port 0) over a table the real
teacher built: the wire returns the core's states, errors map to their status codes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from academus.services.plot.core import PlotLookup
from academus.shared.models.plot import PlotStore, TableError
from academus.shared.models.plot.hierarchical import HierarchicalEncoder
from academus.shared.models.plot.layers import SplitBert
from academus.shared.models.plot.wire import WIRE_DTYPE, lookup_from_pb, request_to_pb
from academus.shared.models.teacher_files import teacher_dir
from academus.shared.models.tokenization import TeacherTokenizer
from academus.shared.runtime.serving import CHANNEL_OPTIONS, RunningService
from academus.shared.training.plot_build import BuildOptions, build, count_ngrams, tokenize
from academus.v1 import plot_pb2, plot_pb2_grpc
from tests.conftest import env

pytestmark = pytest.mark.integration
K = 2
ROOT = ["the cat sat on the mat", "hello", "a red apple fell from the tree", "markets fell sharply today"]
DOMAIN = ["win a free cruise now", "win a free prize", "the cat sat on the mat"]
TEXTS = ["the cat sat on the mat", "win a free cruise today", "hello", "zebra"]



@pytest.fixture(scope="module")
def table_dir(tmp_path_factory, teacher) -> Path:
    out = tmp_path_factory.mktemp("plot-service")
    layers = SplitBert(teacher.body, K)
    build(ROOT, out, BuildOptions(lower_layers=K, unigrams="corpus"), layers=layers)
    build(DOMAIN, out, BuildOptions(lower_layers=K, domain="spam", top_percent=50), layers=layers)
    return out


def settings(table_dir: Path, **extra: str) -> dict[str, str]:
    return {"ACADEMUS_PLOT_DIR": str(table_dir), "ACADEMUS_LOWER_LAYERS": str(K), "ACADEMUS_PORT": "0",
            "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_MAX_TOKENS": "64", "ACADEMUS_GRACE_S": "1", **extra}


@pytest.fixture(scope="module")
async def plot_service(table_dir, redis_server):
    from academus.services.plot.server import build as plot_build

    with env(**settings(table_dir, ACADEMUS_REDIS_URL=redis_server.url, ACADEMUS_KEY_PREFIX="plot-test",
                        ACADEMUS_PLOT_ID="plot-a")):
        service = RunningService(await plot_build())
        await service.start()
    yield service
    await service.stop()


@pytest.fixture(scope="module")
async def stub(plot_service):
    async with grpc.aio.insecure_channel(plot_service.address, options=CHANNEL_OPTIONS) as channel:
        yield plot_pb2_grpc.PlotStub(channel)


@pytest.fixture(scope="module")
def batch() -> tuple[np.ndarray, np.ndarray]:
    seqs = [e.input_ids for e in TeacherTokenizer(teacher_dir()).encode(TEXTS)]
    return np.concatenate(seqs), np.array([len(s) for s in seqs])


@pytest.mark.parametrize("domain", ["", "spam"])
async def test_lookup_over_grpc_equals_the_core(stub, table_dir, batch, domain):
    ids, lengths = batch
    response = await stub.Lookup(request_to_pb(ids, lengths, domain), timeout=10)
    core = PlotLookup(PlotStore.open(table_dir, lower_layers=K), max_tokens=64).lookup(ids, lengths, domain)
    assert (response.hidden, response.lower_layers, response.model, response.dtype) == (384, K, "minilm", "float16")
    assert response.states == core.states.astype(WIRE_DTYPE).tobytes()
    received = lookup_from_pb(response)
    np.testing.assert_array_equal(received.lengths, lengths)
    assert received.counts == core.counts
    assert (received.counts.domain > 0) == bool(domain)


async def test_hierarchical_over_the_wire_matches_in_process(stub, table_dir, teacher, batch):
    ids, lengths = batch
    encoder = HierarchicalEncoder(PlotStore.open(table_dir, lower_layers=K), teacher)
    received = lookup_from_pb(await stub.Lookup(request_to_pb(ids, lengths, "spam"), timeout=10))
    seqs = np.split(ids, np.cumsum(lengths)[:-1])
    torch.testing.assert_close(encoder.pool_states(received.states, received.lengths),
                               encoder.pool([s.tolist() for s in seqs], "spam"), rtol=0, atol=2e-3)


async def test_info_names_the_table(stub):
    info = await stub.Info(plot_pb2.InfoRequest(), timeout=5)
    assert (info.model, info.lower_layers, info.hidden, list(info.domains)) == ("minilm", K, 384, ["spam"])
    assert info.root_entries > 0


@pytest.mark.parametrize(("ids", "lengths", "domain", "code", "message"), [
    ([101, 30522, 102], [3], "", grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
    ([101, 102], [3], "", grpc.StatusCode.INVALID_ARGUMENT, "lengths sum"),
    ([101] * 65, [65], "", grpc.StatusCode.INVALID_ARGUMENT, "limit is 64"),
    ([], [], "", grpc.StatusCode.INVALID_ARGUMENT, "no sequence"),
    ([101, 102], [2], "legal", grpc.StatusCode.NOT_FOUND, "legal"),
])
async def test_bad_requests_get_their_status(stub, ids, lengths, domain, code, message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Lookup(request_to_pb(np.array(ids, np.int64), np.array(lengths, np.int64), domain), timeout=5)
    assert err.value.code() == code and message in err.value.details()


async def test_service_refuses_a_table_of_another_k(table_dir):
    from academus.services.plot.server import build as plot_build

    with env(**settings(table_dir, ACADEMUS_LOWER_LAYERS="3")), pytest.raises(TableError, match="not layer-3"):
        await plot_build()


async def test_service_registers_in_redis_and_clients_find_it(plot_service, redis_server):
    import redis.asyncio as aioredis

    from academus.shared.models.plot.registry import live_plot_services
    from academus.shared.state.keys import Keys

    client, keys = aioredis.Redis.from_url(redis_server.url, decode_responses=True), Keys("plot-test")
    try:
        assert 0 < await client.ttl(keys.plot("plot-a")) <= 5
        [found] = await live_plot_services(client, keys, model="minilm", lower_layers=K, domain="spam")
        assert (found.plot_id, found.address, found.domains) == ("plot-a", plot_service.address, ("spam",))
        assert await live_plot_services(client, keys, lower_layers=3) == []
        assert await live_plot_services(client, keys, domain="legal") == []
        await client.sadd(keys.plots(), "gone")  # a service whose heartbeat expired
        assert [e.plot_id for e in await live_plot_services(client, keys)] == ["plot-a"]
        assert await client.smembers(keys.plots()) == {"plot-a"}
    finally:
        await client.aclose()


async def test_stopping_deregisters(table_dir, redis_server):
    import redis

    from academus.services.plot.server import build as plot_build
    from academus.shared.state.keys import Keys

    keys, client = Keys("plot-stop"), redis.Redis.from_url(redis_server.url, decode_responses=True)
    with env(**settings(table_dir, ACADEMUS_REDIS_URL=redis_server.url, ACADEMUS_KEY_PREFIX="plot-stop",
                        ACADEMUS_PLOT_ID="")):
        service = RunningService(await plot_build())
        await service.start()
    assert client.smembers(keys.plots()) == {service.address}  # no id given: the address is the id
    assert client.hget(keys.plot(service.address), "lower_layers") == str(K)
    await service.stop()
    assert client.smembers(keys.plots()) == set() and not client.exists(keys.plot(service.address))


async def test_an_overlay_built_deleted_or_rebuilt_while_the_service_runs_is_served_as_on_disk(
        table_dir, teacher, redis_server, tmp_path):
    """A Manage API domain job builds an overlay beside the served root: the running service answers for it
    at once and its next heartbeat lists it, so the schedulers' prefetch can use it without a restart.
    DeleteDomain removes it: the service stops serving and announcing it. Built again under the same name
    from another corpus, the new overlay is served, not the one mapped before."""
    import shutil

    import redis.asyncio as aioredis

    from academus.services.plot.server import build as plot_build
    from academus.shared.models.plot.registry import live_plot_services
    from academus.shared.state.keys import Keys

    table = tmp_path / "table"
    shutil.copytree(table_dir, table)
    with env(**settings(table, ACADEMUS_REDIS_URL=redis_server.url, ACADEMUS_KEY_PREFIX="plot-late",
                        ACADEMUS_PLOT_ID="plot-late", ACADEMUS_HEARTBEAT_TTL_S="1")):
        service = RunningService(await plot_build())
        await service.start()
    client, keys = aioredis.Redis.from_url(redis_server.url, decode_responses=True), Keys("plot-late")
    try:
        build(DOMAIN[:2], table, BuildOptions(lower_layers=K, domain="legal", top_percent=100),
              layers=SplitBert(teacher.body, K))
        [seq] = [e.input_ids for e in TeacherTokenizer(teacher_dir()).encode(TEXTS[1:2])]
        ids, lengths = np.array(seq, np.int64), np.array([len(seq)], np.int64)
        async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            reply = await plot_pb2_grpc.PlotStub(channel).Lookup(request_to_pb(ids, lengths, "legal"), timeout=5)
        assert reply.counts.domain > 0
        for _ in range(40):   # the heartbeat (TTL/3) re-announces the loaded overlays
            if await live_plot_services(client, keys, domain="legal"):
                break
            await asyncio.sleep(0.1)
        [found] = await live_plot_services(client, keys, domain="legal")
        assert found.domains == ("legal", "spam")

        shutil.rmtree(table / "domains" / "legal")          # DomainRegistry.delete
        async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await plot_pb2_grpc.PlotStub(channel).Lookup(request_to_pb(ids, lengths, "legal"), timeout=5)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND and "'legal'" in gone.value.details()
        for _ in range(40):
            if not await live_plot_services(client, keys, domain="legal"):
                break
            await asyncio.sleep(0.1)
        assert not await live_plot_services(client, keys, domain="legal")

        build(ROOT[:1], table, BuildOptions(lower_layers=K, domain="legal", top_percent=100),
              layers=SplitBert(teacher.body, K))            # built again: none of the text's windows now
        async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            again = await plot_pb2_grpc.PlotStub(channel).Lookup(request_to_pb(ids, lengths, "legal"), timeout=5)
        assert again.counts.domain == 0 and again.counts.root + again.counts.backoff == reply.counts.domain + \
            reply.counts.root + reply.counts.backoff

        build([*ROOT, TEXTS[1]], table, BuildOptions(lower_layers=K, unigrams="corpus"),
              layers=SplitBert(teacher.body, K))            # the root rebuilt, now with the text's windows
        async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
            stub = plot_pb2_grpc.PlotStub(channel)
            rooted = await stub.Lookup(request_to_pb(ids, lengths, ""), timeout=5)
            info = await stub.Info(plot_pb2.InfoRequest(), timeout=5)
        assert again.counts.backoff > 0 and rooted.counts.root == len(seq) - 2 and rooted.counts.backoff == 0
        assert info.domains == ["legal", "spam"] and info.root_entries > len(count_ngrams(tokenize(ROOT), 3)[0])
    finally:
        await client.aclose()
        await service.stop()
