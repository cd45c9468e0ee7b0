"""PURE: chunk shapes, the write plan and the read plan. Data in, data out; no devices, no I/O.

Terms. An array's *write chunk* is one zarr3 chunk (one ``sharding_indexed`` shard file). It is
the device shard of the saved sharding, or a piece of it when a large shard is replicated: then
each replica writes one piece (replica-parallel writes), still one writer per chunk. Inside a
chunk, *inner chunks* (each crc32c-checked) are the unit a reader fetches, so a resharded
restore reads only the inner chunks it needs.

Indices are tuples of ``(start, stop)`` pairs, one per dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

__all__ = ["Index", "WriteUnit", "normalize_index", "chunk_shape", "inner_chunk_shape",
           "write_plan", "read_plan", "replica_count", "nbytes"]

Index = tuple[tuple[int, int], ...]

# A replicated shard at least this large is split so that every replica writes a piece.
SPLIT_REPLICATED_BYTES = 16 << 20
# Inner chunks (the unit of a partial read and of a checksum) are at most this large.
INNER_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class WriteUnit:
  """One chunk to write: its global index, the device that holds it, and where the chunk
  sits inside that device's shard (``local``, relative to the shard)."""
  index: Index
  device: Hashable
  local: Index


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
  return max(d for d in range(1, min(n, k) + 1) if n % d == 0)


def chunk_shape(shard_shape: Sequence[int], replicas: int, itemsize: int,
                split_bytes: int = SPLIT_REPLICATED_BYTES) -> tuple[int, ...]:
  """The write chunk: the shard, split into up to ``replicas`` pieces along its leading
  dimension when the shard is replicated and large (pieces stay contiguous in memory).
  Chunks are never empty.

  >>> chunk_shape((4, 8), replicas=1, itemsize=4)
  (4, 8)
  >>> chunk_shape((1024, 4096), replicas=4, itemsize=4)
  (256, 4096)
  """
  chunk = [max(1, s) for s in shard_shape]
  if replicas > 1 and chunk and nbytes(chunk, itemsize) >= split_bytes:
    for dim, n in enumerate(chunk):
      pieces = _largest_divisor_at_most(n, replicas)
      if pieces > 1:
        chunk[dim] //= pieces
        break
  return tuple(chunk)


def inner_chunk_shape(chunk: Sequence[int], itemsize: int,
                      target_bytes: int = INNER_CHUNK_BYTES) -> tuple[int, ...]:
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
  """The chunk-grid cells covering ``index`` (which must be aligned to the grid)."""
  ranges = []
  for (start, stop), c in zip(index, chunk):
    if start % c != 0:
      raise ValueError(f"shard starting at {start} is not aligned to chunks of {c}")
    ranges.append([(a, min(a + c, stop)) for a in range(start, stop, c)])
  cells: list[Index] = [()]
  for r in ranges:
    cells = [cell + (piece,) for cell in cells for piece in r]
  return cells


def write_plan(shards: Mapping[Hashable, Index], local_devices: Iterable[Hashable],
               chunk: Sequence[int]) -> list[WriteUnit]:
  """Which chunks this process writes, and from which of its devices.

  ``shards`` maps every device holding the array (across all processes) to its shard index.
  Devices with the same index are replicas; replica ``r`` (in the map's order, which every
  process sees alike) writes the chunks ``r, r + R, r + 2R, ...`` of that shard. So each chunk
  has exactly one writer, and replicas share the work.

  >>> shards = {"d0": ((0, 4),), "d1": ((0, 4),), "d2": ((4, 8),), "d3": ((4, 8),)}
  >>> [(u.index, u.device) for u in write_plan(shards, ["d0", "d1"], (2,))]
  [(((0, 2),), 'd0'), (((2, 4),), 'd1')]
  """
  local = set(local_devices)
  by_index: dict[Index, list[Hashable]] = {}
  for device, index in shards.items():
    by_index.setdefault(index, []).append(device)
  units = []
  for index, devices in by_index.items():
    for i, cell in enumerate(_chunks_of(index, chunk)):
      device = devices[i % len(devices)]
      if device in local:
        rel = tuple((a - s, b - s) for (a, b), (s, _) in zip(cell, index))
        units.append(WriteUnit(cell, device, rel))
  return units


def read_plan(wanted: Mapping[Hashable, Index]) -> dict[Index, list[Hashable]]:
  """Group this process's devices by the slice each needs: every distinct slice is read once.

  >>> read_plan({"d0": ((0, 4),), "d1": ((0, 4),), "d2": ((4, 8),)})
  {((0, 4),): ['d0', 'd1'], ((4, 8),): ['d2']}
  """
  plan: dict[Index, list[Hashable]] = {}
  for device, index in wanted.items():
    plan.setdefault(index, []).append(device)
  return plan


def replica_count(shards: Mapping[Hashable, Index]) -> int:
  """How many devices hold each distinct shard (the smallest count, to be safe)."""
  counts: dict[Index, int] = {}
  for index in shards.values():
    counts[index] = counts.get(index, 0) + 1
  return min(counts.values()) if counts else 1

