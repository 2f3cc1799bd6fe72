"""Redis clients that reconnect with backoff; all writes elsewhere are idempotent, so retries are safe."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from urllib.parse import quote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry  # the asyncio one: the sync class never retries an awaited command
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RESUBSCRIBE_S = 0.05
# A command that fails on its connection is tried again after 0.1, 0.2 and 0.4 s: 0.7 s spans a Redis the
# supervisor restarts (0.3-0.4 s, docs/benchmarks/reliability.md) and keeps a request that needs Redis while
# it stays away failing within a second, not waiting out its deadline
RETRIES, RETRY_CAP_S = 3, 0.5


# Commands in flight at once; one more waits for a connection to come free, up to POOL_WAIT_S. redis-py's default
# pool raised "Too many connections" at once instead: a gateway past capacity, with thousands of requests each
# taking its quota token, failed a request UNAVAILABLE for it (docs/benchmarks/reliability.md, 2026-11-29).
MAX_CONNECTIONS, POOL_WAIT_S = 100, 2.0


class RedisAbsence:
    """When Redis last failed a command on the request path. For AWAY_S after, callers answer from what they
    hold instead of asking again: the client tried for 0.7 s first, and each request need not wait as long.
    One per process, shared by everything that reads Redis for a request (the gateway's keys and quotas)."""

    AWAY_S = 1.0

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock, self._until = clock, float("-inf")

    def away(self) -> bool:
        return self.clock() < self._until

    def failed(self) -> None:
        self._until = self.clock() + self.AWAY_S


def connect(url: str, password: str = "") -> aioredis.Redis:
    """`password`: sent where `url` holds none (ACADEMUS_REDIS_PASSWORD)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=MAX_CONNECTIONS,
        timeout=POOL_WAIT_S,
        password=password or None,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=RETRY_CAP_S, base=0.05), retries=RETRIES),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        socket_connect_timeout=2.0,
        health_check_interval=10,
    )
    return aioredis.Redis.from_pool(pool)   # closing the client closes its pool


def with_password(url: str, password: str) -> str:
    """`url` with `password` in it, unless it holds one already or `password` is empty."""
    parts = urlsplit(url)
    if not password or parts.password:
        return url
    user, host = quote(parts.username or "", safe=""), parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def redacted(url: str) -> str:
    """`url` with its password, if any, as `***`: to print."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"))


async def wake_on(redis: aioredis.Redis, channel: str, changed: asyncio.Event,
                  heard: Callable[[str], None] | None = None) -> None:
    """Sets `changed` on every message published to `channel`, until cancelled: a refresh loop waiting on
    it with its period as the timeout reads a change at once instead of at its next period. `changed` is set
    each time the subscription starts, the first time too: what was published before it was missed (a worker
    registering while its scheduler starts). A lost connection (Redis restarted) is subscribed again, tries
    RESUBSCRIBE_S apart doubling up to 2 s; unguarded, the first restart ended the task and left the loop on
    its period for good. `heard` takes each message's text first, for a listener that reads what changed."""
    wait = RESUBSCRIBE_S

    def subscribed() -> None:
        nonlocal wait
        changed.set()
        wait = RESUBSCRIBE_S

    while True:
        try:
            await _wake_while_subscribed(redis, channel, changed, subscribed, heard)
            raise asyncio.CancelledError
        except (RedisConnectionError, RedisTimeoutError):
            await asyncio.sleep(wait)
            wait = min(2 * wait, 2.0)


async def woken(changed: asyncio.Event, period_s: float) -> bool:
    """A refresh loop's wait: up to `period_s` for `changed` (set by `wake_on`); whether it was set, which it
    clears. The flag is read, not `wait_for`'s outcome: when the timeout and the event come due in one turn of a
    stalled loop, `wait_for` may raise TimeoutError with the event set, and clearing it then loses the event."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), period_s)
    if not changed.is_set():
        return False
    changed.clear()
    return True


async def _wake_while_subscribed(redis: aioredis.Redis, channel: str, changed: asyncio.Event,
                                 subscribed: Callable[[], None], heard: Callable[[str], None] | None) -> None:
    """Returns once the task is being cancelled. Polls with a timeout and checks for a pending cancel
    itself: redis-py's blocking pub/sub read can swallow the task's cancellation, which left a service's
    stop waiting on this task forever."""
    pubsub = redis.pubsub()
    try:
        await pubsub.subscribe(channel)
        subscribed()
        while not asyncio.current_task().cancelling():
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message:
                if heard is not None:
                    data = message["data"]
                    heard(data.decode(errors="replace") if isinstance(data, bytes) else str(data))
                changed.set()
    finally:
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError):
            await pubsub.aclose()
