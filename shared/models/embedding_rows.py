"""A shard artifact's word-embedding table, read row block by row block as requests need them.

The table is the largest tensor of a small encoder (MiniLM: 47 MB of its 90) and a request touches a few dozen
of its rows, so a worker does not hold it: STI treats word embedding as a component of its own, and stores it
on flash as FlashEmbedding does. The rows are stored at full precision in blocks of `BLOCK_ROWS`, each with
its crc32 in the manifest (checked on every read, so a corrupted block is refused, never served), and the
blocks read are kept in a small LRU cache. Frequent tokens sit close together in a WordPiece vocabulary, so a
few blocks serve most texts.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from academus.shared.state.artifacts import ArtifactError

ROWS_FILE = "embeddings.rows"
BLOCK_ROWS = 16                 # 24 KB a block at 384 wide: a text's reads stay small, the manifest too
CACHE_BYTES = 2 << 20           # the blocks a worker keeps between requests


class Reader(Protocol):
    """An IO source (`sti_pipeline.io_source`): positional reads of a file."""

    def read(self, path: Path, offset: int, length: int) -> bytes: ...


def write_rows(directory: Path, table: torch.Tensor) -> dict[str, Any]:
    """Writes the [rows, width] table into `directory/ROWS_FILE`; returns its manifest entry."""
    values = table.detach().to(torch.float32).contiguous().numpy()
    rows, width = values.shape
    crcs = []
    with open(Path(directory) / ROWS_FILE, "wb") as handle:
        for start in range(0, rows, BLOCK_ROWS):
            blob = values[start:start + BLOCK_ROWS].tobytes()
            handle.write(blob)
            crcs.append(zlib.crc32(blob))
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
        self.cache_bytes = min(cache_bytes, self.stored_bytes)
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

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
            return self._held

    def read(self, ids: torch.Tensor, source: Reader) -> torch.Tensor:
        """[*ids.shape, width] on the ids' device: each id's row, its block read (and checked) unless cached."""
        flat = ids.reshape(-1).to("cpu", torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.rows):
            raise ArtifactError(f"{self.path}: token ids must lie in [0, {self.rows}); got "
                                f"{int(flat.min())}..{int(flat.max())}")
        blocks = flat // self.block_rows
        out = torch.empty(flat.numel(), self.width)
        for block in torch.unique(blocks).tolist():
            at = blocks == block
            out[at] = self._block(block, source)[flat[at] - block * self.block_rows]
        return out.reshape(*ids.shape, self.width).to(ids.device)

    def check_all(self, source: Reader) -> int:
        """Every block against its crc32 (`shard verify`); returns the blocks checked."""
        for block in range(len(self.crcs)):
            self._read_block(block, source)
        return len(self.crcs)

    def _block(self, block: int, source: Reader) -> torch.Tensor:
        with self._lock:
            if (held := self._cache.get(block)) is not None:
                self._cache.move_to_end(block)
                return held
        values = self._read_block(block, source)
        with self._lock:
            if block not in self._cache:
                self._cache[block] = values
                self._held += values.numel() * 4
            while len(self._cache) > 1 and self._held > self.cache_bytes:
                self._held -= self._cache.popitem(last=False)[1].numel() * 4
        return values

    def _read_block(self, block: int, source: Reader) -> torch.Tensor:
        offset, length = self.block_span(block)
        blob = source.read(self.path, offset, length)
        if len(blob) != length or (crc := zlib.crc32(blob)) != self.crcs[block]:
            got = f"{len(blob)} bytes" if len(blob) != length else f"crc32 {crc}"
            raise ArtifactError(f"{self.path}: rows block {block} (bytes {offset}..{offset + length}) has {got}; "
                                f"the manifest says {length} bytes, crc32 {self.crcs[block]}")
        return torch.from_numpy(np.frombuffer(blob, dtype=np.float32).reshape(-1, self.width).copy())
