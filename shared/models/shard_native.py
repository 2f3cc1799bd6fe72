"""STI's shard loader in C (`native/shard_put.c`, built by `make setup`), called through ctypes.

A loader thread that decodes with NumPy takes and gives back the GIL at every small step, and the compute thread
needs it between its torch ops: on the 2-core machine each slowed the other by a third or more
(docs/design/sti.md). A ctypes call runs without the GIL, so one call puts a layer's shards in while the compute
runs on (`NativePut`), and in the pipeline a C thread of the library's own puts a whole plan's layers, never taking
the GIL at all (`PlanLoads`), reading their shards from the files itself where they are not in memory. Where the
library was not built (no C compiler), `NATIVE` is None and NumPy decodes.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from isal import isal_zlib

from academus.shared.models.shard_io import address

LIBRARY = Path(__file__).with_name("native") / "libshard_put.so"
_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_I64P = ctypes.POINTER(_I64)


class LayerLoad(ctypes.Structure):
    """One layer's stored shards and where they go: `LayerLoad` in shard_put.c."""

    _fields_ = [("shards", _I64), ("blobs", ctypes.POINTER(_P)), ("lengths", _I64P),
                ("bits", ctypes.POINTER(ctypes.c_int)), ("pairs", ctypes.POINTER(_P)), ("outliers", _I64P),
                ("crcs", ctypes.POINTER(ctypes.c_uint32)), ("index", _I64P), ("parts", _I64), ("rows", _I64P),
                ("cols", _I64P), ("base", ctypes.POINTER(_P)), ("step", _I64P), ("stride", _I64P),
                ("fds", ctypes.POINTER(ctypes.c_int)), ("offsets", _I64P)]


@dataclass(frozen=True)
class Native:
    """The library's calls (shard_put.c)."""

    put_layer: Callable[..., int]
    open: Callable[..., int | None]
    start: Callable[..., int]
    publish: Callable[..., None]
    wait: Callable[..., int]
    done: Callable[..., None]
    finish: Callable[..., int]
    close: Callable[..., None]


LOADER_VERSION = 3    # shard_put.c's academus_loader_version: the layout of LayerLoad and of the calls


def _load() -> Native | None:
    if not LIBRARY.is_file():
        return None
    library = ctypes.CDLL(str(LIBRARY))
    version = getattr(library, "academus_loader_version", None)
    if version is None or version() != LOADER_VERSION:   # built from another source: its structs differ, and NumPy
        return None                                       # serves until `make setup` rebuilds it
    load = ctypes.POINTER(LayerLoad)
    signatures = {"academus_put_layer": ([load, _P], ctypes.c_int),
                  "academus_loader_open": ([_P], _P),
                  "academus_loads_start": ([_P, load, _I64, _I64, _P, _I64, _I64], ctypes.c_int),
                  "academus_loads_publish": ([_P, _I64], None), "academus_loads_wait": ([_P, _I64], ctypes.c_int),
                  "academus_loads_done": ([_P], None), "academus_loads_finish": ([_P], _I64),
                  "academus_loader_close": ([_P], None)}
    for name, (argtypes, restype) in signatures.items():
        getattr(library, name).argtypes, getattr(library, name).restype = argtypes, restype
    return Native(*(getattr(library, name) for name in signatures))     # in the fields' order


NATIVE = _load()
# ISA-L's CRC-32 (zlib's, as `artifacts.crc32` computes it), which the C loader calls on each shard
CRC32 = ctypes.cast(ctypes.CDLL(isal_zlib.__file__).crc32_gzip_refl, _P).value


class BadShard(ValueError):
    """Stored bytes refused before any shard of the call was put: `i` is the shard's place in the call."""

    def __init__(self, i: int, message: str) -> None:
        super().__init__(message)
        self.i = i


@functools.cache
def _layout(parts: tuple[tuple[int, int, int, int], ...]) -> tuple[ctypes.Array, ...]:
    """(rows, cols, step, stride) arrays of a layer shape's parts, built once: a layer is built every run, on the
    loader thread, which holds the GIL while it builds them."""
    return tuple((_I64 * len(parts))(*(part[k] for part in parts)) for k in range(4))


