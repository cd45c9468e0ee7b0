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

from .._errors import CheckpointError, NoCheckpointError
from .._format import parse as _parse
from .._format import records as _records
from .._io import paths as _paths
from .orbax import TooLarge, read_bounded

__all__ = [
  "DTYPES",
  "MAX_HEADER_BYTES",
  "Tensor",
  "parse_header",
  "key_paths",
  "open_file",
  "open_index",
  "open_dir",
  "INDEX_NAME",
]

# safetensors dtype name -> fnckpt's (numpy/ml_dtypes) name. The packed sub-byte types
# (F4, F6_E2M3, F6_E3M2) are refused: their element size is not a whole byte.
DTYPES = {
  "BOOL": "bool",
  "U8": "uint8",
  "I8": "int8",
  "U16": "uint16",
  "I16": "int16",
  "U32": "uint32",
  "I32": "int32",
  "U64": "uint64",
  "I64": "int64",
  "F16": "float16",
  "BF16": "bfloat16",
  "F32": "float32",
  "F64": "float64",
  "C64": "complex64",
  "F8_E4M3": "float8_e4m3fn",
  "F8_E5M2": "float8_e5m2",
  "F8_E4M3FNUZ": "float8_e4m3fnuz",
  "F8_E5M2FNUZ": "float8_e5m2fnuz",
  "F8_E8M0": "float8_e8m0fnu",
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_INDEX_BYTES = 64 << 20
MAX_TENSORS = 1 << 18  # per file, and per index: bounds what parsing a header holds
MAX_NAME = 4096
MAX_PARTS = 64  # '.'-separated parts of one tensor name
MAX_TOTAL_PARTS = 1 << 22  # parts of all the names of one checkpoint
INDEX_NAME = "model.safetensors.index.json"
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_SHARD_NAME = re.compile(r"(.+)-([0-9]{5})-of-([0-9]{5})\.safetensors")
_SEQ_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One validated header entry: ``[begin, end)`` are absolute byte offsets in ``file``."""

  name: str
  file: str
  dtype: str  # fnckpt's dtype name
  shape: tuple[int, ...]
  begin: int
  end: int


def _bad(file: str, what: str) -> CheckpointError:
  return CheckpointError(
    f"The safetensors file {file!r} is invalid: {what}. It cannot be read safely; check the "
    "tool that wrote it (or download it again)."
  )


def _bad_index(index: str, what: str) -> CheckpointError:
  return CheckpointError(
    f"The safetensors index {index!r} is invalid: {what}. Check the tool that wrote it (or "
    "download the checkpoint again)."
  )


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


def parse_header(header: bytes, file: str, key: str | None = None) -> tuple[list[Tensor], Any, int]:
  """The header's tensors (in buffer order), its ``__metadata__`` and the data length.
  ``file`` names the file in errors; ``key`` (default ``file``) is its key in the kvstore.

  >>> h = b'{"a.0":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}'
  >>> ts_, meta, n = parse_header(h, "m.safetensors")
  >>> ts_[0].dtype, ts_[0].begin, n
  ('bfloat16', 65, 4)
  """
  if header.count(b"{") > MAX_TENSORS + 2:  # (each tensor is a map; counted before parsing)
    raise _bad(file, f"its header holds more than {MAX_TENSORS} tensors (JSON maps)")
  try:
    text = header.decode("utf-8")
    raw = json.loads(text, object_pairs_hook=_no_duplicates)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise _bad(file, f"its header is not a JSON map ({e})") from None
  if not isinstance(raw, dict):
    raise _bad(file, "its header is not a JSON map")
  meta = raw.pop("__metadata__", None)
  if meta is not None and not (
    isinstance(meta, dict)
    and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
  ):
    raise _bad(file, "its '__metadata__' must map strings to strings")
  start = 8 + len(header)
  tensors = [_tensor(name, entry, file, start, key or file) for name, entry in raw.items()]
  tensors.sort(key=lambda t: (t.begin, t.end))
  at, prev = start, None
  for t in tensors:
    if t.begin != at:
      what = (
        f"its bytes [{t.begin - start}, {t.end - start}) overlap those of {prev.name!r}"
        if prev is not None and t.begin < at
        else f"its bytes start at {t.begin - start}, after a gap (the previous tensor ends "
        f"at {at - start})"
      )
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
    raise _bad(
      file,
      f"{where} has dtype {str(dtype)[:40]!r}, which fnckpt does not read "
      f"(known: {', '.join(DTYPES)})",
    )
  shape, size = entry["shape"], _records.itemsize(DTYPES[dtype])
  if (
    not (
      isinstance(shape, list)
      and len(shape) <= _records.MAX_DIMS
      and all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n * size < 1 << 62 for n in shape
      )
    )
    or math.prod(shape) * size >= 1 << 62
  ):
    raise _bad(
      file,
      f"{where} has shape {str(shape)[:60]}, expected a list of at most "
      f"{_records.MAX_DIMS} non-negative integers, each (and their product) times "
      f"the {size}-byte {dtype} under 2**62 bytes",
    )
  offsets = entry["data_offsets"]
  if not (
    isinstance(offsets, list)
    and len(offsets) == 2
    and all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o < 1 << 62 for o in offsets)
  ):
    raise _bad(file, f"{where} has data_offsets {str(offsets)[:60]}, expected [begin, end]")
  begin, end = offsets
  nbytes = math.prod(shape) * size
  if end - begin != nbytes:
    raise _bad(
      file,
      f"{where}: data_offsets {offsets} hold {end - begin} bytes, its dtype "
      f"{dtype} and shape {shape} need {nbytes}",
    )
  return Tensor(name, key, DTYPES[dtype], tuple(shape), start + begin, start + end)


def key_paths(names: Sequence[str], where: str) -> list[tuple[tuple[str, Any], ...]]:
  """Key paths of tensor names: split on ``.``; the parts under a node are sequence indices
  when they are exactly ``0..n-1`` (decimal, no leading zeros), dict keys otherwise.

  >>> key_paths(["h.0.w", "h.1.w", "h.x"], "f")[0]
  (('dict', 'h'), ('dict', '0'), ('dict', 'w'))
  >>> key_paths(["h.0.w", "h.1.w"], "f")[1]
  (('dict', 'h'), ('seq', 1), ('dict', 'w'))
  """
  ids: dict[tuple[int, str], int] = {}  # (parent node, part) -> node; the root is 0
  kids: dict[int, list[str]] = {}
  parts, parents, leaves, total = [], [], {}, 0
  for name in names:
    p = name.split(".")
    total += len(p)
    if len(p) > MAX_PARTS or total > MAX_TOTAL_PARTS:
      raise _bad(
        where,
        f"tensor {name[:80]!r} has more than {MAX_PARTS} name parts"
        if len(p) > MAX_PARTS
        else f"its tensor names have more than {MAX_TOTAL_PARTS} parts in all",
      )
    node, chain = 0, []
    for part in p:
      chain.append(node)
      child = ids.get((node, part))
      if child is None:
        child = ids[(node, part)] = len(ids) + 1
        kids.setdefault(node, []).append(part)
      node = child
    parts.append(p)
    parents.append(chain)
    leaves[node] = name
  for p, chain in zip(parts, parents):
    for i in range(1, len(p)):
      if chain[i] in leaves:
        raise CheckpointError(
          f"In {where!r}, tensor {leaves[chain[i]]!r} is also the parent of {'.'.join(p)!r} "
          "(names are split on '.' into key paths, and a leaf cannot have children). "
          "Rename one of them."
        )
  seq = {
    node
    for node, ks in kids.items()
    if all(_SEQ_INDEX.fullmatch(k) for k in ks)
    and sorted(int(k) for k in ks) == list(range(len(ks)))
  }
  return [
    tuple(("seq", int(k)) if chain[i] in seq else ("dict", k) for i, k in enumerate(p))
    for p, chain in zip(parts, parents)
  ]


# --- I/O ---------------------------------------------------------------------------------


def _read(kv: ts.KvStore, key: str, byte_range: slice | None = None, batch=None) -> ts.Future:
  return kv.read(key, byte_range=byte_range, batch=batch)


def _value(fut: ts.Future, location: str, what: str) -> bytes:
  try:
    got = fut.result()
  except ValueError as e:
    if _paths.status_code(e) == "OUT_OF_RANGE":  # the file is shorter than the range
      raise _bad(location, f"it ends inside {what}") from None
    raise CheckpointError(f"Cannot read {location!r} ({what}): {e}") from None
  except Exception as e:
    raise CheckpointError(
      f"Cannot read {location!r} ({what}): {_paths.error_text(e)}. Check "
      "that the file exists and is readable."
    ) from None
  if got.state != "value":
    raise NoCheckpointError(f"No file at {location!r} ({what}). Check the path.")
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
    if _paths.status_code(e) != "OUT_OF_RANGE":
      raise CheckpointError(f"Cannot read {location!r} (its last byte): {e}") from None
    last_ok = False
  if not last_ok:
    who = tensors[-1].name if tensors else "the header"
    raise _bad(location, f"it is truncated: {who!r} ends at byte {end}, past the end of the file")
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
    _records.Leaf(
      index=i,
      path=path,
      kind="array",
      dtype=t.dtype,
      shape=t.shape,
      source="numpy",
      sharding=None,
      stored=_records.Stored(t.file, t.shape, t.shape, None),
    )
    for i, (path, t) in enumerate(zip(paths, tensors))
  )
  try:
    _parse._check_tree(paths)
  except _parse._Bad as e:
    raise CheckpointError(f"The tensor names of {where!r} do not form a tree: {e}.") from None
  return _records.Manifest(0, 0.0, 0, {"format": "safetensors"}, meta, leaves)


class Reader:
  """Slices of the tensors of one safetensors checkpoint (leaf ``i`` is ``tensors[i]``)."""

  format = "safetensors"

  def __init__(self, kv: ts.KvStore, location: str, tensors: list[Tensor], prefix: str = ""):
    self.kv, self.location, self.tensors, self.prefix = kv, location, tensors, prefix
    self.shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # -> _Raw

  def slice_reader(self, rec: _records.Leaf):
    """Reads of one leaf's slices. Slices that need only some of the columns of whole-row
    reads join a :class:`_Group` of this leaf (one per row range, until it starts reading)."""
    t = self.tensors[rec.index]
    groups: dict[tuple[int, int], _Group] = {}

    def read(index, batch=None):
      index = tuple(tuple(r) for r in index)
      dtype = _records.np_dtype(t.dtype)
      if any(hi <= lo for lo, hi in index):  # nothing to read (an empty tensor's slices)
        return _Done(np.empty(tuple(hi - lo for lo, hi in index), dtype))
      if in_blocks(t.shape, index, dtype.itemsize):
        group = groups.get(index[0])
        if group is None or group.started:
          group = groups[index[0]] = _Group(self.kv, t, index[0])
        return group.add(index)
      return _Rows(self.kv, t, index, batch, self.shared)

    return read

  def read_bytes(self, rec: _records.Leaf, index) -> int:
    """What reading one slice holds in memory (for restore's read budget)."""
    t = self.tensors[rec.index]
    size = _records.itemsize(t.dtype)
    if any(hi <= lo for lo, hi in index):
      return 0
    if in_blocks(t.shape, index, size):  # the slice, and the blocks in flight
      return _layout_bytes(index, size) + 2 * block_rows(t.shape, size) * _row_bytes(t.shape, size)
    return raw_bytes(t.shape, index, size)

  def read_error(self, rec: _records.Leaf, e: Exception) -> CheckpointError:
    if isinstance(e, CheckpointError):
      return e
    t = self.tensors[rec.index]
    return CheckpointError(
      f"Cannot restore {rec.where} (tensor {t.name!r}) from {self.prefix + t.file!r}: reading "
      f"its bytes failed ({type(e).__name__}: {_paths.error_text(e)}). Check that the file "
      "is complete and readable."
    )


MAX_RUNS = 4096  # byte ranges per slice read
MIN_RUN = 64 << 10  # shorter ranges cost more in requests than reading whole rows does (slices
# of the same rows in one read window are then fetched once: ts.Batch)


def plan_runs(
  shape: Sequence[int],
  index: Sequence[tuple[int, int]],
  itemsize: int,
  max_runs: int = MAX_RUNS,
  min_run: int = MIN_RUN,
) -> tuple[int, list[int], int]:
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
  strides = [math.prod(shape[j + 1 :]) * itemsize for j in range(len(shape))]
  while k > 0 and (
    math.prod(hi - lo for lo, hi in index[:k]) > max_runs
    or (index[k][1] - index[k][0]) * strides[k] < min_run
  ):
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


BLOCK_BYTES = 1 << 20  # whole rows read at a time for slices of some columns (see _Group)


def _layout_bytes(index, itemsize: int) -> int:
  return math.prod(hi - lo for lo, hi in index) * itemsize


def _row_bytes(shape: Sequence[int], itemsize: int) -> int:
  return math.prod(shape[1:]) * itemsize


def block_rows(shape: Sequence[int], itemsize: int) -> int:
  """Rows per block of a :class:`_Group`: ``BLOCK_BYTES`` of them (at least one row).

  >>> block_rows((100000, 256), 4)
  1024
  """
  return max(1, min(shape[0], BLOCK_BYTES // max(1, _row_bytes(shape, itemsize))))


def in_blocks(shape: Sequence[int], index: Sequence[tuple[int, int]], itemsize: int) -> bool:
  """Whether a slice is read in blocks of whole rows (:class:`_Group`): :func:`plan_runs`
  reads whole rows of the first axis for it (too many or too short ranges otherwise), and it
  needs only some of their bytes.

  >>> in_blocks((8192, 256), ((0, 8192), (0, 32)), 4)     # 8192 pieces of 128 bytes
  True
  >>> in_blocks((8192, 256), ((0, 8), (0, 256)), 4)       # whole rows: one range
  False
  """
  if len(shape) < 2:
    return False
  k, starts, run = plan_runs(shape, index, itemsize)
  return k == 0 and len(starts) * run > _layout_bytes(index, itemsize)


def _check_bool(t: Tensor, out: np.ndarray) -> np.ndarray:
  """safetensors BOOL is one byte per element, 0 or 1: any other byte would be a numpy/JAX bool
  that compares and sums wrongly."""
  if out.dtype == np.bool_ and out.size and out.view(np.uint8).max() > 1:
    raise CheckpointError(
      f"Tensor {t.name!r} of {t.file!r} is BOOL but holds a byte other than 0 or 1 (bool "
      "bytes must be 0 or 1). The file is damaged or was not written by a safetensors "
      "writer; check the tool that wrote it."
    )
  return out


def _got(fut: ts.Future, t: Tensor, n: int) -> Any:
  try:
    got = fut.result()
  except ValueError as e:
    if _paths.status_code(e) != "OUT_OF_RANGE":
      raise
    got = None  # the file is shorter than it was when its header was read
  value = got.value if got is not None and got.state == "value" else None  # (a new copy)
  if value is None or len(value) != n:
    raise CheckpointError(
      f"Tensor {t.name!r} of {t.file!r}: a byte range of {n} bytes could not be read "
      f"({'nothing' if value is None else f'{len(value)} bytes'} came back); the file "
      "changed or is truncated. Check the file."
    )
  return value


class _Done:
  """A slice already known (empty): ``result()`` gives it."""

  def __init__(self, value: np.ndarray):
    self.value = value

  def result(self) -> np.ndarray:
    return self.value


class _Raw:
  """The byte ranges of one read, shared by every slice of a restore that needs the same ones
  (slices of the same rows, different columns): fetched and converted once, each range copied
  into one buffer as it is taken (no second copy of the whole)."""

  def __init__(self, kv: ts.KvStore, t: Tensor, starts: list[int], run: int, batch):
    self.t, self.run = t, run
    self.data: bytearray | None = None
    self.futs: list[ts.Future | None] = (
      [_read(kv, t.file, slice(t.begin + s, t.begin + s + run), batch) for s in starts]
      if run
      else []
    )

  def bytes(self) -> bytearray:
    if self.data is None:
      data = bytearray(len(self.futs) * self.run)
      for i, f in enumerate(self.futs):
        assert f is not None
        data[i * self.run : (i + 1) * self.run] = _got(f, self.t, self.run)
        self.futs[i] = None
      self.data, self.futs = data, []
    return self.data


class _Rows:
  """One slice of a tensor being read: the byte ranges of :func:`plan_runs` (shared through
  ``shared`` with slices needing the same); ``result()`` gives the slice as a new, writable
  array."""

  def __init__(self, kv: ts.KvStore, t: Tensor, index, batch, shared):
    self.t, self.index = t, tuple(index)
    self.dtype = _records.np_dtype(t.dtype)
    self.k, starts, run = plan_runs(t.shape, self.index, self.dtype.itemsize)
    key = (t.file, t.begin, self.k, starts[0], len(starts), run, self.index[: self.k + 1])
    self.raw = shared.get(key)
    if self.raw is None:
      self.raw = shared[key] = _Raw(kv, t, starts, run, batch)

  def result(self) -> np.ndarray:
    k, shape, index = self.k, self.t.shape, self.index
    data = self.raw.bytes()
    if not shape:
      return _check_bool(self.t, np.frombuffer(data, dtype=self.dtype).reshape(()).copy())
    raw_shape = tuple(hi - lo for lo, hi in index[: k + 1]) + tuple(shape[k + 1 :])
    raw = np.frombuffer(data, dtype=self.dtype).reshape(raw_shape)
    rest = tuple(slice(lo, hi) for lo, hi in index[k + 1 :])
    return _check_bool(self.t, np.array(raw[(slice(None),) * (k + 1) + rest]))  # own


class _Group:
  """Slices of one tensor over the same rows, each needing only some of the columns (too
  many, too short ranges to read them alone): read together when the first is asked for, in
  blocks of :func:`block_rows` whole rows (one byte range each, the next one in flight), each
  block read once and its columns copied into every member's array. Host memory: the
  members' arrays (each charged to the read budget by its own slice) and two blocks."""

  def __init__(self, kv: ts.KvStore, t: Tensor, rows: tuple[int, int]):
    self.kv, self.t, self.rows = kv, t, rows
    self.members: list[_Member] = []
    self.started = False
    self.error: Exception | None = None

  def add(self, index) -> _Member:
    member = _Member(self, index)
    self.members.append(member)
    return member

  def _block(self, lo: int, hi: int) -> ts.Future:
    row = _row_bytes(self.t.shape, _records.itemsize(self.t.dtype))
    begin = self.t.begin + lo * row
    return _read(self.kv, self.t.file, slice(begin, begin + (hi - lo) * row))

  def run(self) -> None:
    self.started = True
    t, (lo, hi) = self.t, self.rows
    dtype = _records.np_dtype(t.dtype)
    step, row = block_rows(t.shape, dtype.itemsize), _row_bytes(t.shape, dtype.itemsize)
    outs = [np.empty(tuple(b - a for a, b in m.index), dtype) for m in self.members]
    cols = [tuple(slice(a, b) for a, b in m.index[1:]) for m in self.members]
    nxt: ts.Future | None = self._block(lo, min(hi, lo + step))
    for r in range(lo, hi, step):
      end = min(hi, r + step)
      fut, nxt = nxt, self._block(end, min(hi, end + step)) if end < hi else None
      assert fut is not None
      block = np.frombuffer(_got(fut, t, (end - r) * row), dtype).reshape(
        (end - r,) + tuple(t.shape[1:])
      )
      for out, c in zip(outs, cols):
        out[r - lo : end - lo] = block[(slice(None),) + c]
      del block
    for m, out in zip(self.members, outs):
      m.value = _check_bool(t, out)


class _Member:
  """One slice of a :class:`_Group`: ``result()`` reads the group (once) and gives its array."""

  def __init__(self, group: _Group, index):
    self.group, self.index = group, index
    self.value: np.ndarray | None = None

  def result(self) -> np.ndarray | None:
    g = self.group
    if self.value is None:
      if g.error is None and not g.started:
        try:
          g.run()
        except Exception as e:
          g.error = e
      if g.error is not None:
        raise g.error
    value, self.value = self.value, None
    return value


def open_file(
  kv: ts.KvStore, key: str, location: str, prefix: str = ""
) -> tuple[_records.Manifest, Reader]:
  """One ``.safetensors`` file (``key`` in the directory ``kv``)."""
  tensors, meta = read_tensors(kv, key, location)
  return _manifest(tensors, meta, location), Reader(kv, location, tensors, prefix)


def _open_files(
  kv: ts.KvStore, files: Sequence[str], prefix: str, where: str, wmap: dict[str, str] | None = None
) -> dict[str, list[Tensor]]:
  by_file: dict[str, list[Tensor]] = {}
  seen: dict[str, str] = {}
  for f in files:
    try:
      by_file[f], _ = read_tensors(kv, f, prefix + f)
    except NoCheckpointError:
      if wmap is None:
        raise
      name = next(n for n, g in wmap.items() if g == f)
      raise CheckpointError(
        f"The safetensors index {where!r} maps tensor {name!r} to {f!r}, but there is no "
        f"file {prefix + f!r}. Download the missing file (or use the index that came with "
        "these files)."
      ) from None
    for t in by_file[f]:
      if t.name in seen:
        raise CheckpointError(
          f"In {where!r}, tensor {t.name!r} is in both {seen[t.name]!r} and {f!r}. Keep one "
          "(or load the files separately)."
        )
      seen[t.name] = f
  return by_file


def _read_index(kv: ts.KvStore, key: str, where: str) -> dict[str, Any]:
  """The index's JSON, its ``weight_map`` checked (names to plain file names, every shard
  ``*-NNNNN-of-MMMMM.safetensors`` of a set in it)."""
  try:
    raw = read_bounded(kv, key, MAX_INDEX_BYTES)
  except TooLarge as e:
    raise _bad_index(where, f"the index: {e}") from None
  except ValueError as e:
    raise CheckpointError(f"Cannot read the safetensors index {where!r}: {e}") from None
  if raw is None:
    raise NoCheckpointError(f"No file at {where!r}. Check the path.")
  try:
    index = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
  except (UnicodeDecodeError, ValueError, RecursionError) as e:
    raise _bad_index(where, f"it is not JSON ({e})") from None
  wmap = index.get("weight_map") if isinstance(index, dict) else None
  if not isinstance(wmap, dict) or not all(
    isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
  ):
    raise _bad_index(where, "its 'weight_map' must map tensor names to file names")
  if not 0 < len(wmap) <= MAX_TENSORS * 16:
    raise _bad_index(
      where, f"its 'weight_map' maps {len(wmap)} tensors, expected 1 to {MAX_TENSORS * 16}"
    )
  for name, f in wmap.items():
    if not _FILE_NAME.fullmatch(f):
      raise _bad_index(
        where,
        f"tensor {name[:80]!r} is mapped to {f[:80]!r}, not a plain "
        "file name in the index's directory",
      )
  files = set(wmap.values())
  for f in files:
    m = _SHARD_NAME.fullmatch(f)
    total = int(m.group(3)) if m else 0
    for i in range(1, total + 1):
      assert m is not None
      shard = f"{m.group(1)}-{i:05d}-of-{m.group(3)}.safetensors"
      if shard not in files:
        raise _bad_index(
          where,
          f"it maps no tensor to {shard!r}, one of the {total} files "
          f"{m.group(1)}-*-of-{m.group(3)}.safetensors (the tensors of a file "
          "it omits would be missing)",
        )
  return index


def open_index(kv: ts.KvStore, key: str, prefix: str) -> tuple[_records.Manifest, Reader]:
  """A ``model.safetensors.index.json`` (``weight_map``: tensor name -> file) and its files.
  Every tensor the index names must be in its file, and every tensor of a file in the index."""
  where = prefix + key
  index = _read_index(kv, key, where)
  wmap = index["weight_map"]
  files = list(dict.fromkeys(wmap.values()))
  by_file = _open_files(kv, files, prefix, where, wmap)
  for f, tensors in by_file.items():
    for t in tensors:
      if wmap.get(t.name) != f:
        raise _bad_index(
          where, f"tensor {t.name!r} is in {f!r}, but the index maps it to {wmap.get(t.name)!r}"
        )
  found = {t.name for ts_ in by_file.values() for t in ts_}
  for name, f in wmap.items():
    if name not in found:
      raise _bad_index(where, f"tensor {name!r} is mapped to {f!r}, which does not hold it")
  tensors = [t for f in files for t in by_file[f]]
  meta = index.get("metadata")
  return _manifest(tensors, meta, where), Reader(kv, where, tensors, prefix)


def open_dir(
  kv: ts.KvStore, files: Sequence[str], location: str
) -> tuple[_records.Manifest, Reader]:
  """A directory of ``.safetensors`` files without an index: every tensor of every file."""
  prefix = location.rstrip("/") + "/"
  by_file = _open_files(kv, sorted(files), prefix, location)
  tensors = [t for f in sorted(files) for t in by_file[f]]
  return _manifest(tensors, None, location), Reader(kv, location, tensors, prefix)
