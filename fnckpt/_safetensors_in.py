"""Reading safetensors files as a checkpoint (one file, an index json, or a directory of shards).

A safetensors file is 8 bytes (little-endian u64 ``N``), ``N`` bytes of a JSON header (tensor
name -> ``{"dtype", "shape", "data_offsets": [begin, end]}``, and an optional
``"__metadata__"`` map of strings), then the data buffer: each tensor's C-order little-endian
bytes at ``[begin, end)`` of it. Everything read is untrusted: :func:`parse_header` (pure)
validates the header into :class:`Tensor` records (length limits, known dtypes, offsets that
match the shape, tile the buffer from 0 with no overlap and no gap); the file's length is
checked against them before anything is read. A tensor's key path is its name split on
``.`` (:func:`key_paths`). Reads fetch, per slice a device needs, only the rows of the first
axis that slice covers (one byte range), through the TensorStore kvstore of the location, so
local files, ``memory://``, ``gs://`` and ``s3://`` all work.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import weakref
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

from . import _records
from ._errors import CheckpointError

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "Tensor", "parse_header", "key_paths", "open_file",
           "open_index", "open_dir", "INDEX_NAME"]

# safetensors dtype name -> fnckpt's (numpy/ml_dtypes) name. The packed sub-byte types
# (F4, F6_E2M3, F6_E3M2) are refused: their element size is not a whole byte.
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}
MAX_HEADER_BYTES = 100_000_000     # the safetensors library's own limit
MAX_INDEX_BYTES = 64 << 20
MAX_NAME = 4096
INDEX_NAME = "model.safetensors.index.json"
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One validated header entry: ``[begin, end)`` are absolute byte offsets in ``file``."""
  name: str
  file: str
  dtype: str          # fnckpt's dtype name
  shape: tuple[int, ...]
  begin: int
  end: int


def _bad(file: str, what: str) -> CheckpointError:
  return CheckpointError(
      f"The safetensors file {file!r} is invalid: {what}. It cannot be read safely; check the "
      "tool that wrote it (or download it again).")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out = {}
  for k, v in pairs:
    if k in out:
      raise ValueError(f"the name {k[:80]!r} appears twice")
    out[k] = v
  return out


def header_length(prefix: bytes, file: str) -> int:
  """The header length ``N`` from the file's first 8 bytes (checked against the limit)."""
  if len(prefix) < 8:
    raise _bad(file, f"it holds {len(prefix)} bytes, fewer than the 8 of its header length")
  n = struct.unpack("<Q", prefix[:8])[0]
  if not 2 <= n <= MAX_HEADER_BYTES:
    raise _bad(file, f"its header length is {n} bytes, expected 2 to {MAX_HEADER_BYTES}")
  return n


