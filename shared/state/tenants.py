"""Tenants, their API keys, their models (a base + an adapter + a head) and their request quotas, in Redis.

A tenant record (Keys.tenant) holds its quota (rate, burst) and the id of its API key; the key itself is
never stored, only its SHA-256 (Keys.api_key). A tenant model is TenantModel JSON in Keys.tenant_models,
looked up only under the caller's own tenant: no tenant can name, list or learn of another's models.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from academus.shared.runtime.config import GatewayConfig
from academus.shared.runtime.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from academus.shared.runtime.expiring import ExpiringCache
from academus.shared.runtime.redis_conn import RedisAbsence
from academus.shared.state.api_keys import ApiKeys
from academus.shared.state.catalogue import CLASSIFICATION, EMBEDDING, ModelSpec
from academus.shared.state.keys import Keys, new_api_key

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NAME_RULE = "[A-Za-z0-9_.-]{1,64}, not only dots"
TRAINING, READY, FAILED = "training", "ready", "failed"
STATUSES = (TRAINING, READY, FAILED)
KINDS = (CLASSIFICATION, EMBEDDING)
RESERVED = frozenset({"admin"})  # the mesh's admin key names this tenant; it must never get a record


def check_name(field_name: str, value: str) -> None:
    """Tenant, model and adapter names; the adapter store uses them as path components, so no "." / ".."."""
    if not NAME.fullmatch(value) or set(value) == {"."}:
        raise InvalidArgument(f"{field_name}={value[:80]!r} is invalid: it must match {NAME_RULE}")


def check_quota(rate: float, burst: int) -> None:
    if not rate > 0:
        raise InvalidArgument(f"rate={rate} is invalid: it must be > 0 requests/s")
    if burst < 1:
        raise InvalidArgument(f"burst={burst} is invalid: it must be >= 1 request")


@dataclass(frozen=True)
class TenantModel:
    name: str
    base: str                      # a served catalogue model (minilm, minilm-plot) that runs the adapter
    adapter: str                   # the adapter's name in the adapter store (under the same tenant)
    version: int                   # the adapter version pinned: caches are keyed by it
    labels: list[str] = field(default_factory=list)  # the head's classes; empty for embedding models
    kind: str = CLASSIFICATION     # CLASSIFICATION | EMBEDDING
    status: str = READY            # TRAINING | READY | FAILED: only READY models are served
    created: float = field(default_factory=time.time)
    domain: str = ""               # the PLOT domain chosen at creation (used once adapters run on PLOT bases)
    job: str = ""                  # the Manage API job that last trained it
    message: str = ""              # why its training failed (status FAILED)

    def check(self) -> None:
        for name in ("name", "base", "adapter"):
            check_name(f"model.{name}", getattr(self, name))
        if self.version < 1:
            raise InvalidArgument(f"model.version={self.version} is invalid: it must be >= 1")
        if self.kind not in KINDS:
            raise InvalidArgument(f"model.kind={self.kind!r} is invalid: it must be one of {', '.join(KINDS)}")
        if self.status not in STATUSES:
            raise InvalidArgument(f"model.status={self.status!r} is invalid: it must be one of {', '.join(STATUSES)}")
        if (self.kind == CLASSIFICATION) != bool(self.labels):
            raise InvalidArgument(f"model.labels has {len(self.labels)} entries: a classification model needs "
                                  "at least one, an embedding model none")

    def spec(self, base: ModelSpec) -> ModelSpec:
        """The base's spec (dim, limits) under this model's name, kind and labels."""
        return replace(base, name=self.name, kind=self.kind, labels=list(self.labels))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str) -> TenantModel:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})


# KEYS: tenant record, tenant set, API key hash. ARGV: tenant, created, rate, burst.
# One script, so that two creations of the same tenant cannot both succeed.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'created', ARGV[2], 'rate', ARGV[3], 'burst', ARGV[4], 'api_key_id', KEYS[3])
redis.call('HSET', KEYS[3], 'tenant', ARGV[1], 'role', 'tenant')
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: the tenant's models, the models' change counter; ARGV: name, job, the new record. Replaces the record only
# while it is still that job's: a job finishing never brings back a model deleted or retrained meanwhile.
_REPLACE_OF_JOB = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw or cjson.decode(raw)['job'] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('INCR', KEYS[2])
return 1
"""


