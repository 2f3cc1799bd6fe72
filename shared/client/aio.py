"""The asyncio client (grpc.aio); traced when OpenTelemetry is set up in the process."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from academus.client.types import (
    CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT_S,
    AcademusError,
    InferResult,
    build_request,
    call_metadata,
    from_response,
    retry_wait,
)
from academus.shared.runtime.errors import pushback_ms
from academus.shared.runtime.multiplex import over_streams
from academus.shared.runtime.tracing import client_interceptors
from academus.v1 import inference_pb2_grpc


class AsyncClient:
    """`streams=True`: every call rides one multiplexed stream of the connection (the gateway serves
    `academus.v1.Multiplex`), half a unary call's cost in latency and CPU on each side; errors, deadlines,
    cancellation and the retry of UNAVAILABLE within the deadline are those of a unary call."""

    def __init__(self, target: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 streams: bool = False, own_connection: bool = False) -> None:
        """`own_connection`: a TCP connection of this client's only (gRPC otherwise shares one between the
        channels of a process to the same target)."""
        self.api_key = api_key
        self.timeout = timeout
        self.streams = streams
        options = [*CHANNEL_OPTIONS, *([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])]
        self._channel = grpc.aio.insecure_channel(target, options=options, interceptors=client_interceptors())
        self._stub = inference_pb2_grpc.InferenceStub(over_streams(self._channel, streams))

    async def infer(self, model: str, texts: Sequence[str], output: str = "", *,
                    pairs: Sequence[str] | None = None, truncate: bool | None = None,
                    timeout: float | None = None, request_id: str = "", policy: str = "") -> InferResult:
        request = build_request(model, texts, output, pairs, truncate, request_id, policy)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self.timeout)
        attempt = 0
        while True:
            try:
                response = await self._stub.Infer(request, timeout=max(deadline - loop.time(), 0.001),
                                                  metadata=call_metadata(self.api_key))
                return from_response(response)
            except grpc.aio.AioRpcError as e:
                # the channel retries a unary call itself; a frame of a stream is retried here, the same way
                wait = retry_wait(e.code(), attempt, deadline - loop.time(),
                                  pushback_ms(dict(e.trailing_metadata() or ()).items())) if self.streams else None
                if wait is None:
                    raise AcademusError.from_rpc(e) from None
            await asyncio.sleep(wait)
            attempt += 1

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
