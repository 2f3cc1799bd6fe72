"""A tenant model end to end (issue: `academus tenants create`): validate the labelled data, train the
adapter + head on the frozen base, put the weights in the adapter store, create the tenant and its
key, register the model. Nothing is written until training has succeeded; a failure after that
undoes what was written."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from academus.shared.runtime.errors import InvalidArgument, NotFound, Unavailable, from_rpc_error
from academus.shared.runtime.serving import CHANNEL_OPTIONS
from academus.shared.runtime.tls import mesh_channel
from academus.shared.state.keys import Keys
from academus.shared.state.tenants import TenantModel, TenantRegistry, check_name
from academus.v1 import adapter_store_pb2, adapter_store_pb2_grpc, tensors_pb2


class AdapterStoreClient:
    """The adapter store over gRPC, its address from Redis (announced with a heartbeat TTL)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys

    async def _call(self, method: str, request, timeout_s: float = 30.0):
        address = await self.redis.get(self.keys.adapter_store())
        if not address:
            raise Unavailable("no adapter store is running (its address is not in Redis): start the mesh")
        async with mesh_channel(address, CHANNEL_OPTIONS) as channel:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
            try:
                return await getattr(stub, method)(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e, "adapter store") from e

    async def put(self, tenant: str, name: str, weights: bytes, metadata: dict[str, str]) -> int:
        reply = await self._call("Put", adapter_store_pb2.PutAdapterRequest(
            ref=tensors_pb2.AdapterRef(tenant=tenant, name=name), weights=weights, metadata=metadata))
        return reply.ref.version

    async def delete_all(self, tenant: str) -> int:
        """Every version of every adapter of the tenant."""
        listed = await self._call("List", adapter_store_pb2.ListAdaptersRequest(tenant=tenant))
        deleted = 0
        for info in listed.adapters:
            ref = tensors_pb2.AdapterRef(tenant=tenant, name=info.ref.name)
            deleted += (await self._call("Delete", adapter_store_pb2.DeleteAdapterRequest(ref=ref))).deleted
        return deleted


async def create_tenant_model(redis: aioredis.Redis, keys: Keys, name: str, base: str, data: Path,
                              rank: int = 16, epochs: int = 8, progress: bool = True,
                              domain: str = "") -> dict[str, Any]:
    """Tenant `name` with its model `name`: trained first, then the tenant, key and model are written.
    Returns the summary with the tenant's key (shown once)."""
    check_name("name", name)
    registry = TenantRegistry(redis, keys)
    if name in await registry.tenants():
        raise InvalidArgument(f"tenant {name!r} already exists: delete it first or choose another name")
    adapter, summary = await _train(redis, keys, base, data, rank, epochs, progress, domain)
    key = await registry.create_tenant(name)
    try:
        registered = await publish_adapter(redis, keys, name, name, base, adapter, domain=domain)
    except BaseException:
        await registry.delete_tenant(name)
        raise
    return {**registered, **summary, "key": key}


async def train_tenant_adapter(redis: aioredis.Redis, keys: Keys, tenant: str, name: str, base: str, data: Path,
                               rank: int = 16, epochs: int = 8, progress: bool = True,
                               domain: str = "") -> dict[str, Any]:
    """A new adapter (or a new version of it) for an existing tenant, registered as its model `name`."""
    check_name("name", name)
    await TenantRegistry(redis, keys).tenant(tenant)  # NotFound before any training
    adapter, summary = await _train(redis, keys, base, data, rank, epochs, progress, domain)
    return {**await publish_adapter(redis, keys, tenant, name, base, adapter, domain=domain), **summary}


async def _train(redis: aioredis.Redis, keys: Keys, base: str, data: Path, rank: int, epochs: int,
                 progress: bool, domain: str = "") -> tuple[Any, dict[str, Any]]:
    from academus.shared.training.adapters import read_labelled_jsonl, train_adapter

    if not await redis.get(keys.adapter_store()):
        raise Unavailable("no adapter store is running (its address is not in Redis): start the mesh")
    try:
        texts, labels = read_labelled_jsonl(data)
        adapter, summary = await asyncio.to_thread(train_adapter, texts, labels, base, rank, epochs,
                                                   progress=progress, domain=domain)
    except (ValueError, OSError) as e:  # bad data, an unknown base or domain, no PLOT table: nothing written
        raise InvalidArgument(str(e)) from e
    return adapter, training_summary(summary)


def training_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """What a caller learns of a training (train_adapter's summary, trimmed)."""
    return {"validation": summary["validation"], "untrained_validation": summary["untrained_validation"],
            "examples": summary["counts"], "train_seconds": summary["seconds"]}


async def publish_adapter(redis: aioredis.Redis, keys: Keys, tenant: str, name: str, base: str, adapter: Any,
                          **model_fields: Any) -> dict[str, Any]:
    """Puts the trained adapter in the store (a new version) and registers the tenant's model `name` as
    ready on that version; `model_fields` are further TenantModel fields (domain, job). Given a `job`, the model
    is replaced only while its record is still that job's: otherwise NotFound, and the version stays unused."""
    version = await AdapterStoreClient(redis, keys).put(tenant, name, adapter.to_bytes(), {"base": base})
    registry = TenantRegistry(redis, keys)
    model = TenantModel(name=name, base=base, adapter=name, version=version, labels=list(adapter.labels),
                        **model_fields)
    if not model.job:
        await registry.register_model(tenant, model)
    elif not await registry.replace_job_model(tenant, model, model.job):
        raise NotFound(f"model {name!r} was deleted or is being trained by a newer job")
    return {"tenant": tenant, "model": name, "base": base, "version": version, "labels": list(adapter.labels)}


async def delete_tenant(redis: aioredis.Redis, keys: Keys, name: str) -> dict[str, Any]:
    registry = TenantRegistry(redis, keys)
    if name not in await registry.tenants():
        raise NotFound(f"tenant {name!r} not found")
    deleted = await AdapterStoreClient(redis, keys).delete_all(name)
    await registry.delete_tenant(name)
    return {"tenant": name, "deleted": True, "adapter_versions_deleted": deleted}


async def list_tenants(redis: aioredis.Redis, keys: Keys) -> list[dict[str, Any]]:
    registry = TenantRegistry(redis, keys)
    return [{"tenant": t, "models": [{"name": m.name, "base": m.base, "version": m.version, "labels": m.labels,
                                      "status": m.status} for m in await registry.models(t)]}
            for t in await registry.tenants()]
