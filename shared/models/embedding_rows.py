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
from collections import OrderedDict
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
    """The stored table: rows gathered for a batch's token ids through an IO source; thread-safe."""

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
        self._slots: OrderedDict[int, int] = OrderedDict()       # row -> slot, least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lock = threading.Lock()
        self.hits = self.misses = 0       # distinct rows of a batch found cached, or read

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
            return len(self._slots) * self.row_bytes

    def read(self, ids: torch.Tensor, source: Reader) -> torch.Tensor:
        """[*ids.shape, width] on the ids' device: each id's row, from the cache or read (and checked) with its
        block; the rows read are cached, the least recently used making room."""
        flat = ids.reshape(-1).to("cpu", torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            raise ArtifactError(f"{self.path}: token ids must lie in [0, {self.rows}); got "
                                f"{int(flat.min())}..{int(flat.max())}")
        wanted, inverse = torch.unique(flat, return_inverse=True)
        rows = wanted.tolist()
        local = torch.empty(len(rows), self.width)
        with self._lock:   # gathered under the lock: another batch's rows may take an evicted slot
            cached = {i: self._slots[r] for i, r in enumerate(rows) if r in self._slots}
            self.hits, self.misses = self.hits + len(cached), self.misses + len(rows) - len(cached)
            for i in cached:
                self._slots.move_to_end(rows[i])
            if cached:
                local[torch.tensor(list(cached))] = self._slab[torch.tensor(list(cached.values()))]
        missing = [i for i in range(len(rows)) if i not in cached]
        if missing:
            fetched = self._fetch([rows[i] for i in missing], source)
            local[torch.tensor(missing)] = fetched
            self._keep([rows[i] for i in missing], fetched, set(rows))
        return local[inverse].reshape(*ids.shape, self.width).to(ids.device)

    def prefetch(self, ids: torch.Tensor, source: Reader) -> None:
        """Asks the source now for the blocks of the ids' rows not cached, which `read` then takes: the compute waits
        for the rows, and through a cold page cache they queued behind the shards the loader had asked for, taking
        3-6 times as long (docs/benchmarks/sti.md). Ids out of range are left to `read` to refuse."""
        wanted = torch.unique(ids.reshape(-1).to("cpu", torch.long)).tolist()
        with self._lock:
            blocks = sorted({row // self.block_rows for row in wanted
                             if 0 <= row < self.rows and row not in self._slots})
        for block in blocks:
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
        for i, row in enumerate(rows):            # ascending (torch.unique): a block's rows come together
            if row // self.block_rows != block:
                block = row // self.block_rows
                values = self._read_block(block, source)
            out[i] = values[row - block * self.block_rows]
        return out

    def _keep(self, rows: list[int], values: torch.Tensor, batch: set[int]) -> None:
        """Caches rows just read, evicting the least recently used rows this batch does not use; those that find
        no room are not kept."""
        with self._lock:
            new = [i for i, row in enumerate(rows) if row not in self._slots]   # another batch may have kept some
            victims = []
            for row in self._slots:                   # least recently used first
                if len(self._free) + len(victims) >= len(new):
                    break
                if row not in batch:
                    victims.append(row)
            self._free.extend(self._slots.pop(row) for row in victims)
            kept = new[:len(self._free)]
            slots = [self._free.pop() for _ in kept]
            for i, slot in zip(kept, slots, strict=True):
                self._slots[rows[i]] = slot
            if kept:
                self._slab[torch.tensor(slots)] = values[torch.tensor(kept)]

    def _read_block(self, block: int, source: Reader) -> torch.Tensor:
        offset, length = self.block_span(block)
        blob = source.read(self.path, offset, length)
        if len(blob) != length or (crc := crc32(blob)) != self.crcs[block]:
            got = f"{len(blob)} bytes" if len(blob) != length else f"crc32 {crc}"
            raise ArtifactError(f"{self.path}: rows block {block} (bytes {offset}..{offset + length}) has {got}; "
                                f"the manifest says {length} bytes, crc32 {self.crcs[block]}")
        return torch.from_numpy(np.frombuffer(blob, dtype=np.float32).reshape(-1, self.width).copy())
