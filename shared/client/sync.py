"""The blocking client; traced when OpenTelemetry's gRPC instrumentation is installed and the process has a tracer
provider."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from academus.client.types import (
    CHANNEL_OPTIONS,
    DEFAULT_TIMEOUT_S,
    AcademusError,
    InferResult,
    ModelInfo,
    Token,
    build_request,
    call_metadata,
    decode_request,
    from_response,
    models_from,
    next_wait,
    tokenize_request,
    tokens_from,
)
from academus.shared.runtime.tls import channel_credentials, open_channel_sync
from academus.v1 import inference_pb2, inference_pb2_grpc

try:  # the server packages bring it; a client installed alone (`academus[client]`) goes untraced
    from opentelemetry.instrumentation.grpc import client_interceptor
    from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

    from academus.shared.runtime.tracing import tracer_configured
except ModuleNotFoundError:
    client_interceptor = None

R = TypeVar("R")


class Client:
    def __init__(self, target: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, *,
                 retry_overload: bool = False, tls: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None) -> None:
        """`retry_overload`: RESOURCE_EXHAUSTED with the server's `grpc-retry-pushback-ms` (a tenant over its
        quota, full queues) is retried after that wait, within the deadline and up to 3 attempts. `tls` or any
        certificate (PEM bytes): a TLS channel, verified against `root_certificates` (default: the system's
        roots), with the client's own key and certificate chain when the server asks for them."""
        self.api_key = api_key
        self.timeout = timeout
        self.retry_overload = retry_overload
        self._served = False   # once answered, calls wait out a gateway's restart (types.RECONNECT_OPTIONS)
        credentials = channel_credentials(tls, root_certificates, private_key, certificate_chain)
        self._channel = open_channel_sync(target, credentials, CHANNEL_OPTIONS)
        self._plain = inference_pb2_grpc.InferenceStub(self._channel)
        self._traced = (inference_pb2_grpc.InferenceStub(intercept_channel(self._channel, client_interceptor()))
                        if client_interceptor else None)

    @property
    def _stub(self) -> inference_pb2_grpc.InferenceStub:
        """The traced stub while the process has a tracer provider (set before or after this client was made),
        else the plain one: without a provider the interceptor's spans are no-ops that still cost it about
        0.05 ms a call."""
        return self._traced if self._traced is not None and tracer_configured() else self._plain

    def infer(self, model: str, texts: Sequence[str], output: str = "", *, pairs: Sequence[str] | None = None,
              truncate: bool | None = None, timeout: float | None = None, request_id: str = "",
              policy: str = "", early_exit: bool = False) -> InferResult:
        """`early_exit`: answered as soon as every text has a result, each from the first exit ramp confident
        enough (`Prediction.final` False, `exit_layer` its layer) or else the full model."""
        request = build_request(model, texts, output, pairs, truncate, request_id, policy, early_exit)
        return from_response(self._call(self._stub.Infer, request, timeout))

    def infer_stream(self, model: str, texts: Sequence[str], output: str = "", *, truncate: bool | None = None,
                     timeout: float | None = None, request_id: str = "", policy: str = "") -> Iterator[InferResult]:
        """Early results as exit ramps release them (`final` False), then every text's full-model result
        (`final` True), the last item. Leaving the iteration early cancels the call and its work."""
        request = build_request(model, texts, output, None, truncate, request_id, policy)
        call = self._stub.InferStream(request, timeout=timeout or self.timeout, metadata=call_metadata(self.api_key))
        try:
            for response in call:
                yield from_response(response)
        except grpc.RpcError as e:
            raise AcademusError.from_rpc(e) from None
        finally:
            (getattr(call, "cancel", None) or call.close)()   # a traced channel hands back a generator

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served models and the caller's own tenant models, by name."""
        return models_from(self._call(self._stub.ListModels, inference_pb2.ListModelsRequest(), timeout))

    def tokenize(self, model: str, texts: Sequence[str], *, add_special_tokens: bool = True,
                 timeout: float | None = None) -> list[list[Token]]:
        """Each text's tokens by the model's own tokenizer, untruncated: what a request is counted and cut by."""
        return tokens_from(self._call(self._stub.Tokenize, tokenize_request(model, texts, add_special_tokens),
                                       timeout))

    def decode(self, model: str, ids: Sequence[Sequence[int]], *, skip_special_tokens: bool = True,
               timeout: float | None = None) -> list[str]:
        """The text of each list of token ids, by the model's own tokenizer."""
        return list((self._call(self._stub.Decode, decode_request(model, ids, skip_special_tokens), timeout)).texts)

    def _call(self, method: Callable[..., R], request: object, timeout: float | None) -> R:
        """One call within the deadline; the channel retries UNAVAILABLE, this an overload when asked."""
        deadline = time.monotonic() + (timeout or self.timeout)
        attempt = 0
        while True:
            try:
                answer = method(request, timeout=max(deadline - time.monotonic(), 0.001),
                                metadata=call_metadata(self.api_key), wait_for_ready=self._served)
                self._served = True
                return answer
            except grpc.RpcError as e:
                wait = next_wait(e, attempt, deadline - time.monotonic(), self.retry_overload, True)
                if wait is None:
                    raise AcademusError.from_rpc(e) from None
            time.sleep(wait)
            attempt += 1

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
