"""The PLOT version tree and its batch lookup (HMI §3.3.1 eq. 2, §5.1 eq. 3).

Windows are n tokens, n the root manifest's `ngram` (3 by default, HMI's trigrams; 2 for the
bigram tables of the n sweep, HMI Table 8). Lookup order for a trigram window: the domain overlay,
then the root table; a window found in neither is rebuilt slot by slot from the root's bigrams
(x_a, x_b) and (x_b, x_c), and a slot no bigram covers takes its token's unigram state. With n=2 a
bigram window is looked up in the overlay, then the root's bigrams, and a miss takes both tokens'
unigram states. A token without even a unigram entry (a table built with corpus-only unigrams) is
given the state of [UNK], as the tokenizer does for an unknown word.

Aggregation (eq. 2, "a normalized sum of overlapping token representations ... considering the
token's position within the tri-grams"): every token's layer-K state is the weighted sum of its
states in all windows that contain it, divided by the sum of the weights used (a token inside a
sequence is in three windows, its first and last tokens in one). A state's weight is that of its
slot in the window, SLOT_WEIGHTS = (1, 4, 1): the centre slot, the only one that saw context on
both sides, counts most (on 200 WordNet glosses / 60 spam mails, K=3, mean cosine of minilm-plot
to the teacher 0.8938 / 0.6031 with the plain mean, 0.8979 / 0.6136 with (1, 2, 1), 0.9014 / 0.6340
with the centre alone; (1, 4, 1) keeps the edges a share of the sum). Dividing by the weights keeps the
scale of one window's states, which the upper layers expect (they follow a LayerNorm), and makes the
lookup exact for a sequence of up to three tokens: one window, one term a token.
With n=2 every token is in the two bigrams around it (the first and last in one), slot weights
(1, 1): neither slot of a bigram saw both sides, so neither is favoured; exact up to two tokens.
Sequences shorter than a window are one window of their own length (bigram or unigram).
Everything is vectorized over the batch: one searchsorted per table, one gather per level.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from academus.shared.models.plot.ngrams import pack, window_starts, windows
from academus.shared.models.plot.table import (
    ROOT,
    PlotError,
    PlotVersion,
    TableError,
    build_stamp,
    check_compatible,
    load_version,
    window_table,
)
from academus.shared.runtime.logs import log_event
from academus.shared.runtime.metrics import CACHE_HITS, CACHE_MISSES

DOMAINS_DIR = "domains"
SLOT_WEIGHTS = (1.0, 4.0, 1.0)      # left, centre, right slot of a trigram window (see above)
DEFAULT_SLOT_WEIGHTS = {3: SLOT_WEIGHTS, 2: (1.0, 1.0)}   # n -> the slot weights of an n-gram window
# Full windows a table answered (domain overlay or root) and those rebuilt from shorter n-grams (back-off),
# wherever the lookup runs: the plot service, or a worker serving a PLOT model in process.
WINDOW_HITS, WINDOW_MISSES = CACHE_HITS.labels("plot"), CACHE_MISSES.labels("plot")


class InvalidTokens(PlotError):
    """Token ids or lengths that do not describe sequences of the table's vocabulary."""


class UnknownDomain(PlotError):
    """No overlay is loaded for the requested domain."""


@dataclass
class LookupCounts:
    """Where the windows of one lookup came from (for metrics and the response)."""

    domain: int = 0                # n-gram windows found in the domain overlay
    root: int = 0                  # ... in the root table
    backoff: int = 0               # n-gram windows rebuilt from bigrams / unigrams (n=3) or unigrams (n=2)
    short: int = 0                 # sequences under n tokens (one bigram or unigram window)
    unknown_tokens: int = 0        # tokens with no unigram entry, given [UNK]'s state


@dataclass
class Lookup:
    states: np.ndarray             # (total tokens, hidden) float32, sequences back to back
    lengths: np.ndarray            # (sequences,) int64
    counts: LookupCounts = field(default_factory=LookupCounts)


