"""A Redis that asks for a password (`requirepass`), with the real redis-server: a client without it is
refused, the mesh's clients send it (in the URL, or ACADEMUS_REDIS_PASSWORD beside a URL without one), it
stays off the command line, and a restart (the supervisor's) asks for it again over the same data."""

from __future__ import annotations

import pytest
import redis

from academus.shared.cli.redis_server import RedisServer
from academus.shared.runtime.config import CommonConfig, load
from academus.shared.runtime.redis_conn import connect

pytestmark = pytest.mark.integration
PASSWORD = 'p@ss "word"\\'   # quotes, a backslash and an @: the config file and the URL must carry them


@pytest.fixture
def server(tmp_path):
    running = RedisServer(tmp_path / "redis", password=PASSWORD).start()
    yield running
    running.stop()


def test_a_client_without_the_password_is_refused(server):
    plain = f"redis://127.0.0.1:{server.port}/0"
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(plain).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(plain, password="guess").ping()
    assert redis.Redis.from_url(server.url).ping()   # the URL holds it
    assert PASSWORD not in " ".join(server.process.args)
    assert (server.data_dir / "redis.conf").stat().st_mode & 0o077 == 0


async def test_a_service_sends_the_password_its_setting_holds(server):
    config = load(CommonConfig, {"ACADEMUS_REDIS_URL": f"redis://127.0.0.1:{server.port}/0",
                                 "ACADEMUS_REDIS_PASSWORD": PASSWORD})
    client = connect(config.redis_url, config.redis_password)
    try:
        await client.set("k", "v")
        assert await client.get("k") == "v"
    finally:
        await client.aclose()


def test_a_restart_from_the_url_asks_for_the_password_again_over_the_same_data(server):
    redis.Redis.from_url(server.url).set("kept", "yes")
    server.stop()
    again = RedisServer.at(server.url, server.data_dir).start()
    try:
        assert again.port == server.port and again.url == server.url
        assert redis.Redis.from_url(again.url).get("kept") == b"yes"
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(f"redis://127.0.0.1:{again.port}/0").ping()
    finally:
        again.stop()
