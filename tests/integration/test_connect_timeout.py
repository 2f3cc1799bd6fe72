"""A connection whose handshake is slow still connects: the SDK's channels and the mesh's own give an attempt
CONNECT_TIMEOUT_MS (gRPC's `min_reconnect_backoff_ms` is that time, not only a backoff). A real gRPC server behind
a TCP relay that holds each new connection's first bytes back, as a busy gateway does under a burst of them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from academus.client.types import CHANNEL_OPTIONS, CONNECT_TIMEOUT_MS
from academus.shared.runtime.serving import channel

HANDSHAKE_DELAY_S = 0.3   # three times what an attempt was given before


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


@pytest.fixture
async def slow_handshake() -> AsyncIterator[str]:
    """The address of a relay to a health server that waits HANDSHAKE_DELAY_S before it passes a connection on."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(HANDSHAKE_DELAY_S)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
    yield f"127.0.0.1:{relay_server.sockets[0].getsockname()[1]}"
    relay_server.close()
    await server.stop(None)


async def _check(ch: grpc.aio.Channel) -> str:
    async with ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def test_the_sdks_channel_connects_through_a_slow_handshake(slow_handshake: str) -> None:
    assert CONNECT_TIMEOUT_MS / 1e3 > HANDSHAKE_DELAY_S
    assert await _check(grpc.aio.insecure_channel(slow_handshake, options=CHANNEL_OPTIONS)) == "SERVING"


async def test_the_mesh_channel_connects_through_a_slow_handshake(slow_handshake: str) -> None:
    assert await _check(channel(slow_handshake, own_connections=True)) == "SERVING"


async def test_an_attempt_given_a_tenth_of_a_second_fails_there(slow_handshake: str) -> None:
    """What the options were: each attempt shut down before the server's first bytes came."""
    options = [(k, 100 if k == "grpc.min_reconnect_backoff_ms" else v) for k, v in CHANNEL_OPTIONS]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _check(grpc.aio.insecure_channel(slow_handshake, options=options))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
