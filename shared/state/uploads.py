"""Manage API uploads: parsing and validating labelled JSONL and domain corpora, and keeping them as files.

Parsing raises ValueError naming the source and line; the gateway turns it into INVALID_ARGUMENT before
any job is queued, and the trainer parses the same bytes again with the same code. An accepted upload is
written under the artifacts volume (shared by gateway and trainer) rather than into Redis: Redis is
never the only copy of anything a user gave us (DESIGN §4), and a few MiB a job would bloat its AOF.
"""

from __future__ import annotations

import json
from pathlib import Path

from academus.shared.state.artifacts import write_atomic


def decode_lines(data: bytes, source: str) -> list[tuple[int, str]]:
    """(line number, text) of the non-blank lines; ValueError naming the line and byte for bad UTF-8."""
    lines = []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}:{number}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
        if line.strip():
            lines.append((number, line))
    return lines


def parse_labelled_jsonl(data: bytes, source: str) -> tuple[list[str], list[str]]:
    """(texts, labels) from lines `{"text": str, "label": str|int}`; blank lines are skipped.
    Raises ValueError naming the line for bad UTF-8, bad JSON or a missing/ill-typed field, and when
    fewer than 2 distinct labels remain."""
    texts, labels = [], []
    for number, line in decode_lines(data, source):
        text, label = _parse_line(line, f"{source}:{number}")
        texts.append(text)
        labels.append(label)
    distinct = sorted(set(labels))
    if len(distinct) < 2:
        raise ValueError(f"{source}: needs at least 2 distinct labels, found {distinct} in {len(texts)} examples")
    return texts, labels


def parse_texts_jsonl(data: bytes, source: str) -> list[str]:
    """The texts of lines `{"text": str, ...}` (a "label", when there, is not read); blank lines are skipped.
    Raises ValueError naming the line for bad UTF-8, bad JSON or a missing or empty text, and for no text at all."""
    texts = [_record(line, f"{source}:{number}", ("text",))["text"] for number, line in decode_lines(data, source)]
    if not texts:
        raise ValueError(f"{source}: no texts (lines of {{\"text\": ...}})")
    return texts


def _parse_line(line: str, where: str) -> tuple[str, str]:
    record = _record(line, where, ("text", "label"))
    label = record["label"]
    if isinstance(label, bool) or not isinstance(label, str | int) or str(label) == "":
        raise ValueError(f"{where}: \"label\" must be a non-empty string or an integer, got {label!r}")
    return record["text"], str(label)


def _record(line: str, where: str, fields: tuple[str, ...]) -> dict:
    """The line's JSON object, holding `fields` and a non-empty "text"."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(record, dict):
        wanted = " and ".join(f'"{f}"' for f in fields)
        raise ValueError(f"{where}: expected a JSON object with {wanted}, got {type(record).__name__}")
    missing = [k for k in fields if k not in record]
    if missing:
        raise ValueError(f"{where}: missing field {' and '.join(repr(k) for k in missing)}")
    text = record["text"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{where}: \"text\" must be a non-empty string")
    return record


def parse_corpus(data: bytes, source: str) -> list[str]:
    """A domain corpus: one text a line, blank lines skipped."""
    return [line for _, line in decode_lines(data, source)]


def write_upload(directory: Path, name: str, data: bytes) -> Path:
    """Writes `data` to directory/name atomically (`write_atomic`): the job that names it may run after a crash of
    this host."""
    return write_atomic(directory / name, data)
