"""The local mesh: `academus up` starts Redis (unless REDIS_URL is given), every service as a process and
a supervisor that restarts any of them that dies (shared/cli/supervisor.py); `academus down` stops the
supervisor first, then them. State lives in the run directory (mesh.json, logs, admin.key)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from academus.shared.cli.launcher import Launch, launch, launch_piped, start_launcher, wait_ready
from academus.shared.cli.pki import CLI, TLS_DIR, Pki, PkiError, make_pki
from academus.shared.cli.processes import pid_alive, wait_exit
from academus.shared.cli.redis_server import RedisServer, free_port
from academus.shared.cli.standby import GO, HANDOVER_SERVICES
from academus.shared.cli.standby import READY as STANDBY_READY
from academus.shared.runtime.config import (
    EVERY_MODEL,
    LAUNCHER,
    LAUNCHER_OFF,
    MESH_TOKEN,
    POLICY_NAMES,
    CommonConfig,
    ModelSelection,
    artifacts_dir,
    child_env,
    env_name,
    policy_override,
    redis_password,
    redis_url_from_env,
    trace_file,
)
from academus.shared.runtime.config import load as load_config
from academus.shared.runtime.gpu import MPS_SETTING, gpu_count, mps_plan
from academus.shared.runtime.handover import Handover
from academus.shared.runtime.local_plane import socket_dir
from academus.shared.runtime.logs import logged_events
from academus.shared.runtime.redis_conn import redacted, with_password
from academus.shared.runtime.tls import MeshTls, Options, channel_credentials, open_channel_sync, use_mesh
from academus.shared.state.artifacts import write_atomic
from academus.shared.state.catalogue import ModelSpec
from academus.shared.state.keys import Keys, new_api_key

SERVICES = ("resource_manager", "adapter_store", "trainer", "plot", "worker", "scheduler", "gateway")
DEFAULT_GATEWAY_PORT = 50051
STATE_FILE = "mesh.json"
ADMIN_KEY_FILE = "admin.key"
RESOURCE_MANAGER_SETTING = "ACADEMUS_RESOURCE_MANAGER"   # a worker's setting: where to register
SUPERVISOR_LOG = "supervisor.log"
LAUNCHER_LOG = "launcher.log"
MAX_SOCKET_PATH = 100   # a Unix socket's path must fit in sun_path (108 bytes)
HANDOVER_DIR = "handover"   # the standbys' handover files (runtime/handover.py)
HANDOVER_SETTING = env_name("handover")


class MeshError(RuntimeError):
    pass


@dataclass
class ServiceProcess:
    name: str
    pid: int
    address: str
    metrics_port: int
    log: str
    env: dict[str, str] = field(default_factory=dict)   # its settings over the inherited environment
    restarts: int = 0
    standby_pid: int | None = None   # `up --standby`: the process waiting to replace it (shared/cli/standby.py)

    @property
    def service(self) -> str:
        """The services/ package it runs: its name up to the first dash (worker-1, scheduler-0.1@node-1)."""
        return self.name.split("-", 1)[0]

    @property
    def handover(self) -> Handover | None:
        """Where it asks for its standby when SIGTERM'd (`up --standby`); None: it has none to ask for."""
        path = self.env.get(HANDOVER_SETTING)
        return Handover(path) if path else None


