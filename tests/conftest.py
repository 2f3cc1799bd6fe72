"""Shared fixtures: a real redis-server on loopback (never a mock), and factories."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from academus.shared.redis_server import RedisServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()


def artifacts_path() -> Path:
    from academus.shared.config import artifacts_dir

    return artifacts_dir()
