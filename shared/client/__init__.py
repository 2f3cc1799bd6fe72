"""Academus client SDK: a sync `Client` and an asyncio `AsyncClient` for the Inference service.

    from academus.client import Client
    with Client("127.0.0.1:50051", api_key="...") as c:
        print([m.name for m in c.list_models()])
        result = c.infer("spam", ["win a free prize now"], timeout=2.0)
        print(result.predictions[0].label, result.predictions[0].probs)
        print([t.text for t in c.tokenize("spam", ["win a free prize now"])[0]])

It needs grpcio and protobuf only (`pip install 'academus[client]'`); with the server packages installed
its calls are traced. Every call has a deadline (`timeout`, default 10 s). Inference has no side effects,
so the channel retries UNAVAILABLE (a gateway restarting) up to 3 attempts within that deadline, honouring
the server's `grpc-retry-pushback-ms`; `retry_overload=True` retries an overloaded server's
RESOURCE_EXHAUSTED the same way, only when it sent that hint; nothing else is retried. `tls=True` (or
`root_certificates=`, and `private_key=` with `certificate_chain=` for mutual TLS, PEM bytes) connects
over TLS.
"""

from __future__ import annotations

from academus.client.aio import AsyncClient
from academus.client.sync import Client
from academus.client.types import AcademusError, InferResult, Metadata, ModelInfo, Prediction, ShardRun, Token

__all__ = ["AcademusError", "AsyncClient", "Client", "InferResult", "Metadata", "ModelInfo", "Prediction", "ShardRun",
           "Token"]
