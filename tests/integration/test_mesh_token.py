"""The mesh's token on a real in-process service (the adapter store, over loopback gRPC): a call without it or
with a wrong one is refused UNAUTHENTICATED naming the metadata, unary, multiplexed and blocking alike; the
process's own channels carry it once it has the identity; health checks and reflection pass without it; a
gateway-like (public) server never asks for it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from safetensors.torch import save as st_save

from academus.shared.runtime.certificates import public_credentials
from academus.shared.runtime.config import GatewayConfig, load
from academus.shared.runtime.errors import Unauthenticated
from academus.shared.runtime.multiplex import MultiplexChannel
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import RunningService, ServiceSpec
from academus.shared.runtime.tls import MESH_TOKEN_KEY, mesh_channel_sync, mesh_metadata, use_mesh
from academus.shared.state.keys import Keys
from academus.shared.training.onboarding import AdapterStoreClient
from academus.v1 import adapter_store_pb2, adapter_store_pb2_grpc
from tests.conftest import env
from tests.integration.test_adapter_store_service import tensors

pytestmark = pytest.mark.integration
TOKEN = "mesh-secret-for-the-test"
QUIET = {"ACADEMUS_PORT": "0", "ACADEMUS_METRICS_PORT": "-1", "ACADEMUS_GRACE_S": "1"}
REFUSED = f"metadata '{MESH_TOKEN_KEY}' is missing or wrong"


@pytest.fixture(autouse=True)
def no_identity_after() -> Iterator[None]:
    """A started service gives this process its mesh identity; the next test starts without one."""
    yield
    use_mesh(None)


@pytest.fixture
async def store(tmp_path, redis_server):
    """The real adapter store, asking for the mesh's token."""
    from academus.services.adapter_store.server import build

    settings = {**QUIET, "ACADEMUS_REDIS_URL": redis_server.url, "ACADEMUS_KEY_PREFIX": "token-store",
                "ACADEMUS_ADAPTER_DIR": str(tmp_path / "adapters"), "ACADEMUS_MESH_TOKEN": TOKEN}
    with env(**settings):
        service = RunningService(await build())
        await service.start()
    yield service
    await service.stop()


async def test_a_call_without_the_token_is_refused_naming_it_and_the_mesh_s_own_calls_pass(store, redis_server):
    redis = connect(redis_server.url)
    client = AdapterStoreClient(redis, Keys("token-store"))
    try:
        assert await client.put("acme", "support", st_save(tensors()), {}) == 1   # the service gave this process
        for token in ("", "a-guess"):                                             # its identity when it started
            use_mesh(None, token)
            with pytest.raises(Unauthenticated, match=REFUSED):
                await client.put("acme", "support", st_save(tensors()), {})
        use_mesh(None, TOKEN)
        assert await client.put("acme", "support", st_save(tensors()), {}) == 2
    finally:
        await redis.aclose()


async def test_a_multiplexed_stream_without_the_token_is_refused_every_call(store):
    use_mesh(None, TOKEN)
    request = adapter_store_pb2.ListAdaptersRequest(tenant="nobody")
    async with grpc.aio.insecure_channel(store.address) as channel:
        outsider = adapter_store_pb2_grpc.AdapterStoreStub(MultiplexChannel(channel))
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await outsider.List(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert REFUSED in refused.value.details()
        member = adapter_store_pb2_grpc.AdapterStoreStub(MultiplexChannel(channel, metadata=mesh_metadata()))
        assert list((await member.List(request, timeout=5)).adapters) == []


async def test_blocking_channels_carry_the_token_and_plain_ones_are_refused(store):
    use_mesh(None, TOKEN)
    assert await asyncio.to_thread(list_over, mesh_channel_sync, store.address) == []
    with pytest.raises(grpc.RpcError) as refused:
        await asyncio.to_thread(list_over, grpc.insecure_channel, store.address)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def list_over(open_channel, target: str) -> list:
    """The store's adapters of a tenant nobody is, over a blocking channel (the service runs on this loop)."""
    with open_channel(target) as channel:
        reply = adapter_store_pb2_grpc.AdapterStoreStub(channel).List(
            adapter_store_pb2.ListAdaptersRequest(tenant="nobody"), timeout=5)
    return list(reply.adapters)


async def test_health_and_reflection_need_no_token(store):
    health, listed = await asyncio.to_thread(plumbing, store.address)
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert "academus.v1.AdapterStore" in listed


def plumbing(target: str) -> tuple[int, set[str]]:
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        return health.status, {s.name for r in replies for s in r.list_services_response.service}


async def test_the_public_gateway_never_asks_for_the_token():
    """Its callers hold API keys: a server started as the gateway is, with the token set, serves a plain call."""
    config = load(GatewayConfig, {**QUIET, "ACADEMUS_MESH_TOKEN": TOKEN})

    def add_store(server: grpc.aio.Server) -> None:
        adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(EmptyStore(), server)

    service = RunningService(ServiceSpec("public", config, add_store, ["academus.v1.AdapterStore"],
                                         public_credentials=functools.partial(public_credentials, config)))
    await service.start()
    try:
        async with grpc.aio.insecure_channel(service.address) as channel:
            reply = await adapter_store_pb2_grpc.AdapterStoreStub(channel).List(
                adapter_store_pb2.ListAdaptersRequest(tenant="x"), timeout=5)
        assert list(reply.adapters) == []
    finally:
        await service.stop()


class EmptyStore(adapter_store_pb2_grpc.AdapterStoreServicer):
    async def List(self, request, context):
        return adapter_store_pb2.ListAdaptersResponse()