class TenantRegistry:
    """Creates and deletes tenants and registers their models (the Manage API's store)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, rate: float = GatewayConfig.tenant_rate,
                 burst: int = GatewayConfig.tenant_burst) -> None:
        self.redis, self.keys, self.rate, self.burst = redis, keys, rate, burst
        self._create = redis.register_script(_CREATE)
        self._replace_of_job = redis.register_script(_REPLACE_OF_JOB)

    async def create_tenant(self, tenant: str, rate: float | None = None, burst: int | None = None) -> str:
        """Returns the tenant's new API key: shown once, only its hash is kept."""
        check_name("tenant", tenant)
        if tenant in RESERVED:
            raise InvalidArgument(f"tenant={tenant!r} is reserved")
        rate, burst = self.rate if rate is None else rate, self.burst if burst is None else burst
        check_quota(rate, burst)
        key = new_api_key(tenant)
        created = await self._create(keys=[self.keys.tenant(tenant), self.keys.tenants(), self.keys.api_key(key)],
                                     args=[tenant, time.time(), rate, burst])
        if not created:
            raise AlreadyExists(f"tenant {tenant!r} already exists")
        return key

    async def tenants(self) -> list[str]:
        return sorted(await self.redis.smembers(self.keys.tenants()))

    async def tenant(self, tenant: str) -> dict[str, str]:
        """The tenant's record (created, rate, burst, api_key_id); NotFound when it has none."""
        record = await self.redis.hgetall(self.keys.tenant(tenant))
        if not record:
            raise NotFound(f"tenant {tenant!r} not found")
        return record

    async def set_quota(self, tenant: str, rate: float, burst: int) -> None:
        check_quota(rate, burst)
        await self.tenant(tenant)
        await self.redis.hset(self.keys.tenant(tenant), mapping={"rate": rate, "burst": burst})

    async def register_model(self, tenant: str, model: TenantModel) -> None:
        """Adds or replaces (a retrained version) one of the tenant's models."""
        model.check()
        await self.tenant(tenant)
        # Served models are looked up first: a tenant model of the same name would never be reached.
        if await self.redis.hexists(self.keys.models(), model.name):
            raise InvalidArgument(f"model.name={model.name!r} is invalid: a served model has that name")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.tenant_models(tenant), model.name, model.to_json())
            pipe.incr(self.keys.tenant_models_changed())
            await pipe.execute()

    async def replace_job_model(self, tenant: str, model: TenantModel, job: str) -> bool:
        """Replaces the model `job` trains with `model`, in one step with the check that its record is still that
        job's; False (nothing written) when it was deleted or another job took it over."""
        model.check()
        keys = [self.keys.tenant_models(tenant), self.keys.tenant_models_changed()]
        return bool(await self._replace_of_job(keys=keys, args=[model.name, job, model.to_json()]))

    async def model(self, tenant: str, name: str) -> TenantModel | None:
        raw = await self.redis.hget(self.keys.tenant_models(tenant), name)
        return TenantModel.from_json(raw) if raw else None

    async def models(self, tenant: str) -> list[TenantModel]:
        raw = await self.redis.hgetall(self.keys.tenant_models(tenant))
        return [TenantModel.from_json(raw[name]) for name in sorted(raw)]

    async def models_changed(self) -> int:
        """How many times any tenant's models have changed: unchanged, `served_adapters` is too."""
        return int(await self.redis.get(self.keys.tenant_models_changed()) or 0)

    async def served_adapters(self, bases: set[str]) -> list[tuple[str, str, int]]:
        """(tenant, adapter, version) of every READY tenant model on one of `bases`: what a worker running
        those bases will be asked for."""
        return [(tenant, model.adapter, model.version) for tenant, model in await self.all_models()
                if model.status == READY and model.base in bases]

    async def tenants_on(self, base: str) -> list[str]:
        """The tenants with a model on `base` (which may not be removed while they have)."""
        return sorted({tenant for tenant, model in await self.all_models() if model.base == base})

    async def all_models(self) -> list[tuple[str, TenantModel]]:
        """(tenant, model) of every tenant's models, in one pipelined read."""
        tenants = await self.tenants()
        async with self.redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.hgetall(self.keys.tenant_models(tenant))
            records = await pipe.execute()
        return [(tenant, TenantModel.from_json(raw)) for tenant, models in zip(tenants, records, strict=True)
                for raw in models.values()]

    async def delete_model(self, tenant: str, name: str) -> None:
        if not await self.redis.hdel(self.keys.tenant_models(tenant), name):
            raise NotFound(f"model {name!r} not found")
        await self.redis.incr(self.keys.tenant_models_changed())

    async def delete_tenant(self, tenant: str) -> None:
        """Removes its API keys, models, quota and record in one transaction. Its adapters' weights belong
        to the adapter store, which deletes them itself."""
        record = await self.tenant(tenant)
        api_keys = {record.get("api_key_id", "")} | set(await self._other_keys(tenant))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(*(k for k in api_keys if k), self.keys.tenant_models(tenant), self.keys.quota(tenant),
                        self.keys.tenant(tenant))
            pipe.srem(self.keys.tenants(), tenant)
            pipe.incr(self.keys.tenant_models_changed())
            await pipe.execute()

    async def _other_keys(self, tenant: str) -> list[str]:
        """Keys made for the tenant outside create_tenant (`academus keys create`): found by a scan,
        which is fine for a rare admin operation."""
        return [self.keys.api_key_of_digest(r.digest) for r in await ApiKeys(self.redis, self.keys).list(tenant)]