@dataclass
class MeshState:
    run_dir: str
    redis_url: str
    redis_pid: int | None        # set when the mesh owns its redis-server
    gateway: str
    key_prefix: str
    services: list[ServiceProcess] = field(default_factory=list)
    http: str = ""   # the gateways' HTTP/JSON API (`up --http-port`); "": off
    deployments: list[dict[str, object]] = field(default_factory=list)   # each scheduler's policy and models
    supervisor_pid: int | None = None   # once up() handed the processes over; from then on only it saves
    redis_restarts: int = 0
    tls_ca: str = ""     # `up --tls`: the CA (PEM file) the gateway's certificate is signed by, which clients trust
    tls_cert: str = ""   # with mutual TLS: the command line's own certificate and key, signed by that CA too
    tls_key: str = ""
    artifacts: str = ""  # what the workers load: `academus models add` writes there
    mesh_token: str = ""  # what every call to an internal service carries (ACADEMUS_MESH_TOKEN)
    standby: bool = False  # the supervisor keeps a standby process per worker, scheduler and gateway
    owner_pid: int | None = None  # the process whose end stops the mesh; None: it runs until `academus down`
    launcher: str = ""   # the warm launcher's socket its services are forked from (shared/cli/launcher.py); "": none
    launcher_pid: int | None = None   # set when the mesh owns that launcher (the supervisor restarts it)
    launcher_restarts: int = 0
    tls_server_name: str = ""   # what the mesh's certificate names, checked in place of the address dialled

    def save(self) -> None:
        """Written whole, then renamed: a reader (status, down) never sees half of it. Mode 0600: the Redis
        URLs in it may hold the password."""
        write_atomic(Path(self.run_dir, STATE_FILE), json.dumps(asdict(self), indent=2), mode=0o600)

    def mesh_tls(self) -> MeshTls | None:
        """The command line's identity in a mesh with mutual TLS; None: plaintext."""
        return MeshTls.from_files(self.tls_ca, self.tls_key, self.tls_cert, self.tls_server_name) \
            if self.tls_cert else None

    def use_as_mesh(self) -> None:
        """The command line's internal channels (to the adapter store, the workers) carry the mesh's identity."""
        use_mesh(self.mesh_tls(), self.mesh_token)

    def credentials(self, proc: ServiceProcess) -> grpc.ChannelCredentials | None:
        """What the command line dials `proc` with: the gateway serves TLS with `up --tls`, every service
        mutual TLS with `up --mtls`."""
        if mesh := self.mesh_tls():
            return mesh.channel_credentials()
        return channel_credentials(True, Path(self.tls_ca).read_bytes(), None, None) \
            if self.tls_ca and proc.service == "gateway" else None

    def service(self, name: str) -> ServiceProcess:
        """The process named `name` (worker-0, scheduler, gateway-1, ...)."""
        return next(s for s in self.services if s.name == name)

    def gateways(self) -> list[str]:
        """Where to reach each gateway process: its own port when several share the mesh's, else the mesh's."""
        own = [s.address for s in self.services if s.name.startswith("gateway")]
        return own if len(own) > 1 else [self.gateway]

    @classmethod
    def load(cls, run_dir: Path) -> MeshState:
        path = Path(run_dir) / STATE_FILE
        if not path.exists():
            raise MeshError(f"no mesh is running from {run_dir} (no {STATE_FILE}); start one with `academus up`")
        raw = json.loads(path.read_text())
        raw["services"] = [ServiceProcess(**s) for s in raw["services"]]
        return cls(**raw)

    @classmethod
    def from_settings(cls, run_dir: Path, config: CommonConfig) -> MeshState:
        """A deployed mesh as its services' settings describe it: its Redis, key prefix, token and TLS identity."""
        tls = config.mesh_tls
        return cls(run_dir=str(run_dir), redis_url=with_password(config.redis_url, config.redis_password),
                   redis_pid=None, gateway="", key_prefix=config.key_prefix, mesh_token=config.mesh_token,
                   tls_ca=config.mesh_ca if tls else "", tls_cert=config.mesh_cert if tls else "",
                   tls_key=config.mesh_key if tls else "", tls_server_name=config.mesh_server_name)


def administered(run_dir: Path) -> MeshState:
    """The mesh the command line administers (keys, tenants, ramps, shard budgets): the one `academus up` runs
    from `run_dir`; without one, a mesh deployed elsewhere (compose, Kubernetes) whose Redis the environment
    names, read with its services' own settings, as any of its containers has them."""
    if (Path(run_dir) / STATE_FILE).exists() or not redis_url_from_env():
        try:
            return MeshState.load(run_dir)
        except MeshError as e:
            raise MeshError(f"{e}, or set ACADEMUS_REDIS_URL to a deployed mesh's Redis") from None
    return MeshState.from_settings(run_dir, load_config(CommonConfig))


@dataclass(frozen=True)
class Deployment:
    """One scheduler: its dispatch policy and the models it serves (empty: all). Several deployments
    run side by side over the same workers; requests pick one by model and, optionally, policy. With
    `shards` > 1 the deployment is that many scheduler processes, each running its share of the groups."""

    policy: str = ""               # empty: ACADEMUS_POLICY, else the scheduler's default
    models: str = ""
    shards: int = 1

    @classmethod
    def parse(cls, spec: str) -> Deployment:
        """`POLICY`, `POLICY=MODEL,MODEL`, either with `/SHARDS` after it."""
        head, _, shards = spec.partition("/")
        policy, _, models = head.partition("=")
        if policy not in POLICY_NAMES:
            raise MeshError(f"deployment {spec!r}: policy must be one of {', '.join(POLICY_NAMES)}")
        if shards and not re.fullmatch(r"[1-9][0-9]*", shards):
            raise MeshError(f"deployment {spec!r}: shards must be a whole number >= 1, not {shards!r}")
        return cls(policy, models, int(shards or 1))

    def scheduler_envs(self, deployment: int, node: str = "") -> list[dict[str, str]]:
        """One environment a scheduler process of this deployment (the `deployment`-th), on `node` when
        one is named: that node's scheduler, sent its workers' groups only."""
        base = {"ACADEMUS_MODELS": self.models, **({"ACADEMUS_POLICY": self.policy} if self.policy else {}),
                "ACADEMUS_SHARDS": str(self.shards)}   # set always: an inherited value would split a lone one
        at = f"@{node}" if node else ""
        base |= {"ACADEMUS_NODE": node} if node else {}
        if self.shards == 1:
            return [base | {"ACADEMUS_SCHEDULER_ID": f"scheduler-{deployment}{at}", "ACADEMUS_SHARD": "0"}]
        return [base | {"ACADEMUS_SCHEDULER_ID": f"scheduler-{deployment}.{k}{at}", "ACADEMUS_SHARD": str(k)}
                for k in range(self.shards)]


