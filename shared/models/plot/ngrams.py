"""N-gram keys and the compact index of a PLOT table: sorted uint64 keys searched with numpy.

A fragment of n token ids is packed into one uint64, ID_BITS bits an id (first id highest), so a
trigram of a vocabulary below 2**21 ids is one integer. A table stores its keys sorted ascending
and its states in the same order, so a key's position in `keys` is its row: `np.searchsorted` over
millions of keys answers a whole batch at once, with 8 bytes an entry and no Python dict.
"""

from __future__ import annotations

import numpy as np

ID_BITS = 21
MAX_ID = (1 << ID_BITS) - 1
MISSING = -1


def pack(grams: np.ndarray) -> np.ndarray:
    """(N, n) token ids -> (N,) uint64 keys."""
    grams = np.asarray(grams)
    if grams.size and (grams.min() < 0 or grams.max() > MAX_ID):
        raise ValueError(f"token ids must lie in 0..{MAX_ID} to be packed")
    keys = np.zeros(grams.shape[0], dtype=np.uint64)
    for column in grams.T.astype(np.uint64):
        keys = (keys << np.uint64(ID_BITS)) | column
    return keys


def unpack(keys: np.ndarray, n: int) -> np.ndarray:
    """(N,) uint64 keys -> (N, n) int64 token ids; the inverse of `pack`."""
    keys = np.asarray(keys, dtype=np.uint64)
    mask = np.uint64(MAX_ID)
    columns = [(keys >> np.uint64(ID_BITS * (n - 1 - j))) & mask for j in range(n)]
    return np.stack(columns, axis=1).astype(np.int64) if n else np.zeros((len(keys), 0), np.int64)


def window_starts(lengths: np.ndarray, n: int, only: np.ndarray | None = None) -> np.ndarray:
    """Flat start positions of every n-token window of sequences laid back to back (`only`: a mask of
    the sequences to sweep; the others are skipped but keep their place)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    count = np.maximum(lengths - n + 1, 0)
    if only is not None:
        count = np.where(only, count, 0)
    first = np.repeat(offsets, count)
    within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    return first + within


def windows(ids: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """(W, n) token ids of the windows beginning at `starts`."""
    return np.stack([ids[starts + j] for j in range(n)], axis=1) if len(starts) else np.zeros((0, n), np.int64)


class NgramIndex:
    """Sorted, unique uint64 keys; `find` gives each query's row or MISSING."""

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = np.asarray(keys, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self.keys)

    def is_valid(self) -> bool:
        """Strictly increasing: searchsorted's precondition, and no key twice."""
        return bool(np.all(self.keys[1:] > self.keys[:-1]))

    def find(self, queries: np.ndarray) -> np.ndarray:
        queries = np.asarray(queries, dtype=np.uint64)
        if not len(self.keys):
            return np.full(len(queries), MISSING, dtype=np.int64)
        pos = np.searchsorted(self.keys, queries).clip(max=len(self.keys) - 1)
        return np.where(self.keys[pos] == queries, pos, MISSING).astype(np.int64)
