"""One run against a gateway: open loop (send on schedule) or closed loop (N callers, each sending its
next request when its last is answered); record every answer, summarise."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from hdrh.histogram import HdrHistogram

from academus.client import AcademusError, AsyncClient, InferResult, Metadata
from academus.loadgen import analysis
from academus.loadgen.http_target import HttpTarget, is_http
from academus.loadgen.stats import percentile
from academus.loadgen.texts import Sample

MAX_LATENCY_US = 120_000_000


@dataclass
class Record:
    sent_at: float           # seconds from the start
    latency_ms: float
    code: str                # "OK" or the gRPC status name
    students: int = 0
    correct: bool | None = None
    tokens: int = 0          # the text's token count, [CLS] and [SEP] included
    meta: Metadata | None = None
    details: str = ""        # an error's message: which hop refused, and why
    gateway: str = ""        # the address it was sent to
    late_ms: float = 0.0     # sent this long after its scheduled time: the load generator's own lag
    exit_layer: int = 0      # the ramp's layer that released the answer (early exits asked); 0: the full model's
    text: str = ""           # what was sent (a pair: its query, then its text), to compare runs' answers text by text
    answer: str = ""         # the label answered ("" for an embedding)

    @property
    def done_at(self) -> float:
        return self.sent_at + self.latency_ms / 1e3


@dataclass
class RunResult:
    model: str
    policy: str               # the one asked for, else the one the answers name
    offered_rps: float | None  # None for a closed loop: the load is `concurrency` callers
    duration_s: float
    records: list[Record] = field(default_factory=list)
    deadline_ms: float | None = None
    requested_policy: str = ""
    concurrency: int | None = None
    early_exit: bool = False   # each request asked to be answered as soon as its text has a result

    def report(self) -> dict:
        ok = [r for r in self.records if r.code == "OK"]
        histogram = HdrHistogram(1, MAX_LATENCY_US, 3)
        for r in ok:
            histogram.record_value(max(1, round(r.latency_ms * 1000)))
        labelled = [r for r in ok if r.correct is not None]
        utility = analysis.utility(self.records, self.deadline_ms)
        return {
            "policy": self.policy,
            "model": self.model,
            "requested_policy": self.requested_policy,
            "served_by": dict(Counter(r.meta.policy for r in ok if r.meta is not None)),
            "offered_rps": None if self.offered_rps is None else round(self.offered_rps, 3),
            "concurrency": self.concurrency,
            "sent": len(self.records),
            "completed": len(ok),
            "errors": dict(Counter(r.code for r in self.records if r.code != "OK")),
            "error_examples": error_examples(self.records),
            "error_latency_ms": error_latency(self.records),
            "latency_ms": latency_summary(histogram) if ok else {},
            "throughput_rps": round(len(ok) / self.duration_s, 3) if self.duration_s else 0.0,
            "accuracy": round(sum(r.correct for r in labelled) / len(labelled), 4) if labelled else None,
            "utility": round(float(utility), 6),
            "utility_per_s": round(utility / self.duration_s, 6) if self.duration_s else 0.0,
            "breakdown_ms": analysis.breakdown(self.records),
            "tail_breakdown_ms": analysis.tail_breakdown(self.records),
            "student_number": sorted(Counter(r.students for r in ok).items()),
            "by_gateway": by_gateway(self.records),
            "send_late_ms": None if self.concurrency else send_lateness(self.records),
            "timeline": analysis.timeline(self.records, self.duration_s),
            "early_exit": self.early_exit,
            **({"exits": analysis.exit_summary([r.exit_layer for r in ok])} if self.early_exit else {}),
        }


def error_examples(records: list[Record], per_code: int = 3) -> dict[str, list[dict]]:
    """For each error code, its most frequent messages (up to `per_code`) with their counts and median
    latency: where a code comes from (which hop, which limit) and how late it came."""
    by_message: dict[tuple[str, str], list[float]] = {}
    for r in records:
        if r.code != "OK":
            by_message.setdefault((r.code, r.details), []).append(r.latency_ms)
    out: dict[str, list[dict]] = {}
    for (code, message), latencies in sorted(by_message.items(), key=lambda kv: -len(kv[1])):
        if len(out.setdefault(code, [])) < per_code:
            out[code].append({"details": message, "count": len(latencies),
                              "p50_ms": round(percentile(latencies, 50), 3)})
    return out


def error_latency(records: list[Record]) -> dict[str, dict[str, float]]:
    """For each error code, how long its statuses took to come back (p50, p99, ms): a refusal that comes
    at once costs its caller nothing; one that comes at the deadline cost it the whole wait."""
    by_code: dict[str, list[float]] = {}
    for r in records:
        if r.code != "OK":
            by_code.setdefault(r.code, []).append(r.latency_ms)
    return {code: {"p50": round(percentile(v, 50), 3), "p99": round(percentile(v, 99), 3)}
            for code, v in sorted(by_code.items())}


def send_lateness(records: list[Record]) -> dict[str, float]:
    """How far behind its schedule the open loop sent: a generator that falls behind (its event loop
    saturated) offers less than asked and adds its own reply handling to the latencies, so such a run
    measured the generator; `academus loadgen --procs` spreads the load."""
    late = [r.late_ms for r in records]
    if not late:
        return {}
    return {"p50": round(percentile(late, 50), 3), "p99": round(percentile(late, 99), 3),
            "max": round(max(late), 3)}


def by_gateway(records: list[Record]) -> dict[str, dict]:
    """Per gateway address: requests sent, answered, and the answered ones' p50/p95 latency (ms)."""
    out: dict[str, dict] = {}
    for gateway in sorted({r.gateway for r in records}):
        mine = [r for r in records if r.gateway == gateway]
        ok = [r.latency_ms for r in mine if r.code == "OK"]
        out[gateway] = {"sent": len(mine), "completed": len(ok),
                        "p50_ms": round(percentile(ok, 50), 3) if ok else None,
                        "p95_ms": round(percentile(ok, 95), 3) if ok else None}
    return out


