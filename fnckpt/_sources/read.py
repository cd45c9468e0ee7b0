"""One reader of stored bytes: restore, export, verify and diff read leaves through it.

:class:`Opener` opens any leaf's stored bytes, whatever holds them (inline in the manifest, a
byte range of a pack, pieces in the writers' packs, a zarr3 array of its own, any of those in
the checkpoint a reference names, or an Orbax or safetensors source), once per operation and
without I/O, as a :class:`StoredLeaf`; :func:`read_regions` reads :class:`Region` s of them
under one byte :class:`Window` (reads in flight join a ``ts.Batch``, so a chunk file several
regions need is fetched once) and hands out :class:`Landed` arrays in order.
:func:`leaf_error` says why a read failed as restore reports it, :func:`base_of` and
:func:`data_location` where a leaf's bytes are, :func:`check_memory` refuses a read larger
than this machine's memory. What to read (the regions) and what a read costs stay the
callers': restore reads the slices its devices need, export C-order blocks, verify every chunk
once, diff the same blocks of two checkpoints.

>>> import numpy as np, fnckpt, tempfile
>>> from fnckpt._sources import read, source
>>> d = tempfile.mkdtemp()
>>> _ = fnckpt.save({"w": np.arange(12.0).reshape(3, 4)}, f"{d}/c", inline_bytes=0,
...                 pack_bytes=0).wait()
>>> src = source.open_source(f"{d}/c")
>>> leaf = read.Opener(src).leaf(src.manifest.leaves[0])
>>> leaf.kind, leaf.shape
('stored', (3, 4))
>>> regions = [read.Region(leaf, ((0, 2), (0, 4)), 64), read.Region(leaf, ((2, 3), (0, 4)), 32)]
>>> [float(got.data.sum()) for got in read.read_regions(regions, read.Window(128))]
[28.0, 38.0]
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import posixpath
from typing import Any, Callable, Iterable, Iterator, cast

import numpy as np
import tensorstore as ts

from .. import _state
from .._errors import CheckpointError, DamagedError
from .._format import hashes as _hashes
from .._format import leaves as _leaves
from .._format import records as _records
from .._format import refs as _refs
from .._format import runs as _runs
from .._io import arrays as _arrays
from .._io import commit as _commit
from .._io import paths as _paths
from .._layout import blocks as _blocks
from .._layout import chunks as _chunks
from . import piece_reads as _piece_reads
from .source import Source

__all__ = [
  "Window",
  "Region",
  "Landed",
  "StoredLeaf",
  "PackRun",
  "Opener",
  "read_regions",
  "pack_runs",
  "run_of",
  "leaf_error",
  "base_of",
  "data_location",
  "check_memory",
]

Index = _chunks.Index


@dataclasses.dataclass
class Window:
  """The byte window of one read: at most ``limit`` bytes held (charged: reads in flight, and
  landed ones the caller has not released), one read alone when it does not fit. ``drain``:
  called when nothing is in flight and what the caller keeps leaves no room for the next
  read; it releases what it can (restore places the slices it holds). ``idle``: called when
  the oldest read in flight has not landed yet, before waiting for it (restore places what
  needs no read meanwhile). ``peak``, ``largest``
  and ``reads``: the most held at once, the largest single charge, the reads started."""

  limit: int
  drain: Callable[[], None] | None = None
  idle: Callable[[], None] | None = None
  held: int = 0
  peak: int = 0
  largest: int = 0
  reads: int = 0

  def release(self, n: int) -> None:
    """``n`` charged bytes are free again."""
    self.held -= n


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
  """Elements ``index`` of ``leaf`` to read, charged ``cost`` bytes (the caller's rule);
  ``tag`` is the caller's, handed back with the data. Regions of one leaf in one call are
  disjoint."""

  leaf: StoredLeaf
  index: Index
  cost: int
  tag: Any = None


@dataclasses.dataclass(slots=True)
class Landed:
  """A region read: ``data`` in the saved dtype, C-contiguous, writable and nobody else's;
  or, with ``errors="yield"``, ``data`` None and the raw ``error``. ``next_landed``: whether
  the next read in flight has landed too (restore places what landed while it has not)."""

  region: Region
  data: np.ndarray | None
  error: BaseException | None
  next_landed: bool


# --- the stored leaves, one class per storage kind -------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class StoredLeaf:
  """One leaf's stored bytes opened for reading (by :class:`Opener`), or a whole pack
  (``rec`` None). ``kind``: inline, packed, pieces, stored, foreign or pack; ``dtype``: of
  what a read gives (the saved one; uint8 for a pack); ``align``: the inner chunk shape
  regions are best aligned to (None: any); ``where``: its storage location, for messages."""

  src: Source
  rec: _records.Leaf | None
  kind: str
  shape: tuple[int, ...]
  dtype: np.dtype
  align: tuple[int, ...] | None
  where: str

  @property
  def name(self) -> str:
    """The leaf's key path, or the pack's location."""
    return self.rec.where if self.rec is not None else self.where

  def start(self, index: Index, batch: ts.Batch | None) -> Any:
    """Start reading ``index`` (joining ``batch`` where it can): a pending read, with
    ``result()`` and ``done()``."""
    raise NotImplementedError

  def finish(self, raw: Any, index: Index) -> np.ndarray:
    """A read's result as :class:`Landed` data (the saved dtype, bool bytes checked)."""
    return raw

  def cost(self, index: Index) -> int:
    """Bytes one read of ``index`` holds: its own (a foreign reader may hold more)."""
    return _chunks.nbytes([b - a for a, b in index], self.dtype.itemsize)

  def error(self, e: BaseException) -> CheckpointError:
    """Why a read failed (:func:`leaf_error`; a CheckpointError passes unchanged)."""
    if self.rec is None and not isinstance(e, CheckpointError):  # a pack
      return CheckpointError(
        f"Cannot read the pack at {self.where!r} ({type(e).__name__}: {_paths.error_text(e)})."
      )
    # (rec None: a pack's CheckpointError, which leaf_error passes on unchanged)
    return leaf_error(self.src, cast(_records.Leaf, self.rec), e)


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _Inline(StoredLeaf):
  decoded: list = dataclasses.field(default_factory=list)  # [the value], once a block is read

  def start(self, index: Index, batch: ts.Batch | None) -> _Done:
    assert self.rec is not None
    if index == tuple((0, n) for n in self.shape):
      return _Done(_leaves.inline_array(self.rec))  # a fresh copy, bools checked
    if not self.decoded:
      self.decoded.append(_leaves.inline_array(self.rec))
    return _Done(np.array(self.decoded[0][_box(index)]))


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _Packed(StoredLeaf):
  pack: ts.TensorStore
  offset: int = 0
  digest: bytes | None = None  # checked when the whole leaf is read (format 3)

  @property
  def nbytes(self) -> int:
    """Its bytes in the pack."""
    assert self.rec is not None and self.rec.packed is not None
    return self.rec.packed.nbytes

  def start(self, index: Index, batch: ts.Batch | None) -> ts.Future:
    assert self.rec is not None and self.rec.packed is not None
    size = self.dtype.itemsize
    if index == tuple((0, n) for n in self.shape):  # (restore's: the whole leaf)
      lo, hi = self.offset, self.offset + self.rec.packed.nbytes
    elif _contiguous(index, self.shape):
      lo = self.offset + _blocks.start(index, self.shape) * size
      hi = lo + math.prod(b - a for a, b in index) * size
    else:
      raise ValueError(f"{index} is not one C-order range of {self.shape}")
    return _arrays.read_slice(self.pack, ((lo, hi),), batch)  # (a module attribute: tests
    # patch it)

  def finish(self, raw: np.ndarray, index: Index) -> np.ndarray:
    if (
      self.digest is not None
      and index == tuple((0, n) for n in self.shape)
      and _hashes.array_digest(raw) != self.digest
    ):
      raise hash_damage(self, "its data")
    assert self.rec is not None
    return _leaves.checked_bools(_as_leaf(raw, self.dtype, [b - a for a, b in index]), self.rec)


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class PackRun(StoredLeaf):
  """Whole packed leaves lying one after another in one pack (:func:`pack_runs`), read as one
  byte range ``[lo, lo + shape[0])``: one TensorStore read instead of one per leaf, straight
  into an aligned buffer of ours (``_arrays.read_into``). ``finish`` gives each leaf's array,
  in order, its hash and bool bytes checked as :class:`_Packed` does: disjoint views of that
  one buffer (a caller that hands them out to a host result copies them; CPU devices adopt
  those that start 64-byte aligned without a copy: the mixed state's 999 packed leaves, all
  multiples of 4 KiB laid one after another, were 999 copies into fresh memory, 74 MB,
  out of TensorStore's unaligned result). The read joins the batch: a chunk file's index,
  and an inner chunk two runs share, are read once.
  ``rec``: the first leaf's record; a failed read is named as the leaves read one by one
  would name it (:meth:`error`)."""

  leaves: tuple[_Packed, ...] = ()  # the _Packed leaves
  lo: int = 0

  def start(self, index: Index, batch: ts.Batch | None) -> _arrays.Landing:
    ((a, b),) = index
    return _arrays.read_into(self.leaves[0].pack, ((self.lo + a, self.lo + b),), batch)

  def finish(self, raw: np.ndarray, index: Index) -> list[np.ndarray]:  # type: ignore[override]
    if not (raw.flags.c_contiguous and raw.flags.writeable):
      raw = np.array(raw)
    return [
      leaf.finish(raw[leaf.offset - self.lo :][: leaf.nbytes], tuple((0, n) for n in leaf.shape))
      for leaf in self.leaves
    ]

  def error(self, e: BaseException) -> CheckpointError:
    """The error of the first leaf whose own read fails (else the first leaf's, for ``e``)."""
    if isinstance(e, CheckpointError):
      return e
    for leaf in self.leaves:
      whole = tuple((0, n) for n in leaf.shape)
      try:
        leaf.finish(leaf.start(whole, None).result(), whole)
      except Exception as own:
        return leaf.error(own)
    return leaf_error(self.src, cast(_records.Leaf, self.rec), e)


def pack_runs(leaves: list[Any], limit: int, gap: int = 4096) -> list[list[int]]:
  """Positions in ``leaves`` (whole packed leaves, :class:`_Packed`) grouped into runs to read
  as one :class:`PackRun`: consecutive leaves of one pack, each starting at most ``gap``
  bytes after the previous one ends, a run's bytes at most ``limit`` (a larger leaf alone).

  >>> from types import SimpleNamespace as N
  >>> def leaf(offset, n, pack="p"):
  ...   return N(offset=offset, pack=pack, rec=N(packed=N(nbytes=n)))
  >>> pack_runs([leaf(0, 8), leaf(8, 8), leaf(64, 8), leaf(72, 8, "q"), leaf(80, 8, "q")], 16, 8)
  [[0, 1], [2], [3, 4]]
  """
  runs: list[list[int]] = []
  for k, leaf in enumerate(leaves):
    if runs:
      prev, start = leaves[runs[-1][-1]], leaves[runs[-1][0]].offset
      end = prev.offset + prev.rec.packed.nbytes
      if (
        leaf.pack is prev.pack
        and end <= leaf.offset <= end + gap
        and leaf.offset + leaf.rec.packed.nbytes - start <= limit
      ):
        runs[-1].append(k)
        continue
    runs.append([k])
  return runs


def run_of(leaves: list[Any]) -> PackRun:
  """The :class:`PackRun` reading ``leaves`` (a run of :func:`pack_runs`, two or more)."""
  first, lo = leaves[0], leaves[0].offset
  hi = leaves[-1].offset + leaves[-1].nbytes
  return PackRun(
    src=first.src,
    rec=first.rec,
    kind="packrun",
    shape=(hi - lo,),
    dtype=np.dtype(np.uint8),
    align=None,
    where=first.where,
    leaves=tuple(leaves),
    lo=lo,
  )


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _Pieced(StoredLeaf):
  reader: _piece_reads.SliceReader

  def start(self, index: Index, batch: ts.Batch | None) -> Any:
    return self.reader(index, batch)  # aligned, bools checked


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _Stored(StoredLeaf):
  array: ts.TensorStore
  chunks: tuple[int, ...] = ()

  def start(self, index: Index, batch: ts.Batch | None) -> Any:
    """A slice of whole stored chunks (no other slice reads their files) straight into an
    aligned array of ours; any other through the batch (which reads a chunk file's index
    and an inner chunk that several slices need once, in one request per file)."""
    if _arrays.on_grid(index, self.chunks, self.shape):
      return _arrays.read_into(self.array, index)
    return _arrays.read_slice(self.array, index, batch)

  def finish(self, raw: np.ndarray, index: Index) -> np.ndarray:
    assert self.rec is not None and self.rec.dtype is not None
    return _arrays.from_storage(raw, self.rec.dtype)


def hash_damage(leaf: StoredLeaf, what: str) -> DamagedError:
  """The damage a read whose bytes do not hash to the recorded hash reports: restore raises
  it as it does missing data (a self-healing restore falls back to an earlier step)."""
  src = leaf.src
  return DamagedError(
    f"Cannot restore {leaf.name} from {leaf.where!r}: {what} does not match its recorded "
    f"content hash ({src.manifest.hash}): the data was changed after it was saved. The "
    f"checkpoint is damaged; restore an earlier one (fnckpt verify {src.location} lists "
    "every damaged leaf)."
  )


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _Foreign(StoredLeaf):
  reader: Any = None  # the source's reader (``read_bytes``)
  slices: Any = None  # its slice_reader of this leaf, made once (it groups slices)

  def start(self, index: Index, batch: ts.Batch | None) -> Any:
    return self.slices(index, batch)

  def finish(self, raw: np.ndarray, index: Index) -> np.ndarray:
    assert self.rec is not None and self.rec.dtype is not None
    return _arrays.from_storage(raw, self.rec.dtype)

  def cost(self, index: Index) -> int:
    return max(StoredLeaf.cost(self, index), self.reader.read_bytes(self.rec, index))


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class _Pack(StoredLeaf):
  array: ts.TensorStore

  def start(self, index: Index, batch: ts.Batch | None) -> ts.Future:
    return _arrays.read_slice(self.array, index, batch)


class Opener:
  """Opens leaves' stored bytes for one operation: each pack once, no I/O (the manifest says
  everything) unless ``check_metadata`` (verify: each array's zarr.json is read and compared
  with the manifest). An open error is :func:`leaf_error`'s, or raw with ``check_metadata``
  (verify words it itself). With ``check_hashes`` (and format 3's hashes), every read of a
  whole packed leaf or of a writer's whole run of pieces is checked against its recorded hash
  in the thread that finishes it (:func:`hash_damage`). Stored chunks are not: their data is
  most of a large state's bytes, and hashing them cost 5.2% of a restore of the bench's
  transformer state (``bench/restore_hashes.py``); their crc32c checksums are checked on every
  read, and ``fnckpt verify`` checks their hashes."""

  def __init__(self, src: Source, *, check_metadata: bool = False, check_hashes: bool = True):
    self.src, self.check = src, check_metadata
    self.hashes = (
      check_hashes
      and _state.hooks.check_hashes
      and src.reader is None
      and getattr(src.manifest, "hash", None) is not None
    )
    self._packs: dict[int, ts.TensorStore] = {}

  def leaf(self, rec: _records.Leaf) -> StoredLeaf:
    """Array leaf ``rec``'s stored bytes."""
    try:
      return self._open(rec)
    except Exception as e:
      if self.check:
        raise
      raise leaf_error(self.src, rec, e) from None

  def pack(self, k: int) -> StoredLeaf:
    """Pack ``k`` whole, as a 1-D uint8 array (what verify reads)."""
    p = self.src.manifest.packs[k]
    return _Pack(
      src=self.src,
      rec=None,
      kind="pack",
      shape=(p.nbytes,),
      dtype=np.dtype(np.uint8),
      align=(p.inner,),
      where=data_location(self.src, p.base, p.dir),
      array=self._pack(k),
    )

  def _open(self, rec: _records.Leaf) -> StoredLeaf:
    src = self.src
    head = (src, rec)
    assert rec.shape is not None and rec.dtype is not None  # an array leaf
    shape, dtype = tuple(rec.shape), _leaves.dtype_of(rec.dtype)
    if rec.inline is not None:
      return _Inline(*head, "inline", shape, dtype, None, src.location)
    if src.reader is not None:  # Orbax, safetensors
      return _Foreign(
        *head,
        "foreign",
        shape,
        dtype,
        None,
        src.location,
        reader=src.reader,
        slices=src.reader.slice_reader(rec),
      )
    manifest = src.manifest
    if rec.packed is not None:
      p = manifest.packs[rec.packed.pack]
      return _Packed(
        *head,
        "packed",
        shape,
        dtype,
        None,
        data_location(src, p.base, p.dir),
        pack=self._pack(rec.packed.pack),
        offset=rec.packed.offset,
        digest=rec.hash if self.hashes else None,
      )
    if rec.pieces is not None:
      where = _stored_at(src, rec)[1]
      damaged = None
      if self.hashes:

        def damaged(what: str, rec=rec, where=where) -> DamagedError:
          return hash_damage(
            StoredLeaf(
              src=src, rec=rec, kind="pieces", shape=shape, dtype=dtype, align=None, where=where
            ),
            what,
          )

      return _Pieced(
        *head,
        "pieces",
        shape,
        dtype,
        tuple(rec.pieces.chunks),
        where,
        reader=_piece_reads.SliceReader(manifest, rec, self._pack, damaged),
      )
    st = rec.stored
    assert st is not None
    array = self._array(_arrays.zarr_spec(self._kv(st.base), st, rec.dtype, rec.shape))
    return _Stored(
      *head,
      "stored",
      shape,
      dtype,
      tuple(st.inner),
      data_location(src, st.base, st.dir),
      array=array,
      chunks=tuple(st.chunks),
    )

  def _pack(self, k: int) -> ts.TensorStore:
    if k not in self._packs:
      p = self.src.manifest.packs[k]
      self._packs[k] = self._array(
        _arrays.pack_spec(self._kv(p.base), p.dir, p.nbytes, p.chunk, p.inner)
      )
    return self._packs[k]

  def _kv(self, base: int | None) -> dict[str, Any]:
    """The kvstore of the checkpoint holding data whose record names ``base``."""
    return _refs.base_spec(self.src.kv_spec, self.src.manifest, base, self.src.location)

  def _array(self, spec: dict[str, Any]) -> ts.TensorStore:
    if not self.check:
      return _arrays.open_array(spec, self.src.ctx, mode="read").result()
    return ts.open(
      {**spec, "fill_missing_data_reads": False}, read=True, open=True, context=self.src.ctx
    ).result()


# --- the window loop -------------------------------------------------------------------------


def read_regions(
  regions: Iterable[Region], window: Window, *, errors: str = "raise", release: bool = True
) -> Iterator[Landed]:
  """Read ``regions`` in order, at most ``window.limit`` bytes held (a read larger than that
  alone), and hand each out as it lands, in order. The first reads join a ``ts.Batch`` until it
  holds half the window (a chunk file's index and the inner chunks several regions need are
  fetched once, in one request per file); after that, the reads started while one was handed
  out go out together as the next one is awaited, so storage always has the window's worth in
  flight (closing batches only at half a window left them waiting: the bench transformer
  restored onto another mesh, cold, took 14% longer). ``release``: a landed read's charge is
  freed when the caller asks
  for the next one (else the caller frees it: ``window.release``). ``errors="raise"``: a
  failed read raises ``leaf.error`` (:func:`leaf_error`); ``"yield"``: it is handed out as
  ``Landed.error``, raw. A read larger than this machine's memory is refused before any
  is started (:func:`check_memory`).

  >>> import numpy as np, fnckpt, tempfile
  >>> from fnckpt._sources import source
  >>> d = tempfile.mkdtemp()
  >>> _ = fnckpt.save({"b": np.arange(6, dtype=np.int8)}, f"{d}/c", inline_bytes=0).wait()
  >>> src = source.open_source(f"{d}/c")
  >>> leaf = Opener(src).leaf(src.manifest.leaves[0])
  >>> w = Window(4)
  >>> [(got.region.tag, got.data.tolist()) for got in read_regions(
  ...     [Region(leaf, ((a, a + 2),), 2, tag=a) for a in (0, 2, 4)], w)]
  [(0, [0, 1]), (2, [2, 3]), (4, [4, 5])]
  >>> leaf.kind, w.peak, w.reads, w.held
  ('packed', 4, 3, 0)
  """
  if errors not in ("raise", "yield"):
    raise ValueError(f"errors={errors!r}: expected 'raise' or 'yield'")
  f = _Flight(window)
  try:
    for r in regions:
      check_memory(r.cost, r.leaf)
      while f.pending and window.held + r.cost > window.limit:  # strict: a window equal to
        yield from f.land(errors, release)  # the charges fits them all
      if window.held + r.cost > window.limit and window.drain is not None:
        window.drain()
      f.start(r)
    while f.pending:
      yield from f.land(errors, release)
  finally:
    f.submit()  # an abandoned loop never leaves reads unsubmitted


class _Flight:
  """The reads in flight of one :func:`read_regions`, oldest first, and the open batch."""

  def __init__(self, window: Window):
    self.window = window
    self.pending: collections.deque = collections.deque()  # (region, pending read)
    self.batch: ts.Batch | None = None
    self.batched = 0

  def start(self, r: Region) -> None:
    w = self.window
    if self.batch is None:
      self.batch = ts.Batch()
    try:
      fut = r.leaf.start(r.index, self.batch)
    except Exception as e:  # refused at once (a bad reference, an invalid region)
      fut = _Failed(e)
    self.pending.append((r, fut))
    w.held += r.cost
    w.peak, w.largest, w.reads = max(w.peak, w.held), max(w.largest, r.cost), w.reads + 1
    self.batched += r.cost
    if 2 * self.batched >= w.limit:
      self.submit()

  def submit(self) -> None:
    if self.batch is not None:
      self.batch.submit()
      self.batch, self.batched = None, 0

  def land(self, errors: str, release: bool) -> Iterator[Landed]:
    """Wait for the oldest read and hand it out (its charge released when the caller asks
    for the next one, with ``release``)."""
    r, fut = self.pending.popleft()
    self.submit()  # the reads started since the last one landed go out now, not later
    if self.window.idle is not None and not _ready(fut):
      self.window.idle()
    try:
      data, error = r.leaf.finish(fut.result(), r.index), None
    except Exception as e:
      if errors == "raise":
        raise r.leaf.error(e) from None
      data, error = None, e
    yield Landed(r, data, error, bool(self.pending) and _ready(self.pending[0][1]))
    if release:
      self.window.release(r.cost)


def _ready(fut: Any) -> bool:
  """Whether a read has landed (foreign readers' reads may not say: taken as landed)."""
  done = getattr(fut, "done", None)
  return done() if done is not None else True


class _Done:
  """A read that needed no I/O."""

  def __init__(self, value: np.ndarray):
    self.value = value

  def done(self) -> bool:
    return True

  def result(self) -> np.ndarray:
    return self.value


class _Failed:
  """A read refused when it was started: its error, raised when it is waited on."""

  def __init__(self, error: BaseException):
    self.error = error

  def done(self) -> bool:
    return True

  def result(self) -> Any:
    raise self.error


def _box(index: Index) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in index)


