"""PURE: chunk shapes, the write plan and the read plan. Data in, data out; no devices, no I/O.

Terms. An array's *write chunk* is one zarr3 chunk (one ``sharding_indexed`` shard file). It is
the device shard of the saved sharding, or a piece of it when a large shard is replicated: then
the pieces (never under ``MIN_SPLIT_CHUNK_BYTES``) are written by different replicas
(replica-parallel writes), still one writer per chunk. Inside a chunk, *inner chunks* (each
crc32c-checked) are the unit a reader fetches, so a resharded restore reads only the inner
chunks it needs.

Planning is O(leaves + local shards) per process. A ``NamedSharding`` is reduced once to a
:class:`ShardingInfo` (mesh axis sizes, which mesh axes split which dimension, and where this
process's devices sit in the mesh); every local device's shard index and replica number follow
from its mesh coordinates alone, so no process ever walks the global device list. Other
shardings (single-device, GSPMD, ...) take the generic path through ``devices_indices_map``,
which gives the same result. Layouts are cached per (sharding, shape, itemsize) and whole leaf
plans per (sharding, shape, itemsize, salt), in bounded LRU caches, so the steady state of a
training loop plans nothing anew.

Who writes what (every process decides alike, without talking): piece ``p`` of a shard held by
``R`` replicas and cut into ``k`` pieces is written by replica
``(spread(salt) + n0 + p * max(1, R // k)) % R``, where ``n0`` is the number of the shard's
first cell in the chunk grid and ``salt`` is any int the processes agree on (the leaf's index
in the tree). Pieces of one shard go to ``k`` different replicas spaced evenly among all ``R``
(so, on a multi-axis mesh, on different hosts); different shards and different leaves start at
different replicas, so the bytes of replicated leaves spread over processes.

Indices are tuples of ``(start, stop)`` pairs, one per dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

import numpy as np

from .. import _state
from .._errors import CheckpointError

__all__ = [
  "Index",
  "WriteUnit",
  "ShardingInfo",
  "LocalShard",
  "WriteLayout",
  "normalize_index",
  "chunk_shape",
  "inner_chunk_shape",
  "nbytes",
  "shard_shape_of",
  "shard_index",
  "replica_id",
  "local_shards",
  "write_layout",
  "generic_write_layout",
  "local_writes",
  "local_reads",
  "sharding_info",
  "plan_write",
  "plan_read",
  "clear_plan_caches",
  "write_plan",
  "read_plan",
  "replica_count",
]

Index = tuple[tuple[int, int], ...]

# A replicated shard at least this large is split so that several replicas write a piece ...
SPLIT_REPLICATED_BYTES = 16 << 20
# ... but never into pieces smaller than this: an object store pays per object, and a 32 MiB
# shard replicated 4,096 ways must not become 4,096 objects of 8 KiB (it becomes 4 of 8 MiB).
MIN_SPLIT_CHUNK_BYTES = 8 << 20
# Inner chunks (the unit of a partial read and of a checksum) are at most this large.
INNER_CHUNK_BYTES = 1 << 20
# Entries of each plan cache keyed by sharding and shape (a model has dozens of distinct ones),
# and of the cache of whole leaf plans (one per array leaf: more leaves than this are planned
# anew at each save, in O(local devices) each). All are bounded LRU caches.
PLAN_CACHE_SIZE = 1024
LEAF_PLAN_CACHE_SIZE = 4096


@dataclass(frozen=True, slots=True)
class WriteUnit:
  """One chunk to write: its global index, the device that holds it, and where the chunk
  sits inside that device's shard (``local``, relative to the shard)."""

  index: Index
  device: Hashable
  local: Index