class GatewaySpread:
    """A client a gateway; request i goes to gateway (offset + i) % G. The mesh's G gateways share its port
    and the kernel spreads connections, not requests, over them, so a load generator process on one
    connection would load one gateway only; this spreads requests evenly, as a balancer in front would. A gateway
    given as a URL (http://HOST:PORT[/ROUTE]) is sent HTTP/JSON (`HttpTarget`)."""

    def __init__(self, gateways: Sequence[str], api_key: str | None, timeout: float, streams: bool = False,
                 offset: int = 0, own_connections: bool = False, root_certificates: bytes | None = None) -> None:
        """`own_connections`: a TCP connection a client, so a gateway listed n times gets n connections.
        `root_certificates`: TLS, trusting that CA (PEM; the mesh's `tls_ca` after `academus up --tls`)."""
        if not gateways:
            raise ValueError("no gateway to send to")
        self.clients = [(g, HttpTarget(g, api_key, timeout) if is_http(g) else
                         AsyncClient(g, api_key=api_key, timeout=timeout, streams=streams,
                                     own_connection=own_connections, root_certificates=root_certificates))
                        for g in gateways]
        self._turn = itertools.count(offset)

    def next(self) -> tuple[str, AsyncClient | HttpTarget]:
        return self.clients[next(self._turn) % len(self.clients)]

    async def __aenter__(self) -> GatewaySpread:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for _, client in self.clients:
            await client.close()


def latency_summary(histogram: HdrHistogram) -> dict[str, float]:
    return {f"p{q}": histogram.get_value_at_percentile(q) / 1000 for q in (50, 95, 99)} | {
        "mean": round(histogram.get_mean_value() / 1000, 3), "max": histogram.get_max_value() / 1000}


def answered(sample: Sample, sent_at: float, latency_ms: float, answer: InferResult, gateway: str,
             late_ms: float = 0.0) -> Record:
    prediction = answer.predictions[0]
    correct = (prediction.label == sample.label) if sample.label is not None and prediction.label else None
    return Record(sent_at, latency_ms, "OK", answer.metadata.student_count, correct, prediction.num_tokens,
                  answer.metadata, gateway=gateway, late_ms=late_ms, exit_layer=prediction.exit_layer,
                  text=sample.key, answer=prediction.label)


