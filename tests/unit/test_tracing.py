"""The JSON-lines span exporter and the trace printer used by `academus trace`."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from academus.shared.tracing import JsonlSpanExporter, format_trace, read_traces


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