# KEYS: tenant record, bucket; ARGV: the rate and burst of a tenant without a record (the admin, a key made by
# `academus keys create`), 0 0 for none, and the lease in seconds. The bucket refills at `rate` tokens/s up to
# `burst`; a call takes a lease: the tokens of `lease` seconds at the rate (at least one), or what the bucket
# holds if less. Redis's own clock, so that every gateway sees the same time. Returns {-1} when the tenant has
# no limits, else {ms until a token (0: some taken), tokens taken, rate, burst}.
_TAKE = """
local limits = redis.call('HMGET', KEYS[1], 'rate', 'burst')
local rate, burst = tonumber(limits[1]), tonumber(limits[2])
if not rate or not burst then rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2]) end
if not rate or not burst or rate <= 0 or burst <= 0 then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[2], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local taken = math.min(math.max(1, math.floor(rate * tonumber(ARGV[3]))), math.floor(tokens))
local wait = 0
if taken >= 1 then tokens = tokens - taken else taken = 0; wait = math.ceil((1 - tokens) / rate * 1000) end
redis.call('HSET', KEYS[2], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[2], math.ceil(burst / rate * 1000) + 1000)
return {wait, taken, tostring(rate), tostring(burst)}
"""

# One token back into the bucket (never above the burst), once per refund id: a command the client
# retries after a lost reply finds the marker and gives nothing more.
_GIVE_BACK = """
if not redis.call('SET', KEYS[3], '1', 'NX', 'PX', 10000) then return 0 end
local burst = tonumber(redis.call('HGET', KEYS[1], 'burst')) or tonumber(ARGV[1])
local tokens = tonumber(redis.call('HGET', KEYS[2], 'tokens'))
if not burst or not tokens then return 0 end
redis.call('HSET', KEYS[2], 'tokens', tostring(math.min(burst, tokens + 1)))
return 1
"""


class Limits(NamedTuple):
    rate: float   # requests a second, the bucket's refill; 0: no limit
    burst: int    # the bucket's size


NO_LIMITS = Limits(0.0, 0)


class TokenBucket:
    """A tenant's bucket kept by one gateway while Redis is unreachable: `rate` tokens/s up to `burst`."""

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits, self.tokens, self.at = limits, float(limits.burst), now

    def take(self, now: float) -> int:
        """0 when a token was taken, else the ms until one."""
        rate, burst = self.limits
        self.tokens, self.at = min(burst, self.tokens + max(0.0, now - self.at) * rate), now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0
        return math.ceil((1 - self.tokens) / rate * 1000)


