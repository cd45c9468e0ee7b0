"""PURE: the layout of *pieces* (format 2): small device shards stored in the packs.

An array with a ``NamedSharding`` whose device shard is small (at most :data:`PIECE_BYTES`)
is not given a zarr array of its own (one object per shard, down to a few KiB at pod scale):
each distinct shard (a *chunk*; the chunk grid is the shard grid, chunk ``n`` in C order) is
written by one device, as its C-order little-endian bytes, into that device's process's pack.
No offsets are recorded: they follow from the sharding's structure alone, so every process
(and every reader) computes them alike:

- the writer of chunk ``n`` of leaf ``i`` is the device whose coordinates on the mesh axes
  splitting the array are the chunk's block, and whose replica number (its coordinates on the
  other axes, mixed radix in mesh order) is ``(spread(i) + n) % R`` (``chunks.local_writes``'
  rule for a shard of one cell); its process is ``meshes[m][position]``;
- process ``p``'s *pieces region* (at offset ``pieces`` of its pack) holds, for each pieced
  leaf in leaf order, the chunks ``p`` writes in increasing ``n``, back to back.

Work is O(mesh devices) numpy per distinct (mesh, splitting axes, ``spread(i) % R``) -- a
*group* -- and O(groups) per leaf, so planning stays flat in the number of processes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from .. import _state
from .chunks import _spread

__all__ = ["PIECE_BYTES", "PieceLeaf", "Layout", "build", "writers", "shift_of", "MAX_PIECE_WORK"]

# Device shards up to this size are stored as pieces: a pack's inner chunk (1 MiB), the unit
# storage is read and checked in. A piece no larger is fetched whole by any read of part of it
# anyway, so a resharded read costs no more than from a zarr array; a larger shard is its own
# zarr array, an object of more than 1 MiB with inner chunks that resharded reads fetch alone
# (with 8 MiB pieces, the bench's transformer restored onto another mesh read 2.06x the bytes
# it needed and took twice as long).
PIECE_BYTES = 1 << 20
# The chunk (one object, one write) of the packs of a save with pieces. Smaller than a plain
# pack's 64 MiB: pieces make packs large, and a pack chunk is staged and written whole (twice its
# size from the save's host budget), so a save with a small budget must not hold 128 MiB at
# once; 16 MiB objects stay large for any store.
PACK_CHUNK_BYTES = 16 << 20
# A bound on the numpy work a (possibly hostile) manifest may ask for: total chunks over groups.
MAX_PIECE_WORK = 1 << 27


@dataclasses.dataclass(frozen=True)
class PieceLeaf:
  """A pieced leaf: its ``index`` among the manifest's leaves, its mesh (index into the
  meshes), the mesh ``axis_sizes``, ``dim_axes`` (per array dimension, the mesh axes that
  split it, major first), ``shift`` (``spread(index) % replicas``) and the ``chunk`` (shard)
  shape and its byte size."""

  index: int
  mesh: int
  axis_sizes: tuple[int, ...]
  dim_axes: tuple[tuple[int, ...], ...]
  shift: int
  chunk: tuple[int, ...]
  nbytes: int

  @functools.cached_property
  def grid(self) -> tuple[int, ...]:
    """Chunks per dimension."""
    return tuple(math.prod(self.axis_sizes[a] for a in axes) for axes in self.dim_axes)

  @property
  def key(self) -> tuple:
    return (self.mesh, self.axis_sizes, self.dim_axes, self.shift)


def shift_of(index: int, axis_sizes: Sequence[int], dim_axes: Sequence[Sequence[int]]) -> int:
  """``spread(index) % R``: the replica that writes chunk 0 (``R``: replicas of a shard).

  >>> shift_of(0, (2, 4), ((0,),))
  0
  """
  used = {a for axes in dim_axes for a in axes}
  replicas = math.prod(n for a, n in enumerate(axis_sizes) if a not in used)
  return _spread(index) % replicas


def writers(
  procs: np.ndarray, axis_sizes: Sequence[int], dim_axes: Sequence[Sequence[int]], shift: int
) -> np.ndarray:
  """The process writing each chunk (C order over the grid), from ``procs``: the process of
  every mesh position (C order). O(chunks), numpy.

  >>> procs = np.array([0, 0, 1, 1])                  # a (2, 2) mesh, one row per process
  >>> writers(procs, (2, 2), ((1,),), shift=1).tolist()  # split by axis 1, 2 replicas
  [1, 0]
  """
  grid = [math.prod(axis_sizes[a] for a in axes) for axes in dim_axes]
  n = np.arange(math.prod(grid), dtype=np.int64)
  coord: list = [None] * len(axis_sizes)
  blocks = np.unravel_index(n, grid) if grid else ()
  for d, axes in enumerate(dim_axes):
    b = blocks[d]
    for a in reversed(axes):
      coord[a], b = b % axis_sizes[a], b // axis_sizes[a]
  unused = [a for a in range(len(axis_sizes)) if coord[a] is None]
  r = (shift + n) % max(1, math.prod(axis_sizes[a] for a in unused))
  for a in reversed(unused):
    coord[a], r = r % axis_sizes[a], r // axis_sizes[a]
  if not axis_sizes:
    return np.broadcast_to(procs[:1], n.shape).copy()
  return procs[np.ravel_multi_index(tuple(coord), tuple(axis_sizes))]


@dataclasses.dataclass(frozen=True, eq=False)
class _Group:
  writers: np.ndarray  # process of each chunk
  rank: np.ndarray  # each chunk's number among its writer's chunks of the leaf
  counts: np.ndarray  # chunks per process


def _group(procs: np.ndarray, leaf: PieceLeaf, processes: int) -> _Group:
  w = writers(procs, leaf.axis_sizes, leaf.dim_axes, leaf.shift)
  counts = np.bincount(w, minlength=processes)
  order = np.argsort(w, kind="stable")
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rank = np.empty(len(w), np.int64)
  rank[order] = np.arange(len(w)) - starts[w[order]]
  return _Group(w, rank, counts)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """Where every chunk of every pieced leaf is. ``region[p]``: bytes of process ``p``'s
  pieces region. Build with :func:`build`."""

  leaves: tuple[PieceLeaf, ...]
  processes: int
  groups: tuple[_Group, ...]
  group_of: tuple[int, ...]  # per leaf
  before: tuple  # per leaf: ((group, bytes per chunk of earlier leaves), ...)
  region: np.ndarray
  position: dict  # leaf index -> position in ``leaves``
  _mine: dict = dataclasses.field(default_factory=dict)  # (group, process) -> its chunks

  def leaf(self, index: int) -> PieceLeaf:
    return self.leaves[self.position[index]]

  def locate(self, index: int, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(writer process, offset in its pieces region) of chunks ``chunks`` of leaf ``index``.

    >>> lay = build([np.array([0, 1])], [PieceLeaf(3, 0, (2,), ((0,),), 0, (2,), 8)], 2)
    >>> [x.tolist() for x in lay.locate(3, np.array([0, 1]))]
    [[0, 1], [0, 0]]
    """
    k = self.position[index]
    leaf, g = self.leaves[k], self.groups[self.group_of[k]]
    procs = g.writers[chunks]
    start = g.rank[chunks] * leaf.nbytes
    for h, n in self.before[k]:
      start += self.groups[h].counts[procs] * n
    return procs, start

  def mine(self, index: int, process: int) -> tuple[np.ndarray, int]:
    """The chunks (increasing) leaf ``index`` has in ``process``'s region and where they
    start in it (they lie back to back).

    >>> a = PieceLeaf(0, 0, (2,), ((0,),), 0, (2,), 8)
    >>> b = PieceLeaf(1, 0, (2,), ((0,),), 0, (2,), 4)
    >>> lay = build([np.array([0, 1])], [a, b], 2)
    >>> lay.mine(1, 1)[0].tolist(), lay.mine(1, 1)[1]   # after its 8 bytes of leaf 0
    ([1], 8)
    """
    k = self.position[index]
    key = (self.group_of[k], process)
    if key not in self._mine:
      self._mine[key] = np.flatnonzero(self.groups[key[0]].writers == process)
    start = sum(int(self.groups[h].counts[process]) * n for h, n in self.before[k])
    return self._mine[key], start


