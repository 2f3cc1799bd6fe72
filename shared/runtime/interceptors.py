"""What every server interceptor of the project shares: which calls it wraps, and how."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

import grpc

UnaryBehavior = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]


def is_plumbing(method: str | bytes) -> bool:
    """Health checks and reflection are polled constantly: timing or tracing them would bury the requests.
    A plain prefix test: OTel's composable filters cost ~0.1 ms a call in isinstance checks."""
    return method.startswith(b"/grpc.") if isinstance(method, bytes) else method.startswith("/grpc.")


class UnaryServerInterceptor(grpc.aio.ServerInterceptor, ABC):
    """Wraps the behaviour of every handler that takes one request but the plumbing's with `wrap`: a unary one,
    and a server stream (`InferStream`) as one behaviour that writes its messages (`streamed_as_unary`). A
    stream left out would miss its metrics and the trace draw: untraced, every stream would be traced at
    every hop downstream."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        """gRPC asks on every call. A method resolves to the same handler each time, so its wrapper is built
        once: building it a call (labels, closure, handler) cost 14-38 us of CPU (docs/benchmarks/stack.md)."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_plumbing(method):
            return handler
        known = self._wrapped.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrapped_handler(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrapped_handler(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self.wrap(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self.wrap(streamed_as_unary(handler.unary_stream), method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    @abstractmethod
    def wrap(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        """The behaviour to serve `method` with, around the handler's own."""


def streamed_as_unary(behavior: Callable) -> UnaryBehavior:
    """A server stream's handler as one awaitable behaviour: an async generator's messages written with
    `context.write` (gRPC's other form of a stream handler), so that a unary wrapper times, traces and
    scopes the whole stream. A handler already in that form (wrapped by another interceptor) is kept."""
    if not inspect.isasyncgenfunction(behavior):
        return behavior

    async def written(request: object, context: grpc.aio.ServicerContext) -> None:
        stream = behavior(request, context)
        try:
            async for message in stream:
                await context.write(message)
        finally:   # a caller gone during a write: the stream's own clean-up runs now, not when collected
            await stream.aclose()

    return written