@dataclass
class MeshOptions:
    run_dir: Path
    artifacts: Path = field(default_factory=artifacts_dir)
    gateway_port: int = DEFAULT_GATEWAY_PORT    # 0: any free port
    gateways: int = 1                           # gateway processes sharing that port (SO_REUSEPORT)
    http_port: int | None = None                # the gateways' HTTP/JSON API, shared the same way; 0: any free
                                                # port; None: off
    workers: int = 1
    worker_threads: int = 0
    instances: int = 0                          # student instances per worker (0: its default / profile)
    gpus: int | None = None                     # None: every visible GPU; 0: CPU workers only
    nodes: int = 1                              # machines this one stands in for: workers spread over them in
                                                # turn, and a scheduler a node for each deployment (ACADEMUS_NODE)
    deployments: list[Deployment] = field(default_factory=list)   # empty: default_deployments
    key_prefix: str = "acd"
    env: dict[str, str] = field(default_factory=dict)   # extra ACADEMUS_* settings for every service
    ready_timeout_s: float = 120.0
    supervise: bool = True                      # restart what dies (off: a test watching what a loss leaves)
    tls: bool = False                           # the gateway serves TLS, its certificate from a new local CA
    mutual_tls: bool = False                    # and the services mutual TLS among themselves (implies tls)
    standby: bool = False                       # a standby per worker, scheduler and gateway, built
    # fork services from a warm launcher: ACADEMUS_LAUNCHER's when set, else one the mesh starts and owns
    launcher: bool = True
    # the process whose end stops the mesh (the supervisor downs it): by default the one calling up(), a bench or
    # a test, so that one killed before its `down` leaves nothing running; None (`academus up --detach`): never
    owner_pid: int | None = field(default_factory=os.getpid)


def up(options: MeshOptions) -> MeshState:
    """Starts the mesh and waits until every service is healthy, the workers are placed and a scheduler has a
    group for each model served: a request sent then is answered."""
    run_dir = options.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    if (run_dir / STATE_FILE).exists() and _alive(MeshState.load(run_dir)):
        raise MeshError(f"a mesh is already running from {run_dir}; `academus down` first")
    for setting in ("gateways", "nodes"):
        if getattr(options, setting) < 1:
            raise MeshError(f"{setting} must be >= 1, not {getattr(options, setting)}")
    options = replace(options, gateway_port=options.gateway_port or free_port(),  # one port for every gateway
                      http_port=None if options.http_port is None else options.http_port or free_port(),
                      deployments=options.deployments or default_deployments(options),
                      tls=options.tls or options.mutual_tls)
    tls = _certificates(options)
    url, redis_pid = _redis(run_dir, options.tls)
    token = options.env.get(MESH_TOKEN.name) or MESH_TOKEN.get() or secrets.token_urlsafe(32)
    state = MeshState(str(run_dir), url, redis_pid, "", options.key_prefix,
                      deployments=[asdict(d) for d in options.deployments], artifacts=str(options.artifacts),
                      mesh_token=token, standby=options.standby and options.supervise, owner_pid=options.owner_pid,
                      **tls)
    state.save()
    _choose_launcher(options, state)
    worker_envs = _worker_envs(options)
    # A GPU worker must find the MPS daemon, which the resource manager starts, when it first touches CUDA. Without
    # one every service starts at once (each start is mostly imports) and the workers are told its address.
    mps_first = any(MPS_SETTING in env for env in worker_envs)
    try:
        for name, envs in _plan(options, worker_envs):
            if name == "worker":   # the rest import little: they start plain while the launcher imports torch
                _await_launcher(state, options.ready_timeout_s)
            for i, extra in enumerate(envs):
                if name == "worker":
                    manager = next(s for s in state.services if s.service == "resource_manager")
                    extra = {RESOURCE_MANAGER_SETTING: manager.address} | extra
                state.services.append(_spawn(name, i, options, state, extra))
                state.save()
                if name == "resource_manager" and mps_first:
                    last = state.services[-1]
                    wait_healthy(last.address, options.ready_timeout_s, last, state.credentials(last))
        state.gateway = f"127.0.0.1:{options.gateway_port}"
        state.http = f"127.0.0.1:{options.http_port}" if options.http_port is not None else ""
        state.save()
        for s in state.services:
            wait_healthy(s.address, options.ready_timeout_s, s, state.credentials(s))
        wait_placed(state, len(worker_envs), options.ready_timeout_s)
        wait_served(state, options.ready_timeout_s)
        ensure_admin_key(state)
        if options.supervise:
            state = start_supervisor(state, options.ready_timeout_s)
    except BaseException:
        down(run_dir)
        raise
    return state


