"""The JSON-lines span exporter, the trace printer used by `academus trace`, and the server span interceptor."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from academus.shared.runtime.metrics import RPC_LATENCY, MetricsInterceptor
from academus.shared.runtime.tracing import (
    JsonlSpanExporter,
    ServerSpans,
    client_interceptors,
    client_tracer,
    end_client_span,
    format_trace,
    read_traces,
    root_ratio,
    start_client_span,
    untraced_context,
)


def test_spans_of_two_services_form_one_tree(tmp_path):
    path = tmp_path / "traces.jsonl"
    gateway = TracerProvider(resource=Resource.create({"service.name": "academus-gateway"}))
    worker = TracerProvider(resource=Resource.create({"service.name": "academus-worker"}))
    for provider in (gateway, worker):
        provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    with gateway.get_tracer("t").start_as_current_span("Infer") as root, \
            worker.get_tracer("t").start_as_current_span("Run"):
        pass
    traces = read_traces([path, tmp_path / "missing.jsonl"])
    assert list(traces) == [f"{root.get_span_context().trace_id:032x}"]
    text = format_trace(next(iter(traces.values())))
    lines = text.splitlines()
    assert lines[1].startswith("academus-gateway") and "Infer" in lines[1]
    assert lines[2].startswith("  academus-worker") and "Run" in lines[2]


# ServerSpans over real gRPC on loopback: the caller's context propagates, an abort is an answer (its code
# on the span, no traceback recorded), an unmapped exception is a fault (recorded, status ERROR).

METHOD = "/t.Probe/Answer"


SERVER_ENTERED, SERVER_SAW_CANCEL = asyncio.Event(), asyncio.Event()


async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"wait":  # until the caller leaves
        SERVER_ENTERED.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            SERVER_SAW_CANCEL.set()
            raise
    if request == b"refuse":
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    if request == b"gone":
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker")
    if request == b"fail":
        raise ValueError("a bug")
    return b"ok"


@pytest.fixture
async def probe():
    server_spans, client_spans = InMemorySpanExporter(), InMemorySpanExporter()
    server_provider, client_provider = TracerProvider(), TracerProvider()
    server_provider.add_span_processor(SimpleSpanProcessor(server_spans))
    client_provider.add_span_processor(SimpleSpanProcessor(client_spans))
    server = grpc.aio.server(interceptors=[ServerSpans(server_provider)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Probe", {"Answer": grpc.unary_unary_rpc_method_handler(answer)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_interceptors(client_provider))
    call = channel.unary_unary(METHOD)
    yield call, server_spans, client_spans
    await channel.close()
    await server.stop(None)


async def served_span(call, spans: InMemorySpanExporter, request: bytes):
    spans.clear()
    try:
        reply = await call(request, timeout=5)
    except grpc.aio.AioRpcError as e:
        reply = e.code()
    (span,) = await finished(spans)
    return reply, span


async def finished(spans: InMemorySpanExporter, count: int = 1) -> tuple:
    """A span ends a loop turn or two after the caller has its status: the client's once the status is
    read, the server's once its handler's abort has unwound through the interceptor."""
    for _ in range(100):
        if len(spans.get_finished_spans()) >= count:
            break
        await asyncio.sleep(0.01)
    return spans.get_finished_spans()


async def test_server_span_is_the_callers_child_and_names_the_method(probe):
    call, server_spans, client_spans = probe
    client_spans.clear()
    reply, span = await served_span(call, server_spans, b"hello")
    (client,) = await finished(client_spans)
    assert reply == b"ok" and client.kind == SpanKind.CLIENT and client.attributes["rpc.grpc.status_code"] == 0
    assert span.kind == SpanKind.SERVER and span.name == METHOD
    assert span.parent.span_id == client.context.span_id and span.context.trace_id == client.context.trace_id
    assert span.attributes["rpc.service"] == "t.Probe" and span.attributes["rpc.method"] == "Answer"
    assert span.attributes["rpc.grpc.status_code"] == 0 and span.status.status_code == StatusCode.UNSET


async def test_an_abort_is_an_answer_with_its_code_and_no_traceback(probe):
    call, server_spans, _ = probe
    reply, span = await served_span(call, server_spans, b"refuse")
    assert reply == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert span.status.status_code == StatusCode.UNSET and not span.events
    reply, span = await served_span(call, server_spans, b"gone")
    assert reply == grpc.StatusCode.UNAVAILABLE
    assert span.status.status_code == StatusCode.ERROR and "no worker" in span.status.description
    assert not span.events


async def test_an_unmapped_exception_is_recorded_as_a_fault(probe):
    call, server_spans, _ = probe
    reply, span = await served_span(call, server_spans, b"fail")
    assert reply == grpc.StatusCode.UNKNOWN
    assert span.status.status_code == StatusCode.ERROR and "ValueError" in span.status.description
    assert [e.name for e in span.events] == ["exception"]


async def test_cancelling_the_caller_cancels_the_call_at_the_server(probe):
    """The work downstream stops when the caller leaves (OTel's aio client interceptor swallowed the cancel)."""
    call, server_spans, client_spans = probe
    client_spans.clear()
    server_spans.clear()
    SERVER_ENTERED.clear()
    SERVER_SAW_CANCEL.clear()
    async def wait() -> bytes:
        return await call(b"wait", timeout=30)

    caller = asyncio.create_task(wait())
    await asyncio.wait_for(SERVER_ENTERED.wait(), 5)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.wait_for(SERVER_SAW_CANCEL.wait(), 5)
    (client,) = await finished(client_spans)
    (served,) = await finished(server_spans)
    assert served.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert client.status.status_code == StatusCode.ERROR



SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = SAMPLED[:-2] + "00"


@pytest.mark.parametrize(("traceparent", "ratio", "traced"), [
    (None, 1.0, True), (None, 0.0, False), (SAMPLED, 0.0, True), (UNSAMPLED, 1.0, False)])
async def test_a_request_is_drawn_once_and_every_hop_follows_its_context(traceparent, ratio, traced):
    """The first SERVER span without a context draws; a context that comes with the call is followed, and
    an untraced call makes no span at all, only passing its unsampled context on to the next hop."""
    spans, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    downstream: list[dict[str, str]] = []

    async def hop(request, context):
        span, carrier = start_client_span(client_tracer(provider), "/t.Next/Hop")
        end_client_span(span, grpc.StatusCode.OK, None)
        downstream.append(carrier)
        return b"ok"

    class Context:
        def invocation_metadata(self):
            return (("traceparent", traceparent),) if traceparent else ()

        def code(self):
            return None

        def details(self):
            return None

    assert await ServerSpans(provider, ratio).wrap(hop, METHOD)(b"", Context()) == b"ok"
    (carrier,) = downstream
    assert len(spans.get_finished_spans()) == (2 if traced else 0)
    assert int(carrier["traceparent"][-2:], 16) & 1 == traced   # the W3C flags' sampled bit
    if traceparent:   # the caller's trace goes on
        assert carrier["traceparent"][3:35] == traceparent[3:35]


def test_otel_traces_sampler_leaves_every_decision_to_the_sdk(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    assert root_ratio(0.0) == 1.0 and untraced_context(None, root_ratio(0.0)) is None
    assert untraced_context("00-zz", 0.0) is None   # not one the fast path can read: the SDK's parser judges


def traceparent(trace_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{trace_id:016x}-{'01' if sampled else '00'}"


async def test_a_batch_is_traced_by_its_own_requests_not_by_the_task_that_dispatched_it():
    """Four requests through the scheduler's real Dispatcher (padded batches of up to two) behind its SERVER
    span interceptor: A (sampled) runs at once; B (unsampled) waits and starts as A's batch ends, in A's batch's
    task; C and D (sampled) wait and run together. Each worker call carries its own batch's requests' trace."""
    from academus.services.scheduler.core import Dispatcher, Job
    from academus.services.scheduler.policies import PaddedPolicy
    from academus.services.scheduler.server import traced
    from academus.shared.runtime.tracing import BATCH_SPAN, request_trace

    spans, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    calls: list[tuple[list[str], str]] = []
    answers: list[asyncio.Future] = []

    async def worker(group, jobs):
        span, carrier = start_client_span(client_tracer(provider), "/t.Worker/Run")
        calls.append(([job.payload for job in jobs], carrier["traceparent"]))
        answers.append(asyncio.get_running_loop().create_future())
        await answers[-1]
        end_client_span(span, grpc.StatusCode.OK, None)
        return ["ok"] * len(jobs)

    dispatcher = Dispatcher(PaddedPolicy(max_batch=2, max_delay_s=0.0), traced(worker, provider.get_tracer("t")), 8,
                            25)
    dispatcher.update_workers({"w0": ("127.0.0.1:1", frozenset({"m"}))})

    async def schedule(name: str, context) -> str:
        job = Job(model="m", payload=name, num_texts=1, num_tokens=4, deadline=1e12, enqueued_at=0.0,
                  batch_key=("m", name == "B"), trace=request_trace())   # B batches alone
        return (await dispatcher.submit(job))

    def arrive(name: str, parent: str) -> asyncio.Task:
        class Context:
            def invocation_metadata(self):
                return (("traceparent", parent),)

            def code(self):
                return None

            def details(self):
                return None

        return asyncio.create_task(ServerSpans(provider, 1.0).wrap(
            lambda request, context: schedule(name, context), "/academus.v1.Scheduler/Schedule")(name, Context()))

    parents = {"A": traceparent(0xA, True), "B": traceparent(0xB, False), "C": traceparent(0xC, True),
               "D": traceparent(0xD, True)}
    tasks = [arrive("A", parents["A"])]
    await asyncio.sleep(0.01)
    tasks += [arrive(name, parents[name]) for name in "BCD"]
    for _ in range(3):
        await asyncio.sleep(0.01)
        answers[-1].set_result(None)
    assert await asyncio.gather(*tasks) == ["ok"] * 4
    assert [names for names, _ in calls] == [["A"], ["B"], ["C", "D"]]
    assert calls[1][1] == parents["B"]        # B's own unsampled context, not a span in A's trace
    finished = spans.get_finished_spans()
    by_name = {}
    for span in finished:
        by_name.setdefault(span.name, []).append(span)
    servers = {s.context.trace_id: s for s in by_name["/academus.v1.Scheduler/Schedule"]}
    assert sorted(servers) == [0xA, 0xC, 0xD]
    batch_a, batch_cd = sorted(by_name[BATCH_SPAN], key=lambda s: s.context.trace_id)
    assert batch_a.parent.span_id == servers[0xA].context.span_id and not batch_a.links
    assert batch_cd.parent.span_id == servers[0xC].context.span_id
    assert [link.context.span_id for link in batch_cd.links] == [servers[0xD].context.span_id]
    assert batch_cd.attributes["academus.requests"] == 2
    clients = sorted(by_name["/t.Worker/Run"], key=lambda s: s.context.trace_id)
    assert [c.parent.span_id for c in clients] == [batch_a.context.span_id, batch_cd.context.span_id]
    assert calls[0][1][3:35] == f"{0xA:032x}" and calls[2][1][3:35] == f"{0xC:032x}"


@pytest.mark.parametrize("ratio", [1.0, 0.0])
async def test_a_server_stream_is_timed_drawn_and_traced_as_one_call(ratio):
    """A server stream (InferStream's shape) over real gRPC: each message arrives; the stream is one timed call
    and one draw. Not drawn, its downstream hops carry an unsampled context and no span is made; drawn, one
    SERVER span is the parent of the stream's downstream CLIENT span. A caller leaving mid-stream has the
    stream's own clean-up run at once."""
    spans, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    downstream: list[dict[str, str]] = []
    cleaned = asyncio.Event()

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        try:
            span, carrier = start_client_span(client_tracer(provider), "/t.Next/Hop")
            end_client_span(span, grpc.StatusCode.OK, None)
            downstream.append(carrier)
            yield b"early"
            if request == b"linger":
                await asyncio.sleep(30)
            yield b"final"
        finally:
            cleaned.set()

    server = grpc.aio.server(interceptors=[MetricsInterceptor("t"), ServerSpans(provider, ratio)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Probe", {"Stream": grpc.unary_stream_rpc_method_handler(stream)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    timed = RPC_LATENCY.labels("t", "Stream")
    before = timed._sum.get(), sum(b.get() for b in timed._buckets)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t.Probe/Stream")
            assert [m async for m in call(b"", timeout=5)] == [b"early", b"final"]
            (carrier,) = downstream
            assert int(carrier["traceparent"][-2:], 16) & 1 == (ratio == 1.0)
            finished_spans = await finished(spans, 2 if ratio else 0)
            if ratio:
                client, served = sorted(finished_spans, key=lambda s: s.kind != SpanKind.CLIENT)
                assert served.name == "/t.Probe/Stream" and served.kind == SpanKind.SERVER
                assert client.parent.span_id == served.context.span_id
            else:
                assert finished_spans == ()
            assert sum(b.get() for b in timed._buckets) == before[1] + 1 and timed._sum.get() > before[0]
            cleaned.clear()
            lingering = call(b"linger", timeout=5)
            assert await lingering.read() == b"early"
            lingering.cancel()
            await asyncio.wait_for(cleaned.wait(), 5)
    finally:
        await server.stop(None)


async def test_a_methods_wrapper_is_built_once_and_times_every_call() -> None:
    """gRPC runs the interceptors on every call; the wrapper each builds for a method is kept, and still serves,
    times and traces each call."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "t"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    interceptors = [MetricsInterceptor("t"), ServerSpans(provider, 1.0)]
    built: list[str] = []
    for interceptor in interceptors:
        wrap = interceptor.wrap
        interceptor.wrap = lambda behavior, method, wrap=wrap: built.append(method) or wrap(behavior, method)

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.Cached", {"Echo": grpc.unary_unary_rpc_method_handler(echo),
                     "Other": grpc.unary_unary_rpc_method_handler(echo)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    timed = RPC_LATENCY.labels("t", "Echo")
    before = sum(b.get() for b in timed._buckets)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for i in range(5):
                assert await channel.unary_unary("/t.Cached/Echo")(b"%d" % i, timeout=5) == b"%d" % i
            assert await channel.unary_unary("/t.Cached/Other")(b"x", timeout=5) == b"x"
    finally:
        await server.stop(None)
    assert built == ["/t.Cached/Echo"] * 2 + ["/t.Cached/Other"] * 2   # once a method and interceptor
    assert sum(b.get() for b in timed._buckets) == before + 5
    assert [s.name for s in exporter.get_finished_spans()] == ["/t.Cached/Echo"] * 5 + ["/t.Cached/Other"]
