"""IO sources for shard artifacts: positional reads of a file, as the STI pipeline, the embedding rows, the
student shards and `shard verify` read them.

Every arm of a comparison reads through the same source, and each result names it:
- `file`: the files mapped once; a shard's bytes are a view of the page cache, put into its layer with no copy before;
- `cold`: the shard files' pages are dropped from the page cache (posix_fadvise DONTNEED) before each run, then
  the plan's shards are asked of the disk in order (WILLNEED) and read (by the C loader's thread where it is built);
- `throttled:<MB/s>`: reads complete no sooner than a device of that bandwidth would deliver them, one
  read at a time: flash storage, or the paper's load/compute skew on this machine's compute.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

Span = tuple[Path, int, int]   # a read's file, offset and length


class Reads(Protocol):
    """Reads of spans in order, taken with `next`; `close` when done, or when leaving early."""

    def __next__(self) -> bytes | memoryview: ...

    def close(self) -> None: ...


class Reader(Protocol):
    """An IO source: positional reads of a file, and a span asked for ahead of its read."""

    def read(self, path: Path, offset: int, length: int) -> bytes: ...

    def prefetch(self, path: Path, offset: int, length: int) -> None: ...


class FileSource:
    """Positional reads, descriptors kept open; the plan's shards as views of the files, mapped once."""

    name = "file"
    mapped = True     # a cold source reads: the kernel drops no page of a file that a process maps
    c_reads = False   # whether the C loader's thread may read the files itself (pread), as `read` does
    ahead_layers = 0  # layers of a plan whose shards the disk is asked for ahead of their reads

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._maps: dict[Path, tuple[memoryview, int]] = {}
        self._lock = threading.Lock()

    def descriptor(self, path: Path) -> int:
        """The file's descriptor, open until `close` (the C loader's thread reads it as this source does)."""
        with self._lock:
            if path not in self._fds:
                self._fds[path] = fd = os.open(path, os.O_RDONLY)
                self._opened(fd)
            return self._fds[path]

    def _opened(self, fd: int) -> None:
        """A file just opened, for a source to advise the kernel how it will be read."""

    def read(self, path: Path, offset: int, length: int) -> bytes:
        return os.pread(self.descriptor(path), length, offset)   # a short read fails the shard's checksum check

    def prefetch(self, path: Path, offset: int, length: int) -> None:
        """Nothing: what the page cache holds is read at once, and the rest as the reads come."""

    def view(self, path: Path, offset: int, length: int) -> memoryview:
        """The span's bytes in the file's mapping, not copied. A read through the page cache is a copy, as costly as
        decoding a 6-bit shard and half a full-precision shard's load (docs/benchmarks/sti.md). A span past the
        file's end is short, and fails its checksum as a short read does. Shard files are written whole and never
        rewritten in place (a file cut short while mapped would fault, as with any mapped weights)."""
        whole, _ = self.mapping(path)
        return whole[offset:offset + length]

    def mapping(self, path: Path) -> tuple[memoryview, int]:
        """The whole file's mapping and the address it starts at, mapped once: a shard's view takes no lock, as its
        read takes none. The C loader reads a shard at the address plus its offset; whoever holds the view keeps
        the mapping."""
        mapped = self._maps.get(path)
        if mapped is None:
            fd = self.descriptor(path)
            with self._lock:
                if (mapped := self._maps.get(path)) is None:
                    size = os.fstat(fd).st_size
                    whole = memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b"")
                    mapped = self._maps[path] = whole, address(whole)
        return mapped

    def bytes_at(self, path: Path, offset: int, length: int) -> bytes | memoryview:
        """The span's bytes as this source gives them: a view of the mapping, or a read where the source reads."""
        return self.view(path, offset, length) if self.mapped else self.read(path, offset, length)

    def read_in_order(self, spans: Iterable[Span], depth: int) -> Reads:
        """Each span's bytes in turn, as the consumer takes them: views of the mapped files, which no thread needs
        to read ahead. `depth` is for a source that reads ahead."""
        return (self.view(*span) for span in spans)

    def before_run(self, paths: Sequence[Path]) -> None:
        """Nothing: the page cache keeps what it keeps."""

    def close(self) -> None:
        """Closes the descriptors; a mapping goes when its last view does (the pipeline may still hold one)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._maps.clear()

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class ColdSource(FileSource):
    """Reads after the files' pages are dropped from the page cache, as on a first start."""

    name = "cold"
    mapped = False
    c_reads = True
    ahead_layers = 2  # what a run stopped early (its pace, its deadline) leaves queued for the next stays small

    def _opened(self, fd: int) -> None:
        """The kernel's own readahead off (POSIX_FADV_RANDOM): on a layer read at 6 of its 12 shards it read the
        skipped ones too, and a full-precision shard loaded 1.5 times slower than in a whole layer
        (docs/benchmarks/sti.md). `read_in_order` asks for exactly the plan's shards instead."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)

    def before_run(self, paths: Sequence[Path]) -> None:
        for path in paths:
            os.posix_fadvise(self.descriptor(path), 0, 0, os.POSIX_FADV_DONTNEED)

    def prefetch(self, path: Path, offset: int, length: int) -> None:
        """The disk asked for the span now (POSIX_FADV_WILLNEED), so that it is read before what is asked later."""
        os.posix_fadvise(self.descriptor(path), offset, length, os.POSIX_FADV_WILLNEED)

    def read_in_order(self, spans: Iterable[Span], depth: int) -> Reads:
        """Each span's bytes in turn, the disk asked for the spans up to `ahead_layers * depth` ahead of the reads
        (POSIX_FADV_WILLNEED): it reads the next shards while the loader decodes this one, and reads no more than
        the plan's shards. A thread reading ahead made full-precision loads slower (docs/benchmarks/sti.md)."""
        return self._prefetched(list(spans), max(1, self.ahead_layers * depth))

    def _prefetched(self, spans: list[Span], ahead: int) -> Iterator[bytes]:
        asked = 0
        for i, span in enumerate(spans):
            while asked < min(len(spans), i + ahead):
                self.prefetch(*spans[asked])
                asked += 1
            yield self.read(*span)


