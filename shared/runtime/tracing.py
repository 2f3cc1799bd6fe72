"""OpenTelemetry set-up: one trace per request across gateway, scheduler and worker.

Export goes over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set, to a JSON-lines file when
ACADEMUS_TRACE_FILE is set (the local mesh uses this so `academus trace` can print a trace),
and nowhere otherwise (spans are still created so the context propagates).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from academus.shared.runtime.config import otlp_endpoint, sdk_sampler, trace_file, tracing_enabled
from academus.shared.runtime.interceptors import UnaryBehavior, UnaryServerInterceptor, is_plumbing

_provider: TracerProvider | None = None


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object a span; small appends from several processes do not interleave."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
    }


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def setup_tracing(service_name: str) -> TracerProvider:
    """Installs the process's tracer provider once; later calls return it."""
    global _provider
    if _provider is not None:
        return _provider
    provider = TracerProvider(resource=Resource.create({"service.name": f"academus-{service_name}"}))
    if otlp_endpoint():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if path := trace_file():
        provider.add_span_processor(BatchSpanProcessor(JsonlSpanExporter(Path(path))))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


# Which requests are traced. The SERVER span of a call that came without a trace context (the gateway's, for
# a client's request) draws: a request is traced at `ratio`, and then at every hop, as its context is
# propagated. One not drawn carries an unsampled W3C context (flags 00) to every hop instead, and no hop makes
# a span for it: even an unsampled span costs the SDK its ids, context and attributes (null model, 10 %
# sampled: the stack's CPU fell from 919 to 736 us a request once they went; docs/benchmarks/stack.md).
# A caller's own context is followed, sampled or not. With OTEL_TRACES_SAMPLER set, every call goes to the
# SDK, whose sampler decides.
TRACEPARENT = "traceparent"
_untraced: contextvars.ContextVar[str | None] = contextvars.ContextVar("academus_untraced", default=None)


def root_ratio(ratio: float) -> float:
    """The share of context-less calls drawn for tracing here; 1 (the SDK decides) under OTEL_TRACES_SAMPLER."""
    return 1.0 if sdk_sampler() else ratio


def untraced_context(traceparent: str | None, ratio: float) -> str | None:
    """The unsampled context a call goes on with and no span, or None: it is traced (or its context is one
    only the SDK can read)."""
    if traceparent is None:
        if random.random() < ratio:
            return None
        return f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-00"
    flags = traceparent[-2:] if len(traceparent) == 55 and traceparent[-3] == "-" else ""
    if flags and all(c in "0123456789abcdef" for c in flags) and not int(flags, 16) & 1:
        return traceparent
    return None   # sampled, or a context only the SDK's parser can judge


# The codes that mean the server failed (OTel's semantic conventions for SERVER spans); the others,
# RESOURCE_EXHAUSTED and DEADLINE_EXCEEDED under load among them, are answers, not faults.
SERVER_FAULTS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


class ServerSpans(UnaryServerInterceptor):
    """One SERVER span a unary RPC, the child of the caller's propagated context, named and attributed as
    OTel's gRPC interceptor names them. Unlike it, an abort is taken as an answer: its code goes on the span
    and its traceback is not formatted. OTel's formats it twice, a third of the gateway's and the scheduler's
    CPU under overload, where most calls are refused (py-spy at 3x capacity; docs/benchmarks/tracing.md)."""

    def __init__(self, provider: TracerProvider, ratio: float = 1.0) -> None:
        super().__init__()
        self.tracer = provider.get_tracer("academus.grpc")
        self.ratio = root_ratio(ratio)

    def wrap(self, behavior: UnaryBehavior, method: str) -> UnaryBehavior:
        async def wrapped(request, context: grpc.aio.ServicerContext):
            metadata = dict(context.invocation_metadata() or ())
            if (untraced := untraced_context(metadata.get(TRACEPARENT), self.ratio)) is not None:
                token = _untraced.set(untraced)
                try:
                    return await behavior(request, context)
                finally:
                    _untraced.reset(token)
            parent = propagate.extract(metadata)
            with self.tracer.start_as_current_span(method, context=parent, kind=SpanKind.SERVER,
                                                   attributes=rpc_attributes(method), record_exception=False,
                                                   set_status_on_exception=False) as span:
                try:
                    response = await behavior(request, context)
                except grpc.aio.AbortError:
                    _end_status(span, context)
                    raise
                except asyncio.CancelledError:  # the caller left (or the server is stopping)
                    _set_code(span, grpc.StatusCode.CANCELLED, "the call was cancelled")
                    raise
                except Exception as e:  # a fault the handler did not map to a status
                    span.record_exception(e)
                    span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
                    raise
                _end_status(span, context)
                return response

        return wrapped


