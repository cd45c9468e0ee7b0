"""PURE: which small arrays go into which process's pack, and where.

Format 2 stores arrays too large for the manifest but small enough to gain nothing from their
own zarr array ("medium": up to :data:`PACK_LEAF_BYTES`) in *packs*: one 1-D ``uint8`` zarr3
array per writing process, each leaf a byte range. Every process computes the same assignment
from the same inputs (no communication), so process 0 can describe every pack in the manifest.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Mapping, Sequence

__all__ = [
  "PackItem",
  "PackPlan",
  "assign",
  "PACK_LEAF_BYTES",
  "PACK_INNER_BYTES",
  "PACK_CHUNK_BYTES",
]

# Arrays up to this size (that some process can see whole) are packed.
PACK_LEAF_BYTES = 4 << 20
# A pack's inner chunk (the unit of a partial read and of a crc32c checksum).
PACK_INNER_BYTES = 1 << 20
# A pack's chunk (one file, one write): bounds the host memory one pack write holds.
PACK_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class PackItem:
  """A leaf to pack: its ``leaf`` index, size, and the process that must write it (``None``:
  any process can, the leaf is replicated on all)."""

  leaf: int
  nbytes: int
  writer: int | None


@dataclasses.dataclass(frozen=True)
class PackPlan:
  """Per leaf: (process, offset) in that process's pack; per process: the pack's size (padded
  to whole inner chunks), chunk size (a multiple of the inner size) and inner chunk size."""

  where: dict[int, tuple[int, int]]
  sizes: dict[int, tuple[int, int, int]]
  pieces: dict[int, int] = dataclasses.field(default_factory=dict)  # process -> region start


def assign(
  items: Sequence[PackItem],
  processes: int,
  inner_bytes: int = PACK_INNER_BYTES,
  chunk_bytes: int = PACK_CHUNK_BYTES,
  extra: Mapping[int, int] | None = None,
) -> PackPlan:
  """Place each item in a pack: fixed writers first, then replicated items largest first on
  the process with the fewest bytes so far (ties: the lowest index; ``extra``, each process's
  pieces region bytes, counts as load), so bytes stay balanced. Within a pack, leaves lie in
  leaf order, then the process's pieces region (its start: ``pieces``).

  >>> plan = assign([PackItem(0, 100, None), PackItem(1, 50, 0), PackItem(2, 60, None)], 2)
  >>> plan.where
  {0: (1, 0), 1: (0, 0), 2: (0, 50)}
  >>> plan.sizes
  {0: (110, 110, 110), 1: (100, 100, 100)}
  """
  extra = dict(extra or {})
  load = [extra.get(p, 0) for p in range(processes)]
  owner: dict[int, int] = {}
  for it in items:
    if it.writer is not None:
      owner[it.leaf] = it.writer
      load[it.writer] += it.nbytes
  heap = [(n, q) for q, n in enumerate(load)]  # the least-loaded process first (ties: lowest)
  heapq.heapify(heap)
  for it in sorted((i for i in items if i.writer is None), key=lambda i: (-i.nbytes, i.leaf)):
    p = heap[0][1]
    owner[it.leaf] = p
    load[p] += it.nbytes
    heapq.heapreplace(heap, (load[p], p))
  where: dict[int, tuple[int, int]] = {}
  used = [0] * processes
  for it in sorted(items, key=lambda i: i.leaf):
    p = owner[it.leaf]
    where[it.leaf] = (p, used[p])
    used[p] += it.nbytes
  sizes, pieces = {}, {}
  for p, n in enumerate(used):
    if extra:
      pieces[p] = n
    n += extra.get(p, 0)
    if n:
      inner = min(inner_bytes, n)
      padded = -(-n // inner) * inner
      sizes[p] = (padded, min(padded, max(inner, chunk_bytes // inner * inner)), inner)
  return PackPlan(where, sizes, {p: o for p, o in pieces.items() if p in sizes})
