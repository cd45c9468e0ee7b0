"""Reading slices of pieced leaves (docs/format.md "Pieces"): a wanted slice is the chunks it
intersects, each read as byte ranges of its writer's pack (only the chunk's rows the slice
needs; only its contiguous runs when those are large and rows would read much more), then
copied into the slice. Where a chunk lies: format 2 computes it (the writer's pieces region),
format 3 records it (the writer's run, :func:`fnckpt._format.runs.locate`); a format-3 read of
a writer's whole run is checked against the run's recorded hash.
Opened by ``read.Opener`` (restore, export, verify and diff read pieces through it), with the
interface of ``_arrays.read_slice``."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from .. import _state
from .._format import hashes as _hashes
from .._format import leaves as _leaves
from .._format import records as _records
from .._format import runs as _runs
from .._io import arrays as _arrays
from .._layout.chunks import Index

__all__ = ["SliceReader"]

# Reading a chunk's whole rows may fetch at most this much more than the slice needs; past
# that, each contiguous run is its own byte range when runs are at least MIN_RUN_BYTES (a
# pack's inner chunk: storage is read, and crc32c-checked, in whole inner chunks, so smaller
# runs would fetch the same bytes, each read decoding its inner chunk again: measured 13x
# slower on the bench's resharded restore).
OVERREAD = 1.1
MIN_RUN_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class _Part:
  pack: int
  lo: int  # byte range in the pack
  hi: int
  shape: tuple[int, ...]  # the range's bytes as an array of this shape
  take: tuple[slice, ...]  # then this part of it
  dest: tuple[slice, ...]  # goes here in the slice


class SliceReader:
  """``reader(index, batch)`` -> a future of the slice ``index`` of pieced ``leaf`` (its
  saved dtype), like ``_arrays.read_slice``. ``open_pack(k)``: pack ``k`` opened for reading.

  >>> SliceReader.runs_of(((0, 2), (1, 3)), (4, 4))  # rows 0-1, columns 1-2 of a 4x4 chunk
  (1, [(1, 3), (5, 7)])
  """

  def __init__(
    self,
    manifest: _records.Manifest,
    leaf: _records.Leaf,
    open_pack: Callable[[int], ts.TensorStore],
    damaged: Callable[[str], Exception] | None = None,
  ):
    self.manifest, self.leaf, self.open_pack = manifest, leaf, open_pack
    self.damaged = damaged  # (given: whole runs read are checked; what a mismatch raises)
    self._runs: dict | None = None
    assert leaf.dtype is not None and leaf.shape is not None and leaf.pieces is not None
    self.dtype = _leaves.dtype_of(leaf.dtype)
    self.chunk = leaf.pieces.chunks
    self.grid = tuple(-(-n // c) for n, c in zip(leaf.shape, self.chunk))

  def __call__(self, index: Index, batch: ts.Batch | None = None) -> _Pending:
    shape = tuple(b - a for a, b in index)
    parts = self.parts(index) if all(shape) else []
    reads = _merged(parts)
    futures = []
    for k, lo, hi in reads:
      futures.append(_arrays.read_slice(self.open_pack(k), ((lo, hi),), batch))
      _state.reads.bytes_read += hi - lo  # (every reader of this process: for tests)
      _state.reads.ranges += 1
    checks = [self.run_hash(r) for r in reads] if self.damaged is not None else None
    return _Pending(
      out=_arrays.aligned_empty(shape, self.dtype),
      parts=parts,
      reads=reads,
      futures=futures,
      leaf=self.leaf,
      checks=checks,
      damaged=self.damaged,
    )

  def run_hash(self, read: Sequence[int]) -> tuple[int, bytes] | None:
    """(writer process, recorded hash) when ``read`` (pack, lo, hi) is a writer's whole run
    (format 3)."""
    assert self.leaf.pieces is not None
    if self.leaf.pieces.runs is None:
      return None
    if self._runs is None:
      assert self.manifest.hash is not None and self.leaf.pieces.hashes is not None
      n, hashes = _records.HASH_ALGS[self.manifest.hash], self.leaf.pieces.hashes
      self._runs = {
        (r.pack, r.lo, r.hi): (r.process, hashes[w * n : (w + 1) * n])
        for w, r in enumerate(_runs.writer_runs(self.manifest, self.leaf))
      }
    return self._runs.get(tuple(read))

  def parts(self, index: Index) -> list[_Part]:
    """The byte ranges to read for slice ``index`` and where each lands."""
    blocks = [range(a // c, -(-b // c)) for (a, b), c in zip(index, self.chunk)]
    cells = list(itertools.product(*blocks))
    numbers = (
      np.ravel_multi_index(tuple(np.array(x) for x in zip(*cells)), self.grid)
      if self.grid
      else np.zeros(len(cells), np.int64)
    )
    packs, starts = _runs.locate(self.manifest, self.leaf, np.asarray(numbers))
    out = []
    for cell, k, start in zip(cells, packs.tolist(), starts.tolist()):
      inter = tuple(
        (max(a, b * c) - b * c, min(e, (b + 1) * c) - b * c)
        for (a, e), b, c in zip(index, cell, self.chunk)
      )
      dest = tuple(
        slice(b * c + lo - a, b * c + hi - a)
        for (a, _), b, c, (lo, hi) in zip(index, cell, self.chunk, inter)
      )
      out += self._ranges(k, start, inter, dest)
    return out

  def _ranges(self, k: int, start: int, inter, dest) -> list[_Part]:
    size, chunk = self.dtype.itemsize, self.chunk
    if not chunk:
      return [_Part(k, start, start + size, (), (), ())]
    row = math.prod(chunk[1:]) * size
    (r0, r1), rest = inter[0], inter[1:]
    whole = _Part(
      k,
      start + r0 * row,
      start + r1 * row,
      (r1 - r0,) + chunk[1:],
      (slice(None),) + tuple(slice(a, b) for a, b in rest),
      dest,
    )
    needed = math.prod(b - a for a, b in inter) * size
    if (r1 - r0) * row <= OVERREAD * needed:
      return [whole]
    dim = max((d for d, ((a, b), c) in enumerate(zip(inter, chunk)) if (a, b) != (0, c)), default=0)
    if (inter[dim][1] - inter[dim][0]) * math.prod(chunk[dim + 1 :]) * size < MIN_RUN_BYTES:
      return [whole]
    dim, runs = self.runs_of(inter, chunk)
    out = []
    lead = [range(a, b) for a, b in inter[:dim]]
    for idx, (lo, hi) in zip(itertools.product(*lead), runs):
      n = (hi - lo) // math.prod(chunk[dim + 1 :])
      out.append(
        _Part(
          k,
          start + lo * size,
          start + hi * size,
          (n,) + chunk[dim + 1 :],
          (slice(None),) * (1 + len(chunk) - dim - 1),
          tuple(
            slice(i - a + d.start, i - a + d.start + 1) for i, (a, _), d in zip(idx, inter, dest)
          )
          + dest[dim:],
        )
      )
    return out

  @staticmethod
  def runs_of(inter, chunk) -> tuple[int, list[tuple[int, int]]]:
    """(the dimension the runs cut, each contiguous run's element range in the chunk) of the
    region ``inter`` of a chunk of shape ``chunk``: dimensions after the last partial one are
    whole, so each combination of indices before it is one run."""
    dim = max((d for d, ((a, b), c) in enumerate(zip(inter, chunk)) if (a, b) != (0, c)), default=0)
    strides = [math.prod(chunk[d + 1 :]) for d in range(len(chunk))]
    runs = []
    for idx in itertools.product(*(range(a, b) for a, b in inter[:dim])):
      first = sum(i * s for i, s in zip(idx, strides)) + inter[dim][0] * strides[dim]
      runs.append((first, first + (inter[dim][1] - inter[dim][0]) * strides[dim]))
    return dim, runs


def _merged(parts: list[_Part]) -> list[list[int]]:
  """The byte ranges to read for ``parts``, in order: consecutive parts that continue each
  other in one pack are one range (a writer's chunks of a slice of whole chunks lie back to
  back: a read of a writer's whole run is one range, checked against its hash).

  >>> _merged([_Part(0, 0, 8, (), (), ()), _Part(0, 8, 16, (), (), ()),
  ...          _Part(1, 16, 24, (), (), ())])
  [[0, 0, 16], [1, 16, 24]]
  """
  reads: list[list[int]] = []
  for p in parts:
    if reads and reads[-1][0] == p.pack and reads[-1][2] == p.lo:
      reads[-1][2] = p.hi
    else:
      reads.append([p.pack, p.lo, p.hi])
  return reads


class _Pending:
  """A slice being read: ``result()`` copies each landed range into it (once), after checking
  each range that is a writer's whole run against its hash (``checks``: per read, the writer
  and the hash, or None)."""

  def __init__(
    self,
    out: np.ndarray,
    parts: list[_Part],
    reads: list[list[int]],
    futures: list[Any],
    leaf: _records.Leaf,
    checks: list | None = None,
    damaged: Callable[[str], Exception] | None = None,
  ):
    self.out, self.parts, self.reads, self.futures, self.leaf = out, parts, reads, futures, leaf
    self.checks, self.damaged = checks, damaged

  def done(self) -> bool:
    return all(f.done() for f in self.futures)

  def result(self) -> np.ndarray:
    landed = [f.result() for f in self.futures]
    for (k, lo, hi), raw, check in zip(self.reads, landed, self.checks or [None] * len(landed)):
      if check is not None and _hashes.array_digest(raw) != check[1]:
        assert self.damaged is not None  # (given with the checks)
        raise self.damaged(
          f"the run of chunks process {check[0]} wrote (bytes [{lo}, {hi}) of pack {k})"
        )
    j = 0
    for p in self.parts:
      while not (self.reads[j][0] == p.pack and self.reads[j][1] <= p.lo < self.reads[j][2]):
        j += 1
      at = p.lo - self.reads[j][1]
      got = landed[j][at : at + p.hi - p.lo].view(self.out.dtype).reshape(p.shape)
      self.out[p.dest] = got[p.take]
    if self.parts:  # bool bytes other than 0/1 are damage (checksums cannot tell)
      _leaves.checked_bools(self.out, self.leaf)
    self.futures, self.parts, self.reads = [], [], []
    return self.out
