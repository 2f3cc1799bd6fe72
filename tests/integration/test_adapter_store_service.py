"""The adapter store's real build() on an in-process grpc.aio server (port 0) with a real Redis: the four
RPCs over the wire, errors mapped to their status codes, and the address announced with its TTL."""

from __future__ import annotations

import grpc
import pytest
import redis
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from academus.shared.runtime.serving import CHANNEL_OPTIONS, RunningService
from academus.shared.state.keys import Keys
from academus.v1 import adapter_store_pb2 as pb
from academus.v1 import adapter_store_pb2_grpc, tensors_pb2
from tests.conftest import env

pytestmark = pytest.mark.integration
PREFIX = "as-test"
LIMIT = 32 * 1024


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {"head.weight": torch.randn(2, 8, generator=gen), "head.bias": torch.randn(2, generator=gen)}
    for i in range(2):
        out |= {f"layers.{i}.down.weight": torch.randn(4, 8, generator=gen),
                f"layers.{i}.up.weight": torch.randn(8, 4, generator=gen)}
    return out


def ref(tenant: str = "acme", name: str = "spam", version: int = 0) -> tensors_pb2.AdapterRef:
    return tensors_pb2.AdapterRef(tenant=tenant, name=name, version=version)


def settings(redis_url: str, data_dir: str, prefix: str = PREFIX) -> dict[str, str]:
    return {"ACADEMUS_REDIS_URL": redis_url, "ACADEMUS_KEY_PREFIX": prefix, "ACADEMUS_DATA_DIR": data_dir,
            "ACADEMUS_MAX_ADAPTER_BYTES": str(LIMIT), "ACADEMUS_PORT": "0", "ACADEMUS_METRICS_PORT": "-1",
            "ACADEMUS_GRACE_S": "1", "ACADEMUS_HEARTBEAT_TTL_S": "3"}


@pytest.fixture(scope="module")
async def service(redis_server, tmp_path_factory):
    from academus.services.adapter_store.server import build

    with env(**settings(redis_server.url, str(tmp_path_factory.mktemp("adapters")))):
        running = RunningService(await build())
        await running.start()
    yield running
    await running.stop()


@pytest.fixture(scope="module")
async def stub(service):
    async with grpc.aio.insecure_channel(service.address, options=CHANNEL_OPTIONS) as channel:
        yield adapter_store_pb2_grpc.AdapterStoreStub(channel)


