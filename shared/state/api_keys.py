"""API keys as an operator manages them: `academus keys list | revoke | rotate`.

Only a key's SHA-256 is stored (`Keys.api_key`); a key is named by the first KEY_ID_DIGITS hex digits of it, its
id, which says which key without being one. A revocation is published on the events channel: every gateway drops
the keys it had verified and asks Redis again (services/gateway/server.py), so a revoked key stops working at
once, not when the gateway's cache would have expired it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redis import asyncio as aioredis

from academus.shared.runtime.errors import FailedPrecondition, InvalidArgument, NotFound
from academus.shared.state.keys import Keys, hash_key, new_api_key

KEY_ID_DIGITS = 16
MIN_ID_DIGITS = 8     # fewer could name several keys of a large mesh
REVOKED = "key-revoked"   # the events channel's message: "key-revoked <id> ..."
ADMIN = "admin"


@dataclass(frozen=True)
class KeyRecord:
    tenant: str
    role: str
    digest: str = field(repr=False)   # the whole SHA-256: where the key is stored

    @property
    def key_id(self) -> str:
        return self.digest[:KEY_ID_DIGITS]


class ApiKeys:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self._pattern = keys.api_key_pattern()

    async def create(self, tenant: str, role: str = "tenant") -> str:
        """A new key for `tenant`; returned once, never stored."""
        key = new_api_key(tenant)
        await self.redis.hset(self.keys.api_key(key), mapping={"tenant": tenant, "role": role})
        return key

    async def list(self, tenant: str | None = None) -> list[KeyRecord]:
        """Every key (or `tenant`'s), by tenant then id: a scan, which suits a rare operator's command."""
        names = [name async for name in self.redis.scan_iter(match=self._pattern, count=1000)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hmget(name, "tenant", "role")
            fields = await pipe.execute()
        records = [KeyRecord(owner, role or "tenant", name.rsplit(":", 1)[1])
                   for name, (owner, role) in zip(names, fields, strict=True) if owner]
        return sorted((r for r in records if tenant is None or r.tenant == tenant), key=lambda r: (r.tenant, r.key_id))

    async def revoke(self, key_or_id: str) -> KeyRecord:
        """Deletes one key, named by its id (or a prefix of it of MIN_ID_DIGITS or more) or by the key itself.
        The mesh's admin key is rotated, never revoked: the command line would lose its way in."""
        record = await self.find(key_or_id)
        if record.role == ADMIN:
            raise FailedPrecondition(f"key {record.key_id} is the admin's: rotate it (`academus keys rotate admin`)")
        await self._replace([record], None)
        return record

    async def rotate(self, tenant: str) -> tuple[str, list[KeyRecord]]:
        """A new key for `tenant` in place of every key it has (one transaction; the role kept): the new key, and
        the keys revoked."""
        old = await self.list(tenant)
        if not old:
            raise NotFound(f"tenant {tenant!r} has no API key to rotate")
        role = ADMIN if any(r.role == ADMIN for r in old) else old[0].role
        key = new_api_key(tenant)
        await self._replace(old, (key, tenant, role))
        return key, old

    async def find(self, key_or_id: str) -> KeyRecord:
        wanted = key_or_id.strip().lower()
        if not all(c in "0123456789abcdef" for c in wanted):   # the key itself: its full hash names it
            wanted = hash_key(key_or_id.strip())
        elif len(wanted) < MIN_ID_DIGITS:
            raise InvalidArgument(f"key id {key_or_id!r} is shorter than {MIN_ID_DIGITS} hex digits "
                                  f"(`academus keys list` shows ids of {KEY_ID_DIGITS})")
        matches = [r for r in await self.list() if r.digest.startswith(wanted)]
        if not matches:
            raise NotFound(f"no API key with id {wanted[:KEY_ID_DIGITS]} (`academus keys list` shows them)")
        if len(matches) > 1:
            raise InvalidArgument(f"key id {wanted} names {len(matches)} keys: give more digits")
        return matches[0]

    async def _replace(self, revoked: list[KeyRecord], new: tuple[str, str, str] | None) -> None:
        """Deletes `revoked` and adds `new` (key, tenant, role) in one transaction, then tells the gateways."""
        names = [self.keys.api_key_of_digest(r.digest) for r in revoked]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(*names)
            if new is not None:
                key, tenant, role = new
                pipe.hset(self.keys.api_key(key), mapping={"tenant": tenant, "role": role})
                if await self.redis.exists(self.keys.tenant(tenant)):   # the record names its key (tenants delete)
                    pipe.hset(self.keys.tenant(tenant), "api_key_id", self.keys.api_key(key))
            await pipe.execute()
        await self.redis.publish(self.keys.events(), " ".join([REVOKED, *(r.key_id for r in revoked)]))
