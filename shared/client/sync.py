"""The blocking client."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from opentelemetry.instrumentation.grpc import client_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

from academus.client.types import (
    CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT_S,
    AcademusError,
    InferResult,
    build_request,
    call_metadata,
    from_response,
)
from academus.v1 import inference_pb2_grpc


class Client:
    def __init__(self, target: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.api_key = api_key
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        traced = intercept_channel(self._channel, client_interceptor())
        self._stub = inference_pb2_grpc.InferenceStub(traced)

    def infer(self, model: str, texts: Sequence[str], output: str = "", *, pairs: Sequence[str] | None = None,
              truncate: bool | None = None, timeout: float | None = None, request_id: str = "",
              policy: str = "") -> InferResult:
        request = build_request(model, texts, output, pairs, truncate, request_id, policy)
        try:
            response = self._stub.Infer(request, timeout=timeout or self.timeout,
                                        metadata=call_metadata(self.api_key))
        except grpc.RpcError as e:
            raise AcademusError.from_rpc(e) from None
        return from_response(response)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
