"""The asyncio client (grpc.aio); traced when OpenTelemetry is set up in the process before the client is made."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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
from academus.shared.runtime.multiplex import over_streams
from academus.shared.runtime.tls import channel_credentials, open_channel
from academus.v1 import inference_pb2, inference_pb2_grpc

try:  # the server packages bring OpenTelemetry; a client installed alone (`academus[client]`) goes untraced
    from academus.shared.runtime.tracing import client_interceptors
except ModuleNotFoundError:
    def client_interceptors() -> list:
        return []

R = TypeVar("R")


class AsyncClient:
    """`streams=True`: every call rides one multiplexed stream of the connection (the gateway serves
    `academus.v1.Multiplex`), half a unary call's cost in latency and CPU on each side; errors, deadlines,
    cancellation and the retry of UNAVAILABLE within the deadline are those of a unary call."""

    def __init__(self, target: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 streams: bool = False, own_connection: bool = False, *, retry_overload: bool = False,
                 tls: bool = False, root_certificates: bytes | None = None, private_key: bytes | None = None,
                 certificate_chain: bytes | None = None) -> None:
        """`own_connection`: a TCP connection of this client's only (gRPC otherwise shares one between the
        channels of a process to the same target). `retry_overload`: RESOURCE_EXHAUSTED with the server's
        `grpc-retry-pushback-ms` (a tenant over its quota, full queues) is retried after that wait, within
        the deadline and up to 3 attempts. `tls` or any certificate (PEM bytes): a TLS channel, verified
        against `root_certificates` (default: the system's roots), with the client's own key and certificate
        chain when the server asks for them."""
        self.api_key = api_key
        self.timeout = timeout
        self.streams = streams
        self.retry_overload = retry_overload
        self._served = False   # once answered, calls wait out a gateway's restart (types.RECONNECT_OPTIONS)
        options = [*CHANNEL_OPTIONS, *([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])]
        credentials = channel_credentials(tls, root_certificates, private_key, certificate_chain)
        interceptors = client_interceptors()
        self._channel = over_streams(open_channel(target, credentials, options, interceptors), streams)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)

    async def infer(self, model: str, texts: Sequence[str], output: str = "", *,
                    pairs: Sequence[str] | None = None, truncate: bool | None = None,
                    timeout: float | None = None, request_id: str = "", policy: str = "",
                    early_exit: bool = False) -> InferResult:
        """`early_exit`: answered as soon as every text has a result, each from the first exit ramp confident
        enough (`Prediction.final` False, `exit_layer` its layer) or else the full model."""
        request = build_request(model, texts, output, pairs, truncate, request_id, policy, early_exit)
        return from_response(await self._call(self._stub.Infer, request, timeout))

    async def infer_stream(self, model: str, texts: Sequence[str], output: str = "", *,
                           truncate: bool | None = None, timeout: float | None = None, request_id: str = "",
                           policy: str = "") -> AsyncIterator[InferResult]:
        """Early results as exit ramps release them (`final` False), then every text's full-model result
        (`final` True), the last item. Leaving the iteration early cancels the call and its work."""
        request = build_request(model, texts, output, None, truncate, request_id, policy)
        call = self._stub.InferStream(request, timeout=timeout or self.timeout, metadata=call_metadata(self.api_key))
        try:
            async for response in call:
                yield from_response(response)
        except grpc.aio.AioRpcError as e:
            raise AcademusError.from_rpc(e) from None
        finally:
            call.cancel()

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        """The served models and the caller's own tenant models, by name."""
        return models_from(await self._call(self._stub.ListModels, inference_pb2.ListModelsRequest(), timeout))

    async def tokenize(self, model: str, texts: Sequence[str], *, add_special_tokens: bool = True,
                       timeout: float | None = None) -> list[list[Token]]:
        """Each text's tokens by the model's own tokenizer, untruncated: what a request is counted and cut by."""
        return tokens_from(await self._call(self._stub.Tokenize, tokenize_request(model, texts, add_special_tokens),
                                             timeout))

    async def decode(self, model: str, ids: Sequence[Sequence[int]], *, skip_special_tokens: bool = True,
                     timeout: float | None = None) -> list[str]:
        """The text of each list of token ids, by the model's own tokenizer."""
        decoded = await self._call(self._stub.Decode, decode_request(model, ids, skip_special_tokens), timeout)
        return list(decoded.texts)

    async def _call(self, method: Callable[..., Awaitable[R]], request: object, timeout: float | None) -> R:
        """One call within the deadline, tried again as `next_wait` says."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self.timeout)
        attempt = 0
        while True:
            try:
                ready = {} if self.streams else {"wait_for_ready": self._served}   # a stream reopens itself
                answer = await method(request, timeout=max(deadline - loop.time(), 0.001),
                                      metadata=call_metadata(self.api_key), **ready)
                self._served = True
                return answer
            except grpc.aio.AioRpcError as e:
                # the channel retries a unary call's UNAVAILABLE itself; a frame of a stream is retried here
                wait = next_wait(e, attempt, deadline - loop.time(), self.retry_overload, not self.streams)
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
