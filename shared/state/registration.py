"""A service's entry in Redis: a hash of its address and fields under its id, with the heartbeat's TTL, and the
id in a set that lists its kind (the schedulers, the plot services, the gateways). Readers skip, or prune, ids whose
hash expired.
Every write is an HSET/EXPIRE/SADD of the same values, so a retried command cannot apply twice."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis

from academus.shared.runtime.logs import log_event

GIVE_UP_S = 1.0   # a stop (or a start that may proceed without it) waits no longer on Redis: the TTL tidies up


class Registration:
    """Written when the service serves, renewed every third of the TTL, removed when it stops. Subclasses give
    the fields beside the address (`fields`, read again at each beat)."""

    def __init__(self, redis: aioredis.Redis, entry: Callable[[str], str], members: str, ttl_s: float,
                 member_id: str = "") -> None:
        self.redis, self.entry, self.members = redis, entry, members
        self.ttl = max(1, round(ttl_s))
        self.member_id = member_id   # empty: the address, once known
        self.address = ""

    async def fields(self) -> dict[str, str]:
        return {}

    def owned(self) -> list[str]:
        """The keys deregistering deletes: the entry, and what a subclass writes beside it."""
        return [self.entry(self.member_id)]

    async def start(self, address: str) -> None:
        """on_started: registered, waiting on Redis at most GIVE_UP_S (Redis away: the heartbeat registers it later,
        and the service serves meanwhile)."""
        try:
            async with asyncio.timeout(GIVE_UP_S):
                await self.register(address)
        except Exception as e:
            log_event("register_failed", logging.WARNING, error=repr(e))

    async def register(self, address: str) -> None:
        self.address = address
        self.member_id = self.member_id or address
        key = self.entry(self.member_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={"address": address, **await self.fields()})
        pipe.expire(key, self.ttl)
        pipe.sadd(self.members, self.member_id)
        await pipe.execute()

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.register(self.address)
            except Exception as e:  # Redis away: keep serving, the next beat registers again
                log_event("heartbeat_failed", logging.WARNING, error=repr(e))

    async def deregister(self) -> None:
        if not self.member_id:   # it stopped before it served
            return
        try:
            async with asyncio.timeout(GIVE_UP_S):
                await self.redis.srem(self.members, self.member_id)
                await self.redis.delete(*self.owned())
        except Exception as e:  # the TTL removes the entry anyway
            log_event("deregister_failed", logging.WARNING, error=repr(e))