class NativePut:
    """Puts stored shards into one layer's matrices. `parts[p]` is (rows, cols, step, stride): part p of a
    shard's flat vector, rows x cols, goes to `matrices[p]` from element `index * step`, its rows `stride` apart.
    The matrices are float32 and C-contiguous."""

    def __init__(self, matrices: Sequence[np.ndarray], parts: tuple[tuple[int, int, int, int], ...]) -> None:
        assert NATIVE is not None
        self._matrices = matrices      # the destinations outlive every call
        self._parts = len(parts)
        self._rows, self._cols, self._step, self._stride = _layout(parts)
        self._base = (_P * len(parts))(*(m.ctypes.data for m in matrices))

    def load(self, index: Sequence[int], addresses: Sequence[int], lengths: Sequence[int], bits: Sequence[int],
             pair_tables: Sequence[int], outliers: Sequence[int], crcs: Sequence[int] | None = None,
             reads: Sequence[tuple[int, int]] | None = None) -> BuiltLoad:
        """Stored shards bound for places `index[i]`, as the C loader takes them: shard i's `lengths[i]` bytes at
        `addresses[i]`, its pair table's address (0 at full precision). `reads[i]`: (descriptor, offset) of a shard
        a plan's thread reads from its file, (-1, 0) for one at its address. The load keeps its arrays alive; the
        caller keeps the shards' and tables' memory, and the files open."""
        n = len(addresses)
        fds, offsets = zip(*reads, strict=True) if reads else ((), ())
        load = LayerLoad(n, (_P * n)(*addresses), (_I64 * n)(*lengths), (ctypes.c_int * n)(*bits),
                         (_P * n)(*pair_tables), (_I64 * n)(*outliers), (ctypes.c_uint32 * n)(*(crcs or [0] * n)),
                         (_I64 * n)(*index), self._parts, self._rows, self._cols, self._base, self._step,
                         self._stride, (ctypes.c_int * n)(*fds) if reads else None,
                         (_I64 * n)(*offsets) if reads else None)
        return BuiltLoad(load, lengths, bits, outliers)

    def __call__(self, index: Sequence[int], blobs: Sequence[bytes | memoryview], bits: Sequence[int],
                 pair_tables: Sequence[np.ndarray | None], outliers: Sequence[int],
                 crcs: Sequence[int] | None = None) -> None:
        """Shards `blobs[i]` at places `index[i]`, in one call. Every size, and each CRC-32 against `crcs` where
        given, is checked before any shard is put; a mismatch raises BadShard."""
        assert NATIVE is not None
        built = self.load(index, [address(b) for b in blobs], [len(b) for b in blobs], bits,
                          [0 if t is None else t.ctypes.data for t in pair_tables], outliers, crcs)
        if failed := NATIVE.put_layer(ctypes.byref(built.load), CRC32 if crcs is not None else None):
            raise built.refused(failed)


@dataclass(frozen=True)
class BuiltLoad:
    """A layer's load as the C loader takes it, and its shards' lengths, versions and outlier counts, which word a
    refusal. Built once, it may be put or published again."""

    load: LayerLoad
    lengths: Sequence[int]
    bits: Sequence[int]
    outliers: Sequence[int]

    def refused(self, failed: int) -> BadShard:
        """The C loader's answer for this layer refused (shard i + 1: its size; -(i + 1): its CRC-32), worded."""
        i = abs(failed) - 1
        what = "does not fill this layer's shard" if failed > 0 else "does not match its CRC-32"
        return BadShard(i, f"a stored shard of {self.lengths[i]} bytes at {self.bits[i]} bits with "
                           f"{self.outliers[i]} outliers {what}")


LOADS_STOPPED = 0x40000000    # shard_put.c: the loads ended before the layer, no shard of it refused
LOADS_UNREAD = 0x40000001     # shard_put.c: a shard of the layer could not be read into the staging buffer


