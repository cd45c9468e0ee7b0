"""Saved leaves read to the host in C order, a bounded window of bytes at a time.

:func:`pieces` yields ``Piece(leaf, start, data)`` for the given array leaves, in order: each
leaf cut into C-order contiguous blocks (:func:`blocks`, aligned to the stored inner chunks
where they fit), so the pieces of a leaf concatenated are its bytes in C order. Reads go
through the code restore reads with (``source.Source``, ``_store`` specs opened without I/O,
``source.read_error``'s classification); at most ``window`` bytes of host memory are held at
once, counting the piece the caller is working on and charging each read twice its size
(TensorStore holds the raw bytes beside the decoded piece, as save's budget counts them), with
several reads in flight so storage stays busy. Inline leaves come from the manifest, packed ones
as byte ranges of their pack, stored ones as slices of their zarr3 array.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import tensorstore as ts

from .._format import leaves as _leaves, records as _records, refs as _refs
from .._io import arrays as _store
from .._layout.chunks import Index
from . import source as _source

__all__ = ["Piece", "Window", "blocks", "pieces"]


@dataclasses.dataclass(frozen=True)
class Piece:
  """``data`` (the saved dtype, C-contiguous) is elements ``[start, start + data.size)`` of
  ``leaf`` in C order."""
  leaf: _records.Leaf
  start: int
  data: np.ndarray


@dataclasses.dataclass
class Window:
  """The read window: its limit, and what it saw (for stats and tests)."""
  limit: int
  peak: int = 0                   # most bytes held at once (reads charged twice their size)
  largest: int = 0                # the largest single read (as charged)
  reads: int = 0


def blocks(shape: Sequence[int], itemsize: int, limit: int,
           align: Sequence[int] | None = None) -> Iterator[Index]:
  """The C-order contiguous blocks of an array, each at most ``limit`` bytes (one element at
  least): whole rows of the first dimension that fits, the leading indices one by one. With
  ``align`` (the inner chunk shape), blocks along that dimension start at multiples of it
  whenever one aligned block fits in ``limit``.

  >>> list(blocks((4, 3), 4, 24))
  [((0, 2), (0, 3)), ((2, 4), (0, 3))]
  >>> list(blocks((2, 5), 4, 8))
  [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((0, 1), (4, 5)), ((1, 2), (0, 2)), ((1, 2), (2, 4)), ((1, 2), (4, 5))]
  """
  shape = tuple(shape)
  if 0 in shape:
    return
  if not shape:
    yield ()
    return
  k = next((d for d in range(len(shape)) if math.prod(shape[d + 1:]) * itemsize <= limit),
           len(shape) - 1)
  row = math.prod(shape[k + 1:]) * itemsize
  step = max(1, min(shape[k], limit // row))
  if align is not None and 1 < align[k] <= step:
    step -= step % align[k]
  for lead in itertools.product(*(range(n) for n in shape[:k])):
    head = tuple((i, i + 1) for i in lead)
    tail = tuple((0, n) for n in shape[k + 1:])
    for a in range(0, shape[k], step):
      yield head + ((a, min(a + step, shape[k])),) + tail


def _first(index: Index, shape: Sequence[int]) -> int:
  """The C-order element number where block ``index`` starts."""
  return sum(a * math.prod(shape[d + 1:]) for d, (a, _) in enumerate(index))


class _Reader:
  """Opens each stored array (the current leaf's) and pack once, without I/O, and starts the
  read of one block."""

  def __init__(self, src: _source.Source):
    self.src, self.packs, self.stored = src, {}, (None, None)
    self.pieced: tuple[int | None, Any] = (None, None)

  def start(self, leaf: _records.Leaf, index: Index) -> ts.Future | np.ndarray:
    if leaf.inline is not None:
      return _leaves.inline_array(leaf)[tuple(slice(a, b) for a, b in index) + (...,)]
    try:
      if leaf.packed is not None:
        size = _records.itemsize(leaf.dtype)
        first = leaf.packed.offset + _first(index, leaf.shape) * size
        count = math.prod(b - a for a, b in index) * size
        return _store.read_slice(self._pack(leaf.packed.pack), ((first, first + count),))
      if leaf.pieces is not None:
        if self.pieced[0] != leaf.index:
          self.pieced = (leaf.index, _source.pieces_reader(self.src, leaf, self.packs))
        return self.pieced[1](index)
      if self.stored[0] != leaf.index:  # (a reused leaf: in the checkpoint its base names)
        self.stored = (leaf.index, _store.open_array(_store.zarr_spec(
            self._spec_of(leaf.stored.base), leaf.stored, leaf.dtype,
            leaf.shape), self.src.ctx, mode="read").result())
      return _store.read_slice(self.stored[1], index)
    except Exception as e:  # TensorStore refused the spec or the read
      raise _source.read_error(self.src, leaf, e) from None

  def _pack(self, k: int) -> ts.TensorStore:
    if k not in self.packs:
      pk = self.src.manifest.packs[k]
      self.packs[k] = _store.open_array(_store.pack_spec(
          self._spec_of(pk.base), pk.dir, pk.nbytes, pk.chunk, pk.inner), self.src.ctx,
          mode="read").result()
    return self.packs[k]

  def _spec_of(self, base: int | None) -> dict:
    """The kvstore of the checkpoint holding data whose record names ``base``."""
    return _refs.base_spec(self.src.kv_spec, self.src.manifest, base, self.src.location)

  def finish(self, leaf: _records.Leaf, index: Index, got: ts.Future | np.ndarray
             ) -> np.ndarray:
    if isinstance(got, np.ndarray):
      return np.ascontiguousarray(got)
    try:
      data = got.result()
    except Exception as e:
      raise _source.read_error(self.src, leaf, e) from None
    if leaf.packed is not None:
      return _leaves.checked_bools(
          data.view(_leaves.dtype_of(leaf.dtype)).reshape([b - a for a, b in index]), leaf)
    return _store.from_storage(data, leaf.dtype)


def pieces(src: _source.Source, leaves: Sequence[_records.Leaf], window: Window,
           out_itemsize: Callable[[_records.Leaf], int] | None = None) -> Iterator[Piece]:
  """Every array leaf of ``leaves``, in order, as C-order pieces (see the module). Blocks are
  at most an eighth of the window (so about four reads are in flight, each charged twice), or
  one aligned inner chunk row when that fits; a read error is restore's CheckpointError
  naming the leaf and its storage path. ``out_itemsize``: the element size the caller casts
  a leaf's pieces to; a wider one is charged too (blocks shrink to match)."""
  reader = _Reader(src)
  pending: collections.deque = collections.deque()
  held = 0
  for leaf in leaves:
    size = _records.itemsize(leaf.dtype)
    wider = max(0, (out_itemsize(leaf) if out_itemsize else size) - size)
    align = (leaf.stored.inner if leaf.stored is not None else
             leaf.pieces.chunks if leaf.pieces is not None else None)
    limit = max(window.limit // 8, _aligned_row(leaf, size, window.limit // 2))
    limit = limit * 2 * size // (2 * size + wider)  # (the cast's bytes fit in the same charge)
    for index in blocks(leaf.shape, size, limit, align):
      n = math.prod(b - a for a, b in index) * (size * (1 if leaf.inline is not None else 2)
                                                + wider)
      while pending and held + n > window.limit:
        held -= yield from _land(reader, pending)
      pending.append((leaf, index, reader.start(leaf, index), n))
      held += n
      window.peak, window.largest = max(window.peak, held), max(window.largest, n)
      window.reads += 1
  while pending:
    yield from _land(reader, pending)


def _land(reader: _Reader, pending: collections.deque) -> Iterator[Piece]:
  """Wait for the oldest read and hand it out; returns its size once the caller is done."""
  leaf, index, got, n = pending.popleft()
  yield Piece(leaf, _first(index, leaf.shape), reader.finish(leaf, index, got))
  return n


def _aligned_row(leaf: _records.Leaf, size: int, limit: int) -> int:
  """The bytes of one row of stored inner chunks along the first dimension, if that fits in
  ``limit`` (else 0): a block that size reads each inner chunk once."""
  if leaf.stored is None or not leaf.shape:
    return 0
  n = leaf.stored.inner[0] * math.prod(leaf.shape[1:]) * size
  return n if n <= limit else 0
