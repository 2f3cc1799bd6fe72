"""PLOT lookups on the wire: the one place where `plot.proto` messages become arrays and back."""

from __future__ import annotations

import numpy as np

from academus.shared.models.plot.store import Lookup, LookupCounts
from academus.v1 import plot_pb2, tensors_pb2

WIRE_DTYPE = np.dtype("<f2")   # float16, little-endian whatever the host


def request_to_pb(ids: np.ndarray, lengths: np.ndarray, domain: str = "") -> plot_pb2.LookupRequest:
    batch = tensors_pb2.TokenBatch(input_ids=np.asarray(ids).tolist(), lengths=np.asarray(lengths).tolist())
    return plot_pb2.LookupRequest(batch=batch, domain=domain)


def request_from_pb(request: plot_pb2.LookupRequest) -> tuple[np.ndarray, np.ndarray, str]:
    ids = np.asarray(request.batch.input_ids, dtype=np.int64)
    return ids, np.asarray(request.batch.lengths, dtype=np.int64), request.domain


def lookup_to_pb(lookup: Lookup, model: str, lower_layers: int) -> plot_pb2.LookupResponse:
    c = lookup.counts
    return plot_pb2.LookupResponse(
        states=np.ascontiguousarray(lookup.states, dtype=WIRE_DTYPE).tobytes(),
        lengths=lookup.lengths.tolist(), hidden=lookup.states.shape[1], dtype="float16",
        lower_layers=lower_layers, model=model,
        counts=plot_pb2.LookupCounts(domain=c.domain, root=c.root, backoff=c.backoff, short=c.short,
                                     unknown_tokens=c.unknown_tokens),
    )


def lookup_from_pb(response: plot_pb2.LookupResponse) -> Lookup:
    """float32 states (as the store returns them, after the fp16 trip) with lengths and counts."""
    if response.dtype != "float16":
        raise ValueError(f"PLOT states arrived as {response.dtype!r}; this client reads float16")
    states = np.frombuffer(response.states, dtype=WIRE_DTYPE).reshape(-1, response.hidden).astype(np.float32)
    c = response.counts
    counts = LookupCounts(c.domain, c.root, c.backoff, c.short, c.unknown_tokens)
    return Lookup(states, np.asarray(response.lengths, dtype=np.int64), counts)
