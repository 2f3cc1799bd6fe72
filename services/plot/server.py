"""gRPC edge of the plot service: LookupRequest -> PlotLookup -> packed fp16 states; registers in Redis."""

from __future__ import annotations

import asyncio

import grpc

from academus.services.plot.core import PlotLookup
from academus.shared.models.plot.registry import PlotRegistration
from academus.shared.models.plot.store import InvalidTokens, UnknownDomain
from academus.shared.models.plot.wire import lookup_to_pb, request_from_pb
from academus.shared.runtime import config as cfg
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.redis_conn import connect
from academus.shared.runtime.serving import ServiceSpec, run
from academus.shared.state.keys import Keys
from academus.v1 import plot_pb2, plot_pb2_grpc

STATUS = {InvalidTokens: grpc.StatusCode.INVALID_ARGUMENT, UnknownDomain: grpc.StatusCode.NOT_FOUND}


class PlotServicer(plot_pb2_grpc.PlotServicer):
    def __init__(self, core: PlotLookup) -> None:
        self.core = core

    async def Lookup(self, request, context):
        ids, lengths, domain = request_from_pb(request)
        try:
            # numpy gathers release the GIL: a big batch must not stall the event loop's other RPCs
            result = await asyncio.to_thread(self.core.lookup, ids, lengths, domain)
        except (InvalidTokens, UnknownDomain) as e:
            await context.abort(STATUS[type(e)], str(e))
        store = self.core.store
        return lookup_to_pb(result, store.model, store.lower_layers)

    async def Info(self, request, context):
        store = self.core.store
        return plot_pb2.InfoResponse(model=store.model, lower_layers=store.lower_layers, hidden=store.hidden,
                                     domains=sorted(store.domains), root_entries=store.root_entries)


async def build() -> ServiceSpec:
    config = cfg.load(cfg.PlotConfig)
    core = PlotLookup.open(config)
    log_event("plot_loaded", **core.store.info())
    redis = connect(config.redis_url, config.redis_password)
    store = core.store
    registration = PlotRegistration(redis, Keys(config.key_prefix), config.plot_id, store.model, store.lower_layers,
                                    sorted(store.domains), config.heartbeat_ttl_s, core.refresh_domains)
    return ServiceSpec(
        name="plot",
        config=config,
        add_servicers=lambda s: plot_pb2_grpc.add_PlotServicer_to_server(PlotServicer(core), s),
        service_names=["academus.v1.Plot"],
        on_started=registration.start,
        on_stopping=registration.deregister,
        on_stopped=redis.aclose,
        extra_tasks=[registration.heartbeat],
    )


def main() -> None:
    run(build)


if __name__ == "__main__":
    main()