def _contiguous(index: Index, shape: tuple[int, ...]) -> bool:
  """Whether ``index`` is one C-order range of an array of ``shape``: single indices, then
  one range, then whole dimensions.

  >>> _contiguous(((1, 2), (0, 3), (0, 4)), (2, 3, 4)), _contiguous(((0, 2), (1, 3)), (2, 3))
  (True, False)
  """
  d = 0
  while d < len(index) and index[d][1] - index[d][0] == 1:
    d += 1
  return all(index[e] == (0, shape[e]) for e in range(d + 1, len(index)))


def _as_leaf(raw: np.ndarray, dtype: np.dtype, shape: Any) -> np.ndarray:
  """A packed leaf's bytes as its array: a view of ``raw`` (a fresh TensorStore read result,
  used by nobody else) when it is contiguous and writable, else a copy."""
  if raw.flags.c_contiguous and raw.flags.writeable:
    return raw.view(dtype).reshape(shape)
  return np.frombuffer(raw.tobytes(), dtype=dtype).reshape(shape).copy()


# --- where a leaf's bytes are, and why reading them failed -----------------------------------


def base_of(manifest: _records.Manifest, rec: _records.Leaf) -> int | None:
  """The index in ``manifest.bases`` of the checkpoint holding ``rec``'s bytes (None: this
  checkpoint's own data, or inline). A pieced leaf's are where its writers' packs are."""
  if rec.stored is not None:
    return rec.stored.base
  if rec.packed is not None:
    return manifest.packs[rec.packed.pack].base
  if rec.pieces is not None:
    k = _pieces_pack(manifest, rec)
    return None if k is None else manifest.packs[k].base
  return None