class LoaderThread:
    """The C loader's thread, kept from plan to plan: it waits for a plan, puts its layers and waits again. Starting
    and joining one for each run cost the run 0.13-0.17 ms (docs/benchmarks/sti.md). One plan at a time."""

    def __init__(self) -> None:
        assert NATIVE is not None
        handle = NATIVE.open(CRC32)
        if not handle:
            raise OSError("the C shard loader could not start its thread")
        self.handle: int = handle
        self.pid = os.getpid()       # a forked child has the loader's memory but not its thread
        self._close = weakref.finalize(self, _close_loader, handle, self.pid)   # a pipeline never closed ends it too

    def close(self) -> None:
        """Stops a plan still loading and ends the thread. Once is enough; later calls do nothing."""
        self._close()


def _close_loader(handle: int, pid: int) -> None:
    """Ends the loader's thread, in the process that started it: a forked child would join a thread it does not
    have (it leaves the loader's memory as it is)."""
    if NATIVE is not None and os.getpid() == pid:
        NATIVE.close(handle)


class PlanLoads:
    """A plan's layers put in order by a C thread, which never takes the GIL (shard_put.c): a Python loader thread,
    each time it took the GIL back, made the compute thread wait for it after its next torch op
    (docs/design/sti.md). The caller publishes each layer's shards in order, waits for a layer before running it,
    and says when it is done with one: the thread puts at most `window` layers ahead of that (0: no bound), as
    their buffers are reused in turn."""

    def __init__(self, layers: int, window: int, staging: np.ndarray | None = None, ahead: int = 0,
                 thread: LoaderThread | None = None) -> None:
        """Each shard's CRC-32 is checked against the one published with it. Shards published to be read from their
        files go through `staging` (uint8, a layer's reads at most), the disk asked for them `ahead` layers ahead of
        the layer read. `thread`: a kept loader thread, free (no other plan's loads unfinished); else one of their
        own, ended by `finish`."""
        assert NATIVE is not None
        self._own = thread is None
        self._thread = LoaderThread() if thread is None else thread
        self._loads = (LayerLoad * max(1, layers))()
        self._published: list[BuiltLoad] = []
        self._staging = staging                   # the thread writes into it until `finish`
        self._handle: int | None = self._thread.handle
        if NATIVE.start(self._handle, self._loads, layers, window, 0 if staging is None else staging.ctypes.data,
                        0 if staging is None else staging.nbytes, ahead):
            raise RuntimeError("the C shard loader's thread still loads another plan")

    def publish(self, put: NativePut, index: Sequence[int], addresses: Sequence[int], lengths: Sequence[int],
                bits: Sequence[int], pair_tables: Sequence[int], outliers: Sequence[int],
                crcs: Sequence[int] | None = None, reads: Sequence[tuple[int, int]] | None = None) -> None:
        """The next layer's shards, into `put`'s matrices (as `NativePut.load` takes them). The caller keeps the
        shards' memory, and their files open, until `finish`."""
        self.publish_built(put.load(index, addresses, lengths, bits, pair_tables, outliers, crcs, reads))

    def publish_built(self, built: BuiltLoad) -> None:
        """The next layer's load as `NativePut.load` built it, maybe for an earlier plan."""
        assert NATIVE is not None and self._handle
        self._loads[len(self._published)] = built.load
        self._published.append(built)
        NATIVE.publish(self._handle, len(self._published))

    def wait(self, layer: int) -> None:
        """Until `layer` is put. A layer refused raises BadShard; loads ended before it (stopped, or an earlier
        layer refused) raise RuntimeError."""
        assert NATIVE is not None and self._handle
        if not (failed := NATIVE.wait(self._handle, layer)):
            return
        if failed == LOADS_STOPPED:
            raise RuntimeError(f"the shard loads ended before layer {layer}")
        if failed == LOADS_UNREAD:
            raise OSError(f"the shards of layer {layer} could not be read whole from their files")
        raise self._published[layer].refused(failed)

    def done(self) -> None:
        """The caller is done with one more layer (in order): its buffers may take a later one."""
        assert NATIVE is not None and self._handle
        NATIVE.done(self._handle)

    def finish(self) -> float:
        """Stops the loads after the layer being put, the thread free for another plan (or ended, where it was this
        plan's own): its busy seconds. Once only."""
        assert NATIVE is not None and self._handle
        busy, self._handle = NATIVE.finish(self._handle), None
        if self._own:
            self._thread.close()
        return busy / 1e9
