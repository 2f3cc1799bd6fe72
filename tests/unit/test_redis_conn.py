"""The services' Redis clients against the real Redis: retried commands, and `wake_on` (a published event wakes
a refresh loop and hands its text on, cancelling stops it, a restart of Redis does not end it)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from academus.shared.cli.redis_server import RedisServer
from academus.shared.runtime.redis_conn import connect, wake_on, woken
from academus.shared.state.keys import Keys


async def test_an_event_on_the_channel_wakes_the_waiter_and_cancel_stops_the_watch(redis_url):
    redis, channel = connect(redis_url), Keys("t").events()
    changed = asyncio.Event()
    heard: list[str] = []
    watch = asyncio.create_task(wake_on(redis, channel, changed, heard.append))
    try:
        await subscribed(redis, channel)
        await asyncio.wait_for(changed.wait(), 5.0)   # once subscribed: what was published before was missed
        changed.clear()
        await redis.publish(Keys("other").events(), "serving scheduler-0@node-1")   # another mesh's channel
        await asyncio.sleep(0.2)
        assert not changed.is_set()
        await redis.publish(channel, "serving scheduler-0@node-1")
        await asyncio.wait_for(changed.wait(), 5.0)
        assert heard == ["serving scheduler-0@node-1"]   # its text, to a listener that reads what changed
    finally:
        watch.cancel()
        await asyncio.wait_for(asyncio.gather(watch, return_exceptions=True), 5.0)   # it does stop
        await redis.aclose()
    assert watch.cancelled()


async def test_an_event_due_in_the_same_stalled_turn_as_the_periods_end_is_not_lost():
    """A stalled loop (a loaded machine) lets the period's end and an event come due in one turn: `wait_for`'s
    timeout may win, with the event set. The waiter is still told of it, once: a gateway that missed it would trust
    a revoked key until its cache ran out."""
    changed = asyncio.Event()
    waiting = asyncio.ensure_future(woken(changed, 0.05))
    await asyncio.sleep(0)                                     # the period's timeout is armed
    asyncio.get_running_loop().call_later(0.05, changed.set)   # the event comes due just after it
    time.sleep(0.2)                                            # the stall: both come due in one turn
    assert await waiting and not changed.is_set()
    assert not await woken(changed, 0.01)
    changed.set()
    assert await woken(changed, 5.0)                           # set before the wait: told at once


async def test_a_command_on_a_connection_a_restarted_redis_closed_is_retried(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    redis = connect(server.url)
    restarted = None
    try:
        await redis.set("k", "v")   # a pooled connection, which the kill below closes
        kill(server)
        restarted = RedisServer(tmp_path / "redis", port=server.port).start()
        assert await redis.get("k") == "v"
    finally:
        await redis.aclose()
        (restarted or server).stop()


async def test_a_watch_whose_client_gave_up_subscribes_again_and_wakes_once_back(tmp_path):
    """A client out of retries (Redis away longer than they last; here: none) ends the subscription: the
    watch subscribes again once Redis is back and wakes the waiter, since what was published meanwhile
    was missed; later events wake it as before."""
    server = RedisServer(tmp_path / "redis").start()
    redis = aioredis.Redis.from_url(server.url, decode_responses=True, retry=Retry(NoBackoff(), 0))
    channel, changed = Keys("t").events(), asyncio.Event()
    watch = asyncio.create_task(wake_on(redis, channel, changed))
    restarted = None
    try:
        await subscribed(redis, channel)
        kill(server)
        restarted = RedisServer(tmp_path / "redis", port=server.port).start()
        await asyncio.wait_for(changed.wait(), 10.0)
        changed.clear()
        await subscribed(redis, channel)
        await redis.publish(channel, "serving scheduler-0")
        await asyncio.wait_for(changed.wait(), 5.0)
        assert not watch.done()
    finally:
        watch.cancel()
        await asyncio.wait_for(asyncio.gather(watch, return_exceptions=True), 5.0)
        await redis.aclose()
        (restarted or server).stop()


def kill(server: RedisServer) -> None:
    server.process.kill()
    server.process.wait()


async def subscribed(redis, channel: str) -> None:
    while True:
        with contextlib.suppress(RedisConnectionError):   # a client without retries, Redis just back
            if (await redis.pubsub_numsub(channel))[0][1]:
                return   # subscribed: a message now reaches it
        await asyncio.sleep(0.01)


async def test_more_commands_at_once_than_connections_wait_for_one_instead_of_failing(redis_url):
    """A gateway past capacity has thousands of requests taking quota tokens at once: each waits for a pooled
    connection (redis-py's default pool failed the 101st with "Too many connections")."""
    from academus.shared.runtime.redis_conn import MAX_CONNECTIONS

    client = connect(redis_url)
    await client.set("pool-probe", "1")
    values = await asyncio.gather(*(client.get("pool-probe") for _ in range(3 * MAX_CONNECTIONS)))
    assert values == ["1"] * (3 * MAX_CONNECTIONS)
    await client.aclose()


def test_redis_is_away_for_a_while_after_a_failure_for_every_holder_of_the_record():
    from academus.shared.runtime.redis_conn import RedisAbsence

    now = [0.0]
    absence = RedisAbsence(lambda: now[0])
    assert not absence.away()
    absence.failed()
    now[0] += RedisAbsence.AWAY_S / 2
    assert absence.away()
    now[0] += RedisAbsence.AWAY_S / 2
    assert not absence.away()
