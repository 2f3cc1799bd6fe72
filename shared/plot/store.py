"""The PLOT version tree and its batch lookup (HMI §3.3.1 eq. 2, §5.1 eq. 3).

Lookup order for a trigram window: the domain overlay, then the root table; a window found in
neither is rebuilt slot by slot from the root's bigrams (x_a, x_b) and (x_b, x_c), and a slot no
bigram covers takes its token's unigram state. A token without even a unigram entry (a table built
with corpus-only unigrams) is given the state of [UNK], as the tokenizer does for an unknown word.

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
Sequences shorter than a trigram are one window of their own length (bigram or unigram).
Everything is vectorized over the batch: one searchsorted per table, one gather per level.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from academus.shared.plot.ngrams import pack, window_starts, windows
from academus.shared.plot.table import ROOT, PlotError, PlotVersion, TableError, check_compatible, load_version

DOMAINS_DIR = "domains"
SLOT_WEIGHTS = (1.0, 4.0, 1.0)      # left, centre, right slot of a trigram window (see above)


class InvalidTokens(PlotError):
    """Token ids or lengths that do not describe sequences of the table's vocabulary."""


class UnknownDomain(PlotError):
    """No overlay is loaded for the requested domain."""


@dataclass
class LookupCounts:
    """Where the windows of one lookup came from (for metrics and the response)."""

    domain: int = 0                # trigram windows found in the domain overlay
    root: int = 0                  # ... in the root table
    backoff: int = 0               # trigram windows rebuilt from bigrams / unigrams
    short: int = 0                 # sequences under three tokens (one bigram or unigram window)
    unknown_tokens: int = 0        # tokens with no unigram entry, given [UNK]'s state


@dataclass
class Lookup:
    states: np.ndarray             # (total tokens, hidden) float32, sequences back to back
    lengths: np.ndarray            # (sequences,) int64
    counts: LookupCounts = field(default_factory=LookupCounts)


class PlotStore:
    """A root version and its domain overlays, checked against each other when opened."""

    def __init__(self, root: PlotVersion, domains: dict[str, PlotVersion] | None = None,
                 slot_weights: tuple[float, float, float] = SLOT_WEIGHTS) -> None:
        if len(slot_weights) != 3 or min(slot_weights) <= 0:
            raise ValueError(f"slot_weights {slot_weights} must be three positive numbers")
        self.root = root
        self.domains = dict(domains or {})
        self.slot_weights = tuple(float(w) for w in slot_weights)
        for name, overlay in self.domains.items():
            self._check_overlay(name, overlay)
        self._unk = self._unk_row()

    @classmethod
    def open(cls, directory: Path, *, model: str | None = None, lower_layers: int | None = None,
             domains: Iterable[str] | None = None, verify: bool = True,
             slot_weights: tuple[float, float, float] = SLOT_WEIGHTS) -> PlotStore:
        """`directory/root` plus `directory/domains/<name>` (all overlays found when `domains` is None)."""
        directory = Path(directory)
        root = load_version(directory / ROOT, model=model, lower_layers=lower_layers, verify=verify)
        names = available_domains(directory) if domains is None else list(domains)
        overlays = {name: load_version(directory / DOMAINS_DIR / name, model=root.manifest.model,
                                       lower_layers=root.manifest.lower_layers, verify=verify) for name in names}
        return cls(root, overlays, slot_weights)

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

    def _check_overlay(self, name: str, overlay: PlotVersion) -> None:
        root, m = self.root.manifest, overlay.manifest
        check_compatible(m, f"overlay {name!r}", root.model, root.lower_layers)
        if (m.hidden, m.vocab_size) != (root.hidden, root.vocab_size):
            raise TableError(f"overlay {name!r} (hidden {m.hidden}, vocab {m.vocab_size}) does not match the "
                             f"root (hidden {root.hidden}, vocab {root.vocab_size})")
        if "trigram" not in overlay.tables:
            raise TableError(f"overlay {name!r} holds no trigram table")

    def _unk_row(self) -> int:
        missing = [name for name in ("trigram", "bigram", "unigram") if name not in self.root.tables]
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
        counts = LookupCounts(short=int((lengths < 3).sum()))
        for n, only in ((3, lengths >= 3), (2, lengths == 2), (1, lengths == 1)):
            starts = window_starts(lengths, n, only)
            if not len(starts):
                continue
            grams = windows(ids, starts, n)
            states = self._trigrams(grams, overlay, counts) if n == 3 else self._short(grams)
            slot_weights = self.slot_weights if n == 3 else (1.0,) * n
            for j, weight in enumerate(slot_weights):   # starts are distinct: starts + j has no repeats
                total[starts + j] += weight * states[:, j]
                weights[starts + j] += weight
        counts.unknown_tokens = int((self.root.tables["unigram"].find(pack(ids[:, None])) < 0).sum())
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

    def _trigrams(self, grams: np.ndarray, overlay: PlotVersion | None, counts: LookupCounts) -> np.ndarray:
        """(W, 3, hidden): domain -> root -> bigram/unigram back-off, each level asked only for the rest."""
        keys = pack(grams)
        out = np.empty((len(grams), 3, self.hidden), dtype=np.float32)
        todo = np.arange(len(grams))
        for version, level in ((overlay, "domain"), (self.root, "root")):
            if version is None or not len(todo):
                continue
            table = version.tables["trigram"]
            rows = table.find(keys[todo])
            hit = rows >= 0
            out[todo[hit]] = table.gather(rows[hit])
            setattr(counts, level, getattr(counts, level) + int(hit.sum()))
            todo = todo[~hit]
        if len(todo):
            out[todo] = self._backoff(grams[todo])
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

    def _short(self, grams: np.ndarray) -> np.ndarray:
        """A whole sequence of one or two tokens: its bigram, else its unigrams."""
        out = np.empty((*grams.shape, self.hidden), dtype=np.float32)
        hit = np.zeros(len(grams), dtype=bool)
        if grams.shape[1] == 2:
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

        return {"model": self.model, "lower_layers": self.lower_layers, "hidden": self.hidden,
                "root": version(self.root), "domains": {n: version(v) for n, v in sorted(self.domains.items())}}


def available_domains(directory: Path) -> list[str]:
    base = Path(directory) / DOMAINS_DIR
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
