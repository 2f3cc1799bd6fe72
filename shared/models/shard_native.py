"""STI's shard loader in C (`native/shard_put.c`, built by `make setup`), called through ctypes.

A loader thread that decodes with NumPy takes and gives back the GIL at every small step, and the compute thread
needs it between its torch ops: on the 2-core machine each slowed the other by a third or more
(docs/design/sti.md). A ctypes call runs without the GIL, so one call a layer puts its shards in while the compute
runs on. Where the library was not built (no C compiler), `NATIVE` is None and the NumPy path serves.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from isal import isal_zlib

LIBRARY = Path(__file__).with_name("native") / "libshard_put.so"
_I64 = ctypes.c_int64
_P = ctypes.c_void_p
_I64P = ctypes.POINTER(_I64)


def _load() -> ctypes._NamedFuncPointer | None:
    if not LIBRARY.is_file():
        return None
    put = getattr(ctypes.CDLL(str(LIBRARY)), "academus_put_layer", None)
    if put is None:      # built from an older source: NumPy serves until `make setup` rebuilds it
        return None
    put.argtypes = [_I64, ctypes.POINTER(_P), _I64P, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(_P), _I64P,
                    ctypes.POINTER(ctypes.c_uint32), _P, _I64P, ctypes.c_int, _I64P, _I64P, ctypes.POINTER(_P), _I64P,
                    _I64P]
    put.restype = ctypes.c_int
    return put


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


def address(blob: bytes | memoryview) -> int:
    """Where a buffer's bytes start (read-only ones too: a mapped file's view); the caller keeps `blob` alive."""
    return np.frombuffer(blob, dtype=np.uint8).ctypes.data


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

    def __call__(self, index: Sequence[int], blobs: Sequence[bytes | memoryview], bits: Sequence[int],
                 pair_tables: Sequence[np.ndarray | None], outliers: Sequence[int],
                 crcs: Sequence[int] | None = None) -> None:
        """Shards `blobs[i]` at places `index[i]`, in one call. Every size, and each CRC-32 against `crcs` where
        given, is checked before any shard is put; a mismatch raises BadShard."""
        n = len(blobs)
        failed = NATIVE(n, (_P * n)(*map(address, blobs)), (_I64 * n)(*map(len, blobs)), (ctypes.c_int * n)(*bits),
                        (_P * n)(*(0 if t is None else t.ctypes.data for t in pair_tables)), (_I64 * n)(*outliers),
                        (ctypes.c_uint32 * n)(*(crcs or [0] * n)), CRC32 if crcs is not None else None,
                        (_I64 * n)(*index), self._parts, self._rows, self._cols, self._base, self._step,
                        self._stride)
        if failed:
            i = abs(failed) - 1
            what = "does not fill this layer's shard" if failed > 0 else "does not match its CRC-32"
            raise BadShard(i, f"a stored shard of {len(blobs[i])} bytes at {bits[i]} bits with {outliers[i]} "
                              f"outliers {what}")
