"""IO sources for shard artifacts: positional reads of a file, as the STI pipeline, the embedding rows, the
student shards and `shard verify` read them.

Every arm of a comparison reads through the same source, and each result names it:
- `file`: plain reads (the page cache may hold the files);
- `cold`: the shard files' pages are dropped from the page cache (posix_fadvise DONTNEED) before each run;
- `throttled:<MB/s>`: reads complete no sooner than a device of that bandwidth would deliver them, one
  read at a time: flash storage, or the paper's load/compute skew on this machine's compute.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Protocol


class Reader(Protocol):
    """An IO source: positional reads of a file."""

    def read(self, path: Path, offset: int, length: int) -> bytes: ...


class FileSource:
    """Plain positional reads; descriptors kept open."""

    name = "file"
    waits = False   # a read is a copy from the page cache: CPU work, which a read-ahead thread would only contend for

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def read(self, path: Path, offset: int, length: int) -> bytes:
        return os.pread(self._fd(path), length, offset)   # a short read fails the shard's checksum check

    def before_run(self, paths: Sequence[Path]) -> None:
        """Nothing: the page cache keeps what it keeps."""

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class ColdSource(FileSource):
    """Reads after the files' pages are dropped from the page cache, as on a first start."""

    name = "cold"   # the kernel's readahead reads the next pages while the loader decodes: no reader thread (waits)

    def before_run(self, paths: Sequence[Path]) -> None:
        for path in paths:
            os.posix_fadvise(self._fd(path), 0, 0, os.POSIX_FADV_DONTNEED)


class ThrottledSource(FileSource):
    """Reads that take at least length / bandwidth each, one after another, as one storage device serves them."""

    waits = True    # no kernel readahead behind this device: the pipeline's reader thread reads ahead instead

    def __init__(self, megabytes_per_s: float) -> None:
        super().__init__()
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


class ReadAhead:
    """Reads run in order on a thread of their own (`executor`'s), up to `depth` ahead of the consumer that
    checks and decodes them: the storage device reads the next shard while the CPU decodes this one, as STI's
    IO thread does. Reading and decoding in turn left the device idle during each decode."""

    def __init__(self, executor: Executor, reads: Iterable[Callable[[], bytes]], depth: int) -> None:
        self._queue: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=max(1, depth))
        self._closed = threading.Event()
        executor.submit(self._run, iter(reads))

    def _run(self, reads: Iterable[Callable[[], bytes]]) -> None:
        try:
            for read in reads:
                if not self._offer(read()):
                    return
        except BaseException as e:   # the consumer raises it where the failed read's bytes were due
            self._offer(e)

    def _offer(self, item: bytes | BaseException) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> bytes:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stops the reads the consumer will not take: the reader ends after the read it is in."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


class ReadInTurn:
    """Each read done by the consumer when it asks: for a source whose reads cost CPU, not waiting."""

    def __init__(self, reads: Iterable[Callable[[], bytes]]) -> None:
        self._reads = iter(reads)

    def next(self) -> bytes:
        return next(self._reads)()

    def close(self) -> None:
        """Nothing runs ahead."""


def reads_for(source: FileSource, executor: Executor, reads: Iterable[Callable[[], bytes]],
              depth: int) -> ReadAhead | ReadInTurn:
    """`reads` run ahead on `executor` where the source's reads wait on a device, else in turn."""
    return ReadAhead(executor, reads, depth) if source.waits else ReadInTurn(reads)


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
