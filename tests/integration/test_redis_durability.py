"""Registrations live in Redis with AOF on: they survive a restart of the server."""

from __future__ import annotations

import redis

from academus.shared.cli.redis_server import RedisServer
from academus.shared.state.keys import Keys


def test_api_keys_and_catalogue_survive_a_redis_restart(tmp_path):
    keys = Keys()
    server = RedisServer(tmp_path / "redis").start()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    client.hset(keys.api_key("k"), mapping={"tenant": "t"})
    client.hset(keys.models(), "spam", "{}")
    port = server.port
    server.stop()
    assert (tmp_path / "redis" / "appendonlydir").exists()
    restarted = RedisServer(tmp_path / "redis", port=port).start()
    try:
        client = redis.Redis.from_url(restarted.url, decode_responses=True)
        assert client.hgetall(keys.api_key("k")) == {"tenant": "t"}
        assert client.hget(keys.models(), "spam") == "{}"
    finally:
        restarted.stop()
