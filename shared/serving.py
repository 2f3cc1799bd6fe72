"""Common gRPC server life cycle: uvloop, health, reflection, tracing, metrics, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from academus.shared.config import CommonConfig
from academus.shared.logs import log_event, setup_logging
from academus.shared.metrics import MetricsInterceptor, start_metrics
from academus.shared.tracing import server_interceptors, setup_tracing, shutdown_tracing

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

Hook = Callable[[], Awaitable[None]]


@dataclass
class ServiceSpec:
    """What a service plugs into the common runner."""

    name: str
    config: CommonConfig
    add_servicers: Callable[[grpc.aio.Server], None]
    service_names: list[str]
    on_started: Callable[[str], Awaitable[None]] | None = None  # gets the advertised address
    on_stopping: Hook | None = None   # deregister, drain queues: runs before in-flight RPCs finish
    on_stopped: Hook | None = None    # close clients
    extra_tasks: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


async def serve(spec: ServiceSpec) -> None:
    """Runs until SIGTERM/SIGINT, then stops accepting, lets in-flight RPCs finish, and exits."""
    setup_logging(spec.name)
    provider = setup_tracing(spec.name)
    server = grpc.aio.server(
        interceptors=[MetricsInterceptor(spec.name), *server_interceptors(provider)], options=CHANNEL_OPTIONS
    )
    spec.add_servicers(server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*spec.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    cfg = spec.config
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    metrics_port = start_metrics(cfg.metrics_port)
    await server.start()
    address = f"{cfg.advertised}:{port}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if spec.on_started:
        await spec.on_started(address)
    tasks = [asyncio.create_task(t()) for t in spec.extra_tasks]
    for name in ["", *spec.service_names]:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    log_event("serving", service=spec.name, address=address, metrics_port=metrics_port)
    await stop.wait()
    log_event("stopping", service=spec.name)
    await health.enter_graceful_shutdown()
    for task in tasks:  # heartbeats end first, so nothing re-registers what on_stopping removes
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if spec.on_stopping:
        await spec.on_stopping()
    await server.stop(cfg.grace_s)
    if spec.on_stopped:
        await spec.on_stopped()
    shutdown_tracing()
    log_event("stopped", service=spec.name)


def run(spec_factory: Callable[[], Awaitable[ServiceSpec]]) -> None:
    """Process entry point: build the service on uvloop and serve it."""

    async def main() -> None:
        await serve(await spec_factory())

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        logging.getLogger(__name__).info("interrupted")


def channel(target: str) -> grpc.aio.Channel:
    """An insecure loopback/cluster channel with tracing on, for service-to-service calls."""
    from academus.shared.tracing import client_interceptors

    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=client_interceptors())
