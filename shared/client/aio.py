"""The asyncio client (grpc.aio); traced when OpenTelemetry is set up in the process."""

from __future__ import annotations

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
)
from academus.shared.multiplex import over_streams
from academus.shared.tracing import client_interceptors
from academus.v1 import inference_pb2_grpc


class AsyncClient:
    """`streams=True`: every call rides one multiplexed stream of the connection (the gateway serves
    `academus.v1.Multiplex`), half a unary call's cost in latency and CPU on each side; errors, deadlines
    and cancellation are those of a unary call."""

    def __init__(self, target: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 streams: bool = False) -> None:
        self.api_key = api_key
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS,
                                                  interceptors=client_interceptors())
        self._stub = inference_pb2_grpc.InferenceStub(over_streams(self._channel, streams))

    async def infer(self, model: str, texts: Sequence[str], output: str = "", *,
                    pairs: Sequence[str] | None = None, truncate: bool | None = None,
                    timeout: float | None = None, request_id: str = "", policy: str = "") -> InferResult:
        request = build_request(model, texts, output, pairs, truncate, request_id, policy)
        try:
            response = await self._stub.Infer(request, timeout=timeout or self.timeout,
                                              metadata=call_metadata(self.api_key))
        except grpc.aio.AioRpcError as e:
            raise AcademusError.from_rpc(e) from None
        return from_response(response)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
