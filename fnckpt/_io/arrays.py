"""The module that calls TensorStore for array data: zarr3 specs, chunk writes, slice reads.

Every array leaf is a zarr3 array whose chunk grid is the write chunk (``_layout.chunks``), encoded
with ``sharding_indexed`` (inner chunks; data and index each followed by ``crc32c``), optional
``zstd`` or ``blosc``. Writers open with ``assume_metadata`` (no I/O) and write only their own
chunks, each in its own transaction, so a chunk is written whole, once, never read back. Process
0 writes the ``zarr.json`` files. Readers also open with ``assume_metadata`` (the manifest carries
everything) and with ``fill_missing_data_reads: false``, so a missing chunk is an error,
never zeros.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from .._errors import CheckpointError
from .._format.codecs import BLOSC
from .._format.leaves import dtype_of
from .._format.records import Stored
from .._layout.chunks import Index

__all__ = [
  "zarr_spec",
  "pack_spec",
  "compression_options",
  "Codecs",
  "open_array",
  "write_chunk",
  "read_slice",
  "storage_dtype",
  "from_storage",
  "ByteBudget",
]

_BYTES = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC = {"name": "crc32c"}


Codecs = tuple[int | None, tuple[tuple[str, Any], ...] | None]  # Stored's (zstd, blosc)


def compression_options(compression: Any, zstd: Any) -> Codecs:
  """``save(compression=..., zstd=...)`` -> the ``zstd`` level and ``blosc`` configuration
  (sorted items) of the arrays' :class:`~fnckpt._format.records.Stored` records.

  >>> compression_options("blosc", None)[1][1], compression_options("zstd:3", None)
  (('cname', 'lz4'), (3, None))
  """
  if zstd is not None:
    if compression is not None:
      raise ValueError(
        f"save(compression={compression!r}, zstd={zstd!r}): give one of them "
        "(zstd=N is short for compression='zstd:N')."
      )
    compression = f"zstd:{zstd}" if isinstance(zstd, int) and not isinstance(zstd, bool) else zstd
  if compression is None:
    return None, None
  if compression == "blosc":
    return None, tuple(sorted(BLOSC.items()))
  name, _, level = str(compression).partition(":")
  if name == "zstd" and (not level or level.lstrip("-").isdigit()):
    n = int(level) if level else 1
    if -131072 <= n <= 22 and n != 0:
      return n, None
  raise ValueError(
    f"save(compression={compression!r}): expected None, 'blosc' (lz4 with bit "
    "shuffling: the best ratio per CPU second measured on training state), "
    "'zstd' or 'zstd:<level>' (level 1..22, or negative for faster)."
  )


# The data types zarr3 in TensorStore knows. Any other dtype JAX has (uint2, uint4,
# float8_e4m3) is stored as its bits in the unsigned integer of the same size; the manifest
# keeps the real dtype and readers view the bits back (from_storage).
_ZARR3_DTYPES = frozenset(
  (
    "bool int2 int4 int8 uint8 int16 uint16 int32 uint32 int64 uint64 float8_e3m4 "
    "float8_e4m3fn float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn float16 bfloat16 float32 float64 complex64 complex128"
  ).split()
)


def storage_dtype(dtype: str) -> str:
  """The zarr3 data type that stores arrays of ``dtype``.

  >>> storage_dtype("bfloat16"), storage_dtype("uint4")
  ('bfloat16', 'uint8')
  """
  if dtype in _ZARR3_DTYPES:
    return dtype
  return {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}[dtype_of(dtype).itemsize]


def from_storage(host: np.ndarray, dtype: str) -> np.ndarray:
  """Data read from a zarr3 array -> the saved ``dtype`` (a view for bit-stored dtypes)."""
  if host.dtype.name != dtype:
    return host.view(dtype_of(dtype))
  return host


def _fill_value(dtype: str) -> Any:
  if dtype == "bool":
    return False
  if dtype.startswith("complex"):
    return [0.0, 0.0]
  return 0


def zarr_spec(
  kv: dict[str, Any], stored: Stored, dtype: str, shape: Sequence[int]
) -> dict[str, Any]:
  """The zarr3 TensorStore spec of one array leaf (its ``stored`` record) under the
  checkpoint kvstore ``kv`` (the kvstore of the data's checkpoint: ``stored.base``'s)."""
  inner_codecs: list[dict[str, Any]] = [_BYTES]
  if stored.zstd:
    inner_codecs.append({"name": "zstd", "configuration": {"level": int(stored.zstd)}})
  if stored.blosc:
    inner_codecs.append({"name": "blosc", "configuration": dict(stored.blosc)})
  inner_codecs.append(_CRC)
  sub = dict(kv)
  sub["path"] = kv.get("path", "") + stored.dir.strip("/") + "/"
  return {
    "driver": "zarr3",
    "kvstore": sub,
    "metadata": {
      "shape": list(shape),
      "data_type": storage_dtype(dtype),
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(stored.chunks)}},
      "chunk_key_encoding": {"name": "default"},
      "fill_value": _fill_value(storage_dtype(dtype)),
      "codecs": [
        {
          "name": "sharding_indexed",
          "configuration": {
            "chunk_shape": list(stored.inner),
            "codecs": inner_codecs,
            "index_codecs": [_BYTES, _CRC],
            "index_location": "end",
          },
        }
      ],
    },
  }


def pack_spec(
  kv: dict[str, Any], dir_name: str, nbytes: int, chunk: int, inner: int
) -> dict[str, Any]:
  """A pack (format 2): a 1-D ``uint8`` zarr3 array of ``chunk``-byte chunks and
  ``inner``-byte inner chunks, each checked by crc32c.

  >>> pack_spec({"driver": "memory", "path": "c/"}, "data-0/p/0", 8, 8, 4)["kvstore"]["path"]
  'c/data-0/p/0/'
  """
  return zarr_spec(kv, Stored(dir_name, (chunk,), (inner,), None), "uint8", [nbytes])


def open_array(spec: dict[str, Any], ctx: ts.Context, *, mode: str) -> ts.Future:
  """``mode``: ``"write"`` (no I/O), ``"create"`` (writes zarr.json; the handle writes as a
  ``"write"`` one does), ``"read"`` (no I/O; missing chunks are errors)."""
  if mode == "create":
    return ts.open(
      {**spec, "store_data_equal_to_fill_value": True}, create=True, open=True, context=ctx
    )
  if mode == "write":
    return ts.open(
      {**spec, "store_data_equal_to_fill_value": True},
      write=True,
      assume_metadata=True,
      context=ctx,
    )
  if mode == "read":
    return ts.open(
      {**spec, "fill_missing_data_reads": False}, read=True, assume_metadata=True, context=ctx
    )
  raise ValueError(mode)


def _slices(index: Index) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in index)


def write_chunk(array: ts.TensorStore, index: Index, data: np.ndarray) -> ts.Future:
  """Write one whole chunk in its own transaction (one writeback, no read-modify-write).
  Returns the commit future. TensorStore copies ``data`` into the transaction before this
  returns, so the caller may drop it then.

  It must copy: letting TensorStore reference ``data`` (``can_reference_source_data_
  indefinitely``) hands it Python objects (views of JAX buffers, on ``memory://`` even kept in
  the store) that it then releases on its own threads while holding its own locks; that
  deadlocked against JAX's device transfers (seen with memory:// retention deletes)."""
  stored = array.dtype.numpy_dtype
  if data.dtype.name != stored.name:  # a dtype stored as its bits (storage_dtype)
    data = data.view(stored)
  txn = ts.Transaction()
  array.with_transaction(txn)[_slices(index)].write(data).result()  # copied into the txn
  return txn.commit_async()


