"""A shard artifact's word-embedding table, read as requests need its rows.

The table is the largest tensor of a small encoder (MiniLM: 47 MB of its 90) and a request touches a few dozen
of its rows, so a worker does not hold it: STI treats word embedding as a component of its own, and stores it
on flash as FlashEmbedding does. The rows are stored at full precision in blocks of `BLOCK_ROWS`, each with
its crc32 in the manifest (checked on every read, so a corrupted block is refused, never served). The rows read
are kept in an LRU cache of rows, not of blocks: token ids are spread over the vocabulary, and on the bundled
tasks' test splits 90 % of the tokens fall in about 2,600 rows (3.9 MB at 384 wide) but in 400–530 blocks.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from academus.shared.models.shard_io import Reader
from academus.shared.state.artifacts import ArtifactError, crc32

ROWS_FILE = "embeddings.rows"
BLOCK_ROWS = 16                 # 24 KB a block at 384 wide: a text's reads stay small, the manifest too
CACHE_BYTES = 4 << 20           # the rows a worker keeps between requests


def write_rows(directory: Path, table: torch.Tensor) -> dict[str, Any]:
    """Writes the [rows, width] table into `directory/ROWS_FILE`; returns its manifest entry."""
    values = table.detach().to(torch.float32).contiguous().numpy()
    rows, width = values.shape
    crcs = []
    with open(Path(directory) / ROWS_FILE, "wb") as handle:
        for start in range(0, rows, BLOCK_ROWS):
            blob = values[start:start + BLOCK_ROWS].tobytes()
            handle.write(blob)
            crcs.append(crc32(blob))
    return {"file": ROWS_FILE, "rows": rows, "width": width, "block_rows": BLOCK_ROWS, "crc32": crcs}


class EmbeddingRows:
    """The stored table: rows gathered for a batch's token ids through an IO source; thread-safe. The cache is two
    lookup arrays (row -> slot, slot -> row) and a use stamp a slot: a batch whose rows are all cached is one
    vectorised lookup and one gather. A dictionary of rows kept in LRU order, row by row, took 3.3-4.8 times as long
    for such a batch (docs/benchmarks/sti.md)."""

    def __init__(self, directory: Path, meta: dict[str, Any], cache_bytes: int = CACHE_BYTES) -> None:
        try:
            self.path = Path(directory) / meta["file"]
            self.rows, self.width = int(meta["rows"]), int(meta["width"])
            self.block_rows, self.crcs = int(meta["block_rows"]), [int(c) for c in meta["crc32"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"{directory}: not an embedding rows entry ({e!r})") from e
        if len(self.crcs) != -(-self.rows // self.block_rows):
            raise ArtifactError(f"{self.path}: {len(self.crcs)} block checksums for {self.rows} rows of "
                                f"{self.block_rows}")
        self.row_bytes = self.width * 4
        self.capacity = max(1, min(cache_bytes, self.stored_bytes) // self.row_bytes)   # rows
        self.cache_bytes = self.capacity * self.row_bytes
        self._slab = torch.empty(self.capacity, self.width)     # pages are touched as rows arrive
        self._slot_of = np.full(self.rows, -1, np.int64)          # row -> its slot, -1: not cached
        self._row_at = np.full(self.capacity, -1, np.int64)       # slot -> its row, -1: free
        self._used = np.zeros(self.capacity, np.int64)            # slot -> the batch that last used it
        self._batch = 0
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lock = threading.Lock()
        self.hits = self.misses = 0       # tokens found cached, or read

    @property
    def stored_bytes(self) -> int:
        return self.rows * self.width * 4

    def block_span(self, block: int) -> tuple[int, int]:
        """Offset and length of a block in the file."""
        first = block * self.block_rows
        rows = min(self.block_rows, self.rows - first)
        return first * self.width * 4, rows * self.width * 4

    def held_bytes(self) -> int:
        with self._lock:
            return (self.capacity - len(self._free)) * self.row_bytes

    def read(self, ids: torch.Tensor, source: Reader) -> torch.Tensor:
        """[*ids.shape, width] on the ids' device: each id's row, from the cache or read (and checked) with its
        block; the rows read are cached, the least recently used making room."""
        index = ids.reshape(-1).to("cpu", torch.long).numpy()
        if index.size and (int(index.min()) < 0 or int(index.max()) >= self.rows):
            raise ArtifactError(f"{self.path}: token ids must lie in [0, {self.rows}); got "
                                f"{int(index.min())}..{int(index.max())}")
        with self._lock:   # gathered under the lock: another batch's rows may take an evicted slot
            slots = self._slot_of[index]
            cached = slots >= 0
            self._batch += 1
            self._used[slots[cached]] = self._batch
            hits = int(cached.sum())
            self.hits, self.misses = self.hits + hits, self.misses + len(index) - hits
            if hits == len(index):
                return self._slab[torch.from_numpy(slots)].reshape(*ids.shape, self.width).to(ids.device)
            out = torch.empty(len(index), self.width)
            if hits:
                out[torch.from_numpy(np.flatnonzero(cached))] = self._slab[torch.from_numpy(slots[cached])]
        missing = ~cached
        rows, inverse = np.unique(index[missing], return_inverse=True)
        fetched = self._fetch(rows.tolist(), source)
        out[torch.from_numpy(np.flatnonzero(missing))] = fetched[torch.from_numpy(inverse)]
        self._keep(rows, fetched, index)
        return out.reshape(*ids.shape, self.width).to(ids.device)

    def prefetch(self, ids: torch.Tensor, source: Reader) -> None:
        """Asks the source now for the blocks of the ids' rows not cached, which `read` then takes: the compute waits
        for the rows, and through a cold page cache they queued behind the shards the loader had asked for, taking
        3-6 times as long (docs/benchmarks/sti.md). Ids out of range are left to `read` to refuse."""
        index = ids.reshape(-1).to("cpu", torch.long).numpy()
        index = index[(index >= 0) & (index < self.rows)]
        with self._lock:
            uncached = index[self._slot_of[index] < 0]
        for block in np.unique(uncached // self.block_rows).tolist():
            source.prefetch(self.path, *self.block_span(block))

    def check_all(self, source: Reader) -> int:
        """Every block against its crc32 (`shard verify`); returns the blocks checked."""
        for block in range(len(self.crcs)):
            self._read_block(block, source)
        return len(self.crcs)

    def _fetch(self, rows: list[int], source: Reader) -> torch.Tensor:
        """[len(rows), width]: the rows, each block read once."""
        out = torch.empty(len(rows), self.width)
        block, values = -1, out
        for i, row in enumerate(rows):            # ascending (np.unique): a block's rows come together
            if row // self.block_rows != block:
                block = row // self.block_rows
                values = self._read_block(block, source)
            out[i] = values[row - block * self.block_rows]
        return out

    def _keep(self, rows: np.ndarray, values: torch.Tensor, batch: np.ndarray) -> None:
        """Caches rows just read (ascending, distinct), evicting the least recently used rows the batch does not
        use; those that find no room are not kept."""
        with self._lock:
            new = np.flatnonzero(self._slot_of[rows] < 0)        # another batch may have kept some
            short = len(new) - len(self._free)
            if short > 0:
                taken = np.flatnonzero(self._row_at >= 0)
                movable = taken[~np.isin(self._row_at[taken], batch)]
                victims = movable[np.argsort(self._used[movable], kind="stable")[:short]]
                self._slot_of[self._row_at[victims]] = -1
                self._row_at[victims] = -1
                self._free.extend(victims.tolist())
            kept = new[:len(self._free)]
            slots = np.array([self._free.pop() for _ in kept], np.int64)
            self._slot_of[rows[kept]] = slots
            self._row_at[slots] = rows[kept]
            self._used[slots] = self._batch
            if len(kept):
                self._slab[torch.from_numpy(slots)] = values[torch.from_numpy(kept)]

    def _read_block(self, block: int, source: Reader) -> torch.Tensor:
        offset, length = self.block_span(block)
        blob = source.read(self.path, offset, length)
        if len(blob) != length or (crc := crc32(blob)) != self.crcs[block]:
            got = f"{len(blob)} bytes" if len(blob) != length else f"crc32 {crc}"
            raise ArtifactError(f"{self.path}: rows block {block} (bytes {offset}..{offset + length}) has {got}; "
                                f"the manifest says {length} bytes, crc32 {self.crcs[block]}")
        return torch.from_numpy(np.frombuffer(blob, dtype=np.float32).reshape(-1, self.width).copy())