class ThrottledSource(FileSource):
    """Reads that take at least length / bandwidth each, one after another, as one storage device serves them."""

    mapped = False    # every shard goes through `read`, which the bandwidth paces

    def __init__(self, megabytes_per_s: float) -> None:
        super().__init__()
        self._reader: ThreadPoolExecutor | None = None
        if megabytes_per_s <= 0:
            raise ValueError(f"throttled bandwidth must be > 0 MB/s, got {megabytes_per_s}")
        self.bytes_per_s = megabytes_per_s * 1e6
        self.name = f"throttled:{megabytes_per_s:g}"
        self._free_at = 0.0
        self._device = threading.Lock()   # the loader's shard reads and the compute thread's row reads share it

    def read(self, path: Path, offset: int, length: int) -> bytes:
        start = time.perf_counter()
        data = super().read(path, offset, length)
        with self._device:
            done = self._free_at = max(start, self._free_at) + length / self.bytes_per_s
        if (wait := done - time.perf_counter()) > 0:
            time.sleep(wait)
        return data

    def before_run(self, paths: Sequence[Path]) -> None:
        self._free_at = 0.0

    def read_in_order(self, spans: Iterable[Span], depth: int) -> Reads:
        """Each span's bytes in turn, read up to `depth` ahead on the device's own thread: it reads the next shard
        while the consumer decodes this one, as a real device behind the kernel's readahead would."""
        if self._reader is None:   # again after `close`: a source may be read again
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="throttled-reader")
        return ReadAhead(self._reader, lambda span: self.read(*span), spans, depth)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        super().close()


class ReadAhead:
    """`read` of each span in order on `executor`'s thread, up to `depth` ahead of the consumer, which takes them
    with `next`; a failed read is raised where its bytes were due. `close` stops the reads not taken (the reader
    ends after the read it is in), whether or not the consumer took any."""

    def __init__(self, executor: ThreadPoolExecutor, read: Callable[[Span], bytes], spans: Iterable[Span],
                 depth: int) -> None:
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=max(1, depth))
        self._closed = threading.Event()
        self._ended = False
        executor.submit(self._run, read, iter(spans))

    def _run(self, read: Callable[[Span], bytes], spans: Iterable[Span]) -> None:
        try:
            for span in spans:
                if not self._offer(read(span)):
                    return
            self._offer(None)        # the end, so that a consumer may iterate to it
        except BaseException as e:   # raised to the consumer in its turn
            self._offer(e)

    def _offer(self, item: bytes | BaseException | None) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> bytes:
        if self._ended:
            raise StopIteration
        item = self._queue.get()
        if item is None:
            self._ended = True
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._closed.set()
        while True:   # unblocks a reader waiting for room
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


def address(blob: bytes | memoryview) -> int:
    """Where a buffer's bytes start (read-only ones too: a mapped file's view); the caller keeps `blob` alive."""
    return np.frombuffer(blob, dtype=np.uint8).ctypes.data if len(blob) else 0


def io_source(spec: str) -> FileSource:
    """`file`, `cold` or `throttled:<MB/s>`."""
    if spec == "file":
        return FileSource()
    if spec == "cold":
        return ColdSource()
    if spec.startswith("throttled:"):
        try:
            return ThrottledSource(float(spec.split(":", 1)[1]))
        except ValueError as e:
            raise ValueError(f"io source {spec!r}: {e}") from e
    raise ValueError(f"io source {spec!r} is not file, cold or throttled:<MB/s>")
