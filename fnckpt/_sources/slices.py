"""Saved leaves read to the host in C order, a bounded window of bytes at a time.

:func:`pieces` yields ``Piece(leaf, start, data)`` for the given array leaves, in order: each
leaf cut into C-order contiguous blocks (``_layout.blocks``, aligned to the stored inner
chunks where they fit), so the pieces of a leaf concatenated are its bytes in C order. Reads
go through the one reader (``read.Opener``, ``read.read_regions``, ``read.leaf_error``'s
wording); at most ``window`` bytes of host memory are held at once, counting the piece the
caller is working on and charging each read twice its size (TensorStore holds the raw bytes
beside the decoded piece, as save's budget counts them), with several reads in flight so
storage stays busy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, Sequence

import numpy as np

from .._format import records as _records
from .._layout import blocks as _blocks
from . import read as _read
from . import source as _source
from .read import Window

__all__ = ["Piece", "Window", "pieces"]


@dataclasses.dataclass(frozen=True)
class Piece:
  """``data`` (the saved dtype, C-contiguous) is elements ``[start, start + data.size)`` of
  ``leaf`` in C order."""

  leaf: _records.Leaf
  start: int
  data: np.ndarray


def pieces(
  src: _source.Source,
  leaves: Sequence[_records.Leaf],
  window: Window,
  out_itemsize: Callable[[_records.Leaf], int] | None = None,
) -> Iterator[Piece]:
  """Every array leaf of ``leaves``, in order, as C-order pieces (see the module). Blocks are
  at most an eighth of the window (so about four reads are in flight, each charged twice), or
  one aligned inner chunk row when that fits; a read error is restore's CheckpointError
  naming the leaf and its storage path. ``out_itemsize``: the element size the caller casts
  a leaf's pieces to; a wider one is charged too (blocks shrink to match).

  >>> import numpy as np, fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> _ = fnckpt.save({"w": np.arange(6.0)}, f"{d}/c").wait()
  >>> src = _source.open_source(f"{d}/c")
  >>> [(p.start, p.data.tolist()) for p in pieces(src, src.manifest.leaves, Window(32))]
  [(0, [0.0]), (1, [1.0]), (2, [2.0]), (3, [3.0]), (4, [4.0]), (5, [5.0])]
  """
  regions = _regions(_read.Opener(src), leaves, window.limit, out_itemsize)
  for got in _read.read_regions(regions, window):
    leaf, start = got.region.tag
    assert got.data is not None  # (errors raised)
    yield Piece(leaf, start, got.data)


def _regions(
  opener: _read.Opener,
  leaves: Sequence[_records.Leaf],
  limit: int,
  out_itemsize: Callable[[_records.Leaf], int] | None,
) -> Iterator[_read.Region]:
  """The blocks of each leaf, charged twice their bytes (once for an inline leaf) plus the
  cast's widening; tag ``(leaf, C-order start)``."""
  for rec in leaves:
    size = _records.itemsize(rec.dtype)
    wider = max(0, (out_itemsize(rec) if out_itemsize else size) - size)
    block = max(limit // 8, _aligned_row(rec, size, limit // 2))
    block = block * 2 * size // (2 * size + wider)  # (the cast's bytes fit in the same charge)
    leaf = opener.leaf(rec)
    per = size * (1 if rec.inline is not None else 2) + wider
    assert rec.shape is not None
    for index in _blocks.blocks(rec.shape, size, block, leaf.align):
      yield _read.Region(
        leaf,
        index,
        math.prod(b - a for a, b in index) * per,
        (rec, _blocks.start(index, rec.shape)),
      )


def _aligned_row(leaf: _records.Leaf, size: int, limit: int) -> int:
  """The bytes of one row of stored inner chunks along the first dimension, if that fits in
  ``limit`` (else 0): a block that size reads each inner chunk once."""
  if leaf.stored is None or not leaf.shape:
    return 0
  n = leaf.stored.inner[0] * math.prod(leaf.shape[1:]) * size
  return n if n <= limit else 0
