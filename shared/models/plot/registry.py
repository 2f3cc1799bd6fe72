"""Plot services in Redis: each registers its address and table (acd:plot:<id>, TTL = heartbeat) and
joins the acd:plots set; clients (the scheduler's prefetch, plot_bench) list the live ones here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from academus.shared.state.keys import Keys
from academus.shared.state.registration import Registration


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


class PlotRegistration(Registration):
    """One plot service's entry: its table (model, lower layers, domains) beside its address."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, plot_id: str, model: str, lower_layers: int,
                 domains: list[str], ttl_s: float, refresh_domains: Callable[[], list[str]] | None = None) -> None:
        super().__init__(redis, keys.plot, keys.plots(), ttl_s, plot_id)
        self.table = {"model": model, "lower_layers": str(lower_layers), "domains": ",".join(sorted(domains))}
        self.refresh_domains = refresh_domains   # each beat: the overlays loaded now (new ones announced)

    async def fields(self) -> dict[str, str]:
        if self.refresh_domains is not None:
            self.table["domains"] = ",".join(sorted(await asyncio.to_thread(self.refresh_domains)))
        return self.table


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