class PlotStore:
    """A root version and its domain overlays, checked against each other when opened."""

    def __init__(self, root: PlotVersion, domains: dict[str, PlotVersion] | None = None,
                 slot_weights: tuple[float, ...] | None = None) -> None:
        """`slot_weights`: one per slot of an n-gram window (default DEFAULT_SLOT_WEIGHTS[n])."""
        self.root = root
        self.ngram = root.manifest.ngram
        self.window_table = window_table(self.ngram, f"root table at {root.path}")
        slot_weights = DEFAULT_SLOT_WEIGHTS[self.ngram] if slot_weights is None else slot_weights
        if len(slot_weights) != self.ngram or min(slot_weights) <= 0:
            raise ValueError(f"slot_weights {slot_weights} must be {self.ngram} positive numbers "
                             f"(one per slot of the table's {self.ngram}-gram windows)")
        self.domains = dict(domains or {})
        self.slot_weights = tuple(float(w) for w in slot_weights)
        for name, overlay in self.domains.items():
            self._check_overlay(name, overlay)
        self._unk = self._unk_row()
        self._refused: tuple[int, int] | None = None   # a rebuilt root's stamp that current() would not serve
        self._successor: PlotStore | None = None        # the store current() opened on a rebuilt root

    @classmethod
    def open(cls, directory: Path, *, model: str | None = None, lower_layers: int | None = None,
             domains: Iterable[str] | None = None, verify: bool = True, ngram: int | None = None,
             slot_weights: tuple[float, ...] | None = None) -> PlotStore:
        """`directory/root` plus `directory/domains/<name>` (all overlays found when `domains` is None);
        `model`, `lower_layers`, `ngram`: refuse a root built otherwise (None: any)."""
        directory = Path(directory)
        root = load_version(directory / ROOT, model=model, lower_layers=lower_layers, ngram=ngram, verify=verify)
        names = available_domains(directory) if domains is None else list(domains)
        overlays = {name: load_version(directory / DOMAINS_DIR / name, model=root.manifest.model,
                                       lower_layers=root.manifest.lower_layers, ngram=root.manifest.ngram,
                                       verify=verify) for name in names}
        return cls(root, overlays, slot_weights)

    def current(self) -> PlotStore:
        """This store while its root is the build on disk (one stat). Once the root was rebuilt (`academus
        plot build` again), the table as it is now: the new root with this store's overlays as they are beside
        it, opened as a new store, so that a lookup running on this one finishes on one version; opened once,
        so every holder of this store (the plot models of one table) moves to the same new one. The build
        published it whole (staged, checksummed, renamed into place), so it is mapped without hashing it again.
        A rebuild of another model, K or n, or one that does not open, is refused once (logged) and this store
        kept: the plot service's registration and the heads trained on these states name them."""
        stamp = build_stamp(self.root.path)
        if stamp is None or stamp in (self.root.stamp, self._refused):
            return self
        if self._successor is not None and self._successor.root.stamp == stamp:
            return self._successor
        m, table = self.root.manifest, self.root.path.parent
        served = [name for name in available_domains(table) if name in self.domains]   # deleted ones let go
        try:
            self._successor = PlotStore.open(table, model=m.model, lower_layers=m.lower_layers, ngram=m.ngram,
                                             domains=served, verify=False, slot_weights=self.slot_weights)
            return self._successor
        except PlotError as e:
            self._refused = stamp
            log_event("plot_root_refused", logging.WARNING, path=str(self.root.path), error=str(e))
            return self

    @property
    def hidden(self) -> int:
        return self.root.manifest.hidden

    @property
    def lower_layers(self) -> int:
        return self.root.manifest.lower_layers

    @property
    def model(self) -> str:
        return self.root.manifest.model

    def add_domain(self, name: str, overlay: PlotVersion) -> None:
        """An overlay built after the store was opened, checked as those opened with it are."""
        self._check_overlay(name, overlay)
        self.domains[name] = overlay

    def load_domain(self, name: str, verify: bool = True) -> bool:
        """Makes the served overlay `name` the one on disk beside the root: loads one built after the store
        opened (a Manage API domain job), so it serves without a restart; reloads one rebuilt since; drops
        one deleted since, so its mapped files are let go. False when there is none on disk.
        One stat a call: lookups call it for every domain they use."""
        if not name:
            return False
        loaded = self.domains.get(name)
        directory = loaded.path if loaded is not None else self.root.path.parent / DOMAINS_DIR / name
        stamp = build_stamp(directory)
        if loaded is not None and stamp is not None and stamp == loaded.stamp:
            return True
        if stamp is None:  # deleted: a lookup running on it keeps its reference, the memmaps close after it
            self.domains.pop(name, None)
            return False
        m = self.root.manifest
        self.add_domain(name, load_version(directory, model=m.model, lower_layers=m.lower_layers, ngram=m.ngram,
                                           verify=verify))  # replaces a rebuilt one in one step: no lookup misses it
        return True

    def sync_domains(self) -> list[str]:
        """Every overlay beside the root loaded as it is on disk now (new ones loaded, rebuilt ones reloaded,
        deleted ones dropped); the names served."""
        for name in sorted(set(self.domains) | set(available_domains(self.root.path.parent))):
            self.load_domain(name)
        return sorted(self.domains)

    @property
    def root_entries(self) -> int:
        """Windows in the root table (trigrams, or bigrams for n=2)."""
        return len(self.root.tables[self.window_table])

    def _check_overlay(self, name: str, overlay: PlotVersion) -> None:
        root, m = self.root.manifest, overlay.manifest
        check_compatible(m, f"overlay {name!r}", root.model, root.lower_layers, root.ngram)
        if (m.hidden, m.vocab_size) != (root.hidden, root.vocab_size):
            raise TableError(f"overlay {name!r} (hidden {m.hidden}, vocab {m.vocab_size}) does not match the "
                             f"root (hidden {root.hidden}, vocab {root.vocab_size})")
        if self.window_table not in overlay.tables:
            raise TableError(f"overlay {name!r} holds no {self.window_table} table")

    def _unk_row(self) -> int:
        needed = ("trigram", "bigram", "unigram") if self.ngram == 3 else ("bigram", "unigram")
        missing = [name for name in needed if name not in self.root.tables]
        if missing:
            raise TableError(f"root table at {self.root.path} lacks the {', '.join(missing)} table(s)")
        unk = self.root.manifest.special_ids["unk"]
        row = int(self.root.tables["unigram"].find(pack(np.array([[unk]])))[0])
        if row < 0:
            raise TableError(f"root table at {self.root.path} has no unigram entry for [UNK] ({unk})")
        return row

    def lookup(self, ids: np.ndarray, lengths: np.ndarray, domain: str = "") -> Lookup:
        """Aggregated layer-K states of sequences given back to back as `ids` with `lengths`."""
        ids, lengths = self._checked(ids, lengths)
        overlay = self._overlay(domain)
        total = np.zeros((len(ids), self.hidden), dtype=np.float32)
        weights = np.zeros(len(ids), dtype=np.float32)
        size = self.ngram
        counts = LookupCounts(short=int((lengths < size).sum()))
        sweeps = [(size, lengths >= size), *((n, lengths == n) for n in range(size - 1, 0, -1))]
        for n, only in sweeps:             # full windows, then each shorter sequence as one window
            starts = window_starts(lengths, n, only)
            if not len(starts):
                continue
            grams = windows(ids, starts, n)
            states = self._windows(grams, overlay, counts) if n == size else self._short(grams)
            slot_weights = self.slot_weights if n == size else (1.0,) * n
            for j, weight in enumerate(slot_weights):   # starts are distinct: starts + j has no repeats
                total[starts + j] += weight * states[:, j]
                weights[starts + j] += weight
        counts.unknown_tokens = int((self.root.tables["unigram"].find(pack(ids[:, None])) < 0).sum())
        WINDOW_HITS.inc(counts.domain + counts.root)
        WINDOW_MISSES.inc(counts.backoff)
        total /= weights[:, None]
        return Lookup(total, lengths, counts)

    def _checked(self, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids, lengths = np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        if ids.ndim != 1 or lengths.ndim != 1:
            raise InvalidTokens("input_ids and lengths must be flat lists")
        if len(lengths) and lengths.min() < 1:
            raise InvalidTokens(f"lengths[{int(np.argmin(lengths))}] is {int(lengths.min())}; every sequence "
                                f"needs at least one token")
        if int(lengths.sum()) != len(ids):
            raise InvalidTokens(f"lengths sum to {int(lengths.sum())} but {len(ids)} input_ids were given")
        vocab = self.root.manifest.vocab_size
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if len(bad):
            first = int(bad[0])
            raise InvalidTokens(f"input_ids[{first}]={int(ids[first])} is outside the vocabulary (0..{vocab - 1})")
        return ids, lengths

    def _overlay(self, domain: str) -> PlotVersion | None:
        if not domain:
            return None
        if domain not in self.domains:
            raise UnknownDomain(f"no PLOT overlay for domain {domain!r} (loaded: {sorted(self.domains) or 'none'})")
        return self.domains[domain]

    def _windows(self, grams: np.ndarray, overlay: PlotVersion | None, counts: LookupCounts) -> np.ndarray:
        """(W, n, hidden): domain -> root -> back-off, each level asked only for the rest."""
        keys = pack(grams)
        out = np.empty((*grams.shape, self.hidden), dtype=np.float32)
        todo = np.arange(len(grams))
        for version, level in ((overlay, "domain"), (self.root, "root")):
            if version is None or not len(todo):
                continue
            table = version.tables[self.window_table]
            rows = table.find(keys[todo])
            hit = rows >= 0
            out[todo[hit]] = table.gather(rows[hit])
            setattr(counts, level, getattr(counts, level) + int(hit.sum()))
            todo = todo[~hit]
        if len(todo):
            out[todo] = self._backoff(grams[todo]) if self.ngram == 3 else self._short(grams[todo], bigrams=False)
            counts.backoff += len(todo)
        return out

    def _backoff(self, grams: np.ndarray) -> np.ndarray:
        """Missing trigrams (a, b, c): slots from bigrams (a, b) and (b, c), the rest from unigrams."""
        out = np.empty((len(grams), 3, self.hidden), dtype=np.float32)
        bigram = self.root.tables["bigram"]
        left, right = bigram.find(pack(grams[:, :2])), bigram.find(pack(grams[:, 1:]))
        lhit, rhit = left >= 0, right >= 0
        right_states = bigram.gather(right[rhit])
        out[rhit, 1:] = right_states
        out[lhit, :2] = bigram.gather(left[lhit])  # the left bigram's b wins: it saw a, as the trigram does first
        uncovered = np.stack([~lhit, ~lhit & ~rhit, ~rhit], axis=1)
        out[uncovered] = self._unigrams(grams[uncovered])
        return out

    def _short(self, grams: np.ndarray, bigrams: bool = True) -> np.ndarray:
        """A whole sequence of one or two tokens: its bigram, else (or with `bigrams` off) its unigrams."""
        out = np.empty((*grams.shape, self.hidden), dtype=np.float32)
        hit = np.zeros(len(grams), dtype=bool)
        if bigrams and grams.shape[1] == 2:
            table = self.root.tables["bigram"]
            rows = table.find(pack(grams))
            hit = rows >= 0
            out[hit] = table.gather(rows[hit])
        out[~hit] = self._unigrams(grams[~hit].reshape(-1)).reshape(-1, grams.shape[1], self.hidden)
        return out

    def _unigrams(self, tokens: np.ndarray) -> np.ndarray:
        """(len(tokens), hidden) from each token's unigram entry ([UNK]'s when it has none)."""
        table = self.root.tables["unigram"]
        rows = table.find(pack(tokens[:, None]))
        return table.gather(np.where(rows >= 0, rows, self._unk))[:, 0]

    def info(self) -> dict[str, object]:
        def version(v: PlotVersion) -> dict[str, object]:
            return {"counts": v.manifest.counts, "bytes": v.nbytes, "top_percent": v.manifest.top_percent}

        return {"model": self.model, "lower_layers": self.lower_layers, "ngram": self.ngram, "hidden": self.hidden,
                "root": version(self.root), "domains": {n: version(v) for n, v in sorted(self.domains.items())}}


def available_domains(directory: Path) -> list[str]:
    base = Path(directory) / DOMAINS_DIR
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
