"""PLOT domains (HMI §5.1) as the Manage API knows them: a record per domain in Redis (Keys.domain),
its overlay's files under the root table's `domains/<name>/` (built by the trainer's overlay job)."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import redis.asyncio as aioredis

from academus.shared.runtime.errors import AlreadyExists, NotFound
from academus.shared.state.keys import Keys

BUILDING, READY, FAILED = "building", "ready", "failed"


@dataclass(frozen=True)
class Domain:
    name: str
    status: str = BUILDING
    top_percent: float = 10.0
    job: str = ""
    message: str = ""
    lines: int = 0
    created: float = field(default_factory=time.time)
    deleting: int = 0              # 1 while DeleteDomain looks for tenant models using it (see Manage)

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_hash(cls, raw: dict[str, str]) -> Domain:
        kinds = {"top_percent": float, "created": float, "lines": int, "deleting": int}
        return cls(**{f.name: kinds.get(f.name, str)(raw[f.name]) for f in fields(cls) if f.name in raw})


# KEYS: domain record, domain set. ARGV: name, field/value pairs. A failed domain may be created again.
_CREATE = """
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'failed' then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: domain record. ARGV: the field's new value. Only an existing record is marked.
_MARK_DELETING = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'deleting', ARGV[1])
return 1
"""


class DomainRegistry:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self._create = redis.register_script(_CREATE)
        self._mark_deleting = redis.register_script(_MARK_DELETING)

    async def create(self, domain: Domain) -> None:
        pairs = [x for item in domain.to_hash().items() for x in item]
        if not await self._create(keys=[self.keys.domain(domain.name), self.keys.domains()],
                                  args=[domain.name, *pairs]):
            raise AlreadyExists(f"domain {domain.name!r} already exists: delete it first to rebuild it")

    async def get(self, name: str) -> Domain | None:
        raw = await self.redis.hgetall(self.keys.domain(name))
        return Domain.from_hash(raw) if raw else None

    async def list(self) -> list[Domain]:
        found = [await self.get(n) for n in sorted(await self.redis.smembers(self.keys.domains()))]
        return [d for d in found if d is not None]

    async def set_status(self, name: str, status: str, message: str = "") -> bool:
        """False when the domain was deleted meanwhile (its build's result is then thrown away)."""
        if not await self.redis.exists(self.keys.domain(name)):
            return False
        await self.redis.hset(self.keys.domain(name), mapping={"status": status, "message": message})
        return True

    async def mark_deleting(self, name: str, deleting: bool = True) -> bool:
        """Marks (or unmarks) the domain as being deleted; False when there is no such domain. A mark left
        by a gateway that died mid-delete refuses new tenant models until DeleteDomain is called again."""
        return bool(await self._mark_deleting(keys=[self.keys.domain(name)], args=[int(deleting)]))

    async def delete(self, name: str, table: Path | None) -> None:
        """The record, then the overlay's files (workers and plot services that loaded them drop their
        mapped copy at their next lookup of the domain)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.domain(name))
            pipe.srem(self.keys.domains(), name)
            removed, _ = await pipe.execute()
        if not removed:
            raise NotFound(f"domain {name!r} not found")
        if table is not None:
            shutil.rmtree(overlay_dir(table, name), ignore_errors=True)


def overlay_dir(table: Path, name: str) -> Path:
    from academus.shared.models.plot.store import DOMAINS_DIR

    return Path(table) / DOMAINS_DIR / name


def root_table(plot_dir: str = "") -> Path | None:
    """The PLOT table whose root overlays extend: `plot_dir` when set, else the first table on the bundled teacher
    the mesh serves (plot_tables over the artifacts: tenant domains sit on `minilm-plot`, and the overlays are
    built with the teacher's layers); None when no such table is built there."""
    from academus.shared.models.plot.table import ROOT, plot_tables, read_manifest
    from academus.shared.models.user_models import BUNDLED_BASE
    from academus.shared.runtime.config import artifacts_dir

    if plot_dir:
        return Path(plot_dir) if (Path(plot_dir) / ROOT / "manifest.json").is_file() else None
    return next((t for t in plot_tables(artifacts_dir()) if read_manifest(t / ROOT).model == BUNDLED_BASE), None)