def data_location(src: Source, base: int | None, d: str) -> str:
  """Where directory ``d`` of a checkpoint's data is: in ``src``, or in the checkpoint its
  reference ``base`` names.

  >>> import types
  >>> src = types.SimpleNamespace(location="/r/7", manifest=types.SimpleNamespace(
  ...     bases=(types.SimpleNamespace(dir="../other/5"),)))
  >>> data_location(src, None, "data-1/a/0"), data_location(src, 0, "data-2/p/0")
  ('/r/7/data-1/a/0', '/other/5/data-2/p/0')
  """
  if base is None:
    return f"{src.location}/{d}"
  return f"{_refs.display(src.location, src.manifest.bases[base].dir)}/{d}"


def _pieces_pack(manifest: _records.Manifest, rec: _records.Leaf) -> int | None:
  """A pack holding pieces of ``rec`` (format 2: a fork's all refer to its parent's; format 3:
  a referenced one if any of its runs is)."""
  assert rec.pieces is not None
  if rec.pieces.runs is None:
    return next((k for k, p in enumerate(manifest.packs) if p.process is not None), None)
  packs = sorted(set(_runs.pieces_runs(manifest, rec)[0].tolist()))
  return next((k for k in packs if manifest.packs[k].base is not None), packs[0] if packs else None)