def read_slice(array: ts.TensorStore, index: Index, batch: ts.Batch | None = None) -> ts.Future:
  return array[_slices(index)].read(batch=batch)


# Bytes. XLA's CPU client adopts a host buffer aligned to this instead of copying it
# (jax.device_put onto a CPU device then aliases the numpy array).
ALIGN = 64


def aligned_empty(shape: Sequence[int], dtype: Any) -> np.ndarray:
  """A new C-order array whose data starts on an :data:`ALIGN`-byte boundary (an empty
  array has no bytes to align: its pointer may be anything).

  >>> a = aligned_empty((3, 5), np.float32)
  >>> a.shape, a.ctypes.data % ALIGN
  ((3, 5), 0)
  """
  dtype = np.dtype(dtype)
  n = math.prod(int(d) for d in shape) * dtype.itemsize  # (np.prod: 4 us a call)
  raw = np.empty(n + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  return raw[start : start + n].view(dtype).reshape(shape)


class Landing:
  """A slice being read into an array of ours (:func:`read_into`): ``done()``, ``result()``."""

  def __init__(self, copy: Any, out: np.ndarray):
    self._copy, self._out = copy, out

  def done(self) -> bool:
    return self._copy.done()

  def result(self) -> np.ndarray:
    self._copy.result()
    return self._out


def read_into(array: ts.TensorStore, index: Index, batch: ts.Batch | None = None) -> Landing:
  """Read slice ``index`` of ``array`` into a new :func:`aligned_empty` array: on CPU
  devices JAX then places it without a copy, once for all the devices that share it.
  TensorStore copies the decoded chunks straight into it. ``batch``: as for
  :func:`read_slice` (the reads of several slices of one chunk file, sharing it, fetch its
  index once and its data in one request); none for a slice of whole chunks that no other
  slice reads."""
  out = aligned_empty([b - a for a, b in index], array.dtype.numpy_dtype)
  return Landing(ts.array(out, write=True).write(array[_slices(index)], batch=batch).commit, out)


def on_grid(index: Index, grid: Sequence[int], shape: Sequence[int]) -> bool:
  """Whether every bound of ``index`` lies on ``grid`` (or at the array's end): with the
  stored chunk shape, whether the slice is made of whole chunks.

  >>> on_grid(((0, 4), (2, 6)), (2, 2), (4, 6)), on_grid(((0, 3),), (2,), (4,))
  (True, False)
  """
  return all(a % g == 0 and (b % g == 0 or b == n) for (a, b), g, n in zip(index, grid, shape))


def budget_arg(value: Any, call: str, default: int, minimum: int = 1) -> int:
  """``budget_bytes=value`` of ``call`` checked: ``None`` is ``default``, else an int of at
  least ``minimum``.

  >>> budget_arg(None, "restore", 128)
  128
  """
  if value is None:
    return default
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise CheckpointError(
      f"{call}(budget_bytes={value!r}): expected an int of at least "
      f"{minimum} (bytes), or None for the default ({default})."
    )
  return int(value)


class ByteBudget:
  """A counting semaphore over bytes. ``acquire(n)`` waits while ``n`` more bytes would go over
  the limit, except when nothing is held (so one item larger than the budget still passes:
  peak <= limit + one item)."""

  def __init__(self, limit: int):
    self.limit = int(limit)
    self.held = 0
    self.waiting = 0  # callers of acquire waiting now
    self._spillers: list[Callable[[], Any]] = []
    self._cv = threading.Condition()

  def acquire(self, n: int, on_wait: Callable[[], Any] | None = None) -> None:
    """Take ``n`` bytes; if that has to wait, call ``on_wait()`` first (under the lock, so
    it cannot miss the wait), e.g. to start the writer that will free some, and every
    registered spiller (:meth:`add_spiller`)."""
    with self._cv:
      fits = lambda: self.held == 0 or self.held + n <= self.limit  # noqa: E731
      if not fits():
        if on_wait is not None:
          on_wait()
        for spill in list(self._spillers):
          spill()
        self.waiting += 1
        try:
          self._cv.wait_for(fits)
        finally:
          self.waiting -= 1
      self.held += n

  def add_spiller(self, fn: Callable[[], Any]) -> None:
    """``fn()`` is called (under the lock: it must only signal) before anyone waits: a holder
    of bytes that could write them instead of holding them (an overlapping save's writer)."""
    with self._cv:
      if fn not in self._spillers:
        self._spillers.append(fn)

  def remove_spiller(self, fn: Callable[[], Any]) -> None:
    """Stop calling ``fn`` (it holds nothing any more)."""
    with self._cv:
      if fn in self._spillers:
        self._spillers.remove(fn)

  def release(self, n: int) -> None:
    with self._cv:
      self.held -= n
      self._cv.notify_all()