def _choose_launcher(options: MeshOptions, state: MeshState) -> None:
    """Names the launcher the services fork from: ACADEMUS_LAUNCHER's (shared, not the mesh's), else a new one
    of the mesh's own, which imports while Redis and the light services start."""
    shared = options.env.get(LAUNCHER.name) or LAUNCHER.get()
    if not options.launcher or shared == LAUNCHER_OFF:
        return
    if shared:
        state.launcher = shared
    else:
        state.launcher = str(launcher_socket(Path(state.run_dir)))
        state.launcher_pid = start_own_launcher(state)
    state.save()


def launcher_socket(run_dir: Path) -> Path:
    """In the run directory, unless that path is too long for a socket: then in the temporary folder."""
    path = run_dir.resolve() / "launcher.sock"
    if len(str(path)) <= MAX_SOCKET_PATH:
        return path
    folder = socket_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder / f"launcher-{secrets.token_hex(6)}.sock"


def start_own_launcher(state: MeshState) -> int:
    """The mesh's own launcher (again), its output in logs/launcher.log; its pid."""
    return start_launcher(Path(state.launcher), log=_launcher_log(state)).pid


def _launcher_log(state: MeshState) -> Path:
    return Path(state.run_dir) / "logs" / LAUNCHER_LOG


def _await_launcher(state: MeshState, timeout_s: float) -> None:
    """Waits for the mesh's own launcher to listen before the services that would import torch; one that exits
    or is late leaves them to start plain (it is a shortcut, never a condition of the start)."""
    if state.launcher_pid and not wait_ready(state.launcher_pid, _launcher_log(state), timeout_s):
        print(f"academus: the launcher did not start; services start plain (see {LAUNCHER_LOG})", file=sys.stderr)


def start_supervisor(state: MeshState, timeout_s: float) -> MeshState:
    """Starts the supervisor on the saved state and waits until it has taken it over (recorded its pid):
    from then on it alone writes mesh.json. Returns the state as it saved it."""
    log = Path(state.run_dir) / "logs" / SUPERVISOR_LOG
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "academus.shared.cli.supervisor", "--run-dir", state.run_dir],
                                env=child_env({}), stdout=out, stderr=out, start_new_session=True)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        saved = MeshState.load(Path(state.run_dir))
        if saved.supervisor_pid == proc.pid:
            return saved
        if proc.poll() is not None:
            raise MeshError(f"the supervisor exited with {proc.returncode} at start; see {log}")
        time.sleep(0.05)
    proc.kill()   # else, taking over late, it would restart what the failed up() is about to stop
    proc.wait()
    raise MeshError(f"the supervisor did not start within {timeout_s}s; see {log}")


def default_deployments(options: MeshOptions) -> list[Deployment]:
    """What `academus up` serves without --deployment: student groups with `student` (the policy they are
    built for) and every other model with `concat` (ConcatBatching: batches without waiting for them to
    fill, packed rather than padded; 1.5-2.4x padded's throughput, which has twice fifo's, see
    docs/benchmarks/concat.md), each model by one scheduler. ACADEMUS_POLICY, when set, is one deployment
    of that policy for every model."""
    if policy := options.env.get("ACADEMUS_POLICY") or policy_override():
        return [Deployment(policy)]
    path = Path(options.artifacts) / "models.json"
    catalogue = json.loads(path.read_text()) if path.is_file() else {}
    students = sorted(name for name, entry in catalogue.items() if isinstance(entry, dict) and entry.get("students"))
    if not students:
        return [Deployment("concat")]
    return [Deployment("student", ",".join(students)), Deployment("concat", ",".join(f"-{s}" for s in students))]


def _certificates(options: MeshOptions) -> dict[str, str]:
    """`up --tls`: a new local CA and the certificates (shared/cli/pki.py); the state's TLS fields."""
    if not options.tls:
        return {}
    try:
        pki = make_pki(options.run_dir, [*SERVICES, CLI] if options.mutual_tls else ["gateway"])
    except PkiError as e:
        raise MeshError(str(e)) from e
    own = {"tls_cert": str(pki.cert(CLI)), "tls_key": str(pki.key(CLI))} if options.mutual_tls else {}
    return {"tls_ca": str(pki.ca), **own}


def _redis(run_dir: Path, tls: bool = False) -> tuple[str, int | None]:
    """The mesh's Redis URL, holding the password (ACADEMUS_REDIS_PASSWORD; with `tls` and none set, a random
    one for its own Redis), and the pid of its own redis-server."""
    url = redis_url_from_env()
    if url:
        return with_password(url, redis_password()), None
    server = RedisServer(run_dir / "redis", password=redis_password() or (secrets.token_urlsafe(24) if tls else ""))
    return server.start().url, server.process.pid


