"""Reading slices of pieced leaves (README "Pieces"): a wanted slice is the chunks it
intersects, each read as byte ranges of its writer's pack (only the chunk's rows the slice
needs; only its contiguous runs when those are large and rows would read much more), then
copied into the slice.
Opened by ``read.Opener`` (restore, export, verify and diff read pieces through it), with the
interface of ``_store.read_slice``."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

import numpy as np
import tensorstore as ts

from .. import _state
from .._format import leaves as _leaves, records as _records
from .._io import arrays as _store
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
  lo: int                                  # byte range in the pack
  hi: int
  shape: tuple[int, ...]                   # the range's bytes as an array of this shape
  take: tuple[slice, ...]                  # then this part of it
  dest: tuple[slice, ...]                  # goes here in the slice


class SliceReader:
  """``reader(index, batch)`` -> a future of the slice ``index`` of pieced ``leaf`` (its
  saved dtype), like ``_store.read_slice``. ``open_pack(k)``: pack ``k`` opened for reading.

  >>> SliceReader.runs_of(((0, 2), (1, 3)), (4, 4))  # rows 0-1, columns 1-2 of a 4x4 chunk
  (1, [(1, 3), (5, 7)])
  """

  def __init__(self, manifest: _records.Manifest, leaf: _records.Leaf,
               open_pack: Callable[[int], ts.TensorStore]):
    self.manifest, self.leaf, self.open_pack = manifest, leaf, open_pack
    self.dtype = _leaves.dtype_of(leaf.dtype)
    self.chunk = leaf.pieces.chunks
    self.grid = tuple(-(-n // c) for n, c in zip(leaf.shape, self.chunk))

  def __call__(self, index: Index, batch: ts.Batch | None = None) -> "_Pending":
    shape = tuple(b - a for a, b in index)
    parts = self.parts(index) if all(shape) else []
    futures = []
    for p in parts:
      futures.append(_store.read_slice(self.open_pack(p.pack), ((p.lo, p.hi),), batch))
      _state.reads.bytes_read += p.hi - p.lo  # (every reader of this process: for tests)
      _state.reads.ranges += 1
    return _Pending(_store.aligned_empty(shape, self.dtype), parts, futures, self.leaf)

  def parts(self, index: Index) -> list[_Part]:
    """The byte ranges to read for slice ``index`` and where each lands."""
    blocks = [range(a // c, -(-b // c)) for (a, b), c in zip(index, self.chunk)]
    cells = list(itertools.product(*blocks))
    numbers = (np.ravel_multi_index(tuple(np.array(x) for x in zip(*cells)), self.grid)
               if self.grid else np.zeros(len(cells), np.int64))
    procs, offsets = self.manifest.layout.locate(self.leaf.index, np.asarray(numbers))
    out = []
    for cell, proc, off in zip(cells, procs.tolist(), offsets.tolist()):
      k = self.manifest.pack_of(proc)
      start = self.manifest.packs[k].pieces + off
      inter = tuple((max(a, b * c) - b * c, min(e, (b + 1) * c) - b * c)
                    for (a, e), b, c in zip(index, cell, self.chunk))
      dest = tuple(slice(b * c + lo - a, b * c + hi - a)
                   for (a, _), b, c, (lo, hi) in zip(index, cell, self.chunk, inter))
      out += self._ranges(k, start, inter, dest)
    return out

  def _ranges(self, k: int, start: int, inter, dest) -> list[_Part]:
    size, chunk = self.dtype.itemsize, self.chunk
    if not chunk:
      return [_Part(k, start, start + size, (), (), ())]
    row = math.prod(chunk[1:]) * size
    (r0, r1), rest = inter[0], inter[1:]
    whole = _Part(k, start + r0 * row, start + r1 * row, (r1 - r0,) + chunk[1:],
                  (slice(None),) + tuple(slice(a, b) for a, b in rest), dest)
    needed = math.prod(b - a for a, b in inter) * size
    if (r1 - r0) * row <= OVERREAD * needed:
      return [whole]
    dim = max((d for d, ((a, b), c) in enumerate(zip(inter, chunk)) if (a, b) != (0, c)),
              default=0)
    if (inter[dim][1] - inter[dim][0]) * math.prod(chunk[dim + 1:]) * size < MIN_RUN_BYTES:
      return [whole]
    dim, runs = self.runs_of(inter, chunk)
    out = []
    lead = [range(a, b) for a, b in inter[:dim]]
    for idx, (lo, hi) in zip(itertools.product(*lead), runs):
      n = (hi - lo) // math.prod(chunk[dim + 1:])
      out.append(_Part(k, start + lo * size, start + hi * size, (n,) + chunk[dim + 1:],
                       (slice(None),) * (1 + len(chunk) - dim - 1),
                       tuple(slice(i - a + d.start, i - a + d.start + 1)
                             for i, (a, _), d in zip(idx, inter, dest))
                       + dest[dim:]))
    return out

  @staticmethod
  def runs_of(inter, chunk) -> tuple[int, list[tuple[int, int]]]:
    """(the dimension the runs cut, each contiguous run's element range in the chunk) of the
    region ``inter`` of a chunk of shape ``chunk``: dimensions after the last partial one are
    whole, so each combination of indices before it is one run."""
    dim = max((d for d, ((a, b), c) in enumerate(zip(inter, chunk)) if (a, b) != (0, c)),
              default=0)
    strides = [math.prod(chunk[d + 1:]) for d in range(len(chunk))]
    runs = []
    for idx in itertools.product(*(range(a, b) for a, b in inter[:dim])):
      first = sum(i * s for i, s in zip(idx, strides)) + inter[dim][0] * strides[dim]
      runs.append((first, first + (inter[dim][1] - inter[dim][0]) * strides[dim]))
    return dim, runs


class _Pending:
  """A slice being read: ``result()`` copies each landed range into it (once)."""

  def __init__(self, out: np.ndarray, parts: list[_Part], futures: list[Any],
               leaf: _records.Leaf):
    self.out, self.parts, self.futures, self.leaf = out, parts, futures, leaf

  def done(self) -> bool:
    return all(f.done() for f in self.futures)

  def result(self) -> np.ndarray:
    for p, f in zip(self.parts, self.futures):
      raw = f.result()
      got = raw.view(self.out.dtype).reshape(p.shape)
      self.out[p.dest] = got[p.take]
    if self.parts:  # bool bytes other than 0/1 are damage (checksums cannot tell)
      _leaves.checked_bools(self.out, self.leaf)
    self.futures, self.parts = [], []
    return self.out
