"""PLOT versions on disk: memory-mapped fp16 states, sorted key indexes, and a manifest that checks them.

A version is a directory (HMI §5.1: one root table, one overlay a domain):

    <name>.keys.npy     (entries,) uint64, sorted: the packed n-grams (see ngrams.py)
    <name>.states.npy   (entries, n, hidden) float16: layer-K states of the fragment's n tokens
    manifest.json       format version, model, K, n, hidden, dtype, counts, sha256 of every file

`name` is trigram, bigram or unigram. The manifest's `ngram` (n, 3 when absent: tables written before
it was recorded) is the window size a lookup sweeps: an n=3 root holds all three tables, an n=2 root
only bigrams and unigrams; a domain overlay holds only the windows' table (trigram or bigram).
States are opened with `mmap_mode="r"`: a lookup reads only the rows it gathers, so a table far
larger than memory still serves. Versions are written to a staging sibling and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from academus.shared.models.plot.ngrams import NgramIndex
from academus.shared.state.artifacts import file_stamp, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPE = "float16"
GRAMS = {"trigram": 3, "bigram": 2, "unigram": 1}
WINDOW_TABLES = {3: "trigram", 2: "bigram"}    # n -> the table a lookup's windows are searched in
ROOT = "root"


class PlotError(Exception):
    """Base of the PLOT errors."""


class TableError(PlotError):
    """A table is missing, corrupt, of another format, or built for another model or K."""


@dataclass(frozen=True)
class PlotManifest:
    model: str                     # served name of the model whose lower layers were run ("minilm")
    teacher: str                   # its checkpoint
    lower_layers: int              # K: the states are the output of layer K
    hidden: int
    vocab_size: int
    special_ids: dict[str, int]    # cls, sep, unk: framing and the OOV fallback depend on them
    version: str                   # "root" or the domain's name
    counts: dict[str, int]         # table name -> entries
    files: dict[str, str]          # file name -> sha256 hex
    created: str = ""
    build_s: float = 0.0
    framing: str = "cls-sep"       # see build.py: [CLS] / [SEP] added unless the fragment has them
    top_percent: float = 100.0     # overlays: the share of the domain's distinct n-grams kept
    ngram: int = 3                 # n: window size (3: trigrams, bigram/unigram back-off; 2: bigrams, unigrams)
    corpus: dict[str, Any] = field(default_factory=dict)
    dtype: str = DTYPE
    kind: str = "plot"
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str, source: str) -> PlotManifest:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TableError(f"{source} is not valid JSON: {e}") from e
        if not isinstance(data, dict) or data.get("kind") != "plot":
            raise TableError(f"{source} is not a PLOT manifest")
        if data.get("format_version") != FORMAT_VERSION:
            raise TableError(f"{source} has format_version {data.get('format_version')!r}; this build reads "
                             f"{FORMAT_VERSION} (rebuild with `academus plot build`)")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise TableError(f"{source} is incomplete: {e}") from e


@dataclass(frozen=True)
class NgramTable:
    """One n-gram table: row i of `states` belongs to key i of `index`."""

    n: int
    index: NgramIndex
    states: np.ndarray             # (entries, n, hidden) float16, usually a read-only memmap

    def __len__(self) -> int:
        return len(self.index)

    def find(self, keys: np.ndarray) -> np.ndarray:
        return self.index.find(keys)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """float32 (len(rows), n, hidden): the fp16 rows widened once, for exact sums in aggregation."""
        return self.states[rows].astype(np.float32)


@dataclass(frozen=True)
class PlotVersion:
    path: Path
    manifest: PlotManifest
    tables: dict[str, NgramTable]
    stamp: tuple[int, int] | None = None   # which build of `path` was loaded (build_stamp, taken first)

    @property
    def nbytes(self) -> int:
        return sum((self.path / name).stat().st_size for name in self.manifest.files)


def keys_file(name: str) -> str:
    return f"{name}.keys.npy"


def states_file(name: str) -> str:
    return f"{name}.states.npy"


def read_manifest(directory: Path) -> PlotManifest:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise TableError(f"no PLOT table at {directory} (no {MANIFEST}; run `academus plot build`)")
    return PlotManifest.from_json(path.read_text(), str(path))


def window_table(ngram: int, source: str = "") -> str:
    """The table holding windows of `ngram` tokens (TableError for an n no lookup sweeps)."""
    if ngram not in WINDOW_TABLES:
        where = f"{source} has " if source else ""
        raise TableError(f"{where}ngram {ngram!r}; PLOT windows are {' or '.join(map(str, sorted(WINDOW_TABLES)))} "
                         f"tokens")
    return WINDOW_TABLES[ngram]


def check_compatible(manifest: PlotManifest, source: str, model: str | None, lower_layers: int | None,
                     ngram: int | None = None) -> None:
    """Refuses a table of another model, K or n: its states would be silently wrong, not missing."""
    if model is not None and manifest.model != model:
        raise TableError(f"{source} was built for model {manifest.model!r}, not {model!r}")
    if lower_layers is not None and manifest.lower_layers != lower_layers:
        raise TableError(f"{source} holds layer-{manifest.lower_layers} states, not layer-{lower_layers} "
                         f"(rebuild with --lower-layers {lower_layers})")
    window_table(manifest.ngram, source)
    if ngram is not None and manifest.ngram != ngram:
        raise TableError(f"{source} holds {manifest.ngram}-gram windows, not {ngram}-grams "
                         f"(rebuild with --ngram {ngram})")
    if manifest.dtype != DTYPE:
        raise TableError(f"{source} stores {manifest.dtype}; this build reads {DTYPE}")


def _verify_files(directory: Path, manifest: PlotManifest) -> None:
    for name, expected in manifest.files.items():
        path = directory / name
        if not path.is_file():
            raise TableError(f"{path} is listed in {MANIFEST} but missing")
        if sha256_file(path) != expected:
            raise TableError(f"{path} does not match its sha256 in {MANIFEST} (corrupt or modified)")


def _open_table(directory: Path, manifest: PlotManifest, name: str) -> NgramTable:
    n, entries = GRAMS[name], manifest.counts[name]
    try:
        keys = np.load(directory / keys_file(name))
        states = np.load(directory / states_file(name), mmap_mode="r")
    except (OSError, ValueError) as e:
        raise TableError(f"{directory}/{name} cannot be read: {e}") from e
    if keys.dtype != np.uint64 or keys.shape != (entries,):
        raise TableError(f"{directory}/{keys_file(name)} is {keys.dtype}{keys.shape}; "
                         f"the manifest says uint64({entries},)")
    if states.dtype != np.float16 or states.shape != (entries, n, manifest.hidden):
        raise TableError(f"{directory}/{states_file(name)} is {states.dtype}{states.shape}; "
                         f"the manifest says float16{(entries, n, manifest.hidden)}")
    index = NgramIndex(keys)
    if not index.is_valid():
        raise TableError(f"{directory}/{keys_file(name)} is not sorted and unique")
    return NgramTable(n, index, states)


def load_version(directory: Path, *, model: str | None = None, lower_layers: int | None = None,
                 ngram: int | None = None, verify: bool = True) -> PlotVersion:
    """Opens a version after checking its manifest (and, with `verify`, every file's sha256)."""
    directory = Path(directory)
    stamp = build_stamp(directory)   # before the files: a rebuild while they are read shows as a new stamp
    manifest = read_manifest(directory)
    check_compatible(manifest, str(directory), model, lower_layers, ngram)
    if verify:
        _verify_files(directory, manifest)
    unknown = set(manifest.counts) - set(GRAMS)
    if unknown:
        raise TableError(f"{directory}/{MANIFEST} lists unknown tables {sorted(unknown)}")
    tables = {name: _open_table(directory, manifest, name) for name in manifest.counts}
    return PlotVersion(directory, manifest, tables, stamp)


def build_stamp(version_dir: Path) -> tuple[int, int] | None:
    """Which build of a version is on disk: its manifest's inode and mtime (a rebuild publishes a new
    directory, so both change); None when there is none."""
    return file_stamp(Path(version_dir) / MANIFEST)


class VersionWriter:
    """Writes a version into a staging directory; `publish` checksums it and renames it into place."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self.directory.parent / f".{self.directory.name}.tmp-{uuid.uuid4().hex[:8]}"
        self.staging.mkdir()
        self.counts: dict[str, int] = {}

    def table(self, name: str, keys: np.ndarray, hidden: int) -> np.ndarray:
        """Saves the sorted keys and returns the (entries, n, hidden) fp16 memmap to fill."""
        np.save(self.staging / keys_file(name), np.asarray(keys, dtype=np.uint64))
        self.counts[name] = len(keys)
        shape = (len(keys), GRAMS[name], hidden)
        return np.lib.format.open_memmap(self.staging / states_file(name), mode="w+", dtype=np.float16, shape=shape)

    def publish(self, **manifest_fields: Any) -> PlotManifest:
        files = {p.name: sha256_file(p) for p in sorted(self.staging.glob("*.npy"))}
        manifest = PlotManifest(counts=dict(self.counts), files=files, **manifest_fields)
        (self.staging / MANIFEST).write_text(manifest.to_json() + "\n")
        old = self.directory.parent / f".{self.directory.name}.old-{uuid.uuid4().hex[:8]}"
        if self.directory.exists():
            os.replace(self.directory, old)
        os.replace(self.staging, self.directory)
        shutil.rmtree(old, ignore_errors=True)
        return manifest

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def plot_tables(artifacts: Path) -> list[Path]:
    """The PLOT tables the mesh serves, a plot service each: every built table the catalogue's `plot` entries name
    (the teacher's and those on users' models), in the catalogue's order; else the first built under
    <artifacts>/plot/ (a directory with root/manifest.json); none when there is none."""
    catalogue = Path(artifacts) / "models.json"
    named: list[Path] = []
    if catalogue.is_file():
        entries = json.loads(catalogue.read_text()).values()
        named = [Path(artifacts) / e["plot"] for e in entries if isinstance(e, dict) and e.get("plot")]
    named = [d for d in dict.fromkeys(named) if (d / "root" / "manifest.json").is_file()]
    if named:
        return named
    built = sorted(p.parent.parent for p in (Path(artifacts) / "plot").glob("*/root/manifest.json"))
    return built[:1]