def restart_redis(state: MeshState) -> int:
    """The mesh's own Redis again, on its port and data directory: it reloads its AOF, every key as it was."""
    server = RedisServer.at(state.redis_url, Path(state.run_dir) / "redis").start()
    return server.process.pid


def _plan(options: MeshOptions, worker_envs: list[dict[str, str]]) -> list[tuple[str, list[dict[str, str]]]]:
    """Each service to start, in order, with one extra environment a copy. A plot service for each PLOT table
    under the artifacts, none without one: it could not start, and no model needs it."""
    # imported here: it imports torch, which the supervisor (importing this module) must not
    from academus.shared.models.plot.table import plot_tables

    tables = plot_tables(options.artifacts)
    deployments = options.deployments or default_deployments(options)
    schedulers = [env for node in node_names(options) for d, deployment in enumerate(deployments)
                  for env in deployment.scheduler_envs(d, node)]
    copies = {"worker": worker_envs, "scheduler": schedulers, "gateway": [{}] * options.gateways,
              "plot": [_plot_env(table, i) for i, table in enumerate(tables)]}
    return [(name, copies.get(name, [{}])) for name in SERVICES if copies.get(name, [{}])]


def _plot_env(table: Path, index: int = 0) -> dict[str, str]:
    from academus.shared.models.plot.table import ROOT, read_manifest

    manifest = read_manifest(table / ROOT)
    return {"ACADEMUS_PLOT_DIR": str(table), "ACADEMUS_MODEL": manifest.model,
            "ACADEMUS_LOWER_LAYERS": str(manifest.lower_layers), "ACADEMUS_PLOT_ID": f"plot-{index}"}


def _worker_envs(options: MeshOptions) -> list[dict[str, str]]:
    """On a GPU node, one worker process a student instance, each pinned to its GPU and sharing it
    under MPS (the resource manager starts the daemon); on CPU, `workers` plain processes."""
    gpus = gpu_count() if options.gpus is None else options.gpus
    plan = mps_plan(gpus, options.instances or 1)
    envs = [env | {"ACADEMUS_INSTANCES": "1"} for env in plan] if plan else [{}] * options.workers
    nodes = node_names(options)
    return [env | ({"ACADEMUS_NODE": nodes[i % len(nodes)]} if nodes[0] else {}) for i, env in enumerate(envs)]


def node_names(options: MeshOptions) -> list[str]:
    """The nodes the mesh stands in for: [""] (no name: one node) unless there are several."""
    return [f"node-{n}" for n in range(options.nodes)] if options.nodes > 1 else [""]


