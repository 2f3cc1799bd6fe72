"""Prometheus metrics per service: RPC latency histogram, in-flight gauge, errors by status code, cache hits;
the names and what records them: docs/observability.md."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from academus.shared.runtime.interceptors import UnaryBehavior, UnaryServerInterceptor

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

RPC_LATENCY = Histogram(
    "academus_rpc_seconds", "Server-side RPC latency", ["service", "method"], buckets=LATENCY_BUCKETS
)
RPC_IN_FLIGHT = Gauge("academus_rpc_in_flight", "RPCs being handled", ["service", "method"])
MULTIPLEXED = Counter("academus_multiplexed_calls_total", "Unary calls served as frames of a Multiplex stream",
                      ["method"])
MULTIPLEXED_UNRUN = Counter("academus_multiplexed_unrun_total",
                            "Frames of a Multiplex stream answered unrun: past their deadline (DEADLINE_EXCEEDED), "
                            "after waiting half of it to start or past the stream's call limit (RESOURCE_EXHAUSTED), "
                            "or an id already running (INVALID_ARGUMENT)", ["method", "code"])
MULTIPLEXED_BATCHED = Counter("academus_multiplexed_batched_frames_total",
                              "Frames that shared a Multiplex stream message with others: calls read, replies "
                              "sent", ["direction"])
REPLIES_IN_PIECES = Counter("academus_multiplexed_replies_in_pieces_total",
                            "Replies on a Multiplex stream larger than four of the caller's frames, sent in pieces",
                            ["method"])
LOCAL_PLANE_CONNECTIONS = Gauge("academus_local_plane_connections",
                                "Callers connected over the node-local data plane (shared/runtime/local_plane.py)")
LOCAL_PLANE_REFUSED = Counter("academus_local_plane_refused_total",
                              "Node-local data plane connections closed for what their peer sent", ["code"])
RPC_ERRORS = Counter("academus_rpc_errors_total", "RPCs that ended with a non-OK status", ["service", "method", "code"])
# A refusal's worth is its promptness: RPC_LATENCY mixes it with the answers, and a client's own clock adds its
# loop's delays (a load generator's on a loaded host).
RPC_ERROR_SECONDS = Histogram("academus_rpc_error_seconds", "Server-side time of the RPCs that ended with a non-OK "
                              "status, by code", ["service", "method", "code"], buckets=LATENCY_BUCKETS)
# DESIGN §6's cache hits, one `cache` label value a cache: plot (PLOT table windows), adapter (the worker's
# device cache), adapter_host (its host tier)
CACHE_HITS = Counter("academus_cache_hits_total", "Lookups a cache answered", ["cache"])
CACHE_MISSES = Counter("academus_cache_misses_total", "Lookups a cache could not answer", ["cache"])


def children(metric: Counter | Gauge | Histogram, *fixed: str) -> Callable[..., Any]:
    """`metric.labels(*fixed, *rest)`, resolved once per `rest`: a hot path then pays a dict lookup, not
    the label checks of `labels` (MetricsInterceptor resolves its children once a method for the same reason)."""
    @functools.cache
    def child(*rest: str) -> Any:
        return metric.labels(*fixed, *rest)

    return child


def start_metrics(port: int) -> int:
    """Serves /metrics on loopback-or-configured port; returns the bound port (-1: disabled)."""
    if port < 0:
        return -1
    server = make_server("0.0.0.0", port, make_wsgi_app(), _SharedPortServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server.server_address[1]


class _SharedPortServer(ThreadingWSGIServer):
    allow_reuse_port = True   # a stopping service and the standby taking its place both hold it (runtime/handover.py)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:   # a scrape is not an event
        pass


def scrape(port: int, host: str = "127.0.0.1") -> Iterator[Sample]:
    """Every sample a service's /metrics endpoint serves now (benchmarks and tests read counters so)."""
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        yield from family.samples


class MetricsInterceptor(UnaryServerInterceptor):
    """Times every unary RPC of the service (health and reflection excluded)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def wrap(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        method = method.rsplit("/", 1)[-1]
        in_flight, latency = RPC_IN_FLIGHT.labels(self.service, method), RPC_LATENCY.labels(self.service, method)

        async def wrapped(request, context: grpc.aio.ServicerContext):   # the children resolved once, not a call
            in_flight.inc()
            start = time.perf_counter()
            code = "OK"
            try:
                response = await behavior(request, context)
                code = _code_name(context.code()) or "OK"
                return response
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception:
                code = _code_name(context.code()) or "UNKNOWN"
                raise
            finally:
                in_flight.dec()
                seconds = time.perf_counter() - start
                latency.observe(seconds)
                if code != "OK":
                    RPC_ERRORS.labels(self.service, method, code).inc()
                    RPC_ERROR_SECONDS.labels(self.service, method, code).observe(seconds)

        return wrapped


def _code_name(code: object) -> str | None:
    if isinstance(code, grpc.StatusCode):
        return code.name
    return None