@dataclass(frozen=True, slots=True)
class ShardingInfo:
  """A ``NamedSharding`` reduced to what planning needs, as one process sees it.

  ``axis_sizes``: the mesh axis sizes, in mesh order. ``dim_axes``: one entry per
  PartitionSpec entry, the positions (in ``axis_sizes``) of the mesh axes that split that
  array dimension, major first: ``P(None, ("b", "a"))`` on axes ``("a", "b")`` is
  ``((), (1, 0))``; dimensions past the spec are whole. ``devices``: this process's devices
  (any hashable: JAX devices, or ints in a simulation) in mesh order, and ``coords``: the
  position of each in the mesh.

  >>> info = ShardingInfo((2, 4), ((0,),), devices=("d0", "d5"), coords=((0, 0), (1, 1)))
  >>> info.replicas  # the unused axis of size 4
  4
  """

  axis_sizes: tuple[int, ...]
  dim_axes: tuple[tuple[int, ...], ...]
  devices: tuple[Hashable, ...] = ()
  coords: tuple[tuple[int, ...], ...] = ()

  def __post_init__(self) -> None:
    used = [a for axes in self.dim_axes for a in axes]
    if len(set(used)) != len(used) or not all(0 <= a < len(self.axis_sizes) for a in used):
      raise ValueError(f"mesh axes {self.dim_axes} must be distinct positions in {self.axis_sizes}")
    if len(self.devices) != len(self.coords) or not all(
      len(c) == len(self.axis_sizes) and all(0 <= x < n for x, n in zip(c, self.axis_sizes))
      for c in self.coords
    ):
      raise ValueError(
        f"coords {self.coords} do not place {len(self.devices)} devices in a "
        f"mesh of shape {self.axis_sizes}"
      )

  @property
  def unused_axes(self) -> tuple[int, ...]:
    """The mesh axes that split no dimension: devices differing only there are replicas."""
    used = {a for axes in self.dim_axes for a in axes}
    return tuple(a for a in range(len(self.axis_sizes)) if a not in used)

  @property
  def replicas(self) -> int:
    """How many devices hold each shard."""
    return math.prod(self.axis_sizes[a] for a in self.unused_axes)


@dataclass(frozen=True, slots=True)
class LocalShard:
  """One device of this process and the shard it holds. ``replica`` (``0 .. replicas - 1``)
  numbers the devices holding that same shard, alike in every process."""

  device: Hashable
  index: Index
  replica: int
  replicas: int


@dataclass(frozen=True, slots=True)
class WriteLayout:
  """What a leaf's write depends on besides its salt: the array shape, the write chunk, and
  this process's shards (each device once)."""

  shape: tuple[int, ...]
  chunk: tuple[int, ...]
  shards: tuple[LocalShard, ...]


def nbytes(shape: Sequence[int], itemsize: int) -> int:
  return int(math.prod(shape)) * itemsize


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
  """JAX's tuple of slices -> ``((start, stop), ...)``.

  >>> normalize_index((slice(0, 4), slice(None)), (8, 3))
  ((0, 4), (0, 3))
  """
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided shard index {s} is not supported")
    out.append((start, stop))
  return tuple(out)


def _smallest_factor(n: int) -> int:
  for p in range(2, int(math.isqrt(n)) + 1):
    if n % p == 0:
      return p
  return n


def _largest_divisor_at_most(n: int, k: int) -> int:
  return next(d for d in range(min(n, k), 0, -1) if n % d == 0)