def parse_header(header: bytes, file: str, key: str | None = None
                 ) -> tuple[list[Tensor], Any, int]:
  """The header's tensors (in buffer order), its ``__metadata__`` and the data length.
  ``file`` names the file in errors; ``key`` (default ``file``) is its key in the kvstore.

  >>> h = b'{"a.0":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}'
  >>> ts_, meta, n = parse_header(h, "m.safetensors")
  >>> ts_[0].dtype, ts_[0].begin, n
  ('bfloat16', 65, 4)
  """
  try:
    text = header.decode("utf-8")
    raw = json.loads(text, object_pairs_hook=_no_duplicates)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise _bad(file, f"its header is not a JSON map ({e})") from None
  if not isinstance(raw, dict):
    raise _bad(file, "its header is not a JSON map")
  meta = raw.pop("__metadata__", None)
  if meta is not None and not (isinstance(meta, dict) and all(
      isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
    raise _bad(file, "its '__metadata__' must map strings to strings")
  start = 8 + len(header)
  tensors = [_tensor(name, entry, file, start, key or file) for name, entry in raw.items()]
  tensors.sort(key=lambda t: (t.begin, t.end))
  at, prev = start, None
  for t in tensors:
    if t.begin != at:
      what = (f"its bytes [{t.begin - start}, {t.end - start}) overlap those of "
              f"{prev.name!r}" if t.begin < at else
              f"its bytes start at {t.begin - start}, after a gap (the previous tensor ends "
              f"at {at - start})")
      raise _bad(file, f"tensor {t.name!r}: {what}")
    at, prev = t.end, t
  return tensors, meta, at - start


def _tensor(name: Any, entry: Any, file: str, start: int, key: str) -> Tensor:
  if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
    raise _bad(file, f"a tensor name must be a string of 1 to {MAX_NAME} characters")
  where = f"tensor {name!r}"
  if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
    raise _bad(file, f"{where} must be a map of exactly 'dtype', 'shape', 'data_offsets'")
  dtype = entry["dtype"]
  if dtype not in DTYPES if isinstance(dtype, str) else True:
    raise _bad(file, f"{where} has dtype {str(dtype)[:40]!r}, which fnckpt does not read "
               f"(known: {', '.join(DTYPES)})")
  shape = entry["shape"]
  if not (isinstance(shape, list) and len(shape) <= _records.MAX_DIMS and all(
      isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= _records.MAX_ELEMENTS
      for n in shape)) or math.prod(shape) > _records.MAX_ELEMENTS:
    raise _bad(file, f"{where} has shape {str(shape)[:60]}, expected a list of at most "
               f"{_records.MAX_DIMS} non-negative integers")
  offsets = entry["data_offsets"]
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(
      isinstance(o, int) and not isinstance(o, bool) and 0 <= o < 1 << 62 for o in offsets)):
    raise _bad(file, f"{where} has data_offsets {str(offsets)[:60]}, expected [begin, end]")
  begin, end = offsets
  nbytes = math.prod(shape) * _records.itemsize(DTYPES[dtype])
  if end - begin != nbytes:
    raise _bad(file, f"{where}: data_offsets {offsets} hold {end - begin} bytes, its dtype "
               f"{dtype} and shape {shape} need {nbytes}")
  return Tensor(name, key, DTYPES[dtype], tuple(shape), start + begin, start + end)


def key_paths(names: Sequence[str], where: str) -> list[tuple[tuple[str, Any], ...]]:
  """Key paths of tensor names: split on ``.``; the parts under a node are sequence indices
  when they are exactly ``0..n-1`` (decimal, no leading zeros), dict keys otherwise.

  >>> key_paths(["h.0.w", "h.1.w", "h.x"], "f")[0]
  (('dict', 'h'), ('dict', '0'), ('dict', 'w'))
  >>> key_paths(["h.0.w", "h.1.w"], "f")[1]
  (('dict', 'h'), ('seq', 1), ('dict', 'w'))
  """
  parts = [tuple(n.split(".")) for n in names]
  children: dict[tuple, set[str]] = {}
  for p in parts:
    if len(p) > 256:
      raise _bad(where, f"tensor {'.'.join(p)[:80]!r} has more than 256 name parts")
    for i in range(len(p)):
      children.setdefault(p[:i], set()).add(p[i])
  leaves = set(parts)
  for p in parts:
    for i in range(1, len(p)):
      if p[:i] in leaves:
        raise CheckpointError(
            f"In {where!r}, tensor {'.'.join(p[:i])!r} is also the parent of {'.'.join(p)!r} "
            "(names are split on '.' into key paths, and a leaf cannot have children). "
            "Rename one of them.")
  seq = {node for node, kids in children.items()
         if all(re.fullmatch(r"0|[1-9][0-9]{0,8}", k) for k in kids)
         and sorted(int(k) for k in kids) == list(range(len(kids)))}
  return [tuple(("seq", int(k)) if p[:i] in seq else ("dict", k) for i, k in enumerate(p))
          for p in parts]


# --- I/O ---------------------------------------------------------------------------------

def _read(kv: ts.KvStore, key: str, byte_range: slice | None = None, batch=None) -> ts.Future:
  return kv.read(key, byte_range=byte_range, batch=batch)


def _value(fut: ts.Future, location: str, what: str) -> bytes:
  try:
    got = fut.result()
  except ValueError as e:
    if "OUT_OF_RANGE" in str(e):  # the file is shorter than the range
      raise _bad(location, f"it ends inside {what}") from None
    raise CheckpointError(f"Cannot read {location!r} ({what}): {e}") from None
  except Exception as e:
    from . import _paths
    raise CheckpointError(f"Cannot read {location!r} ({what}): {_paths.error_text(e)}. Check "
                          "that the file exists and is readable.") from None
  if got.state != "value":
    raise CheckpointError(f"No file at {location!r} ({what}). Check the path.")
  return bytes(got.value)


def read_tensors(kv: ts.KvStore, key: str, location: str) -> tuple[list[Tensor], Any]:
  """Read and validate one file's header; check that the file is exactly as long as it says."""
  n = header_length(_value(_read(kv, key, slice(0, 8)), location, "its header length"), location)
  header = _value(_read(kv, key, slice(8, 8 + n)), location, f"its {n}-byte header")
  tensors, meta, data = parse_header(header, location, key)
  end = 8 + n + data
  last, past = _read(kv, key, slice(end - 1, end)), _read(kv, key, slice(end, end + 1))
  try:
    last_ok = last.result().state == "value"
  except ValueError as e:
    if "OUT_OF_RANGE" not in str(e):
      raise CheckpointError(f"Cannot read {location!r} (its last byte): {e}") from None
    last_ok = False
  if not last_ok:
    who = tensors[-1].name if tensors else "the header"
    raise _bad(location, f"it is truncated: {who!r} ends at byte {end}, past the end of the "
               "file")
  try:
    extra = past.result().state == "value"
  except Exception:  # OUT_OF_RANGE: the file ends exactly there
    extra = False
  if extra:
    raise _bad(location, f"it has bytes after its last tensor (which ends at byte {end})")
  return tensors, meta


def _manifest(tensors: list[Tensor], meta: Any, where: str) -> _records.Manifest:
  paths = key_paths([t.name for t in tensors], where)
  leaves = tuple(
      _records.Leaf(i, path, "array", t.dtype, t.shape, "numpy", None,
                    stored=_records.Stored(t.file, t.shape, t.shape, None))
      for i, (path, t) in enumerate(zip(paths, tensors)))
  try:
    _records._check_tree(paths)
  except _records._Bad as e:
    raise CheckpointError(f"The tensor names of {where!r} do not form a tree: {e}.") from None
  return _records.Manifest(0, 0.0, 0, {"format": "safetensors"}, meta, leaves)


class Reader:
  """Slices of the tensors of one safetensors checkpoint (leaf ``i`` is ``tensors[i]``)."""
  format = "safetensors"

  def __init__(self, kv: ts.KvStore, location: str, tensors: list[Tensor], prefix: str = ""):
    self.kv, self.location, self.tensors, self.prefix = kv, location, tensors, prefix
    self.shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # -> _Raw

  def slice_reader(self, rec: _records.Leaf):
    t = self.tensors[rec.index]
    return lambda index, batch=None: _Rows(self.kv, t, index, batch, self.shared)

  def read_bytes(self, rec: _records.Leaf, index) -> int:
    """What reading one slice holds in memory (for restore's read budget)."""
    t = self.tensors[rec.index]
    return raw_bytes(t.shape, index, _records.itemsize(t.dtype))

  def read_error(self, rec: _records.Leaf, e: Exception) -> CheckpointError:
    if isinstance(e, CheckpointError):
      return e
    from . import _paths
    t = self.tensors[rec.index]
    return CheckpointError(
        f"Cannot restore {rec.where} (tensor {t.name!r}) from {self.prefix + t.file!r}: reading "
        f"its bytes failed ({type(e).__name__}: {_paths.error_text(e)}). Check that the file "
        "is complete and readable.")


MAX_RUNS = 4096   # byte ranges per slice read
MIN_RUN = 64 << 10  # shorter ranges cost more in requests than reading whole rows does (slices
                    # of the same rows in one read window are then fetched once: ts.Batch)


def plan_runs(shape: Sequence[int], index: Sequence[tuple[int, int]], itemsize: int,
              max_runs: int = MAX_RUNS, min_run: int = MIN_RUN) -> tuple[int, list[int], int]:
  """How to read one slice of a C-order tensor: ``(k, starts, run)``, byte ranges
  ``[s, s + run)`` relative to the tensor's first byte, one per index of the slice's first
  ``k`` axes, each covering the slice's range of axis ``k`` and the whole of the axes after
  it. ``k`` is the last axis the slice does not cover whole, or an earlier one so that there
  are at most ``max_runs`` ranges of at least ``min_run`` bytes (then the ranges hold more
  than the slice).

  >>> plan_runs((4, 6), ((1, 3), (0, 6)), 1)    # whole rows: one range
  (0, [6], 12)
  >>> plan_runs((4, 6), ((0, 4), (2, 4)), 1, min_run=1)    # columns 2..3: a range per row
  (1, [2, 8, 14, 20], 2)
  >>> plan_runs((4, 6), ((0, 4), (2, 4)), 1, max_runs=2, min_run=1)  # too many: whole rows
  (0, [0], 24)
  >>> plan_runs((4, 6), ((0, 4), (2, 4)), 1)    # ranges too short: whole rows
  (0, [0], 24)
  """
  partial = [j for j, (lo, hi) in enumerate(index) if (lo, hi) != (0, shape[j])]
  k = partial[-1] if partial else 0
  if not shape:
    return 0, [0], itemsize
  strides = [math.prod(shape[j + 1:]) * itemsize for j in range(len(shape))]
  while k > 0 and (math.prod(hi - lo for lo, hi in index[:k]) > max_runs or
                   (index[k][1] - index[k][0]) * strides[k] < min_run):
    k -= 1
  starts = [index[k][0] * strides[k]]
  for j in range(k - 1, -1, -1):  # outer axes, C order
    lo, hi = index[j]
    starts = [i * strides[j] + s for i in range(lo, hi) for s in starts]
  return k, starts, (index[k][1] - index[k][0]) * strides[k]


def raw_bytes(shape: Sequence[int], index: Sequence[tuple[int, int]], itemsize: int) -> int:
  """Bytes :class:`_Rows` reads (and holds) for one slice."""
  _, starts, run = plan_runs(shape, index, itemsize)
  return len(starts) * run


class _Raw:
  """The byte ranges of one read, shared by every slice of a restore that needs the same ones
  (slices of the same rows, different columns): fetched and converted once."""

  def __init__(self, kv: ts.KvStore, t: Tensor, starts: list[int], run: int, batch):
    self.t, self.run, self.data = t, run, None
    self.futs = [_read(kv, t.file, slice(t.begin + s, t.begin + s + run), batch)
                 for s in starts] if run else []

  def bytes(self) -> bytes:
    if self.data is None:
      parts = []
      for f in self.futs:
        got = f.result()
        value = got.value if got.state == "value" else None  # (each .value is a new copy)
        if value is None or len(value) != self.run:
          raise CheckpointError(
              f"Tensor {self.t.name!r} of {self.t.file!r}: a byte range of {self.run} bytes "
              f"could not be read ({'missing' if value is None else len(value)} bytes came "
              "back); the file changed or is truncated. Check the file.")
        parts.append(value)
      self.data, self.futs = b"".join(parts), []
    return self.data


class _Rows:
  """One slice of a tensor being read: the byte ranges of :func:`plan_runs` (shared through
  ``shared`` with slices needing the same); ``result()`` gives the slice as a new, writable
  array."""

  def __init__(self, kv: ts.KvStore, t: Tensor, index, batch, shared):
    self.t, self.index = t, tuple(index)
    self.dtype = _records.np_dtype(t.dtype)
    self.k, starts, run = plan_runs(t.shape, self.index, self.dtype.itemsize)
    key = (t.file, t.begin, self.k, starts[0], len(starts), run, self.index[:self.k + 1])
    self.raw = shared.get(key)
    if self.raw is None:
      self.raw = shared[key] = _Raw(kv, t, starts, run, batch)

  def result(self) -> np.ndarray:
    k, shape, index = self.k, self.t.shape, self.index
    data = self.raw.bytes()
    if not shape:
      return np.frombuffer(data, dtype=self.dtype).reshape(()).copy()
    raw_shape = tuple(hi - lo for lo, hi in index[:k + 1]) + tuple(shape[k + 1:])
    raw = np.frombuffer(data, dtype=self.dtype).reshape(raw_shape)
    rest = tuple(slice(lo, hi) for lo, hi in index[k + 1:])
    return np.array(raw[(slice(None),) * (k + 1) + rest])  # own, writable


def open_file(kv: ts.KvStore, key: str, location: str, prefix: str = ""
              ) -> tuple[_records.Manifest, Reader]:
  """One ``.safetensors`` file (``key`` in the directory ``kv``)."""
  tensors, meta = read_tensors(kv, key, location)
  return _manifest(tensors, meta, location), Reader(kv, location, tensors, prefix)


def _open_files(kv: ts.KvStore, files: Sequence[str], prefix: str, where: str
                ) -> dict[str, list[Tensor]]:
  by_file, seen = {}, {}
  for f in files:
    by_file[f], _ = read_tensors(kv, f, prefix + f)
    for t in by_file[f]:
      if t.name in seen:
        raise CheckpointError(
            f"In {where!r}, tensor {t.name!r} is in both {seen[t.name]!r} and {f!r}. Keep one "
            "(or load the files separately).")
      seen[t.name] = f
  return by_file


def open_index(kv: ts.KvStore, key: str, prefix: str) -> tuple[_records.Manifest, Reader]:
  """A ``model.safetensors.index.json`` (``weight_map``: tensor name -> file) and its files.
  Every tensor the index names must be in its file, and every tensor of a file in the index."""
  where = prefix + key
  from ._orbax_in import read_bounded
  try:
    raw = read_bounded(kv, key, MAX_INDEX_BYTES)
  except ValueError as e:
    if "larger than" in str(e):
      raise _bad(where, f"the index: {e}") from None
    raise CheckpointError(f"Cannot read {where!r}: {e}") from None
  if raw is None:
    raise CheckpointError(f"No file at {where!r}. Check the path.")
  try:
    index = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise _bad(where, f"it is not JSON ({e})") from None
  wmap = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(wmap, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()):
    raise _bad(where, "its 'weight_map' must map tensor names to file names")
  for name, f in wmap.items():
    if not _FILE_NAME.fullmatch(f):
      raise _bad(where, f"tensor {name[:80]!r} is mapped to {f[:80]!r}, not a plain file "
                 "name in the index's directory")
  files = list(dict.fromkeys(wmap.values()))
  by_file = _open_files(kv, files, prefix, where)
  for f, tensors in by_file.items():
    for t in tensors:
      if wmap.get(t.name) != f:
        raise _bad(where, f"tensor {t.name!r} is in {f!r}, but the index maps it to "
                   f"{wmap.get(t.name)!r}")
  found = {t.name for ts_ in by_file.values() for t in ts_}
  for name, f in wmap.items():
    if name not in found:
      raise _bad(where, f"tensor {name!r} is mapped to {f!r}, which does not hold it")
  tensors = [t for f in files for t in by_file[f]]
  meta = index.get("metadata")
  return _manifest(tensors, meta, where), Reader(kv, where, tensors, prefix)


def open_dir(kv: ts.KvStore, files: Sequence[str], location: str
             ) -> tuple[_records.Manifest, Reader]:
  """A directory of ``.safetensors`` files without an index: every tensor of every file."""
  prefix = location.rstrip("/") + "/"
  by_file = _open_files(kv, sorted(files), prefix, location)
  tensors = [t for f in sorted(files) for t in by_file[f]]
  return _manifest(tensors, None, location), Reader(kv, location, tensors, prefix)