async def call(spread: GatewaySpread, result: RunResult, sample: Sample, start: float, timeout_s: float,
               late_ms: float = 0.0) -> None:
    """One request to the next gateway, recorded in `result` (times from `start`)."""
    gateway, client = spread.next()
    sent = time.perf_counter()
    try:
        texts, pairs = ([sample.query], [sample.text]) if sample.query else ([sample.text], None)
        answer = await client.infer(result.model, texts, timeout=timeout_s, policy=result.requested_policy,
                                    early_exit=result.early_exit, pairs=pairs)
    except AcademusError as e:
        result.records.append(Record(sent - start, (time.perf_counter() - sent) * 1e3, e.code, details=e.details,
                                     gateway=gateway, late_ms=late_ms))
        return
    result.policy = result.policy or answer.metadata.policy
    result.records.append(answered(sample, sent - start, (time.perf_counter() - sent) * 1e3, answer, gateway,
                                   late_ms))


async def run(client: GatewaySpread, model: str, arrivals: list[float], samples: list[Sample],
              timeout_s: float, duration_s: float, policy: str = "", early_exit: bool = False) -> RunResult:
    """Sends request i at arrivals[i] with samples[i % n], asking for deployment `policy` ("" = any) and, with
    `early_exit`, for early exits; waits for every answer."""
    result = RunResult(model, policy, len(arrivals) / duration_s if duration_s else 0.0, duration_s,
                       deadline_ms=timeout_s * 1e3, requested_policy=policy, early_exit=early_exit)
    start = time.perf_counter()

    async def one(i: int, at: float) -> None:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        late_ms = max(0.0, (time.perf_counter() - start - at) * 1e3)
        await call(client, result, samples[i % len(samples)], start, timeout_s, late_ms)

    await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
    result.duration_s = max(duration_s, time.perf_counter() - start)
    return result


async def send_load(client: GatewaySpread, model: str, policy: str, arrivals: list[float], samples: list[Sample],
                    timeout_s: float, duration_s: float, concurrency: int | None = None,
                    early_exit: bool = False) -> RunResult:
    """One run: a closed loop of `concurrency` callers, else the open loop on `arrivals`."""
    if concurrency:
        return await run_closed(client, model, concurrency, samples, timeout_s, duration_s, policy, early_exit)
    return await run(client, model, arrivals, samples, timeout_s, duration_s, policy, early_exit)


async def run_closed(client: GatewaySpread, model: str, concurrency: int, samples: list[Sample],
                     timeout_s: float, duration_s: float, policy: str = "", early_exit: bool = False) -> RunResult:
    """Capacity, as perf_analyzer's concurrency mode measures it: `concurrency` callers, each sending its
    next text when its last is answered, until `duration_s`. The queue stays bounded, so no request
    expires in it and the throughput is what the deployment sustains (an open loop past capacity
    measures its backlog instead)."""
    result = RunResult(model, policy, None, duration_s, deadline_ms=timeout_s * 1e3, requested_policy=policy,
                       concurrency=concurrency, early_exit=early_exit)
    start = time.perf_counter()
    result.duration_s = await closed_callers(
        concurrency, duration_s, lambda i: call(client, result, samples[i % len(samples)], start, timeout_s))
    return result


async def closed_callers(concurrency: int, duration_s: float, send: Callable[[int], Awaitable[None]]) -> float:
    """`concurrency` callers; caller k awaits send(k), send(k + concurrency), ... one after the other
    until `duration_s` has passed. Returns the seconds it took (the last answers included)."""
    start = time.perf_counter()

    async def caller(k: int) -> None:
        for i in itertools.count(k, concurrency):
            if time.perf_counter() - start >= duration_s:
                return
            await send(i)

    await asyncio.gather(*(caller(k) for k in range(concurrency)))
    return time.perf_counter() - start