def chunk_shape(
  shard_shape: Sequence[int],
  replicas: int,
  itemsize: int,
  split_bytes: int = SPLIT_REPLICATED_BYTES,
  min_bytes: int = MIN_SPLIT_CHUNK_BYTES,
) -> tuple[int, ...]:
  """The write chunk: the shard, or, when the shard is replicated and at least
  ``split_bytes``, a piece of it, so that up to ``replicas`` replicas write one piece each.
  Pieces are never smaller than ``min_bytes``. The split takes the first dimension that
  divides, largest pieces count first, and goes on into the next dimensions only past a
  dimension split down to 1 (pieces stay contiguous in memory when the leading dimension
  divides). Chunks are never empty.

  >>> chunk_shape((4, 8), replicas=1, itemsize=4)
  (4, 8)
  >>> chunk_shape((1024, 4096), replicas=4096, itemsize=8)  # 32 MiB: 4 pieces of 8 MiB
  (256, 4096)
  >>> chunk_shape((2, 8), replicas=4, itemsize=1, split_bytes=1, min_bytes=1)
  (1, 4)
  """
  chunk = [max(1, s) for s in shard_shape]
  size = nbytes(chunk, itemsize)
  if replicas <= 1 or not chunk or size < split_bytes:
    return tuple(chunk)
  left = min(replicas, size // max(1, min_bytes))
  for dim, n in enumerate(chunk):
    pieces = _largest_divisor_at_most(n, left) if left > 1 else 1
    if pieces == 1:
      if left <= 1:
        break
      continue
    chunk[dim] = n // pieces
    left //= pieces
    if chunk[dim] > 1:
      break
  return tuple(chunk)


def inner_chunk_shape(
  chunk: Sequence[int], itemsize: int, target_bytes: int = INNER_CHUNK_BYTES
) -> tuple[int, ...]:
  """Divide the chunk (each inner dimension divides the chunk's) until an inner chunk holds at
  most ``target_bytes``, always halving (or dividing by the smallest factor of) the largest
  dimension, so inner chunks stay close to square and a resharded read that slices any
  dimension fetches little it does not need.

  >>> inner_chunk_shape((4096, 4096), itemsize=4, target_bytes=4 << 20)
  (1024, 1024)
  """
  inner = list(chunk)
  while inner and nbytes(inner, itemsize) > target_bytes:
    dim = max(range(len(inner)), key=lambda d: inner[d])
    if inner[dim] <= 1:
      break
    inner[dim] //= _smallest_factor(inner[dim])
  return tuple(inner)


def _chunks_of(index: Index, chunk: Sequence[int]) -> list[Index]:
  """The chunk-grid cells covering ``index`` (which must be aligned to the grid), C order."""
  ranges = []
  for (start, stop), c in zip(index, chunk):
    if start % c != 0:
      raise ValueError(f"shard starting at {start} is not aligned to chunks of {c}")
    ranges.append([(a, min(a + c, stop)) for a in range(start, stop, c)])
  cells: list[Index] = [()]
  for r in ranges:
    cells = [cell + (piece,) for cell in cells for piece in r]
  return cells


# --- the structural planner: a NamedSharding's local shards from mesh coordinates ----------


def shard_shape_of(info: ShardingInfo, shape: Sequence[int]) -> tuple[int, ...]:
  """Every device's shard shape under ``info``. Like JAX, refuses a dimension the sharding
  does not divide evenly, and a spec longer than the array's rank.

  >>> shard_shape_of(ShardingInfo((2, 4), ((0,), (1,))), (8, 12))
  (4, 3)
  """
  if len(info.dim_axes) > len(shape):
    raise CheckpointError(
      f"A PartitionSpec of {len(info.dim_axes)} entries cannot shard an array of shape "
      f"{tuple(shape)} (rank {len(shape)}); use a spec with at most {len(shape)} entries."
    )
  out = []
  for d, n in enumerate(shape):
    parts = math.prod(info.axis_sizes[a] for a in info.dim_axes[d]) if d < len(info.dim_axes) else 1
    if n % parts:
      raise CheckpointError(
        f"The sharding splits dimension {d} of shape {tuple(shape)} into {parts} parts, "
        f"which do not divide {n}; JAX needs even shards: choose a PartitionSpec whose mesh "
        "axes divide every sharded dimension."
      )
    out.append(n // parts)
  return tuple(out)


def _mixed_radix(coord: Sequence[int], axes: Iterable[int], sizes: Sequence[int]) -> int:
  i = 0
  for a in axes:
    i = i * sizes[a] + coord[a]
  return i


def shard_index(info: ShardingInfo, coord: Sequence[int], shard_shape: Sequence[int]) -> Index:
  """The shard held by the device at mesh position ``coord``: along dimension ``d``, block
  number = the device's coordinates on the axes splitting ``d``, read as a mixed-radix
  number (major axis first).

  >>> info = ShardingInfo((2, 4), ((1, 0),))          # P(("b", "a")) on axes ("a", "b")
  >>> shard_index(info, (1, 2), shard_shape_of(info, (16,)))  # block 2 * 2 + 1 = 5
  ((10, 12),)
  """
  out = []
  for d, s in enumerate(shard_shape):
    block = _mixed_radix(coord, info.dim_axes[d], info.axis_sizes) if d < len(info.dim_axes) else 0
    out.append((block * s, block * s + s))
  return tuple(out)


def replica_id(info: ShardingInfo, coord: Sequence[int]) -> int:
  """The device's number among the devices holding its shard: its coordinates on the unused
  axes as a mixed-radix number (mesh order), which is also JAX's ``Shard.replica_id``.

  >>> replica_id(ShardingInfo((2, 4), ((0,),)), (1, 3))
  3
  """
  return _mixed_radix(coord, info.unused_axes, info.axis_sizes)


def local_shards(info: ShardingInfo, shape: Sequence[int]) -> tuple[LocalShard, ...]:
  """This process's devices with their shard and replica number, in O(local devices).

  >>> info = ShardingInfo((2, 2), ((0,),), devices=("d2", "d3"), coords=((1, 0), (1, 1)))
  >>> [(s.device, s.index, s.replica) for s in local_shards(info, (4, 3))]
  [('d2', ((2, 4), (0, 3)), 0), ('d3', ((2, 4), (0, 3)), 1)]
  """
  shard = shard_shape_of(info, shape)
  replicas = info.replicas
  return tuple(
    LocalShard(d, shard_index(info, c, shard), replica_id(info, c), replicas)
    for d, c in zip(info.devices, info.coords)
  )


def _write_chunk(
  shard_shape: Sequence[int],
  replicas: int,
  itemsize: int,
  shape: Sequence[int],
  split: tuple[int, int],
) -> tuple[int, ...]:
  # an empty array is never split (there is nothing to write), whatever its replication
  return chunk_shape(shard_shape, replicas if math.prod(shape) else 1, itemsize, *split)


@_state.memo(PLAN_CACHE_SIZE)
def _cached_write_layout(
  info: ShardingInfo, shape: tuple[int, ...], itemsize: int, split: tuple[int, int]
) -> WriteLayout:
  chunk = _write_chunk(shard_shape_of(info, shape), info.replicas, itemsize, shape, split)
  return WriteLayout(shape, chunk, local_shards(info, shape))


def write_layout(
  info: ShardingInfo,
  shape: Sequence[int],
  itemsize: int,
  split_bytes: int = SPLIT_REPLICATED_BYTES,
  min_bytes: int = MIN_SPLIT_CHUNK_BYTES,
) -> WriteLayout:
  """The write chunk (:func:`chunk_shape` with ``split_bytes`` and ``min_bytes``) and this
  process's shards, in O(local devices); cached (bounded LRU) per argument values.

  >>> info = ShardingInfo((4,), ((),), devices=(0,), coords=((0,),))  # 4 replicas
  >>> layout = write_layout(info, (1024, 8192), itemsize=4)         # a 32 MiB shard
  >>> layout.chunk, layout.shards[0].replicas
  ((256, 8192), 4)
  """
  return _cached_write_layout(
    info, tuple(int(n) for n in shape), int(itemsize), (int(split_bytes), int(min_bytes))
  )


# --- the generic planner: any sharding, from the map of every device to its shard ---------


def replica_count(shards: Mapping[Hashable, Index]) -> int:
  """How many devices hold each distinct shard (the smallest count, to be safe)."""
  counts: dict[Index, int] = {}
  for index in shards.values():
    counts[index] = counts.get(index, 0) + 1
  return min(counts.values()) if counts else 1


def _generic_local_shards(
  shards: Mapping[Hashable, Index], local_devices: Iterable[Hashable]
) -> tuple[LocalShard, ...]:
  """Replica ``r`` of a shard is the r-th device holding it in the map's order (which every
  process sees alike). O(all devices)."""
  local = set(local_devices)
  by_index: dict[Index, list[Hashable]] = {}
  for device, index in shards.items():
    by_index.setdefault(index, []).append(device)
  return tuple(
    LocalShard(d, index, r, len(devices))
    for index, devices in by_index.items()
    for r, d in enumerate(devices)
    if d in local
  )


def generic_write_layout(
  shards: Mapping[Hashable, Index],
  local_devices: Iterable[Hashable],
  shape: Sequence[int],
  shard_shape: Sequence[int],
  itemsize: int,
  split_bytes: int = SPLIT_REPLICATED_BYTES,
  min_bytes: int = MIN_SPLIT_CHUNK_BYTES,
) -> WriteLayout:
  """As :func:`write_layout`, for any sharding, from ``shards``: the map of *every* device
  (across all processes) to its shard index, in the sharding's device order.

  >>> shards = {"d0": ((0, 4),), "d1": ((0, 4),), "d2": ((4, 8),), "d3": ((4, 8),)}
  >>> layout = generic_write_layout(shards, ["d1"], (8,), (4,), itemsize=4)
  >>> layout.chunk, layout.shards
  ((4,), (LocalShard(device='d1', index=((0, 4),), replica=1, replicas=2),))
  """
  shape = tuple(int(n) for n in shape)
  chunk = _write_chunk(
    shard_shape, replica_count(shards), itemsize, shape, (split_bytes, min_bytes)
  )
  return WriteLayout(shape, chunk, _generic_local_shards(shards, local_devices))


# --- who writes which chunk ---------------------------------------------------------------


def _spread(salt: int) -> int:
  """A fixed integer hash (Fibonacci hashing): alike in every process, unlike ``hash()``."""
  return ((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32


def _cell_number(cell: Index, chunk: Sequence[int], shape: Sequence[int]) -> int:
  """The C-order number of a cell in the chunk grid of an array of ``shape``."""
  n = 0
  for (start, _), c, size in zip(cell, chunk, shape):
    n = n * max(1, -(-size // c)) + start // c
  return n


def _relative(cell: Index, shard: Index) -> Index:
  return tuple((a - s, b - s) for (a, b), (s, _) in zip(cell, shard))


def local_writes(layout: WriteLayout, salt: int = 0) -> list[WriteUnit]:
  """The chunks this process writes, each from one of its devices: piece ``p`` of a shard cut
  into ``k`` cells and held by ``R`` replicas goes to replica
  ``(spread(salt) + n0 + p * max(1, R // k)) % R`` (``n0``: the number of the shard's first
  cell in the chunk grid). Every chunk gets exactly one writer across all processes, and
  replicas share a shard's pieces evenly. ``salt``: an int every process agrees on, e.g. the
  leaf's index in the tree, so that replicated leaves spread over different replicas.

  >>> info = ShardingInfo((2,), ((),), devices=(0, 1), coords=((0,), (1,)))  # 2 replicas
  >>> layout = WriteLayout((8,), (4,), local_shards(info, (8,)))           # in 2 pieces
  >>> [(u.index, u.device) for u in local_writes(layout, salt=0)]
  [(((0, 4),), 0), (((4, 8),), 1)]
  """
  start = _spread(salt)
  units = []
  for s in layout.shards:
    cells = _chunks_of(s.index, layout.chunk)
    if not cells:
      continue
    base = start + _cell_number(cells[0], layout.chunk, layout.shape)
    stride = max(1, s.replicas // len(cells))
    for p, cell in enumerate(cells):
      if (base + p * stride) % s.replicas == s.replica:
        units.append(WriteUnit(cell, s.device, _relative(cell, s.index)))
  return units


def write_plan(
  shards: Mapping[Hashable, Index],
  local_devices: Iterable[Hashable],
  chunk: Sequence[int],
  salt: int = 0,
) -> list[WriteUnit]:
  """Which chunks this process writes, and from which of its devices, given ``shards``: the
  map of every device holding the array (across all processes) to its shard index. The
  generic, O(all devices) form of :func:`plan_write` with a given chunk (see
  :func:`local_writes` for who writes which piece).

  >>> shards = {"d0": ((0, 4),), "d1": ((0, 4),), "d2": ((4, 8),), "d3": ((4, 8),)}
  >>> [(u.index, u.device) for u in write_plan(shards, ["d0", "d1"], (2,))]
  [(((0, 2),), 'd0'), (((2, 4),), 'd1')]
  """
  ndim = len(next(iter(shards.values()), ()))
  shape = tuple(max((idx[d][1] for idx in shards.values()), default=0) for d in range(ndim))
  layout = WriteLayout(shape, tuple(chunk), _generic_local_shards(shards, local_devices))
  return local_writes(layout, salt)


# --- the read plan ------------------------------------------------------------------------


def read_plan(wanted: Mapping[Hashable, Index]) -> dict[Index, list[Hashable]]:
  """Group this process's devices by the slice each needs: every distinct slice is read once.

  >>> read_plan({"d0": ((0, 4),), "d1": ((0, 4),), "d2": ((4, 8),)})
  {((0, 4),): ['d0', 'd1'], ((4, 8),): ['d2']}
  """
  plan: dict[Index, list[Hashable]] = {}
  for device, index in wanted.items():
    plan.setdefault(index, []).append(device)
  return plan


def local_reads(info: ShardingInfo, shape: Sequence[int]) -> dict[Index, list[Hashable]]:
  """The distinct slices this process's devices need under ``info``, each with the devices
  that need it, in O(local devices).

  >>> info = ShardingInfo((2, 2), ((1,),), devices=(0, 1, 2), coords=((0, 0), (0, 1), (1, 0)))
  >>> local_reads(info, (4,))
  {((0, 2),): [0, 2], ((2, 4),): [1]}
  """
  shard = shard_shape_of(info, shape)
  return read_plan({d: shard_index(info, c, shard) for d, c in zip(info.devices, info.coords)})


# --- the adapter from JAX shardings (the only code here that looks at JAX objects) ---------


@_state.memo(16)
def _local_positions(mesh: Any) -> tuple[tuple[Hashable, ...], tuple[tuple[int, ...], ...]]:
  """This process's devices of ``mesh`` and their coordinates, in mesh order (once per mesh:
  it is the one O(all devices) step, done with numpy)."""
  local_ids = np.fromiter((d.id for d in mesh.local_devices), dtype=np.int64)
  where = np.argwhere(np.isin(mesh.device_ids, local_ids))
  devices = tuple(mesh.devices[tuple(c)] for c in where)
  return devices, tuple(tuple(int(x) for x in c) for c in where)


@_state.memo(PLAN_CACHE_SIZE)
def _named_info(sharding: Any) -> ShardingInfo | None:
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
    return None
  spec = sharding.spec
  if (
    getattr(sharding, "_logical_device_ids", None) is not None
    or getattr(spec, "unreduced", None)
    or getattr(spec, "reduced", None)
  ):
    return None
  names = list(sharding.mesh.axis_names)
  dim_axes = []
  for entry in spec:
    if entry is PartitionSpec.UNCONSTRAINED:
      return None
    axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    dim_axes.append(tuple(names.index(a) for a in axes))
  devices, coords = _local_positions(sharding.mesh)
  return ShardingInfo(tuple(sharding.mesh.devices.shape), tuple(dim_axes), devices, coords)


def sharding_info(sharding: Any) -> ShardingInfo | None:
  """The :class:`ShardingInfo` of a ``NamedSharding`` over a concrete mesh, for this process
  (cached per sharding); a ``ShardingInfo`` itself (a simulated sharding) as it is; ``None``
  for any other sharding (and for specs with unreduced, reduced or unconstrained axes, or
  custom device ids), which then takes the generic path.

  >>> import jax
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((1,), ("a",))
  >>> sharding_info(NamedSharding(mesh, P(None, "a"))).dim_axes
  ((), (0,))
  """
  return sharding if isinstance(sharding, ShardingInfo) else _named_info(sharding)


def _about(sharding: Any, shape: tuple[int, ...], e: CheckpointError) -> CheckpointError:
  return CheckpointError(f"{e} (sharding {sharding}, shape {shape})")


@_state.memo(PLAN_CACHE_SIZE)
def _generic_layout(sharding: Any, shape: tuple[int, ...], itemsize: int) -> WriteLayout:
  shards = {
    d: normalize_index(idx, shape) for d, idx in sharding.devices_indices_map(shape).items()
  }
  return generic_write_layout(
    shards, sharding.addressable_devices, shape, sharding.shard_shape(shape), itemsize
  )


@_state.memo(LEAF_PLAN_CACHE_SIZE)
def _cached_plan_write(
  sharding: Any, shape: tuple[int, ...], itemsize: int, salt: int
) -> tuple[tuple[int, ...], tuple[WriteUnit, ...]]:
  info = sharding_info(sharding)
  try:
    layout = (
      write_layout(info, shape, itemsize)
      if info is not None
      else _generic_layout(sharding, shape, itemsize)
    )
  except CheckpointError as e:
    raise _about(sharding, shape, e) from None
  return layout.chunk, tuple(local_writes(layout, salt))


def plan_write(
  sharding: Any, shape: Sequence[int], itemsize: int, salt: int = 0
) -> tuple[tuple[int, ...], list[WriteUnit]]:
  """The write chunk of an array with this sharding (JAX's, or a :class:`ShardingInfo`),
  shape and item size, and the chunks this process writes (see :func:`local_writes`;
  ``salt``: the leaf's index in the tree). O(local devices) for a ``NamedSharding``; cached
  per (sharding, shape, itemsize, salt), so the saves of a training loop after the first
  plan nothing (while the tree has at most ``LEAF_PLAN_CACHE_SIZE`` array leaves).

  >>> import jax
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> s = NamedSharding(jax.make_mesh((1,), ("a",)), P("a"))
  >>> chunk, units = plan_write(s, (8, 2), itemsize=4, salt=3)
  >>> chunk, [u.index for u in units]
  ((8, 2), [((0, 8), (0, 2))])
  """
  chunk, units = _cached_plan_write(
    sharding, tuple(int(n) for n in shape), int(itemsize), int(salt)
  )
  return chunk, list(units)


@_state.memo(PLAN_CACHE_SIZE)
def _read_groups(
  sharding: Any, shape: tuple[int, ...]
) -> tuple[tuple[Index, tuple[Hashable, ...]], ...]:
  info = sharding_info(sharding)
  try:
    plan = (
      local_reads(info, shape)
      if info is not None
      else read_plan(
        {
          d: normalize_index(idx, shape)
          for d, idx in sharding.addressable_devices_indices_map(shape).items()
        }
      )
    )
  except CheckpointError as e:
    raise _about(sharding, shape, e) from None
  return tuple((index, tuple(devices)) for index, devices in plan.items())


def plan_read(sharding: Any, shape: Sequence[int]) -> dict[Index, list[Hashable]]:
  """The distinct slices this process's devices need for an array of ``shape`` placed with
  this sharding (JAX's, or a :class:`ShardingInfo`), each with the devices that need it (a
  new dict each call). O(local devices) for a ``NamedSharding``; cached per (sharding,
  shape).

  >>> import jax
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> s = NamedSharding(jax.make_mesh((1,), ("a",)), P())
  >>> list(plan_read(s, (4, 2)))
  [((0, 4), (0, 2))]
  """
  return {
    index: list(devices) for index, devices in _read_groups(sharding, tuple(int(n) for n in shape))
  }


def clear_plan_caches() -> None:
  """Empty every plan cache of this module (they are bounded; this is for benchmarks and
  tests that measure a first save)."""
  for cache in (
    _local_positions,
    _named_info,
    _cached_write_layout,
    _generic_layout,
    _cached_plan_write,
    _read_groups,
  ):
    cache.cache_clear()  # type: ignore[attr-defined]  # (each an lru_cache)