def build(meshes: Sequence[np.ndarray], leaves: Sequence[PieceLeaf], processes: int) -> Layout:
  """The layout of ``leaves`` (in leaf order) over ``meshes`` (each: the process of every
  mesh position, C order). Raises ``ValueError`` if a region would exceed 2^62 bytes or the
  work bound.

  >>> lay = build([np.array([0, 0, 1, 1])],
  ...             [PieceLeaf(0, 0, (2, 2), ((0,), (1,)), 0, (2, 2), 16)], 2)
  >>> lay.region.tolist()
  [32, 32]
  """
  key = (tuple(leaves), tuple(m.tobytes() for m in meshes), processes)
  last = _state.pieces.last  # (key, layout) of the latest build (a training loop's saves): one
  if last is not None and last[0] == key:  # tuple, read and replaced whole: concurrent saves
    return last[1]  # and restores never see another key's layout
  layout = _build(meshes, leaves, processes)
  _state.pieces.last = (key, layout)
  return layout


def _build(meshes: Sequence[np.ndarray], leaves: Sequence[PieceLeaf], processes: int) -> Layout:
  keys: dict[tuple, int] = {}
  groups: list[_Group] = []
  group_of = []
  work = 0
  for leaf in leaves:
    g = keys.get(leaf.key)
    if g is None:
      work += math.prod(leaf.grid)
      if work > MAX_PIECE_WORK:
        raise ValueError(f"more than {MAX_PIECE_WORK} distinct pieces to lay out")
      g = keys[leaf.key] = len(groups)
      groups.append(_group(meshes[leaf.mesh], leaf, processes))
    group_of.append(g)
  before = []
  total = [0] * len(groups)
  for k, leaf in enumerate(leaves):
    before.append(tuple((h, n) for h, n in enumerate(total) if n))
    total[group_of[k]] += leaf.nbytes
  region = np.zeros(processes, np.int64)
  limit = 1 << 62
  for group, t in zip(groups, total):
    if (
      int(group.counts.max(initial=0)) * t > limit
      or int(region.max(initial=0)) + int(group.counts.max(initial=0)) * t > limit
    ):
      raise ValueError("a pieces region would exceed 2^62 bytes")
    region += group.counts * t
  return Layout(
    leaves=tuple(leaves),
    processes=processes,
    groups=tuple(groups),
    group_of=tuple(group_of),
    before=tuple(before),
    region=region,
    position={leaf.index: k for k, leaf in enumerate(leaves)},
  )
