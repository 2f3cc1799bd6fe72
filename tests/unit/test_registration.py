"""A service's entry in Redis (shared/state/registration.py) and the gateway's (services/gateway/server.py), on a
real Redis: written with the heartbeat's TTL, renewed, removed on stop; what `academus status` reads of them."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import redis as sync_redis

from academus.services.gateway.server import GatewayRegistration
from academus.shared.cli.mesh import registered_gateways
from academus.shared.cli.redis_server import free_port
from academus.shared.runtime.config import GatewayConfig
from academus.shared.runtime.redis_conn import connect
from academus.shared.state.keys import Keys
from academus.shared.state.registration import Registration

KEYS = Keys("acd")


class HttpPort:
    """The part of the gateway's HttpServer a registration reads: its bound port."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def start(self) -> int:
        return self.port


async def test_an_entry_lives_by_its_heartbeat_and_leaves_on_stop(redis):
    registration = Registration(redis, KEYS.gateway, KEYS.gateways(), ttl_s=1)
    await registration.register("10.0.0.7:50051")
    assert await redis.smembers(KEYS.gateways()) == {"10.0.0.7:50051"}   # no id given: the address is the id
    assert await redis.hgetall(KEYS.gateway("10.0.0.7:50051")) == {"address": "10.0.0.7:50051"}
    assert 0 < await redis.ttl(KEYS.gateway("10.0.0.7:50051")) <= 1
    beating = asyncio.create_task(registration.heartbeat())
    try:
        await asyncio.sleep(2.5)   # past the TTL: only the beats kept it
        assert await redis.exists(KEYS.gateway("10.0.0.7:50051"))
    finally:
        beating.cancel()
    await registration.deregister()
    assert await redis.smembers(KEYS.gateways()) == set() and not await redis.exists(KEYS.gateway("10.0.0.7:50051"))


async def test_a_stop_with_redis_gone_gives_up_and_leaves_the_entry_to_its_ttl(caplog):
    gone = connect(f"redis://127.0.0.1:{free_port()}/0")
    registration = Registration(gone, KEYS.gateway, KEYS.gateways(), ttl_s=5, member_id="g")
    try:
        with caplog.at_level(logging.WARNING):
            await asyncio.wait_for(registration.deregister(), timeout=30)   # logged, not raised
    finally:
        await gone.aclose()
    assert [json.loads(r.message)["event"] for r in caplog.records] == ["deregister_failed"]


@pytest.mark.parametrize(("settings", "http_port", "entry"), [
    ({}, None, {"address": "10.0.0.7:50051", "http": "", "tls": "0"}),
    ({"own_port": 50061}, 8080, {"address": "10.0.0.7:50061", "http": "10.0.0.7:8080", "tls": "0"}),
    ({"tls_cert": "/c/gateway.crt", "tls_key": "/c/gateway.key", "tls_server_name": "api.example.com"}, 8080,
     {"address": "10.0.0.7:50051", "http": "10.0.0.7:8080", "tls": "1", "server_name": "api.example.com"}),
])
async def test_a_gateway_registers_the_address_its_health_is_checked_on(redis, redis_url, settings, http_port,
                                                                        entry):
    """Gateways share the mesh's port: one with a port of its own registers that one, so each has its own entry."""
    config = GatewayConfig(advertise_host="10.0.0.7", heartbeat_ttl_s=5, **settings)
    registration = GatewayRegistration(redis, KEYS, config, HttpPort(http_port) if http_port else None)
    await registration.serving("10.0.0.7:50051")   # what the runner passes: the shared port's address
    assert await redis.hgetall(KEYS.gateway(entry["address"])) == entry
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    assert registered_gateways(client, KEYS) == [(entry["address"], entry)]


async def test_status_prunes_the_gateways_whose_entry_expired(redis, redis_url):
    await Registration(redis, KEYS.gateway, KEYS.gateways(), ttl_s=5).register("10.0.0.7:50051")
    await redis.sadd(KEYS.gateways(), "10.0.0.9:50051")   # a gateway gone (its container's address), entry expired
    client = sync_redis.Redis.from_url(redis_url, decode_responses=True)
    assert [address for address, _ in registered_gateways(client, KEYS)] == ["10.0.0.7:50051"]
    assert client.smembers(KEYS.gateways()) == {"10.0.0.7:50051"}

