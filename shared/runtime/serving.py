"""Common gRPC server life cycle: uvloop, health, reflection, tracing, metrics, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from academus.client.types import RECONNECT_OPTIONS
from academus.shared.runtime.certificates import follow_mesh_identity, mesh_credentials
from academus.shared.runtime.config import CommonConfig, load
from academus.shared.runtime.handover import Handover
from academus.shared.runtime.heap import freeze_start_up_heap, keep_freed_pages, watch_pauses
from academus.shared.runtime.local_plane import LocalPlane, open_local, socket_dir
from academus.shared.runtime.logs import log_event, setup_logging
from academus.shared.runtime.loop_watch import StallTracer, watch_lag
from academus.shared.runtime.metrics import MetricsInterceptor, start_metrics
from academus.shared.runtime.multiplex import SERVICE_NAME as MULTIPLEX_SERVICE
from academus.shared.runtime.multiplex import MultiplexServicer, over_streams, serve_multiplexed
from academus.shared.runtime.slices import set_process_slice
from academus.shared.runtime.tls import MeshTls, MeshTokenCheck, mesh_channel, mesh_generation, mesh_metadata, use_mesh
from academus.shared.runtime.tracing import server_interceptors, setup_tracing, shutdown_tracing

T = TypeVar("T")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
RECANCEL_S = 0.1   # a stopping service cancels a background task still running again this often
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
RENEWED_CLOSE_S = 120.0   # a renewed channel's calls finish within their deadlines before it is closed

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
    own_port: int = 0                 # a second port, no other process binds (the mesh hands it out); 0: none
    hop_target: bool = False          # other services call it on the request path: it serves the node-local plane
    # the gateway: its ports' TLS (None from it: plaintext), read at start, instead of the mesh's mutual TLS
    public_credentials: Callable[[], grpc.ServerCredentials | None] | None = None
    # the largest request message read (0: the mesh's MAX_MESSAGE_BYTES); a larger one is refused unread
    max_receive_bytes: int = 0


class RunningService:
    """A started server with health, reflection, tracing and metrics; `stop()` drains it."""

    def __init__(self, spec: ServiceSpec) -> None:
        self.spec = spec
        self.address = ""
        self.metrics_port = -1
        self._tasks: list[asyncio.Task] = []
        provider = setup_tracing(spec.name)
        self.interceptors = [MetricsInterceptor(spec.name), *server_interceptors(provider, spec.config.trace_ratio)]
        options = dict(CHANNEL_OPTIONS)   # one entry a key: grpc takes an option's first
        if spec.max_receive_bytes:
            options["grpc.max_receive_message_length"] = spec.max_receive_bytes
        # an internal service's calls come from the mesh only: checked before the project's own interceptors,
        # and not frame by frame (the multiplexed frames' stream was)
        gate = [MeshTokenCheck(spec.config.mesh_token)] if spec.config.mesh_token and not self.is_public else []
        self.server = grpc.aio.server(interceptors=[*gate, *self.interceptors], options=list(options.items()))
        self.health = HealthServicer()
        self.multiplex: MultiplexServicer | None = None
        self.local_plane: LocalPlane | None = None
        self.stall_tracer: StallTracer | None = None

    @property
    def is_public(self) -> bool:
        """The gateway: its callers hold API keys, not the mesh's token."""
        return self.spec.public_credentials is not None

    async def start(self) -> str:
        spec, cfg = self.spec, self.spec.config
        # every unary method is also served as frames of one stream a caller (shared/runtime/multiplex.py)
        self.multiplex = serve_multiplexed(self.server, spec.add_servicers, self.interceptors, cfg.frame_batches,
                                           cfg.max_stream_calls, cfg.max_stream_backlog_bytes)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        names = [*spec.service_names, MULTIPLEX_SERVICE, health_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        mesh = MeshTls.from_config(cfg)   # the process's identity on the internal channels it opens
        use_mesh(mesh, cfg.mesh_token)
        credentials = self._credentials(mesh)
        port = self._bind(cfg.port, credentials())
        if spec.own_port:
            self._bind(spec.own_port, credentials())
        self.metrics_port = start_metrics(cfg.metrics_port)
        if spec.hop_target and cfg.hop_streams and cfg.local_plane:
            self.local_plane = await self._start_local_plane(socket_dir(cfg.socket_dir))
        await self.server.start()
        self.address = f"{cfg.advertised}:{port}"
        if spec.on_started:
            await spec.on_started(self.address)
        self._tasks = [asyncio.create_task(t()) for t in spec.extra_tasks]
        self._tasks.append(asyncio.create_task(watch_lag(spec.name)))
        if mesh is not None:
            self._tasks.append(asyncio.create_task(follow_mesh_identity(cfg, mesh)))
        if cfg.loop_stall_ms:
            self.stall_tracer = StallTracer(spec.name, cfg.loop_stall_ms / 1e3)
            self.stall_tracer.start(asyncio.get_running_loop())
        for name in ["", *spec.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.handover:   # a standby that took a stopping process's place: that process may drain now
            Handover(cfg.handover).served()
        log_event("serving", service=spec.name, address=self.address, metrics_port=self.metrics_port, pid=os.getpid())
        return self.address

    async def _start_local_plane(self, folder: Path) -> LocalPlane | None:
        """The plane only saves time: a folder this user cannot make or write (a host folder mounted root's
        own) leaves the peers of this node on gRPC, with a warning that names the folder and its setting."""
        plane = LocalPlane(self.multiplex, folder, self.spec.name)
        try:
            await plane.start()
        except OSError as e:
            log_event("local_plane_off", logging.WARNING, service=self.spec.name, folder=str(folder), error=repr(e),
                      uid=os.getuid(), fix="make ACADEMUS_SOCKET_DIR a folder this uid may write")
            return None
        return plane

    def _credentials(self, mesh: MeshTls | None) -> Callable[[], grpc.ServerCredentials | None]:
        """What makes its ports' TLS, one a port (each follows its files: gRPC takes a reloading credential on one
        port only; a file that cannot be read stops the start, naming its setting)."""
        if self.is_public:
            return self.spec.public_credentials
        return (lambda: mesh_credentials(self.spec.config)) if mesh else (lambda: None)

    def _bind(self, port: int, credentials: grpc.ServerCredentials | None) -> int:
        address = f"{self.spec.config.host}:{port}"
        if credentials is None:
            return self.server.add_insecure_port(address)
        return self.server.add_secure_port(address, credentials)

    async def stop(self) -> None:
        """NOT_SERVING, background tasks end (no heartbeat re-registers), deregister, hand over to a standby where
        the supervisor offers one (runtime/handover.py), drain, close. The `stopped` event gives each step's
        seconds: a stop that waits out its grace names the step that waited."""
        log_event("stopping", service=self.spec.name)
        took: dict[str, float] = {}
        await self.health.enter_graceful_shutdown()
        await _timed(took, "tasks", self._cancel_tasks())
        if self.stall_tracer is not None:
            self.stall_tracer.stop()
        if self.spec.on_stopping:
            await _timed(took, "on_stopping", self.spec.on_stopping())
        handed = await _timed(took, "handover", self._hand_over()) if self.spec.config.handover else None
        if self.multiplex is not None:  # new frames are refused; the streams end once their calls answer
            self.multiplex.drain()
        # both at once: the server's GOAWAY and closed listener move callers to a successor on the same ports
        # (runtime/handover.py) while the node-local connections finish their calls
        grace, cut = self.spec.config.grace_s, 0
        server = _timed(took, "server", self.server.stop(grace))
        if self.local_plane is None:
            await server
        else:
            _, cut = await asyncio.gather(server, _timed(took, "local_plane", self.local_plane.stop(grace)))
        if self.spec.on_stopped:
            await _timed(took, "on_stopped", self.spec.on_stopped())
        log_event("stopped", service=self.spec.name, seconds=took, local_connections_cut=cut, handed_over=handed,
                  pid=os.getpid())

    async def _hand_over(self) -> bool:
        """Deregistered, it asks for its standby and keeps its listener until the standby serves (at most
        HANDOVER_WAIT_S): whether it did. Without a standby offered it answers at once."""
        handover = Handover(self.spec.config.handover)
        return handover.ask() and await handover.taken()

    async def _cancel_tasks(self) -> None:
        """Cancels the background tasks and waits for them at most the grace period. A task whose
        cancellation a library swallowed (turned into an error that the task's loop catches) runs on:
        it is cancelled again every RECANCEL_S, so its next await ends it."""
        if not self._tasks:
            return
        stuck, end = set(self._tasks), time.monotonic() + self.spec.config.grace_s
        while True:
            for task in stuck:
                task.cancel()
            _, stuck = await asyncio.wait(stuck, timeout=min(RECANCEL_S, max(end - time.monotonic(), 0.0)))
            if not stuck or time.monotonic() >= end:
                break
        done = [t for t in self._tasks if t.done()]
        for task in done:  # retrieved, so asyncio does not report it as never retrieved
            if not task.cancelled() and task.exception():
                log_event("task_failed", logging.ERROR, service=self.spec.name, error=repr(task.exception()))
        if stuck:
            log_event("tasks_not_stopped", service=self.spec.name,
                      tasks=[t.get_coro().__qualname__ for t in stuck])


async def _timed(took: dict[str, float], step: str, awaitable: Awaitable[T]) -> T:
    """Awaits one step of a stop, noting its seconds under `step`."""
    started = time.perf_counter()
    try:
        return await awaitable
    finally:
        took[step] = round(time.perf_counter() - started, 3)


async def _serve(spec: ServiceSpec) -> None:
    """Runs until SIGTERM/SIGINT, then stops accepting, lets in-flight RPCs finish, and exits (its logging is
    `run`'s)."""
    service = RunningService(spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await service.start()
    watch_pauses(spec.name)   # from here on: the pauses serving meets, not start-up's
    await stop.wait()
    await service.stop()
    shutdown_tracing()


def run(spec_factory: Callable[[], Awaitable[ServiceSpec]], gate: Callable[[], Awaitable[None]] | None = None) -> None:
    """Process entry point: build the service on uvloop and serve it, once `gate()` returns where given (a
    standby's wait for its turn: shared/cli/standby.py). A short slice (ACADEMUS_HOP_SLICE_US) is asked for
    first, so every thread the service starts inherits it (a worker's compute threads take the kernel's back)."""
    common = load(CommonConfig)
    set_process_slice(common.hop_slice_us)
    if common.keep_freed_pages:   # before the models load: their tensors and every batch's come from the heap
        keep_freed_pages()

    async def main() -> None:
        spec = await spec_factory()
        setup_logging(spec.name)
        if spec.config.gc_freeze:   # the models are loaded; frozen before the service is announced, so the
            # collection that precedes the freeze (0.1-0.3 s in a worker) stalls no request
            log_event("heap_frozen", service=spec.name, objects=freeze_start_up_heap(spec.name))
        if gate is not None:
            await gate()
        await _serve(spec)

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        logging.getLogger(__name__).info("interrupted")


def channel(target: str, own_connections: bool = False) -> grpc.aio.Channel:
    """A channel to another service of the mesh with tracing on: mutual TLS with the process's mesh identity
    when it has one (runtime/tls.py), else plaintext. `own_connections`: none shared with the process's other
    channels to `target` (gRPC pools them by address, and a pooled one backing off from a dead peer would fail
    the new channel's first calls too)."""
    from academus.shared.runtime.tracing import client_interceptors

    own = [("grpc.use_local_subchannel_pool", 1)] if own_connections else []
    # A peer the supervisor restarts serves again a second or two after it died; after refused connects a channel
    # waits 1 s, growing 1.6x, between tries by default, so it reached the peer 1.2-1.5 s after it served
    # (docs/benchmarks/reliability.md). The SDK's RECONNECT_OPTIONS try 0.1 s apart, at most 1 s, each attempt
    # given CONNECT_TIMEOUT_MS to complete.
    return mesh_channel(target, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS, *own], client_interceptors())


class Stubs:
    """One traced channel and stub per peer address, reused for every call (channels are costly).
    `multiplexed`: the stub's unary calls ride one stream of that channel (shared/runtime/multiplex.py), frames
    waiting together in one message when `batches`, moving to the peer's node-local data plane when `local`
    (shared/runtime/local_plane.py)."""

    def __init__(self, stub_class: type, multiplexed: bool = False, batches: bool = True, local: bool = False) -> None:
        self.stub_class = stub_class
        self.multiplexed = multiplexed
        self.batches = batches
        self.local = local
        self._stubs: dict[str, object] = {}
        self._channels: dict[str, Any] = {}   # what each stub calls through (a channel or its multiplexed stand-in)
        self._incarnations: dict[str, str] = {}   # address -> the process its channel was opened for
        self._renewed: set[str] = set()       # addresses whose channels connect on their own (see _renew)
        self._generation = mesh_generation()  # the process's mesh identity the open channels present

    @classmethod
    def for_hops(cls, stub_class: type, config: CommonConfig) -> Stubs:
        """The next hop's stubs as the service is configured: multiplexed (hop_streams), batched (frame_batches),
        node-local where the peer is (local_plane)."""
        return cls(stub_class, config.hop_streams, config.frame_batches, config.local_plane)

    def __call__(self, address: str, incarnation: str = ""):
        """The stub for `address`. `incarnation` names the process serving there (a worker's registration): a new
        one, a restart on the same ports, gets a new channel, as does every address once the process's mesh identity
        changed (a rotated certificate: its peers may trust only the new one's CA)."""
        if self._generation != mesh_generation():
            self._generation = mesh_generation()
            for opened in list(self._channels):
                self._renew(opened)
        if self._incarnations.setdefault(address, incarnation) != incarnation:
            self._incarnations[address] = incarnation
            self._renew(address)
        stub = self._stubs.get(address)
        if stub is None:
            opened = over_streams(channel(address, address in self._renewed), self.multiplexed, self.batches,
                                  open_local if self.local else None, mesh_metadata())
            stub = self._stubs[address] = self.stub_class(opened)
            self._channels[address] = opened
        return stub

    def _renew(self, address: str) -> None:
        """The next call to `address` opens a fresh channel: the old one would still be backing off from the dead
        process's refusals. The old one is closed once the calls it carries have had their time."""
        self._stubs.pop(address, None)
        self._renewed.add(address)
        old = self._channels.pop(address, None)
        if old is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(RENEWED_CLOSE_S, lambda: loop.create_task(old.close()))


class PeerHealth:
    """A peer's standard health service (it passes the mesh's token gate), on a channel a peer process: a restart on
    the same address (another `incarnation`) gets a fresh channel, not one backing off. Callers read the outcome:
    the resource manager's liveness watch takes refusals for death, the scheduler silence for a hung worker."""

    def __init__(self) -> None:
        self.stubs = Stubs(health_pb2_grpc.HealthStub)

    async def check(self, address: str, incarnation: str, timeout_s: float) -> grpc.StatusCode:
        """How one check ended: OK when it was answered (serving or not), else its status code."""
        try:
            await self.stubs(address, incarnation).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    async def answers(self, address: str, timeout_s: float, incarnation: str = "") -> bool:
        """Whether the peer answers a check within `timeout_s` or refuses it: False only for silence, a hung
        process's (a dead one refuses, one stopping answers NOT_SERVING)."""
        return await self.check(address, incarnation, timeout_s) != grpc.StatusCode.DEADLINE_EXCEEDED

    async def watch(self, address: str, incarnation: str) -> bool:
        """Follows the peer's health stream until it ends; whether it was ever open."""
        reached = False
        try:
            async for _ in self.stubs(address, incarnation).Watch(health_pb2.HealthCheckRequest()):
                reached = True
        except grpc.aio.AioRpcError:
            pass
        return reached
