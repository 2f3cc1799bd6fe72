"""`wake_on` against the real Redis: a published event wakes a refresh loop, and cancelling stops it."""

from __future__ import annotations

import asyncio

from academus.shared.runtime.redis_conn import connect, wake_on
from academus.shared.state.keys import Keys


async def test_an_event_on_the_channel_wakes_the_waiter_and_cancel_stops_the_watch(redis_url):
    redis, channel = connect(redis_url), Keys("t").events()
    changed = asyncio.Event()
    watch = asyncio.create_task(wake_on(redis, channel, changed))
    try:
        while (await redis.pubsub_numsub(channel))[0][1] == 0:
            await asyncio.sleep(0.01)                    # subscribed: a message now reaches it
        await redis.publish(Keys("other").events(), "serving scheduler-0@node-1")   # another mesh's channel
        await asyncio.sleep(0.2)
        assert not changed.is_set()
        await redis.publish(channel, "serving scheduler-0@node-1")
        await asyncio.wait_for(changed.wait(), 5.0)
    finally:
        watch.cancel()
        await asyncio.wait_for(asyncio.gather(watch, return_exceptions=True), 5.0)   # it does stop
        await redis.aclose()
    assert watch.cancelled()
