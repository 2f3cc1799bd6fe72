"""Prometheus metrics per service: RPC latency histogram, in-flight gauge, errors by status code."""

from __future__ import annotations

import asyncio
import time

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

RPC_LATENCY = Histogram(
    "academus_rpc_seconds", "Server-side RPC latency", ["service", "method"], buckets=LATENCY_BUCKETS
)
RPC_IN_FLIGHT = Gauge("academus_rpc_in_flight", "RPCs being handled", ["service", "method"])
RPC_ERRORS = Counter("academus_rpc_errors_total", "RPCs that ended with a non-OK status", ["service", "method", "code"])


def start_metrics(port: int) -> int:
    """Serves /metrics on loopback-or-configured port; returns the bound port (-1: disabled)."""
    if port < 0:
        return -1
    server, _thread = start_http_server(port)
    return server.server_address[1]


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times every unary RPC of the service (health and reflection excluded)."""

    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or method.startswith("/grpc."):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._timed(handler.unary_unary, method.rsplit("/", 1)[-1]),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _timed(self, behavior, method: str):
        async def wrapped(request, context: grpc.aio.ServicerContext):
            in_flight = RPC_IN_FLIGHT.labels(self.service, method)
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
                RPC_LATENCY.labels(self.service, method).observe(time.perf_counter() - start)
                if code != "OK":
                    RPC_ERRORS.labels(self.service, method, code).inc()

        return wrapped


def _code_name(code: object) -> str | None:
    if isinstance(code, grpc.StatusCode):
        return code.name
    return None
