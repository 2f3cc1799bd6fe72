"""Structured logs: one JSON line an event, on stderr, with its level and, inside a sampled span, the trace id
(the trace of the request the event belongs to: `academus trace <id>`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from opentelemetry import trace

_service = "academus"
_logger = logging.getLogger("academus")


def setup_logging(service: str, level: int = logging.INFO) -> None:
    global _service
    _service = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    _logger.handlers[:] = [handler]
    _logger.setLevel(level)
    _logger.propagate = False


def log_event(event: str, level: int = logging.INFO, **fields: object) -> None:
    if not _logger.isEnabledFor(level):
        return
    record = {"ts": round(time.time(), 3), "level": _level_name(level), "service": _service, "event": event}
    context = trace.get_current_span().get_span_context()   # reads the context: no span is made
    if context.is_valid and context.trace_flags.sampled:   # an untraced request (no span: tracing.py) has none
        record["trace_id"] = f"{context.trace_id:032x}"
    _logger.log(level, json.dumps(record | fields, default=str))


def logged_events(log: Path, event: str) -> list[dict]:
    """The JSON lines of one event in a service's log ([] without the file); other lines are skipped."""
    mark, found = f'"event": "{event}"', []
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if mark not in line:   # most lines are other events: not parsed
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def _level_name(level: int) -> str:
    return _LEVELS.get(level) or logging.getLevelName(level).lower()


_LEVELS = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error",
           logging.CRITICAL: "critical"}
