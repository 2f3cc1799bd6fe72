"""End-to-end fixtures: the mesh as real processes (Redis, resource manager, workers, scheduler,
gateway) with the real teacher and the prepared artifacts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from academus.shared.cli.mesh import ADMIN_KEY_FILE, Deployment, MeshOptions, MeshState, down, up
from academus.shared.runtime.config import artifacts_dir
from academus.shared.runtime.metrics import scrape
from tests.conftest import NO_WAIT_BOUND


def academus(run_dir: Path | str, *args: str | Path, timeout: float = 300,
             env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command line as a process of its own on the mesh of `run_dir`; `env`: its whole environment."""
    return subprocess.run([sys.executable, "-m", "academus.shared.cli", "--run-dir", str(run_dir), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def administer(run_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """The command line beside no `up`: its settings in the environment, as inside a deployed mesh's container."""
    plain = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ACADEMUS_REDIS_URL")}
    return academus(run_dir, *args, timeout=60, env={**plain, **env})


def start_mesh(run_dir: Path, workers: int = 1, env: dict[str, str] | None = None, gateways: int = 1,
               deployments: list[Deployment] | None = None, supervise: bool = False,
               artifacts: Path | None = None, standby: bool = False, launcher: bool = True,
               http_port: int | None = None) -> MeshState:
    """`deployments`: one fifo scheduler for every model unless given (the serving tests are written against
    fifo's one-request batches); [] for `academus up`'s defaults. Unsupervised unless asked: the tests that
    kill a process look at what its loss leaves (test_chaos.py looks at the restart). `artifacts`: a test's
    own catalogue (default: the prepared one). The queue's wait bound is off (`NO_WAIT_BOUND`)."""
    if not (artifacts_dir() / "models.json").exists():
        pytest.fail(f"no artifacts in {artifacts_dir()}: `make test` runs `academus prepare` first")
    return up(MeshOptions(run_dir=run_dir, artifacts=artifacts or artifacts_dir(), gateway_port=0, workers=workers,
                          worker_threads=1, gateways=gateways, http_port=http_port,
                          deployments=[Deployment("fifo")] if deployments is None else deployments, supervise=supervise,
                          standby=standby, launcher=launcher,
                          env={"OTEL_BSP_SCHEDULE_DELAY": "100", "ACADEMUS_GRACE_S": "20", "ACADEMUS_TRACE_RATIO": "1",
                               **NO_WAIT_BOUND, **(env or {})}))


class OtlpCollector(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver on loopback: what the services export lands here."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (trace id, service, span name)
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                self.spans += [(s.trace_id.hex(), attrs.get("service.name", ""), s.name) for s in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def otlp() -> Iterator[OtlpCollector]:
    collector = OtlpCollector()
    yield collector
    collector.server.stop(0)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, otlp: OtlpCollector) -> Iterator[MeshState]:
    run_dir = tmp_path_factory.mktemp("run")
    state = start_mesh(run_dir, env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp.port}",
                                     "OTEL_EXPORTER_OTLP_INSECURE": "true"})
    yield state
    down(run_dir)


@pytest.fixture(scope="module")
def admin_key(mesh: MeshState) -> str:
    return (Path(mesh.run_dir) / ADMIN_KEY_FILE).read_text().strip()


def metric(port: int, name: str, **labels: str) -> float:
    """Reads one sample from a service's Prometheus endpoint (0 when absent)."""
    return next((s.value for s in scrape(port)
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())), 0.0)


def service(mesh: MeshState, name: str):
    return mesh.service(name)


def wait_for(predicate, timeout_s: float = 20.0, what: str = "", explain: Callable[[], str] | None = None) -> None:
    """Polls `predicate` until it holds; `explain` says, on a timeout, what the mesh held instead."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f"; {explain()}" if explain else ""))
