"""Plot services in Redis: each registers its address and table (acd:plot:<id>, TTL = heartbeat) and
joins the acd:plots set; clients (the scheduler's prefetch, plot_bench) list the live ones here."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from academus.shared.runtime.logs import log_event
from academus.shared.state.keys import Keys


@dataclass(frozen=True)
class PlotEndpoint:
    plot_id: str
    address: str
    model: str
    lower_layers: int
    domains: tuple[str, ...]

    def serves(self, model: str = "", lower_layers: int = 0, domain: str = "") -> bool:
        return ((not model or model == self.model) and (not lower_layers or lower_layers == self.lower_layers)
                and (not domain or domain in self.domains))


class PlotRegistration:
    """One plot service's entry: written at start, refreshed by the heartbeat, removed on stop.
    Every write is a SET/HSET/SADD of the same values, so a retried command cannot apply twice."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, plot_id: str, model: str, lower_layers: int,
                 domains: list[str], ttl_s: float, refresh_domains: Callable[[], list[str]] | None = None) -> None:
        self.redis, self.keys = redis, keys
        self.plot_id = plot_id
        self.fields = {"model": model, "lower_layers": str(lower_layers), "domains": ",".join(sorted(domains))}
        self.ttl = max(1, round(ttl_s))
        self.address = ""
        self.refresh_domains = refresh_domains   # each beat: the overlays loaded now (new ones announced)

    async def register(self, address: str) -> None:
        self.address = address
        self.plot_id = self.plot_id or address
        if self.refresh_domains is not None:
            self.fields["domains"] = ",".join(sorted(await asyncio.to_thread(self.refresh_domains)))
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.plot(self.plot_id), mapping={"address": address, **self.fields})
        pipe.expire(self.keys.plot(self.plot_id), self.ttl)
        pipe.sadd(self.keys.plots(), self.plot_id)
        await pipe.execute()

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self.register(self.address)
            except Exception as e:  # Redis away: keep serving, the next beat re-registers
                log_event("heartbeat_failed", logging.WARNING, error=repr(e))

    async def deregister(self) -> None:
        try:
            await self.redis.srem(self.keys.plots(), self.plot_id)
            await self.redis.delete(self.keys.plot(self.plot_id))
        except Exception as e:  # the TTL removes the entry anyway
            log_event("deregister_failed", logging.WARNING, error=repr(e))


async def live_plot_services(redis: aioredis.Redis, keys: Keys, model: str = "", lower_layers: int = 0,
                             domain: str = "") -> list[PlotEndpoint]:
    """The registered plot services whose heartbeat is alive and that hold the wanted table; ids
    whose entry expired are pruned from the set."""
    found: list[PlotEndpoint] = []
    for plot_id in sorted(await redis.smembers(keys.plots())):
        entry = await redis.hgetall(keys.plot(plot_id))
        if not entry.get("address"):
            await redis.srem(keys.plots(), plot_id)
            continue
        domains = tuple(d for d in entry.get("domains", "").split(",") if d)
        endpoint = PlotEndpoint(plot_id, entry["address"], entry.get("model", ""),
                                int(entry.get("lower_layers", 0)), domains)
        if endpoint.serves(model, lower_layers, domain):
            found.append(endpoint)
    return found