class Quotas:
    """Per-tenant request token buckets, each updated atomically by one script (no read-modify-write race
    between gateways); one tenant over its quota costs the others nothing.

    Redis is not on every request's path: a gateway takes a lease of a tenant's tokens at once (LEASE_S of
    its rate, at least one) and spends it locally for up to LEASE_HOLD_S, so a tenant at 100 requests/s costs
    one script call in ten. While Redis is unreachable each gateway keeps a bucket of its own per tenant, at
    the limits Redis last gave it: the tenants keep their quotas (each gateway's whole, for the outage)."""

    LEASE_S = 0.1         # a lease holds this long of the tenant's rate
    LEASE_HOLD_S = 1.0    # tokens of a lease unspent this long are dropped: an idle gateway holds none back

    def __init__(self, redis: aioredis.Redis, keys: Keys, unlimited_cache_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, default: Limits = NO_LIMITS,
                 admin: Limits = NO_LIMITS, absence: RedisAbsence | None = None) -> None:
        """`default`: the quota of a tenant without a record (a key made by `academus keys create`); `admin`: the
        admin's; `absence`: the process's record of Redis failing (shared with its Authenticator)."""
        self.keys, self.default, self.admin, self.clock = keys, default, admin, clock
        self._take = redis.register_script(_TAKE)
        self._give_back = redis.register_script(_GIVE_BACK)
        self._unlimited: ExpiringCache[str, bool] = ExpiringCache(unlimited_cache_s, clock)  # known to have none
        self._leases: dict[str, tuple[int, float]] = {}   # tenant -> (tokens left, when the lease lapses)
        self._known: ExpiringCache[str, Limits] = ExpiringCache(float("inf"), clock)  # limits Redis last gave
        self._outage: dict[str, TokenBucket] = {}          # tenant -> its bucket while Redis is unreachable
        self.absence = absence or RedisAbsence(clock)

    async def take(self, tenant: str) -> bool:
        """Takes one request's token (True), or raises ResourceExhausted with the wait as a pushback hint.
        A tenant without limits (no record, and no default for it: the admin unless configured) has no token to
        take (False); it is remembered briefly, as verified keys are, so that its requests do not pay a Redis
        round trip each for a quota they do not have."""
        if self._unlimited.get(tenant):
            return False
        now = self.clock()
        left, lapses = self._leases.get(tenant, (0, now))
        if left > 0 and lapses > now:
            self._leases[tenant] = (left - 1, lapses)
            return True
        if self.absence.away():
            return self._take_in_outage(tenant, now)
        try:
            answer = await self._take(keys=[self.keys.tenant(tenant), self.keys.quota(tenant)],
                                      args=[*self._limits(tenant), self.LEASE_S])
        except RedisError:
            self.absence.failed()
            return self._take_in_outage(tenant, now)
        self._outage.pop(tenant, None)
        wait_ms = int(answer[0])
        if wait_ms < 0:
            self._unlimited.put(tenant, True)
            self._leases.pop(tenant, None)
            return False
        limits = Limits(float(answer[2]), int(float(answer[3])))
        self._known.put(tenant, limits)
        if wait_ms > 0:
            self._leases.pop(tenant, None)
            raise over_quota(tenant, limits, wait_ms)
        self._leases[tenant] = (int(answer[1]) - 1, now + self.LEASE_HOLD_S)
        return True

    def _take_in_outage(self, tenant: str, now: float) -> bool:
        """Redis unreachable: a token from this gateway's own bucket of the tenant's last known limits (its
        default ones if it was never seen), or ResourceExhausted as Redis would answer."""
        limits = self._known.get(tenant) or self._limits(tenant)
        if not limits.rate:
            return False
        bucket = self._outage.get(tenant)
        if bucket is None or bucket.limits != limits:
            bucket = self._outage[tenant] = TokenBucket(limits, now)
        wait_ms = bucket.take(now)
        if wait_ms:
            raise over_quota(tenant, limits, wait_ms)
        return True

    async def give_back(self, tenant: str, refund_id: str = "") -> bool:
        """Returns one taken token: the request was refused for the node's lack of capacity, not the
        tenant's rate, and the tenant should not pay for it. True when a token went back; a refund id
        already used (a retried command) gives nothing."""
        marker = self.keys.quota_refund(refund_id or uuid.uuid4().hex)
        return bool(await self._give_back(keys=[self.keys.tenant(tenant), self.keys.quota(tenant), marker],
                                          args=[self._limits(tenant).burst]))

    def _limits(self, tenant: str) -> Limits:
        """Where the tenant has no record: the admin's quota, or every other key's default."""
        return self.admin if tenant in RESERVED else self.default


def over_quota(tenant: str, limits: Limits, wait_ms: int) -> ResourceExhausted:
    return ResourceExhausted(f"tenant {tenant!r} is over its rate limit of {limits.rate:g} requests/s "
                             f"(burst {limits.burst}); retry in {wait_ms} ms", pushback_ms=wait_ms)


def gateway_quotas(config: GatewayConfig, redis: aioredis.Redis, keys: Keys, unlimited_cache_s: float = 0.0,
                   absence: RedisAbsence | None = None) -> Quotas:
    """The configured quotas: a tenant's own record, else the new-tenant default for any other key, and the
    admin's (ACADEMUS_ADMIN_RATE, unlimited unless set)."""
    return Quotas(redis, keys, unlimited_cache_s, default=Limits(config.tenant_rate, config.tenant_burst),
                  admin=Limits(config.admin_rate, config.admin_burst or max(1, round(2 * config.admin_rate))),
                  absence=absence)
