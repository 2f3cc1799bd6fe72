"""Adapter store core (HMI §6.2): tenant adapters as safetensors files on this store's disk, their versions and
metadata in Redis (AOF on: they survive a restart). No gRPC here; errors are shared.errors classes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
import safetensors

from academus.shared.runtime.config import AdapterStoreConfig
from academus.shared.runtime.errors import InvalidArgument, NotFound, ServingError
from academus.shared.state.artifacts import write_atomic
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import check_name

TENSOR = re.compile(r"layers\.(\d+)\.(?:down|up)\.(?:weight|bias)|head\.(?:weight|bias)")
TENSOR_RULE = "layers.<i>.down|up.weight|bias or head.weight|bias"
MAX_METADATA_BYTES = 64 * 1024
FILE_METADATA = "__metadata__"  # the safetensors header's free-text entry, not a tensor

# The hash's v<N> fields (one JSON record a version) are the truth; `versions` (JSON list), `latest` and
# `metadata` (the latest's record) are re-derived from them inside the same script, so that concurrent puts
# and deletes can never leave them disagreeing.
_REFRESH = """
local function versions(key)
  local vs = {}
  for _, f in ipairs(redis.call('HKEYS', key)) do
    local n = string.match(f, '^v(%d+)$')
    if n then table.insert(vs, tonumber(n)) end
  end
  table.sort(vs)
  return vs
