"""Manage API background jobs in Redis: the gateway submits, a trainer claims, runs and finishes them.

A job is a hash (Keys.job) with its parameters, status and progress. Its id waits in Keys.jobs()
(LPUSH by the gateway); a trainer claims it by moving it to Keys.jobs_running() and taking a lease
(Keys.job_lease, a TTL it renews) in one script, so an accepted job is always in one of the two lists.
A job whose lease expired (its trainer died) is moved back to the queue by any trainer's reaper, at
start and then periodically; a job that was claimed `max_attempts` times is failed instead, so one job
that kills its trainer cannot kill every trainer in turn.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import redis.asyncio as aioredis

from academus.shared.state.keys import Keys

QUEUED, RUNNING, SUCCEEDED, FAILED = "queued", "running", "succeeded", "failed"
ADAPTER, OVERLAY = "adapter", "overlay"     # kinds: a tenant model's training, a domain's PLOT overlay build
MODEL = "model"                             # a user's model added to or removed from the catalogue


@dataclass(frozen=True)
class Job:
    kind: str
    tenant: str                    # whose job it is: only this tenant may read it ("admin" for domains)
    target: str                    # the model or domain it builds
    params: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: str = QUEUED
    progress: float = 0.0
    message: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    updated: float = 0.0
    attempts: int = 0

    def to_hash(self) -> dict[str, str]:
        raw = asdict(self)
        return {k: json.dumps(v) if k in ("params", "result") else str(v) for k, v in raw.items()}

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> Job:
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if name not in types:
                continue
            if name in ("params", "result"):
                values[name] = json.loads(value) if value else {}
            elif name in ("progress", "created", "updated"):
                values[name] = float(value)
            elif name == "attempts":
                values[name] = int(value)
            else:
                values[name] = value
        return cls(**values)

    @property
    def done(self) -> bool:
        return self.status in (SUCCEEDED, FAILED)


# KEYS: job hash, queue. ARGV: id, then field/value pairs. Idempotent: a retried submit queues it once.
_SUBMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
"""

# KEYS: queue, running list. ARGV: lease key prefix, trainer id, lease seconds, now, job key prefix.
# Claim and lease in one step: no moment where a claimed job has no lease for a reaper to mistake.
_CLAIM = """
local id = redis.call('RPOPLPUSH', KEYS[1], KEYS[2])
if not id then return false end
redis.call('SET', ARGV[1] .. id, ARGV[2], 'EX', tonumber(ARGV[3]))
local job = ARGV[5] .. id
if redis.call('EXISTS', job) == 1 then
  redis.call('HINCRBY', job, 'attempts', 1)
  redis.call('HSET', job, 'status', 'running', 'updated', ARGV[4])
end
return id
"""

# KEYS: queue, running list. ARGV: lease key prefix, job key prefix, now, only this id (or '').
# Moves running jobs without a lease (or the one named, on a graceful stop) back to the queue's head.
_REQUEUE = """
local moved = 0
for _, id in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
  if (ARGV[4] ~= '' and id == ARGV[4]) or (ARGV[4] == '' and redis.call('EXISTS', ARGV[1] .. id) == 0) then
    redis.call('LREM', KEYS[2], 0, id)
    redis.call('DEL', ARGV[1] .. id)
    local job = ARGV[2] .. id
    if redis.call('EXISTS', job) == 1 and redis.call('HGET', job, 'status') == 'running' then
      redis.call('RPUSH', KEYS[1], id)
      redis.call('HSET', job, 'status', 'queued', 'progress', '0.0', 'updated', ARGV[3])
    end
    moved = moved + 1
  end
end
return moved
"""


class JobQueue:
    def __init__(self, redis: aioredis.Redis, keys: Keys, done_ttl_s: float = 7 * 86400) -> None:
        self.redis, self.keys, self.done_ttl_s = redis, keys, done_ttl_s
        self._submit = redis.register_script(_SUBMIT)
        self._claim = redis.register_script(_CLAIM)
        self._requeue = redis.register_script(_REQUEUE)

    async def submit(self, job: Job) -> Job:
        pairs = [x for item in job.to_hash().items() for x in item]
        await self._submit(keys=[self.keys.job(job.id), self.keys.jobs()], args=[job.id, *pairs])
        return job

    async def get(self, job_id: str) -> Job | None:
        raw = await self.redis.hgetall(self.keys.job(job_id))
        return Job.from_hash(raw) if raw else None

    async def claim(self, trainer: str, lease_s: float) -> Job | None:
        """The oldest queued job, now running under this trainer's lease; None when the queue is empty."""
        job_id = await self._claim(keys=[self.keys.jobs(), self.keys.jobs_running()],
                                   args=[self.keys.job_lease(""), trainer, max(1, round(lease_s)), time.time(),
                                         self.keys.job("")])
        if not job_id:
            return None
        job = await self.get(job_id)
        if job is None:  # its record expired or was removed: nothing to run
            await self.redis.lrem(self.keys.jobs_running(), 0, job_id)
            await self.redis.delete(self.keys.job_lease(job_id))
        return job

    async def renew(self, job_id: str, trainer: str, lease_s: float) -> None:
        await self.redis.set(self.keys.job_lease(job_id), trainer, ex=max(1, round(lease_s)))

    async def progress(self, job_id: str, fraction: float, message: str = "") -> None:
        fields_ = {"progress": round(min(max(fraction, 0.0), 1.0), 4), "updated": time.time()}
        if message:
            fields_["message"] = message
        await self.redis.hset(self.keys.job(job_id), mapping=fields_)

    async def finish(self, job_id: str, status: str, message: str = "", result: dict[str, Any] | None = None) -> None:
        """Final status; the record is kept `done_ttl_s` for GetJob, the lease and running entry go."""
        mapping = {"status": status, "message": message, "updated": time.time(),
                   "result": json.dumps(result or {})}
        if status == SUCCEEDED:
            mapping["progress"] = 1.0
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.job(job_id), mapping=mapping)
            pipe.expire(self.keys.job(job_id), max(1, round(self.done_ttl_s)))
            pipe.lrem(self.keys.jobs_running(), 0, job_id)
            pipe.delete(self.keys.job_lease(job_id))
            await pipe.execute()

    async def requeue_orphans(self) -> int:
        """Running jobs whose trainer is gone (lease expired) go back to the head of the queue."""
        return await self._requeue_script("")

    async def release(self, job_id: str) -> None:
        """A graceful stop: the job goes back to the head of the queue at once, for the next trainer."""
        await self._requeue_script(job_id)

    async def _requeue_script(self, only: str) -> int:
        return int(await self._requeue(keys=[self.keys.jobs(), self.keys.jobs_running()],
                                       args=[self.keys.job_lease(""), self.keys.job(""), time.time(), only]))

    async def waiting(self) -> int:
        return int(await self.redis.llen(self.keys.jobs()))
