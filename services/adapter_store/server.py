"""gRPC edge of the adapter store: AdapterStore RPCs -> core.AdapterStore; announces its address in Redis."""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from academus.services.adapter_store.core import AdapterInfo, AdapterStore, Fetched, StoredVersion
from academus.shared.runtime import config as cfg
from academus.shared.runtime.errors import ServingError, Unavailable, abort_with
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import ServiceSpec, run
from academus.shared.state.keys import Keys
from academus.v1 import adapter_store_pb2 as pb
from academus.v1 import adapter_store_pb2_grpc, tensors_pb2


def ref_pb(stored: StoredVersion) -> tensors_pb2.AdapterRef:
    return tensors_pb2.AdapterRef(tenant=stored.tenant, name=stored.name, version=stored.version)


def info_pb(info: AdapterInfo) -> pb.AdapterInfo:
    latest = info.latest
    return pb.AdapterInfo(ref=ref_pb(latest), versions=info.versions, bytes=latest.bytes, metadata=latest.metadata)


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    def __init__(self, core: AdapterStore) -> None:
        self.core = core

    async def Put(self, request: pb.PutAdapterRequest, context: grpc.aio.ServicerContext):
        ref = request.ref
        stored = await self._call(context, self.core.put(ref.tenant, ref.name, request.weights,
                                                         dict(request.metadata)))
        return pb.PutAdapterResponse(ref=ref_pb(stored), bytes=stored.bytes)

    async def Get(self, request: pb.GetAdapterRequest, context: grpc.aio.ServicerContext):
        ref = request.ref
        fetched = await self._call(context, self.core.get(ref.tenant, ref.name, ref.version, list(request.layers),
                                                          request.head))
        return pb.GetAdapterResponse(ref=ref_pb(fetched.stored), weights=fetched.weights,
                                     metadata=fetched.stored.metadata)

    async def GetMany(self, request: pb.GetManyRequest, context: grpc.aio.ServicerContext):
        gets = [(g.ref.tenant, g.ref.name, g.ref.version, list(g.layers), g.head) for g in request.gets]
        results = await self._call(context, self.core.get_many(gets))
        return pb.GetManyResponse(items=[item_pb(r) for r in results])

    async def List(self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext):
        infos = await self._call(context, self.core.list(request.tenant))
        return pb.ListAdaptersResponse(adapters=[info_pb(i) for i in infos])

    async def Delete(self, request: pb.DeleteAdapterRequest, context: grpc.aio.ServicerContext):
        ref = request.ref
        deleted = await self._call(context, self.core.delete(ref.tenant, ref.name, ref.version))
        return pb.DeleteAdapterResponse(deleted=deleted)

    @staticmethod
    async def _call(context: grpc.aio.ServicerContext, work):
        try:
            return await work
        except ServingError as e:
            await abort_with(context, e)
        except RedisError as e:  # versions unreachable: nothing was recorded, a retry may succeed
            await abort_with(context, Unavailable(f"adapter metadata store unreachable: {e}"))


def item_pb(result: Fetched | ServingError) -> pb.GetManyItem:
    if isinstance(result, ServingError):
        return pb.GetManyItem(code=result.code.value[0], error=result.message)
    return pb.GetManyItem(adapter=pb.GetAdapterResponse(ref=ref_pb(result.stored), weights=result.weights,
                                                        metadata=result.stored.metadata))


class Announcement:
    """The store's address at Keys.adapter_store(), with the heartbeat TTL: gone soon after the store is."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: float) -> None:
        self.redis, self.keys = redis, keys
        self.ttl = max(1, round(ttl_s))
        self.address = ""

    async def announce(self, address: str) -> None:
        self.address = address
        await self.redis.set(self.keys.adapter_store(), address, ex=self.ttl)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.announce(self.address)
            except Exception as e:  # Redis away: keep serving, the next beat re-announces
                log_event("heartbeat_failed", logging.WARNING, error=repr(e))

    async def withdraw(self) -> None:
        try:  # only our own address: a newer store may have taken the key over
            if await self.redis.get(self.keys.adapter_store()) == self.address:
                await self.redis.delete(self.keys.adapter_store())
        except Exception as e:  # the TTL removes it anyway
            log_event("withdraw_failed", logging.WARNING, error=repr(e))


async def build() -> ServiceSpec:
    config = cfg.load(cfg.AdapterStoreConfig)
    redis = connect(config.redis_url, config.redis_password)
    core = AdapterStore.from_config(config, redis)
    log_event("adapter_store_opened", data_dir=str(core.data_dir), max_adapter_bytes=core.max_bytes)
    announcement = Announcement(redis, Keys(config.key_prefix), config.heartbeat_ttl_s)
    return ServiceSpec(
        name="adapter_store",
        config=config,
        add_servicers=lambda s: adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(
            AdapterStoreServicer(core), s),
        service_names=["academus.v1.AdapterStore"],
        on_started=announcement.announce,
        on_stopping=announcement.withdraw,
        on_stopped=redis.aclose,
        extra_tasks=[announcement.heartbeat],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