def unused_port(taken: set[int]) -> int:
    """A free port none of `taken` is: a port handed out earlier but not bound yet (a process still starting)
    is free to the OS, which may offer it again."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


def _taken_ports(options: MeshOptions, state: MeshState) -> set[int]:
    return {options.gateway_port, *([options.http_port] if options.http_port else []),
            *(int(s.address.rsplit(":", 1)[1]) for s in state.services),
            *(s.metrics_port for s in state.services)}


def _spawn(name: str, index: int, options: MeshOptions, state: MeshState,
           extra: dict[str, str] | None = None) -> ServiceProcess:
    taken = _taken_ports(options, state)
    port = options.gateway_port if name == "gateway" else unused_port(taken)
    # several gateways share one port and the kernel picks one a connection: each also gets a port of its
    # own, its address, so that its health check reaches it and a load generator can spread over them
    own_port = unused_port(taken) if name == "gateway" and options.gateways > 1 else 0
    metrics_port = unused_port(taken)
    settings = {**options.env,
                "ACADEMUS_REDIS_URL": state.redis_url, "ACADEMUS_KEY_PREFIX": options.key_prefix,
                "ACADEMUS_PORT": str(port), "ACADEMUS_METRICS_PORT": str(metrics_port),
                "ACADEMUS_ARTIFACTS": str(options.artifacts), "HF_HUB_OFFLINE": "1",
                "ACADEMUS_TRACE_FILE": trace_file(Path(state.run_dir) / "traces.jsonl"),
                MESH_TOKEN.name: state.mesh_token}
    if own_port:
        settings["ACADEMUS_OWN_PORT"] = str(own_port)
    if name == "gateway" and options.http_port is not None:
        settings["ACADEMUS_HTTP_PORT"] = str(options.http_port)
    if name == "worker":
        settings["ACADEMUS_WORKER_ID"] = f"worker-{index}"
        if options.worker_threads:
            settings["ACADEMUS_TORCH_THREADS"] = str(options.worker_threads)
        if options.instances:
            settings["ACADEMUS_INSTANCES"] = str(options.instances)
    if options.tls:
        settings.update(Pki(Path(state.run_dir) / TLS_DIR).service_env(name, options.mutual_tls))
    settings.update(extra or {})   # the plan's own for this copy (a GPU worker's pinning, a scheduler's deployment)
    label = f"{name}-{index}" if name == "worker" or (name in ("gateway", "plot") and index) else name
    if name == "scheduler" and child_env(settings).get("ACADEMUS_SCHEDULER_ID", "scheduler-0") != "scheduler-0":
        label = settings["ACADEMUS_SCHEDULER_ID"]   # its id: which deployment, shard and node the log is of
    if state.standby and name in HANDOVER_SERVICES:
        settings[HANDOVER_SETTING] = str(Path(state.run_dir) / HANDOVER_DIR / label)
    proc = ServiceProcess(label, 0, f"127.0.0.1:{own_port or port}", metrics_port,
                          str(Path(state.run_dir) / "logs" / f"{label}.log"), settings)
    proc.pid = start_process(proc, state.launcher)
    return proc


def start_process(proc: ServiceProcess, launcher: str = "") -> int:
    """Starts the service `proc` describes (again, for the supervisor: the same ports, id and settings, so
    its address and registration stay the same), its output appended to its log; returns the pid. Forked from
    the warm launcher listening at `launcher` (shared/cli/launcher.py), else a new process."""
    module = f"academus.services.{proc.service}"
    pid = launch(launcher, _launch_of(proc, module)) if launcher else None
    return pid if pid is not None else _popen(proc, module).pid


@dataclass
class Standby:
    """A standby process and the write end of its stdin: `go` there makes it serve; at end of file (this
    process gone) it exits. Forked from the warm launcher, or a child of this process (`popen`, reaped here)."""

    pid: int
    stdin: BinaryIO
    popen: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.popen.poll() is None if self.popen else pid_alive(self.pid)

    def go(self) -> bool:
        """Tells it to serve; False when it died meanwhile."""
        try:
            self.stdin.write(f"{GO}\n".encode())
            self.stdin.close()
        except OSError:
            return False
        return True

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.stdin.close()
        if self.popen:
            self.popen.wait()
        else:
            wait_exit(self.pid, 10)


def start_standby(proc: ServiceProcess, launcher: str = "") -> Standby:
    """A standby for `proc`'s service with its settings: it builds the service, then waits for `go` on its stdin.
    Forked from the warm launcher listening at `launcher`, skipping the imports, else a new process."""
    module = "academus.shared.cli.standby"
    if launcher and (piped := launch_piped(launcher, _launch_of(proc, module, proc.service))):
        return Standby(*piped)
    popen = _popen(proc, module, proc.service, stdin=subprocess.PIPE)
    return Standby(popen.pid, popen.stdin, popen)


def _launch_of(proc: ServiceProcess, module: str, *args: str) -> Launch:
    """What the launcher is sent to fork `python -m module *args` with `proc`'s settings and log, as `_popen`
    starts it."""
    return Launch(module, list(args), child_env(proc.env), proc.log, os.getcwd())


def standby_ready(proc: ServiceProcess) -> bool:
    """Whether `proc`'s standby is built and waiting (its log says so)."""
    return proc.standby_pid is not None and \
        any(e.get("pid") == proc.standby_pid for e in logged_events(Path(proc.log), STANDBY_READY))


def _popen(proc: ServiceProcess, module: str, *args: str, **kwargs: object) -> subprocess.Popen:
    """A session of its own: its own autogroup, and no terminal's signals."""
    with open(proc.log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], env=child_env(proc.env), stdout=out,
                                stderr=out, start_new_session=True, **kwargs)


