"""STI's shard loader in C (`native/shard_put.c`, built by `make setup`), called through ctypes.

A loader thread that decodes with NumPy takes and gives back the GIL at every small step, and the compute thread
needs it between its torch ops: on the 2-core machine each slowed the other by a third or more
(docs/design/sti.md). A ctypes call runs without the GIL, so one call a shard puts it into its layer while the
compute runs on. Where the library was not built (no C compiler), `NATIVE` is None and the NumPy path serves.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LIBRARY = Path(__file__).with_name("native") / "libshard_put.so"
_I64 = ctypes.c_int64
_P = ctypes.c_void_p


def _load() -> ctypes._NamedFuncPointer | None:
    if not LIBRARY.is_file():
        return None
    put = ctypes.CDLL(str(LIBRARY)).academus_put_shard
    put.argtypes = [_P, _I64, ctypes.c_int, _P, _I64, ctypes.c_int, ctypes.POINTER(_I64), ctypes.POINTER(_I64),
                    ctypes.POINTER(_P), ctypes.POINTER(_I64), ctypes.POINTER(_I64), _I64]
    put.restype = ctypes.c_int
    return put


NATIVE = _load()


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

    def __call__(self, index: int, blob: bytes | memoryview, bits: int, centroids: np.ndarray | None,
                 outliers: int) -> None:
        data = np.frombuffer(blob, dtype=np.uint8)      # no copy; held for the call
        table = 0 if centroids is None else centroids.ctypes.data
        if NATIVE(data.ctypes.data, len(data), bits, table, outliers, self._parts, self._rows, self._cols,
                  self._base, self._step, self._stride, index):
            raise ValueError(f"a stored shard of {len(data)} bytes at {bits} bits with {outliers} outliers does "
                             f"not fill this layer's shard")
