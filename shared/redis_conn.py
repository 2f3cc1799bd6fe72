"""Redis clients that reconnect with backoff; all writes elsewhere are idempotent, so retries are safe."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry


def connect(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=8),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        socket_connect_timeout=2.0,
        health_check_interval=10,
    )