def _stored_at(src: Source, rec: _records.Leaf) -> tuple[int | None, str]:
  """(:func:`base_of`, the storage location a read error names) of an array leaf."""
  manifest = src.manifest
  base = base_of(manifest, rec)
  if rec.packed is not None:
    return base, data_location(src, base, manifest.packs[rec.packed.pack].dir)
  if rec.pieces is not None:
    k = _pieces_pack(manifest, rec)
    d = posixpath.dirname(manifest.packs[k].dir) if k is not None else f"{manifest.data}/p"
    return base, f"{data_location(src, base, d)} (pieces of {rec.where})"
  if rec.stored is not None:
    return base, data_location(src, base, rec.stored.dir)
  return None, src.location


def leaf_error(src: Source, rec: _records.Leaf, e: BaseException) -> CheckpointError:
  """Why reading ``rec``'s stored bytes failed, as restore reports it: a CheckpointError
  already saying so (a bool byte other than 0 and 1, a reference that leads nowhere)
  unchanged; else the checkpoint changed while being read, a referenced checkpoint is
  missing, damage (a :class:`DamagedError`: a checksum mismatch, corrupt or missing data), or
  another read failure; a foreign format's reader words its own."""
  if isinstance(e, CheckpointError):
    return e
  if src.reader is not None:
    return src.reader.read_error(rec, e)
  location = src.location
  if not _commit.unchanged(src.kv, src.commit):
    return _commit.changed_error(location)
  where = rec.where
  base, store = _stored_at(src, rec)
  text = _paths.error_text(e)
  if base is not None and _paths.read_failure(e) == "missing":
    # (damage: self-healing restores skip the step)
    return DamagedError(
      f"Cannot restore {where} from {location!r}: it refers to "
      f"{_refs.describe(location, src.manifest, base)}, which is missing (no data at "
      f"{store!r}: that checkpoint was deleted or moved). This checkpoint cannot be "
      "restored without it; restore another step, or put the referenced checkpoint back. "
      f"[{text}]"
    )
  cause = {
    "checksum": "its data is corrupt (crc32c checksum mismatch)",
    "corrupt": "its data is corrupt or truncated",
    "missing": "a chunk of its data is missing",
    "metadata": "its zarr.json does not match the manifest",
  }.get(_paths.read_failure(e))
  error = DamagedError if cause else CheckpointError  # else: not known to be damage
  cause = cause or f"reading failed ({type(e).__name__}: {text})"
  return error(
    f"Cannot restore {where} from {store!r}: {cause}. The checkpoint is damaged; restore an "
    f"earlier one (fnckpt verify {location} lists every damaged leaf). [{text}]"
  )


def check_memory(n: int, leaf: StoredLeaf) -> None:
  """A read larger than this machine's memory would abort the interpreter inside
  TensorStore: refuse it (a manifest that lies about a shape, or a restore that needs more
  processes)."""
  limit = _memory_bytes()
  if n > limit:
    raise CheckpointError(
      f"Cannot restore {leaf.name} from {leaf.src.location!r}: one slice of it needs {n} "
      f"bytes, more than this machine's memory ({limit} bytes). Restore it sharded over "
      "more devices or processes, or check the checkpoint (its manifest may be damaged)."
    )


def _memory_bytes() -> int:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (OSError, ValueError):
    return 1 << 40