def http_tracer() -> trace.Tracer | None:
    """The HTTP edge's tracer (the process's provider, once setup_tracing has set it); None with
    ACADEMUS_TRACING=off: as the gRPC interceptors, its spans are not there."""
    return trace.get_tracer("academus.http") if tracing_enabled() else None


@contextlib.contextmanager
def http_server_span(tracer: trace.Tracer | None, method: str, route: str, headers,
                     ratio: float) -> Iterator[trace.Span | None]:
    """One SERVER span an HTTP request, as ServerSpans makes one a gRPC call: the child of its `traceparent` header,
    drawn against `ratio` (root_ratio's) where it has none. A request not drawn makes no span and carries an
    unsampled context downstream (None is yielded). `headers`: any mapping whose `get` finds `traceparent`
    (aiohttp's ignores case)."""
    if tracer is None:
        yield None
        return
    if (untraced := untraced_context(headers.get(TRACEPARENT), ratio)) is not None:
        token = _untraced.set(untraced)
        try:
            yield None
        finally:
            _untraced.reset(token)
        return
    with tracer.start_as_current_span(f"{method} {route}", context=propagate.extract(headers), kind=SpanKind.SERVER,
                                      attributes={"http.request.method": method, "http.route": route},
                                      record_exception=False, set_status_on_exception=False) as span:
        yield span


def end_http_span(span: trace.Span | None, status: int) -> None:
    """The answer's status on the span; a 5xx marks it failed (OTel's HTTP conventions for SERVER spans)."""
    if span is not None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))


