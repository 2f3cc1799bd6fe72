"""Structured log lines: one JSON object an event, with its level and, inside a sampled span, its trace id."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from academus.shared.runtime.logs import log_event


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(record.getMessage()))


@pytest.fixture
def lines() -> Iterator[list[dict]]:
    """What log_event writes, each line parsed (at INFO and above, as services log)."""
    logger, handler = logging.getLogger("academus"), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_an_event_in_a_sampled_span_names_its_level_and_the_spans_trace(lines):
    tracer = TracerProvider().get_tracer("test")   # the SDK's default sampler samples a root span
    with tracer.start_as_current_span("request") as span:
        log_event("heartbeat_failed", logging.WARNING, error="Redis away")
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert len(trace_id) == 32
    assert lines == [{"ts": lines[0]["ts"], "level": "warning", "service": lines[0]["service"],
                      "event": "heartbeat_failed", "trace_id": trace_id, "error": "Redis away"}]


def test_an_event_outside_a_span_or_in_an_unsampled_one_has_no_trace_id(lines):
    log_event("registered", worker_id="w0")
    unsampled = SpanContext(trace_id=1 << 64, span_id=1 << 32, is_remote=True, trace_flags=TraceFlags(0))
    with trace.use_span(NonRecordingSpan(unsampled)):
        log_event("task_failed", logging.ERROR)
    assert [(line["level"], line["event"], "trace_id" in line) for line in lines] == [
        ("info", "registered", False), ("error", "task_failed", False)]


def test_an_event_below_the_loggers_level_is_not_written(lines):
    log_event("detail", logging.DEBUG)
    assert lines == []
