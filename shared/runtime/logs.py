"""Structured logs: one JSON line an event, on stderr."""

from __future__ import annotations

import json
import logging
import sys
import time

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
    record = {"ts": round(time.time(), 3), "service": _service, "event": event, **fields}
    _logger.log(level, json.dumps(record, default=str))
