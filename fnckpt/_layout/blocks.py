"""PURE: the regions a reader cuts an array into. Data in, data out; no I/O.

:func:`blocks` cuts an array into C-order contiguous blocks of at most a given size (export
writes them front to back; diff and verify compare and check them a window at a time);
:func:`start` is the C-order element number where such a block starts; :func:`grid` lists the
cells of a chunk grid (verify reads every inner chunk, the content-hash check every write
chunk). Indices are tuples of ``(start, stop)`` pairs, one per dimension (``chunks.Index``).
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence

from .chunks import Index

__all__ = ["blocks", "start", "grid"]


def blocks(
  shape: Sequence[int], itemsize: int, limit: int, align: Sequence[int] | None = None
) -> Iterator[Index]:
  """The C-order contiguous blocks of an array, each at most ``limit`` bytes (one element at
  least): whole rows of the first dimension that fits, the leading indices one by one. With
  ``align`` (the inner chunk shape), blocks along that dimension start at multiples of it
  whenever one aligned block fits in ``limit``.

  >>> list(blocks((4, 3), 4, 24))
  [((0, 2), (0, 3)), ((2, 4), (0, 3))]
  >>> list(blocks((2, 5), 4, 8))
  [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((0, 1), (4, 5)), ((1, 2), (0, 2)), ((1, 2), (2, 4)), ((1, 2), (4, 5))]
  """  # noqa: E501 (a doctest's expected output)
  shape = tuple(shape)
  if 0 in shape:
    return
  if not shape:
    yield ()
    return
  k = next(
    (d for d in range(len(shape)) if math.prod(shape[d + 1 :]) * itemsize <= limit), len(shape) - 1
  )
  row = math.prod(shape[k + 1 :]) * itemsize
  step = max(1, min(shape[k], limit // row))
  if align is not None and 1 < align[k] <= step:
    step -= step % align[k]
  for lead in itertools.product(*(range(n) for n in shape[:k])):
    head = tuple((i, i + 1) for i in lead)
    tail = tuple((0, n) for n in shape[k + 1 :])
    for a in range(0, shape[k], step):
      yield head + ((a, min(a + step, shape[k])),) + tail


def start(index: Index, shape: Sequence[int]) -> int:
  """The C-order element number where block ``index`` of an array of ``shape`` starts.

  >>> start(((1, 2), (2, 4)), (2, 5))
  7
  """
  return sum(a * math.prod(shape[d + 1 :]) for d, (a, _) in enumerate(index))


def grid(shape: Sequence[int], chunk: Sequence[int]) -> Iterator[Index]:
  """The cells of the regular grid of ``chunk`` over ``shape``, in C order, lazily (an
  untrusted manifest may claim billions of them).

  >>> list(grid((3, 2), (2, 2)))
  [((0, 2), (0, 2)), ((2, 3), (0, 2))]
  """
  if any(n == 0 for n in shape):
    return
  if not shape:
    yield ()
    return
  for a in range(0, shape[0], chunk[0]):
    for rest in grid(shape[1:], chunk[1:]):
      yield ((a, min(a + chunk[0], shape[0])),) + rest