def health(address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None,
           options: Options = ()) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE for the server's overall health; over TLS with `credentials`."""
    try:
        with open_channel_sync(address, credentials, options) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def wait_healthy(address: str, timeout_s: float, proc: ServiceProcess | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and not pid_alive(proc.pid):
            tail = Path(proc.log).read_text(errors="replace")[-2000:] if Path(proc.log).exists() else ""
            raise MeshError(f"{proc.name} exited during start-up; log tail:\n{tail}")
        if health(address, 0.5, credentials) == "SERVING":
            return
        time.sleep(0.1)
    raise MeshError(f"{address} not healthy after {timeout_s}s")


def wait_placed(state: MeshState, workers: int, timeout_s: float) -> None:
    client, keys = redis.Redis.from_url(state.redis_url, decode_responses=True), Keys(state.key_prefix)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        models = client.smembers(keys.placements())
        if models and all(client.scard(keys.placement(m)) >= workers for m in models):
            return
        time.sleep(0.1)
    raise MeshError(f"workers not placed after {timeout_s}s")


def ensure_admin_key(state: MeshState) -> str:
    """The local admin key: kept in run_dir/admin.key (0600), only its hash goes to Redis."""
    path = Path(state.run_dir) / ADMIN_KEY_FILE
    key = path.read_text().strip() if path.exists() else new_api_key("admin")
    if not path.exists():
        write_atomic(path, key, mode=0o600)
    client = redis.Redis.from_url(state.redis_url, decode_responses=True)
    client.hset(Keys(state.key_prefix).api_key(key), mapping={"tenant": "admin", "role": "admin"})
    return key


def create_key(state: MeshState, tenant: str, role: str = "tenant") -> str:
    key = new_api_key(tenant)
    client = redis.Redis.from_url(state.redis_url, decode_responses=True)
    client.hset(Keys(state.key_prefix).api_key(key), mapping={"tenant": tenant, "role": role})
    return key


def down(run_dir: Path, timeout_s: float = 30.0) -> list[str]:
    """SIGTERM the supervisor first (so nothing stopped here is restarted), then every service (gateway first,
    so nothing new arrives), then the owned Redis."""
    state = MeshState.load(run_dir)
    stopped = []
    if state.supervisor_pid:
        _terminate(state.supervisor_pid, timeout_s)
        stopped.append("supervisor")
        state = MeshState.load(run_dir)   # the pids of what it restarted
    for proc in reversed(state.services):
        _terminate(proc.pid, timeout_s)
        stopped.append(proc.name)
    if state.launcher_pid:
        _terminate(state.launcher_pid, timeout_s)
        Path(state.launcher).unlink(missing_ok=True)
        stopped.append("launcher")
    if state.redis_pid:
        with contextlib.suppress(redis.exceptions.ConnectionError):
            redis.Redis.from_url(state.redis_url).shutdown()
        wait_exit(state.redis_pid, timeout_s)
        stopped.append("redis")
    (Path(run_dir) / STATE_FILE).unlink(missing_ok=True)
    return stopped


def status(run_dir: Path) -> dict:
    state = administered(run_dir)
    if not (Path(run_dir) / STATE_FILE).exists():
        return deployed_status(state)
    client = redis.Redis.from_url(state.redis_url, socket_connect_timeout=1, decode_responses=True)
    try:
        redis_ok = bool(client.ping())
        models = served_models(client, Keys(state.key_prefix))
    except redis.exceptions.RedisError:
        redis_ok, models = False, []
    supervisor = state.supervisor_pid
    return {
        "run_dir": state.run_dir,
        "gateway": state.gateway,
        "http": state.http,
        "redis": {"url": redacted(state.redis_url), "owned": state.redis_pid is not None,
                  "health": "SERVING" if redis_ok else "UNREACHABLE", "restarts": state.redis_restarts},
        "services": [{"name": s.name, "address": s.address, "pid": s.pid, "metrics_port": s.metrics_port,
                      "health": health(s.address, credentials=state.credentials(s)) if pid_alive(s.pid) else "EXITED",
                      "restarts": s.restarts, "standby_pid": s.standby_pid}
                     for s in state.services],
        "launcher": {"socket": state.launcher, "pid": state.launcher_pid, "restarts": state.launcher_restarts,
                     "health": "OFF" if not state.launcher else "SHARED" if not state.launcher_pid
                     else "RUNNING" if pid_alive(state.launcher_pid) else "EXITED"},
        "supervisor": {"pid": supervisor,
                       "health": "OFF" if not supervisor else "RUNNING" if pid_alive(supervisor) else "EXITED"},
        "deployments": state.deployments,
        "models": models,
    }


def deployed_status(state: MeshState) -> dict:
    """A mesh `up` did not start, as its Redis has it: the services and gateways registered there, each one's
    health (the services' over the mesh's identity, a gateway's as its clients dial it), and the models. No pids:
    they are in other containers."""
    client, keys = redis.Redis.from_url(state.redis_url, socket_connect_timeout=1, decode_responses=True), \
        Keys(state.key_prefix)
    try:
        registered, gateways = registered_services(client, keys), registered_gateways(client, keys)
        models, redis_ok = served_models(client, keys), True
    except redis.exceptions.RedisError:
        registered, gateways, models, redis_ok = [], [], [], False
    mesh = state.mesh_tls()
    credentials, options = (mesh.channel_credentials(), mesh.channel_options()) if mesh else (None, [])
    checked = [(name, address, health(address, credentials=credentials, options=options))
               for name, address in registered]
    checked += [("gateway", address, gateway_health(state, address, entry))
                for address, entry in gateways]
    return {
        "deployed": True, "run_dir": "", "gateway": "", "deployments": [], "models": models,
        "http": ", ".join(entry["http"] for _, entry in gateways if entry.get("http")),
        "redis": {"url": redacted(state.redis_url), "owned": False,
                  "health": "SERVING" if redis_ok else "UNREACHABLE", "restarts": 0},
        "services": [{"name": name, "address": address, "pid": None, "metrics_port": None, "restarts": 0,
                      "standby_pid": None, "health": checked_health} for name, address, checked_health in checked],
        "launcher": {"socket": "", "pid": None, "restarts": 0, "health": "OFF"},
        "supervisor": {"pid": None, "health": "OFF"},
    }


def gateway_health(state: MeshState, address: str, entry: dict[str, str]) -> str:
    """A registered gateway's health as a client reaches it: over TLS where it serves TLS, trusting the mesh's CA
    (`academus certs` signs both) or, without one, the system's roots, for the name its registration gives."""
    if entry.get("tls") != "1":
        return health(address)
    roots = Path(state.tls_ca).read_bytes() if state.tls_ca else None
    name = entry.get("server_name", "")
    return health(address, credentials=channel_credentials(True, roots, None, None),
                  options=[("grpc.ssl_target_name_override", name)] if name else [])


def registered_gateways(client: redis.Redis, keys: Keys) -> list[tuple[str, dict[str, str]]]:
    """(address, entry) of each gateway registered in Redis (Keys.gateway); the ids whose entry expired, gateways
    gone or moved (a container's new address), are pruned from the set."""
    found = [(i, client.hgetall(keys.gateway(i))) for i in sorted(client.smembers(keys.gateways()))]
    if gone := [i for i, entry in found if not entry.get("address")]:
        client.srem(keys.gateways(), *gone)
    return [(entry["address"], entry) for _, entry in found if entry.get("address")]


def registered_services(client: redis.Redis, keys: Keys) -> list[tuple[str, str]]:
    """(name, address) of each service registered in Redis and not expired: the resource manager, the adapter
    store, the schedulers, the workers serving a model and the PLOT services."""
    found = [(name, address) for name, address in (("resource_manager", client.get(keys.resource_manager())),
                                                  ("adapter_store", client.get(keys.adapter_store()))) if address]
    for kind, ids, key in (("scheduler", client.smembers(keys.schedulers()), keys.scheduler),
                           ("worker", set().union(*(client.smembers(keys.placement(m))
                                                    for m in client.smembers(keys.placements()))), keys.worker),
                           ("plot", client.smembers(keys.plots()), keys.plot)):
        found += [(f"{kind} {i}", address) for i in sorted(ids) if (address := client.hget(key(i), "address"))]
    return found


def served_models(client: redis.Redis, keys: Keys) -> list[dict[str, object]]:
    """Each registered model: its kind, architecture, layers, the memory its weights take in a worker, how many
    workers serve it, an embedding model's pooling and whether its vectors are normalized, and for a group held
    within a student budget, the students each worker holds (index: bits, 32 for full precision)."""
    rows = []
    for name, raw in sorted(client.hgetall(keys.models()).items()):
        spec = ModelSpec.from_json(raw)
        workers = sorted(client.smembers(keys.placement(name)))
        row = {"name": name, "kind": spec.kind, "architecture": spec.architecture, "layers": spec.layers,
               "memory_bytes": spec.memory_bytes, "workers": len(workers)}
        if spec.pooling:   # an embedding model: how its vectors are made, as ListModels gives it
            row |= {"pooling": spec.pooling, "normalized": spec.normalized}
        held = {w: json.loads(h).get(name) for w in workers if (h := client.hget(keys.worker(w), "students"))}
        if held := {w: students for w, students in held.items() if students is not None}:
            row["held_students"] = held
        rows.append(row)
    return rows


def _alive(state: MeshState) -> bool:
    return any(pid_alive(s.pid) for s in state.services)


def wait_served(state: MeshState, timeout_s: float) -> None:
    """Until every placed model a deployment selects has a scheduler with a live group for it: a scheduler reads
    the placements a moment after they are written, and a request before that finds no worker."""
    client, keys = redis.Redis.from_url(state.redis_url, decode_responses=True), Keys(state.key_prefix)
    selections = [ModelSelection.parse(str(d.get("models", ""))) for d in state.deployments] or [EVERY_MODEL]
    end = time.monotonic() + timeout_s
    while True:
        placed = {m for m in client.smembers(keys.placements())
                  if client.scard(keys.placement(m)) and any(m in s for s in selections)}
        grouped = set()
        for scheduler in client.smembers(keys.schedulers()):
            raw = client.hget(keys.load(scheduler), "models")
            grouped |= {m for m, entry in json.loads(raw).items() if entry.get("groups", 0)} if raw else set()
        if placed <= grouped:
            return
        if time.monotonic() > end:
            raise MeshError(f"no scheduler has a group for {', '.join(sorted(placed - grouped))} after {timeout_s}s")
        time.sleep(0.05)


def reap_children() -> None:
    """Collects the exit status of this process' children that have exited, so none lingers as a zombie."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _terminate(pid: int, timeout_s: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not wait_exit(pid, timeout_s):
        os.kill(pid, signal.SIGKILL)
        wait_exit(pid, 5)