async def test_put_get_list_delete_over_grpc(stub):
    first, second = tensors(1), tensors(2)
    put = await stub.Put(pb.PutAdapterRequest(ref=ref(version=7), weights=st_save(first),
                                              metadata={"base": "minilm"}), timeout=5)
    assert (put.ref.tenant, put.ref.name, put.ref.version, put.bytes) == ("acme", "spam", 1, len(st_save(first)))
    put = await stub.Put(pb.PutAdapterRequest(ref=ref(), weights=st_save(second), metadata={"rank": "4"}),
                         timeout=5)
    assert put.ref.version == 2  # the store assigns versions, the request's is ignored

    got = await stub.Get(pb.GetAdapterRequest(ref=ref()), timeout=5)
    assert (got.ref.version, dict(got.metadata), got.weights) == (2, {"rank": "4"}, st_save(second))
    got = await stub.Get(pb.GetAdapterRequest(ref=ref(version=1)), timeout=5)
    assert (got.ref.version, dict(got.metadata)) == (1, {"base": "minilm"})
    assert all(torch.equal(t, first[n]) for n, t in st_load(got.weights).items())

    [info] = (await stub.List(pb.ListAdaptersRequest(tenant="acme"), timeout=5)).adapters
    assert (info.ref.name, info.ref.version, list(info.versions)) == ("spam", 2, [1, 2])
    assert (info.bytes, dict(info.metadata)) == (put.bytes, {"rank": "4"})
    assert not (await stub.List(pb.ListAdaptersRequest(tenant="nobody"), timeout=5)).adapters

    assert (await stub.Delete(pb.DeleteAdapterRequest(ref=ref(version=1)), timeout=5)).deleted == 1
    assert (await stub.Delete(pb.DeleteAdapterRequest(ref=ref()), timeout=5)).deleted == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Get(pb.GetAdapterRequest(ref=ref()), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "acme/spam" in err.value.details()


async def test_layer_wise_get_over_grpc(stub):
    stored = tensors(3)
    await stub.Put(pb.PutAdapterRequest(ref=ref(name="layered"), weights=st_save(stored)), timeout=5)
    for layers, head in (([0], False), ([1], True)):
        got = await stub.Get(pb.GetAdapterRequest(ref=ref(name="layered"), layers=layers, head=head), timeout=5)
        fetched = st_load(got.weights)
        wanted = {n for n in stored if n.startswith(f"layers.{layers[0]}.")} | (
            {"head.weight", "head.bias"} if head else set())
        assert set(fetched) == wanted
        assert all(torch.equal(t, stored[n]) for n, t in fetched.items())


BAD = [
    ("Put", pb.PutAdapterRequest(ref=ref(tenant=""), weights=b"x"), grpc.StatusCode.INVALID_ARGUMENT, "ref.tenant"),
    ("Put", pb.PutAdapterRequest(ref=ref(name="../etc"), weights=b"x"), grpc.StatusCode.INVALID_ARGUMENT,
     "ref.name='../etc' is invalid: it must match [A-Za-z0-9_.-]{1,64}"),
    ("Put", pb.PutAdapterRequest(ref=ref()), grpc.StatusCode.INVALID_ARGUMENT, "weights are empty"),
    ("Put", pb.PutAdapterRequest(ref=ref(), weights=b"x" * (LIMIT + 1)), grpc.StatusCode.INVALID_ARGUMENT,
     f"weights are {LIMIT + 1} bytes; the limit is {LIMIT} bytes"),
    ("Put", pb.PutAdapterRequest(ref=ref(), weights=b"garbage!"), grpc.StatusCode.INVALID_ARGUMENT,
     "not a safetensors file"),
    ("Put", pb.PutAdapterRequest(ref=ref(), weights=st_save({"bert.pooler": torch.zeros(1)})),
     grpc.StatusCode.INVALID_ARGUMENT, "'bert.pooler'"),
    ("Get", pb.GetAdapterRequest(ref=ref(name="absent")), grpc.StatusCode.NOT_FOUND, "acme/absent not found"),
    ("Get", pb.GetAdapterRequest(ref=ref(name="present", version=99)), grpc.StatusCode.NOT_FOUND, "no version 99"),
    ("Get", pb.GetAdapterRequest(ref=ref(name="present"), layers=[-3]), grpc.StatusCode.INVALID_ARGUMENT,
     "layers=[-3]"),
    ("Get", pb.GetAdapterRequest(ref=ref(version=-1)), grpc.StatusCode.INVALID_ARGUMENT, "ref.version=-1"),
    ("List", pb.ListAdaptersRequest(tenant="a b"), grpc.StatusCode.INVALID_ARGUMENT, "tenant='a b'"),
    ("Delete", pb.DeleteAdapterRequest(ref=ref(name="absent")), grpc.StatusCode.NOT_FOUND, "acme/absent"),
    ("Delete", pb.DeleteAdapterRequest(ref=ref(name="present", version=5)), grpc.StatusCode.NOT_FOUND,
     "no version 5"),
]


@pytest.fixture(scope="module")
async def present(stub) -> None:
    """One adapter with a single version, for the requests that name a version or layer it lacks."""
    await stub.Put(pb.PutAdapterRequest(ref=ref(name="present"), weights=st_save(tensors())), timeout=5)


@pytest.mark.parametrize(("method", "request_pb", "code", "message"), BAD, ids=[f"{b[0]}-{i}" for i, b in
                                                                                  enumerate(BAD)])
async def test_bad_requests_get_their_status_and_a_message_naming_the_cause(stub, present, method, request_pb,
                                                                             code, message):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await getattr(stub, method)(request_pb, timeout=5)
    assert err.value.code() == code
    assert message in err.value.details()


async def test_not_found_does_not_reveal_other_tenants(stub):
    await stub.Put(pb.PutAdapterRequest(ref=ref(tenant="globex", name="secret"), weights=st_save(tensors())),
                   timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Get(pb.GetAdapterRequest(ref=ref(tenant="acme", name="secret")), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "globex" not in err.value.details()
    names = [a.ref.name for a in (await stub.List(pb.ListAdaptersRequest(tenant="acme"), timeout=5)).adapters]
    assert "secret" not in names


async def test_the_address_is_announced_with_a_ttl(service, redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert client.get(Keys(PREFIX).adapter_store()) == service.address
    assert 0 < client.ttl(Keys(PREFIX).adapter_store()) <= 3


async def test_stopping_withdraws_the_address(redis_server, tmp_path):
    from academus.services.adapter_store.server import build

    keys, client = Keys("as-stop"), redis.Redis.from_url(redis_server.url, decode_responses=True)
    with env(**settings(redis_server.url, str(tmp_path), prefix="as-stop")):
        running = RunningService(await build())
        await running.start()
    assert client.get(keys.adapter_store()) == running.address
    await running.stop()
    assert not client.exists(keys.adapter_store())


async def test_the_workers_fetcher_reads_the_address_once_and_again_after_the_store_moves(redis_server, tmp_path):
    """The worker's blocking fetcher keeps the announced address (no Redis read a fetch); when the store
    restarts on another port the next fetch fails UNAVAILABLE (retried by the cache's caller) and the one
    after reads the new address."""
    import asyncio

    from academus.services.adapter_store.server import build
    from academus.services.worker.adapters import StoreFetcher
    from academus.shared.runtime.errors import Unavailable

    prefix, data = "as-move", str(tmp_path / "adapters")

    async def start() -> RunningService:
        with env(**settings(redis_server.url, data, prefix)):
            running = RunningService(await build())
            await running.start()
        return running

    first = await start()
    async with grpc.aio.insecure_channel(first.address, options=CHANNEL_OPTIONS) as channel:
        await adapter_store_pb2_grpc.AdapterStoreStub(channel).Put(
            pb.PutAdapterRequest(ref=ref(), weights=st_save(tensors())), timeout=5)
    fetcher = StoreFetcher(redis_server.url, Keys(prefix))
    try:
        fetch = lambda: st_load(fetcher(("acme", "spam", 0), [0], True))  # noqa: E731
        assert set(await asyncio.to_thread(fetch)) == {"head.weight", "head.bias", "layers.0.down.weight",
                                                       "layers.0.up.weight"}
        assert fetcher._address == first.address
        await first.stop()
        second = await start()
        try:
            with pytest.raises(Unavailable):
                await asyncio.to_thread(fetch)
            assert "head.weight" in await asyncio.to_thread(fetch)
            assert fetcher._address == second.address != first.address
        finally:
            await second.stop()
    finally:
        fetcher.close()


async def test_get_many_over_grpc_and_through_the_workers_fetcher(stub, redis_server):
    import asyncio

    from academus.services.worker.adapters import StoreFetcher
    from academus.shared.runtime.errors import NotFound

    await stub.Put(pb.PutAdapterRequest(ref=ref("many", "m"), weights=st_save(tensors(3))), timeout=5)
    reply = await stub.GetMany(pb.GetManyRequest(gets=[
        pb.GetAdapterRequest(ref=ref("many", "m", 1), layers=[0], head=True),
        pb.GetAdapterRequest(ref=ref("many", "absent", 1), layers=[0])]), timeout=5)
    first, missing = reply.items
    assert first.code == 0 and first.adapter.ref.version == 1 and "head.weight" in st_load(first.adapter.weights)
    assert missing.code == grpc.StatusCode.NOT_FOUND.value[0] and "many/absent" in missing.error
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetMany(pb.GetManyRequest(gets=[pb.GetAdapterRequest(ref=ref("many", "m", 1))] * 65), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit is 64" in err.value.details()
    fetcher = StoreFetcher(redis_server.url, Keys(PREFIX))
    try:
        got, gone = await asyncio.to_thread(fetcher.many, [(("many", "m", 1), [1], False),
                                                           (("many", "absent", 1), [1], False)])
    finally:
        fetcher.close()
    assert set(st_load(got)) == {"layers.1.down.weight", "layers.1.up.weight"} and isinstance(gone, NotFound)
