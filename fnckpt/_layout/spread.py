"""Read once, spread over the replicas (pure: numpy, no JAX, no I/O).

A target sharding that replicates an array over processes makes every process holding a copy
of a shard read it from storage: R replica groups read the checkpoint R times. The *reader*
layout splits each distinct shard further over the mesh axes that replicate it across
processes (those axes appended, minor, to one dimension's partitioning), so each process
reads 1/R of what it holds and each stored byte is read once across the job; a reshard
(``_restore.reshard``) then fills the other replicas over the interconnect.

A mesh is described by a :class:`Grid`: axis names and sizes and, for every mesh position,
the process that holds the device there. Everything here is a function of a grid, a
PartitionSpec (as a tuple of per-dimension axis tuples) and a shape, so the planning of a
4,096-process job runs on one machine without devices (``bench/plan_scale.py``).

>>> import numpy as np
>>> g = Grid(("r", "s"), (2, 4), np.repeat(np.arange(2), 4).reshape(2, 4))  # r: processes
>>> crossing_axes(g)
('r',)
>>> spec, factor = reader_spec(g, (("s",), ()), (64, 8))
>>> spec, factor
((('s', 'r'), ()), 2)
>>> bytes_per_process(g, (("s",), ()), (64, 8), 4).tolist()   # every process reads it all
[2048, 2048]
>>> bytes_per_process(g, spec, (64, 8), 4).tolist()           # read once
[1024, 1024]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

__all__ = [
  "Grid",
  "Spec",
  "crossing_axes",
  "reader_spec",
  "fetched",
  "replica_groups",
  "bytes_per_process",
  "contiguous_blocks",
  "waves",
]

Spec = tuple[tuple[str, ...], ...]  # per dimension: the mesh axes it is split over, major first


@dataclasses.dataclass(frozen=True, eq=False)
class Grid:
  """A mesh as planning sees it: ``processes[pos]`` is the process holding the device at mesh
  position ``pos`` (an int array of shape ``sizes``)."""

  names: tuple[str, ...]
  sizes: tuple[int, ...]
  processes: np.ndarray

  def size(self, axis: str) -> int:
    return self.sizes[self.names.index(axis)]


def crossing_axes(grid: Grid) -> tuple[str, ...]:
  """The mesh axes along which the process changes somewhere (in mesh order): replication
  over them is replication across processes."""
  p = grid.processes
  return tuple(
    name
    for k, name in enumerate(grid.names)
    if grid.sizes[k] > 1 and bool((p != np.take(p, [0], axis=k)).any())
  )


def reader_spec(
  grid: Grid, spec: Spec, shape: Sequence[int], align: Sequence[int] | None = None
) -> tuple[Spec, int]:
  """The reader layout of an array of ``shape`` placed with ``spec``: every axis that
  replicates it across processes appended (minor) to the partitioning of one dimension it
  divides evenly, and the factor by which the copies each process reads shrink (1: no axis
  could be added; the layout is ``spec``). A target shard is then a contiguous run of reader
  blocks, one per replica. ``align``: the stored chunks' shape (a read fetches whole
  chunks): an axis goes to the dimension where a part's fetch (:func:`fetched`) is smallest,
  and only if it is smaller than without it (a chunk larger than the parts along every
  dimension would be fetched whole by every replica anyway).

  >>> g = Grid(("x",), (2,), np.arange(2))
  >>> reader_spec(g, (), (3, 4))        # (dimension 0 is odd: dimension 1 takes it)
  (((), ('x',)), 2)
  >>> reader_spec(g, ((),), (3,))       # nothing divides: every replica reads its copy
  (((),), 1)
  >>> reader_spec(g, ((), ()), (512, 1024), align=(512, 256))   # rows of whole chunks
  (((), ('x',)), 2)
  >>> reader_spec(g, ((), ()), (512, 512), align=(512, 512))    # one chunk: no gain
  (((), ()), 1)
  """
  entries = [tuple(spec[d]) if d < len(spec) else () for d in range(len(shape))]
  used = {a for e in entries for a in e}
  factor = 1

  def parts(d: int, extra: int = 1) -> int:
    return math.prod(grid.size(a) for a in entries[d]) * extra

  for axis in crossing_axes(grid):
    if axis in used:
      continue
    n = grid.size(axis)
    fits = [d for d, size in enumerate(shape) if size > 0 and size % parts(d, n) == 0]
    if not fits:
      continue
    now = fetched(shape, [parts(d) for d in range(len(shape))], align)
    cost = {
      d: fetched(shape, [parts(e, n if e == d else 1) for e in range(len(shape))], align)
      for d in fits
    }
    d = min(fits, key=lambda d: cost[d])  # (the first of equals)
    if align is None or cost[d] < now:
      entries[d] += (axis,)
      factor *= n
  return tuple(entries), factor


def fetched(shape: Sequence[int], parts: Sequence[int], align: Sequence[int] | None) -> int:
  """Elements one read of a block fetches when ``shape`` is split ``parts`` ways per
  dimension and storage reads whole chunks of ``align`` (None: exactly the block): per
  dimension the block's extent if it is whole chunks, the chunk's if the block lies inside
  one, else both (an unaligned block can touch one chunk more).

  >>> fetched((1024, 1024), (2, 1), (512, 512)), fetched((1024, 1024), (4, 1), (512, 512))
  (524288, 524288)
  """
  out = 1
  for d, (n, p) in enumerate(zip(shape, parts)):
    e = max(1, n // p)
    c = align[d] if align is not None and d < len(align) and align[d] > 0 else e
    out *= e if e % c == 0 else c if c % e == 0 else e + c
  return out


def replica_groups(grid: Grid, spec: Spec) -> int:
  """How many processes hold each distinct shard of an array placed with ``spec`` (the
  number of replica groups; those of the first shard, which all match on a regular mesh)."""
  used = {a for e in spec for a in e}
  first = tuple(0 if name in used else slice(None) for name in grid.names)
  return len(np.unique(grid.processes[first]))


def _blocks(grid: Grid, spec: Spec, ndim: int) -> np.ndarray:
  """For every mesh position, the flat index of the block it holds (C order over the block
  grid): an int array of shape ``grid.sizes``."""
  coords = np.indices(grid.sizes)
  flat = np.zeros(grid.sizes, np.int64)
  for d in range(ndim):
    block = np.zeros(grid.sizes, np.int64)
    axes = spec[d] if d < len(spec) else ()
    for a in axes:
      k = grid.names.index(a)
      block = block * grid.sizes[k] + coords[k]
    flat = flat * math.prod(grid.size(a) for a in axes) + block
  return flat


def bytes_per_process(grid: Grid, spec: Spec, shape: Sequence[int], itemsize: int) -> np.ndarray:
  """Bytes each process reads from storage for an array placed with ``spec``: each distinct
  block its devices hold, once (shapes dividing evenly: the reader layouts of
  :func:`reader_spec` do)."""
  ndim = len(shape)
  parts = [math.prod(grid.size(a) for a in (spec[d] if d < len(spec) else ())) for d in range(ndim)]
  block_bytes = math.prod(-(-n // p) for n, p in zip(shape, parts)) * itemsize
  nprocs = int(grid.processes.max()) + 1
  nblocks = math.prod(parts)
  keys = np.unique(
    grid.processes.astype(np.int64).ravel() * nblocks + _blocks(grid, spec, ndim).ravel()
  )
  return np.bincount(keys // nblocks, minlength=nprocs) * block_bytes


def contiguous_blocks(grid: Grid, spec: Spec, shape: Sequence[int]) -> bool:
  """Whether every block of ``spec`` is one C-order run of the array's elements (a packed
  leaf's byte range can be read in part only so): single rows, then one range, then whole
  dimensions.

  >>> g = Grid(("x",), (2,), np.arange(2))
  >>> contiguous_blocks(g, (("x",), ()), (4, 3)), contiguous_blocks(g, ((), ("x",)), (4, 4))
  (True, False)
  """
  extent = [
    n // math.prod(grid.size(a) for a in (spec[d] if d < len(spec) else ()))
    for d, n in enumerate(shape)
  ]
  d = 0
  while d < len(shape) and extent[d] == 1:
    d += 1
  return all(extent[e] == shape[e] for e in range(d + 1, len(shape)))


def waves(costs: Sequence[int], budget: int) -> list[list[int]]:
  """Consecutive groups of the items (indices into ``costs``) whose costs fit ``budget``
  (one larger than the budget alone): the same on every process given the same costs.

  >>> waves([4, 4, 4, 9, 1], 8)
  [[0, 1], [2], [3], [4]]
  """
  out: list[list[int]] = []
  held = 0
  for i, c in enumerate(costs):
    if not out or held + c > budget:
      out.append([])
      held = 0
    out[-1].append(i)
    held += c
  return out