class ClientSpans(grpc.aio.UnaryUnaryClientInterceptor):
    """One CLIENT span a unary call, its context injected into the call's metadata. The call is returned
    unawaited, so cancelling the caller's task cancels the call and, through it, the work downstream.
    OTel's aio interceptor awaits the call's status inside the interceptor, where a cancellation stops only
    that wait: the server never learns the caller left (open-telemetry-python-contrib#3271)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.tracer = client_tracer(provider)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        if is_plumbing(method):
            return await continuation(client_call_details, request)
        if (untraced := _untraced.get()) is not None:
            metadata = grpc.aio.Metadata(*tuple(client_call_details.metadata or ()), (TRACEPARENT, untraced))
            return await continuation(client_call_details._replace(metadata=metadata), request)
        span, carrier = start_client_span(self.tracer, method.decode() if isinstance(method, bytes) else method)
        metadata = grpc.aio.Metadata(*tuple(client_call_details.metadata or ()), *carrier.items())
        details = client_call_details._replace(metadata=metadata)
        try:
            call = await continuation(details, request)
        except BaseException as e:
            span.record_exception(e)
            span.end()
            raise
        call.add_done_callback(functools.partial(_end_client_span, span))
        return call


def _end_client_span(span: trace.Span, call: grpc.aio.Call) -> None:
    ended = time.time_ns()
    if call.cancelled():
        _set_code(span, grpc.StatusCode.CANCELLED, "cancelled by the caller")
        span.end(ended)
        return

    async def finish() -> None:  # the call is done: its status is at hand
        _set_code(span, await call.code(), await call.details())
        span.end(ended)

    task = asyncio.ensure_future(finish())
    _finishing.add(task)  # held until done: the loop keeps only a weak reference
    task.add_done_callback(_finishing.discard)


_finishing: set[asyncio.Future] = set()


def client_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer | None:
    """The tracer of CLIENT spans (the process's provider by default); None with tracing off or no provider."""
    chosen = _client_provider(provider)
    return None if chosen is None else chosen.get_tracer("academus.grpc")


def start_client_span(tracer: trace.Tracer | None, method: str) -> tuple[trace.Span | None, dict[str, str]]:
    """A CLIENT span for a call, and the metadata that carries its context to the server ((None, {})
    without a tracer). ClientSpans sends it on a unary call, a multiplexed call in its frame."""
    if tracer is None:
        return None, {}
    if (untraced := _untraced.get()) is not None:
        return None, {TRACEPARENT: untraced}
    span = tracer.start_span(method, kind=SpanKind.CLIENT, attributes=rpc_attributes(method))
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier


def end_client_span(span: trace.Span | None, code: grpc.StatusCode, details: str | None) -> None:
    if span is not None:
        _set_code(span, code, details)
        span.end()


@functools.cache  # per method, not per call (OTel copies the attributes into each span)
def rpc_attributes(method: str) -> dict[str, str]:
    service, name = method.lstrip("/").split("/", 1)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _set_code(span: trace.Span, code: grpc.StatusCode, details: str | None,
              faults: frozenset[grpc.StatusCode] | None = None) -> None:
    """The call's code on the span; ERROR status for a fault (for a client, any code but OK)."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK and (faults is None or code in faults):
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))


def _end_status(span: trace.Span, context: grpc.aio.ServicerContext) -> None:
    _set_code(span, context.code() or grpc.StatusCode.OK, context.details(), SERVER_FAULTS)


def server_interceptors(provider: TracerProvider, ratio: float = 1.0) -> list:
    """The SERVER spans of a service that traces `ratio` of the calls that come without a trace context."""
    if not tracing_enabled():
        return []
    return [ServerSpans(provider, ratio)]


def client_interceptors(provider: TracerProvider | None = None) -> list:
    """A channel's CLIENT spans: with `provider`, else with the process's where it has one (`tracer_configured`)."""
    chosen = _client_provider(provider)
    return [] if chosen is None else [ClientSpans(chosen)]


def tracer_configured() -> bool:
    """Whether this process has a tracer provider: a service's, or an SDK user's own. Without one, a client's
    spans would be no-ops that still cost their interceptor and context (about 0.05 ms a call)."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _client_provider(provider: trace.TracerProvider | None) -> trace.TracerProvider | None:
    """The provider of CLIENT spans: `provider`, else the process's; None with tracing off or no provider."""
    if not tracing_enabled() or (provider is None and not tracer_configured()):
        return None
    return provider or trace.get_tracer_provider()


# What a request's batch links to: its unsampled traceparent (str), its span's context, or None (tracing off).
RequestTrace = str | trace.SpanContext | None
BATCH_SPAN = "academus.batch"


def request_trace() -> RequestTrace:
    """The calling request's trace, kept with its job: the batch it joins is traced by it."""
    if (untraced := _untraced.get()) is not None:
        return untraced
    context = trace.get_current_span().get_span_context()
    return context if context.is_valid else None


@contextlib.contextmanager
def batch_trace(traces: Sequence[RequestTrace], tracer: trace.Tracer) -> Iterator[None]:
    """The calls a batch makes (to its group's workers) belong to the batch's own requests, whatever context
    dispatched it: a batch that starts as another ends runs in the ended one's task. With a sampled request
    among them, one INTERNAL span for the batch, the first sampled request's child, linked to the other
    sampled ones; else the first request's unsampled context goes on, and no span is made."""
    sampled = [t for t in traces if isinstance(t, trace.SpanContext) and t.trace_flags.sampled]
    first = traces[0] if traces else None
    if sampled:
        span = tracer.start_span(BATCH_SPAN, context=trace.set_span_in_context(trace.NonRecordingSpan(sampled[0])),
                                 kind=SpanKind.INTERNAL, links=[trace.Link(c) for c in sampled[1:]],
                                 attributes={"academus.requests": len(traces), "academus.sampled": len(sampled)})
    else:   # a context the SDK's sampler did not sample (OTEL_TRACES_SAMPLER) goes on as the current span's
        span = trace.NonRecordingSpan(first) if isinstance(first, trace.SpanContext) else None
    token = _untraced.set(None if span is not None else first)   # None with tracing off: nothing to carry
    try:
        with (trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False)
              if span is not None else contextlib.nullcontext()):
            yield
    finally:
        _untraced.reset(token)


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


def annotate(**attributes: object) -> None:
    """Adds attributes (model, tenant, policy, batch size...) to the current hop's span."""
    span = trace.get_current_span()
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(f"academus.{key}", value)


def read_traces(paths: Sequence[Path]) -> dict[str, list[dict]]:
    """Groups the spans of JSON-lines trace files by trace id."""
    traces: dict[str, list[dict]] = {}
    for path in paths:
        if not Path(path).exists():
            continue
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                traces.setdefault(record["trace_id"], []).append(record)
    return traces


def format_trace(spans: list[dict]) -> str:
    """An indented tree: one line a span with its service and duration."""
    by_parent: dict[str | None, list[dict]] = {}
    ids = {s["span_id"] for s in spans}
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        by_parent.setdefault(s["parent_id"] if s["parent_id"] in ids else None, []).append(s)
    t0 = min(s["start_ns"] for s in spans)
    lines: list[str] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in by_parent.get(parent, []):
            ms = (s["end_ns"] - s["start_ns"]) / 1e6
            at = (s["start_ns"] - t0) / 1e6
            lines.append(f"{'  ' * depth}{s['service']:<28} {s['kind']:<7} {s['name']:<48} +{at:7.2f} ms {ms:7.2f} ms")
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    return f"trace {spans[0]['trace_id']}\n" + "\n".join(lines)
