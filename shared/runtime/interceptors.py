"""What every server interceptor of the project shares: which calls it wraps, and how."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable

import grpc

UnaryBehavior = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]


def is_plumbing(method: str | bytes) -> bool:
    """Health checks and reflection are polled constantly: timing or tracing them would bury the requests.
    A plain prefix test: OTel's composable filters cost ~0.1 ms a call in isinstance checks."""
    return method.startswith(b"/grpc.") if isinstance(method, bytes) else method.startswith("/grpc.")


class UnaryServerInterceptor(grpc.aio.ServerInterceptor, ABC):
    """Wraps the behaviour of every unary-unary handler but the plumbing's with `wrap` (all the
    project's RPCs are unary)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or handler.unary_unary is None or is_plumbing(method):
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self.wrap(handler.unary_unary, method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    @abstractmethod
    def wrap(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        """The behaviour to serve `method` with, around the handler's own."""
