"""Save's side of pieces (docs/format.md): which leaves are pieced, their manifest fields, the
meshes' process maps, and the chunks this process puts into its pack's pieces region (the
layout itself is :mod:`fnckpt._layout.pieces`, pure)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np

from .. import _state
from .._errors import CheckpointError
from .._format import records as _records
from .._layout import chunks as _chunks
from .._layout import pieces as _pieces
from .copies import Copies
from .staged_leaf import Staged

__all__ = ["PackPart", "Planner", "mesh_processes", "stage_buffer"]


@dataclasses.dataclass(frozen=True)
class PackPart:
  """Bytes ``[offset, offset + nbytes)`` of this process's pack: record ``leaf``'s bytes
  (a whole packed leaf, or one chunk of a pieced one), staged by ``make(copies)`` (the save's
  ``copies.Copies``) when needed."""

  offset: int
  nbytes: int
  leaf: int
  make: Callable[[], Any] = dataclasses.field(compare=False)
  shard: Any = dataclasses.field(default=None, compare=False)  # the device buffer (pieces)


@_state.memo(16)
def mesh_processes(mesh: Any) -> np.ndarray:
  """The process of every device of ``mesh``, C order over mesh positions (once per mesh;
  read-only, as the manifest's ``meshes`` records hold it).

  >>> mesh_processes(jax.make_mesh((1,), ("a",))).tolist()
  [0]
  """
  procs = np.fromiter(
    (d.process_index for d in mesh.devices.flat), np.int64, count=mesh.devices.size
  )
  procs.flags.writeable = False
  return procs


@dataclasses.dataclass
class _Leaf:
  index: int
  data: Any
  info: _chunks.ShardingInfo
  spec: _pieces.PieceLeaf


class Planner:
  """Collects a save's pieced leaves (:meth:`consider`, in leaf order), then lays them out
  (:meth:`finish`). ``piece_bytes``: the largest shard stored as pieces (0: none).
  ``meshes``: per mesh of the pieced leaves, the process of each position (the manifest's).

  >>> p = Planner(piece_bytes=0)
  >>> p.consider(0, _records.Leaf(0, (), "array"), None), p.finish(), p.meshes
  (None, {}, [])
  """

  def __init__(self, piece_bytes: int = _pieces.PIECE_BYTES):
    self.piece_bytes = piece_bytes
    self.leaves: list[_Leaf] = []
    self.meshes: list[np.ndarray] = []
    self._mesh_index: dict[bytes, int] = {}
    self._mesh_of: dict[Any, int] = {}  # per mesh object (each mapped once)
    self.layout: _pieces.Layout | None = None  # every pieced leaf: the writer rule
    self.regions: _pieces.Layout | None = None  # those in this save's own packs' regions
    self._apart: frozenset[int] = frozenset()  # those written on their own (candidates)

  def consider(self, i: int, rec: _records.Leaf, data: Any) -> _records.Leaf | None:
    """Record ``i`` stored as pieces, if it qualifies (a jax array with a NamedSharding whose
    shard is non-empty and at most ``piece_bytes``): with ``pieces`` and ``sharding.mesh``."""
    if not self.piece_bytes or rec.kind != "array" or not isinstance(data, jax.Array):
      return None
    sharding = data.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
      return None
    info = _chunks.sharding_info(sharding)
    shape, itemsize = tuple(data.shape), np.dtype(data.dtype).itemsize
    if info is None or len(info.dim_axes) > len(shape):
      return None
    try:
      shard = _chunks.shard_shape_of(info, shape)
    except CheckpointError:
      return None
    n = _chunks.nbytes(shard, itemsize)
    if not 0 < n <= self.piece_bytes:
      return None
    m = self._mesh(sharding.mesh)
    dim_axes = info.dim_axes + ((),) * (len(shape) - len(info.dim_axes))
    spec = _pieces.PieceLeaf(
      index=i,
      mesh=m,
      axis_sizes=info.axis_sizes,
      dim_axes=dim_axes,
      shift=_pieces.shift_of(i, info.axis_sizes, dim_axes),
      chunk=shard,
      nbytes=n,
    )
    self.leaves.append(_Leaf(i, data, info, spec))
    assert rec.sharding is not None
    return dataclasses.replace(
      rec,
      sharding=dataclasses.replace(rec.sharding, mesh=m),
      pieces=_records.Pieces(tuple(shard), m),
    )

  def _mesh(self, mesh: Any) -> int:
    if mesh in self._mesh_of:
      return self._mesh_of[mesh]
    procs = mesh_processes(mesh)
    key = procs.tobytes()
    if key not in self._mesh_index:
      self._mesh_index[key] = len(self.meshes)
      self.meshes.append(procs)
    self._mesh_of[mesh] = self._mesh_index[key]
    return self._mesh_index[key]

  def finish(self, apart: Any = ()) -> dict[int, int]:
    """Lay the pieced leaves out; returns each writing process's region bytes. The leaves in
    ``apart`` (those that may reuse a base's runs) have no place in the regions: each
    process's run of them goes to the writer's pack segments (:meth:`runs`)."""
    if not self.leaves:
      return {}
    nproc = jax.process_count()
    self._apart = frozenset(apart)
    self.layout = _pieces.build(self.meshes, [l.spec for l in self.leaves], nproc)
    rest = [l.spec for l in self.leaves if l.index not in self._apart]
    self.regions = (
      self.layout if not self._apart else _pieces.build(self.meshes, rest, nproc) if rest else None
    )
    if self.regions is None:
      return {}
    return {int(p): int(self.regions.region[p]) for p in np.flatnonzero(self.regions.region)}

  def parts(self, start: int, me: int) -> list[PackPart]:
    """The chunks this process writes into its pack's region, each at its offset (the region
    starts at ``start``)."""
    return [
      part
      for leaf in self.leaves
      if leaf.index not in self._apart
      for part in self._leaf_parts(leaf, me, start)
    ]

  def runs(self, me: int) -> list[tuple[int, list[PackPart]]]:
    """Per leaf written apart, this process's run: its chunks (offsets from the run's start)."""
    out = []
    for leaf in self.leaves:
      if leaf.index in self._apart:
        got = self._leaf_parts(leaf, me, None)
        if got:
          out.append((leaf.index, got))
    return out

  def _leaf_parts(self, leaf: _Leaf, me: int, start: int | None) -> list[PackPart]:
    """The chunks of ``leaf`` this process writes, back to back from ``start`` plus its place
    in the region (``start`` None: from 0, a run on its own)."""
    out = []
    if start is None:
      assert self.layout is not None
      chunks, at, start = self.layout.mine(leaf.index, me)[0], 0, 0
    else:
      assert self.regions is not None
      chunks, at = self.regions.mine(leaf.index, me)
    units = _units(leaf)
    if [n for n, _ in units] != chunks.tolist():
      raise CheckpointError(
        f"Internal error planning the pieces of leaf #{leaf.index}: this process "
        f"(#{me}) holds chunks {[n for n, _ in units][:8]} to write, the layout says "
        f"{chunks.tolist()[:8]}. Please report this; save with compression= to avoid "
        "pieces meanwhile."
      )
    shards = {s.device: s for s in leaf.data.addressable_shards} if units else {}
    for k, (_, unit) in enumerate(units):
      shard = shards[unit.device]
      out.append(
        PackPart(
          start + at + k * leaf.spec.nbytes,
          leaf.spec.nbytes,
          leaf.index,
          functools.partial(_stage_shard, shard, leaf.data.dtype),
          shard.data,
        )
      )
    return out


def _units(leaf: _Leaf) -> list[tuple[int, _chunks.WriteUnit]]:
  """(chunk number, unit) of the chunks this process writes, by ``local_writes``' rule (the
  write plan, cached per leaf: a shard of at most 8 MiB is never split, so its chunk is the
  shard)."""
  shape, chunk = tuple(leaf.data.shape), leaf.spec.chunk
  got, units = _chunks.plan_write(
    leaf.data.sharding, shape, np.dtype(leaf.data.dtype).itemsize, salt=leaf.index
  )
  if tuple(got) != chunk:
    layout = _chunks.WriteLayout(shape, chunk, _chunks.local_shards(leaf.info, shape))
    units = _chunks.local_writes(layout, salt=leaf.index)
  return sorted((_chunks._cell_number(u.index, chunk, shape), u) for u in units)


def _stage_shard(shard: Any, dtype: Any, copies: Copies) -> Any:
  """One device shard staged (a copy the save owns, or a view of a CPU buffer: ``copies``)."""
  return stage_buffer(shard.data, shard.device, dtype, copies)


def stage_buffer(buffer: jax.Array, device: Any, dtype: Any, copies: Copies) -> Any:
  """One device's array (a shard on ``device``) staged whole."""
  shape = tuple(buffer.shape)
  whole = tuple(slice(0, n) for n in shape)
  return Staged(shape, np.dtype(dtype), [(whole, copies.get(buffer, device=device))])
