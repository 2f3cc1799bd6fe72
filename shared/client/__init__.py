"""Academus client SDK: a sync `Client` and an asyncio `AsyncClient` for the Inference service.

    from academus.client import Client
    with Client("127.0.0.1:50051", api_key="...") as c:
        result = c.infer("spam", ["win a free prize now"], timeout=2.0)
        print(result.predictions[0].label, result.predictions[0].probs)

Every call has a deadline (`timeout`, default 10 s). Inference has no side effects, so the channel
retries UNAVAILABLE (a gateway restarting) up to 3 attempts within that deadline, honouring the
server's `grpc-retry-pushback-ms`; nothing else is retried.
"""

from __future__ import annotations

from academus.client.aio import AsyncClient
from academus.client.sync import Client
from academus.client.types import AcademusError, InferResult, Metadata, Prediction

__all__ = ["AcademusError", "AsyncClient", "Client", "InferResult", "Metadata", "Prediction"]