end
local function refresh(key)
  local vs = versions(key)
  if #vs == 0 then return 0 end
  local latest = vs[#vs]
  redis.call('HSET', key, 'versions', '[' .. table.concat(vs, ',') .. ']', 'latest', latest,
             'metadata', redis.call('HGET', key, 'v' .. latest))
  return latest
end
"""
# KEYS: adapter hash, tenant's name set. ARGV: version, record JSON, name.
_RECORD = _REFRESH + """
redis.call('HSET', KEYS[1], 'v' .. ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return refresh(KEYS[1])
"""
# The `next` counter outlives every version: a number is never given twice, so a worker's cache, keyed
# by (tenant, name, version), can never serve a deleted adapter's weights for a re-created one.
# ARGV: version, name. -1: no such version; the adapter goes when its last version does.
_DROP_ONE = _REFRESH + """
if redis.call('HDEL', KEYS[1], 'v' .. ARGV[1]) == 0 then return -1 end
local latest = refresh(KEYS[1])
if latest == 0 then
  redis.call('HDEL', KEYS[1], 'versions', 'latest', 'metadata')
  redis.call('SREM', KEYS[2], ARGV[2])
end
return latest
"""
# ARGV: name. Returns the versions removed.
_DROP_ALL = _REFRESH + """
local vs = versions(KEYS[1])
for _, v in ipairs(vs) do redis.call('HDEL', KEYS[1], 'v' .. v) end
redis.call('HDEL', KEYS[1], 'versions', 'latest', 'metadata')
redis.call('SREM', KEYS[2], ARGV[1])
return vs
"""


@dataclass(frozen=True)
class StoredVersion:
    tenant: str
    name: str
    version: int
    bytes: int
    metadata: dict[str, str]  # as the Put gave it
    created: float            # unix seconds


@dataclass(frozen=True)
class AdapterInfo:
    latest: StoredVersion
    versions: list[int]


GetPiece = tuple[str, str, int, Sequence[int], bool]   # tenant, name, version, layers, head: one `get`


@dataclass(frozen=True)
class Fetched:
    stored: StoredVersion
    weights: bytes            # safetensors


@dataclass(frozen=True)
class AdapterFile:
    """One stored file and where each tensor's bytes lie in it (the header was validated at Put)."""

    raw: bytes
    tensors: dict[str, tuple[str, list[int], int, int]]  # name -> dtype, shape, start, end in raw
    metadata: dict[str, str] | None = None                # the header's __metadata__ (models/adapters.py needs it)

    @classmethod
    def parse(cls, raw: bytes) -> AdapterFile:
        size = int.from_bytes(raw[:8], "little")
        header, base = json.loads(raw[8 : 8 + size]), 8 + size
        return cls(raw, {name: (e["dtype"], e["shape"], base + e["data_offsets"][0], base + e["data_offsets"][1])
                         for name, e in header.items() if name != FILE_METADATA}, header.get(FILE_METADATA))

    def select(self, layers: Sequence[int], head: bool) -> bytes:
        """A safetensors file of only these layers' tensors (and the head's), sliced from the stored bytes;
        the header's metadata is kept, so a piece parses like the whole file."""
        wanted = set(layers)
        names = sorted(n for n in self.tensors if layer_of(n) in wanted or (head and n.startswith("head.")))
        return pack({n: (self.tensors[n][0], self.tensors[n][1], self.raw[self.tensors[n][2] : self.tensors[n][3]])
                     for n in names}, self.metadata)


def pack(tensors: Mapping[str, tuple[str, list[int], bytes]], metadata: Mapping[str, str] | None = None) -> bytes:
    """Safetensors encoding: u64 LE header length, JSON header padded to 8 bytes, then the data back to back."""
    header: dict[str, object] = {FILE_METADATA: dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(data for _, _, data in tensors.values())


def layer_of(tensor: str) -> int | None:
    match = TENSOR.fullmatch(tensor)
    return int(match.group(1)) if match and match.group(1) is not None else None


def check_version(version: int) -> None:
    if version < 0:
        raise InvalidArgument(f"ref.version={version} is invalid: it must be >= 0 (0: the latest, or every one)")


def check_weights(weights: bytes, limit: int) -> None:
    if not weights:
        raise InvalidArgument("weights are empty: a safetensors file is required")
    if len(weights) > limit:
        raise InvalidArgument(f"weights are {len(weights)} bytes; the limit is {limit} bytes")
    try:
        names = [name for name, _ in safetensors.deserialize(weights)]
    except Exception as e:  # the Rust parser's errors have no common Python base
        raise InvalidArgument(f"weights are not a safetensors file: {e}") from e
    if not names:
        raise InvalidArgument("weights hold no tensor")
    bad = next((n for n in names if not TENSOR.fullmatch(n)), None)
    if bad is not None:
        raise InvalidArgument(f"weights hold tensor {bad[:80]!r}; tensor names must be {TENSOR_RULE}")


def metadata_record(metadata: Mapping[str, str], size: int) -> str:
    text = json.dumps({"metadata": dict(metadata), "bytes": size, "created": time.time()}, sort_keys=True)
    if len(text) > MAX_METADATA_BYTES:
        raise InvalidArgument(f"metadata is {len(text)} bytes as JSON; the limit is {MAX_METADATA_BYTES} bytes")
    return text


class FileCache:
    """LRU of parsed files within a byte budget: layer-by-layer gets of one adapter read the disk once."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.size = 0
        self.entries: OrderedDict[tuple[str, str, int], AdapterFile] = OrderedDict()

    def get(self, key: tuple[str, str, int]) -> AdapterFile | None:
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
        return found

    def put(self, key: tuple[str, str, int], file: AdapterFile) -> None:
        if len(file.raw) > self.budget:
            return
        self.drop(key)
        self.entries[key] = file
        self.size += len(file.raw)
        while self.size > self.budget:
            _, evicted = self.entries.popitem(last=False)
            self.size -= len(evicted.raw)

    def drop(self, key: tuple[str, str, int]) -> None:
        gone = self.entries.pop(key, None)
        if gone is not None:
            self.size -= len(gone.raw)


class AdapterStore:
    """Put / Get / List / Delete of tenant adapters. Files are written before Redis records their version and
    removed after Redis forgets it, so a version Redis lists always has its file."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, data_dir: Path, max_bytes: int,
                 cache_bytes: int = 64 * 1024 * 1024, max_get_many: int = 64) -> None:
        self.redis, self.keys = redis, keys
        self.data_dir = Path(data_dir)
        self.max_bytes = max_bytes
        self.cache = FileCache(cache_bytes)
        self.max_get_many = max_get_many
        self._record = redis.register_script(_RECORD)
        self._drop_one = redis.register_script(_DROP_ONE)
        self._drop_all = redis.register_script(_DROP_ALL)

    @classmethod
    def from_config(cls, config: AdapterStoreConfig, redis: aioredis.Redis) -> AdapterStore:
        return cls(redis, Keys(config.key_prefix), config.store_dir, config.max_adapter_bytes, config.cache_bytes,
                   config.max_get_many)

    def path(self, tenant: str, name: str, version: int) -> Path:
        return self.data_dir / tenant / name / f"v{version}.safetensors"

    async def put(self, tenant: str, name: str, weights: bytes, metadata: Mapping[str, str]) -> StoredVersion:
        check_name("ref.tenant", tenant)
        check_name("ref.name", name)
        record = metadata_record(metadata, len(weights))
        await asyncio.to_thread(check_weights, weights, self.max_bytes)
        key = self.keys.adapter(tenant, name)
        version = int(await self.redis.hincrby(key, "next", 1))
        path = self.path(tenant, name, version)
        try:
            await asyncio.to_thread(write_atomic, path, weights)
        except OSError as e:  # disk full, permissions: the client sees why, the version number is skipped
            raise ServingError(f"could not write adapter {tenant}/{name} version {version}: {e.strerror}") from e
        try:
            await self._record(keys=[key, self.keys.adapters(tenant)], args=[version, record, name])
        except BaseException:  # unrecorded: nobody can name this version, so its file is garbage
            path.unlink(missing_ok=True)
            raise
        return self._stored(tenant, name, version, record)

    async def get(self, tenant: str, name: str, version: int = 0, layers: Sequence[int] = (),
                  head: bool = False) -> Fetched:
        """version 0: the latest. `layers`: only those layers' tensors (+ the head's with `head`); none: the file."""
        if any(layer < 0 for layer in layers):
            raise InvalidArgument(f"layers={list(layers)} is invalid: layer indices must be >= 0")
        stored = await self.version(tenant, name, version)
        file = await self._file(stored)
        return Fetched(stored, file.select(layers, head) if layers else file.raw)

    async def get_many(self, gets: Sequence[GetPiece]) -> list[Fetched | ServingError]:
        """Several `get`s at once, answered in order; an item's error is its answer, not the call's."""
        if len(gets) > self.max_get_many:
            raise InvalidArgument(f"gets has {len(gets)} items; the limit is {self.max_get_many} a call")
        results = await asyncio.gather(*(self.get(*g) for g in gets), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, ServingError):
                raise result  # Redis away or a bug: the whole call fails, as one get would
        return results

    async def version(self, tenant: str, name: str, version: int = 0) -> StoredVersion:
        check_name("ref.tenant", tenant)
        check_name("ref.name", name)
        check_version(version)
        key = self.keys.adapter(tenant, name)
        if version == 0:
            latest = await self.redis.hget(key, "latest")
            if latest is None:
                raise NotFound(f"adapter {tenant}/{name} not found")
            version = int(latest)
        record = await self.redis.hget(key, f"v{version}")
        if record is None:
            raise NotFound(f"adapter {tenant}/{name} has no version {version}")
        return self._stored(tenant, name, version, record)

    async def list(self, tenant: str) -> list[AdapterInfo]:
        """Every adapter of the tenant, by name; an unknown tenant has none."""
        check_name("tenant", tenant)
        names = sorted(await self.redis.smembers(self.keys.adapters(tenant)))
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.adapter(tenant, name))
        rows = await pipe.execute() if names else []
        found = []
        for name, fields in zip(names, rows, strict=True):
            if "latest" not in fields:  # deleted between the two reads
                continue
            latest = int(fields["latest"])
            found.append(AdapterInfo(self._stored(tenant, name, latest, fields[f"v{latest}"]),
                                     json.loads(fields["versions"])))
        return found

    async def delete(self, tenant: str, name: str, version: int = 0) -> int:
        """version 0: every version. Returns how many versions went."""
        check_name("ref.tenant", tenant)
        check_name("ref.name", name)
        check_version(version)
        keys = [self.keys.adapter(tenant, name), self.keys.adapters(tenant)]
        if version == 0:
            versions = [int(v) for v in await self._drop_all(keys=keys, args=[name])]
            if not versions:
                raise NotFound(f"adapter {tenant}/{name} not found")
        else:
            if int(await self._drop_one(keys=keys, args=[version, name])) < 0:
                raise NotFound(f"adapter {tenant}/{name} has no version {version}")
            versions = [version]
        for v in versions:
            self.cache.drop((tenant, name, v))
        await asyncio.to_thread(self._remove_files, tenant, name, versions)
        return len(versions)

    def _remove_files(self, tenant: str, name: str, versions: Sequence[int]) -> None:
        for v in versions:
            self.path(tenant, name, v).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # empty once every version went; a Put in flight keeps it
            self.path(tenant, name, 0).parent.rmdir()

    async def _file(self, stored: StoredVersion) -> AdapterFile:
        key = (stored.tenant, stored.name, stored.version)
        file = self.cache.get(key)
        if file is None:
            path = self.path(*key)
            try:
                file = AdapterFile.parse(await asyncio.to_thread(path.read_bytes))
            except FileNotFoundError as e:
                raise ServingError(f"weights of adapter {stored.tenant}/{stored.name} version {stored.version} "
                                   f"are missing on the store's disk") from e
            self.cache.put(key, file)
        return file

    @staticmethod
    def _stored(tenant: str, name: str, version: int, record: str) -> StoredVersion:
        r = json.loads(record)
        return StoredVersion(tenant, name, version, int(r["bytes"]), dict(r["metadata"]), float(r["created"]))
