"""Redis clients that reconnect with backoff; all writes elsewhere are idempotent, so retries are safe."""

from __future__ import annotations

import asyncio

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


async def wake_on(redis: aioredis.Redis, channel: str, changed: asyncio.Event) -> None:
    """Sets `changed` on every message published to `channel`, until cancelled: a refresh loop waiting on
    it with its period as the timeout reads a change at once instead of at its next period. Polls with a
    timeout and checks for a pending cancel itself: redis-py's blocking pub/sub read can swallow the
    task's cancellation, which left a service's stop waiting on this task forever."""
    pubsub = redis.pubsub()
    try:
        await pubsub.subscribe(channel)
        while not asyncio.current_task().cancelling():
            if await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0):
                changed.set()
        raise asyncio.CancelledError
    finally:
        await pubsub.aclose()
