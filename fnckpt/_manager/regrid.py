"""PURE: recovery from peers after a change of process count or device order (the planner).

A held record (:mod:`fnckpt._manager.held`) written by another job names its pieces by
position in that job's grid: each leaf's :class:`LeafGrid` (key path, shape, dtype and the
shape of one shard; the pieces are the blocks of that shape, in C order). At recovery each
process reports the foreign records its fast tier holds intact (:class:`Foreign`), and
:func:`plan` decides whether the processes together hold every block of every leaf and, if
so, who reads what: per leaf, a *source mesh* of the target's devices of shape
``blocks + (R,)`` (``R`` = devices / blocks): block ``b`` lies on ``R`` devices, the first of
them on a process that holds ``b`` (a matching of blocks to devices), which reads it; the
others carry zeros. One ``psum`` over the ``R`` axis fills every copy, and a reshard moves
the bytes to the target's sharding (:mod:`fnckpt._manager.peers_regrid`).

>>> g = LeafGrid("['w']", (8, 16), "float32", (8, 4))
>>> g.counts, g.count, g.index(3)
((1, 4), 4, ((0, 8), (12, 16)))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

__all__ = ["LeafGrid", "Foreign", "LeafMove", "Plan", "plan", "grid_json", "grid_of_json"]


@dataclasses.dataclass(frozen=True)
class LeafGrid:
  """One leaf of a saved step's grid: ``key``, ``shape``, ``dtype`` (``"host"``: a host
  leaf, one piece) and ``block`` (the shape of each piece; ``()`` for host leaves)."""

  key: str
  shape: tuple[int, ...]
  dtype: str
  block: tuple[int, ...]

  @property
  def counts(self) -> tuple[int, ...]:
    return tuple(n // b for n, b in zip(self.shape, self.block))

  @property
  def count(self) -> int:
    return 1 if self.dtype == "host" else math.prod(self.counts)

  def index(self, j: int) -> tuple[tuple[int, int], ...]:
    """The global index of piece ``j`` (C order over the blocks)."""
    out = []
    for n, b in reversed(list(zip(self.counts, self.block))):
      j, c = divmod(j, n)
      out.append((c * b, (c + 1) * b))
    return tuple(reversed(out))


def grid_json(grid: Sequence[LeafGrid]) -> list:
  return [[g.key, list(g.shape), g.dtype, list(g.block)] for g in grid]


def grid_of_json(raw: Sequence) -> tuple[LeafGrid, ...]:
  return tuple(LeafGrid(str(k), tuple(s), str(d), tuple(b)) for k, s, d, b in raw)


@dataclasses.dataclass(frozen=True)
class Foreign:
  """What one process's fast tier holds of a step saved by another job (of ``count``
  processes): the step's ``grid`` and, per old process whose record is there intact, the
  piece positions it holds per leaf."""

  count: int
  grid: tuple[LeafGrid, ...]
  held: Mapping[int, tuple[tuple[int, ...], ...]]

  def as_json(self) -> dict:
    return {
      "count": self.count,
      "grid": grid_json(self.grid),
      "held": {str(q): [list(h) for h in hs] for q, hs in self.held.items()},
    }

  @staticmethod
  def from_json(d: dict) -> Foreign:
    held = {int(q): tuple(tuple(h) for h in hs) for q, hs in d["held"].items()}
    return Foreign(int(d["count"]), grid_of_json(d["grid"]), held)


@dataclasses.dataclass(frozen=True)
class LeafMove:
  """How one leaf moves: ``mesh`` (the source mesh's shape: the blocks, then ``R``),
  ``order`` (positions in the leaf's device list, in the source mesh's C order) and
  ``readers`` (per block: ``(new process, old process)`` whose record it is read from; the
  block's first device, at ``order[b * R]``, is on that new process)."""

  mesh: tuple[int, ...]
  order: tuple[int, ...]
  readers: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per leaf, its :class:`LeafMove` (host leaves: mesh ``()``, one reader)."""

  grid: tuple[LeafGrid, ...]
  leaves: tuple[LeafMove, ...]


def _holders(foreign: Mapping[int, Foreign], grid: tuple[LeafGrid, ...]) -> list[list[list]]:
  """Per leaf and block, the ``(new process, old process)`` pairs that hold it, sorted."""
  out: list[list[list]] = [[[] for _ in range(g.count)] for g in grid]
  for p in sorted(foreign):
    if foreign[p].grid != grid:
      continue
    for q in sorted(foreign[p].held):
      for i, positions in enumerate(foreign[p].held[q]):
        for j in positions:
          if 0 <= j < grid[i].count:
            out[i][j].append((p, q))
  return out


def _match(holders: list[list], devices: Sequence[int]) -> list[int] | None:
  """For each block, a distinct device (position in ``devices``, each a process) on a
  process that holds it (augmenting paths); None when there is none."""
  by_process: dict[int, list[int]] = {}
  for d, p in enumerate(devices):
    by_process.setdefault(p, []).append(d)
  owner: dict[int, int] = {}  # device -> block

  def place(b: int, seen: set[int]) -> bool:
    mine = [d for p in dict.fromkeys(p for p, _ in holders[b]) for d in by_process.get(p, [])]
    free = next((d for d in mine if d not in owner), None)  # (a free device first)
    if free is not None:
      owner[free] = b
      return True
    for d in mine:
      if d not in seen:
        seen.add(d)
        if place(owner[d], seen):
          owner[d] = b
          return True
    return False

  for b in range(len(holders)):
    if not place(b, set()):
      return None
  chosen = {b: d for d, b in owner.items()}
  return [chosen[b] for b in range(len(holders))]


def _leaf(g: LeafGrid, holders: list[list], devices: Sequence[int] | None) -> LeafMove | str:
  missing = [j for j, h in enumerate(holders) if not h]
  if missing:
    return f"no process holds piece {missing[0]} of leaf {g.key} (of {g.count})"
  if g.dtype == "host" or devices is None:
    return LeafMove((), (), (holders[0][0],) if g.dtype == "host" else ())
  if len(devices) % g.count:
    return (
      f"the {g.count} pieces of leaf {g.key} cannot be laid out evenly on the target's "
      f"{len(devices)} devices"
    )
  first = _match(holders, devices)
  if first is None:
    return f"the processes holding the pieces of leaf {g.key} have too few devices for them"
  r = len(devices) // g.count
  rest = iter(d for d in range(len(devices)) if d not in set(first))
  order = [d for b in range(g.count) for d in [first[b]] + [next(rest) for _ in range(r - 1)]]
  readers = tuple(next(h for h in holders[b] if h[0] == devices[first[b]]) for b in range(g.count))
  return LeafMove(g.counts + (r,), tuple(order), readers)


def plan(
  foreign: Mapping[int, Foreign],
  target: Sequence[LeafGrid] | None,
  devices: Sequence[Sequence[int]] | None,
) -> Plan | str:
  """PURE: how the processes restore a step only foreign records hold (``foreign[p]``: what
  process ``p``'s fast tier holds of it), or why they cannot. ``target``: the target's
  leaves (key, shape, dtype; None: any); ``devices``: per leaf, the process of each device
  of its target sharding, in device-id order (None: only whether the pieces are all held).

  >>> g = (LeafGrid("w", (4,), "int32", (1,)),)
  >>> f = {0: Foreign(4, g, {0: ((0, 1),)}), 1: Foreign(4, g, {1: ((2, 3),)})}
  >>> plan(f, g, [[0, 0, 1, 1]]).leaves[0]
  LeafMove(mesh=(4, 1), order=(0, 1, 2, 3), readers=((0, 0), (0, 0), (1, 1), (1, 1)))
  >>> plan({0: f[0]}, g, [[0, 0, 1, 1]])
  'no process holds piece 2 of leaf w (of 4)'

  Process 1's fast tier was wiped; process 0 holds every piece (2 copies of each block):

  >>> every = {0: Foreign(4, g, {0: ((0, 1, 2, 3),)})}
  >>> plan(every, g, [[0, 0, 0, 0, 1, 1, 1, 1]]).leaves[0].order
  (0, 4, 1, 5, 2, 6, 3, 7)
  >>> plan(every, g, [[0, 1, 1, 1]])
  'the processes holding the pieces of leaf w have too few devices for them'
  """
  if not foreign:
    return "no process holds a record of it"
  grid = foreign[min(foreign)].grid
  if target is not None:
    mismatch = _mismatch(grid, target)
    if mismatch:
      return mismatch
  holders = _holders(foreign, grid)
  leaves = []
  for i, g in enumerate(grid):
    got = _leaf(g, holders[i], None if devices is None else devices[i])
    if isinstance(got, str):
      return got
    leaves.append(got)
  return Plan(grid, tuple(leaves))


def _mismatch(grid: Sequence[LeafGrid], target: Sequence[LeafGrid]) -> str | None:
  if len(grid) != len(target):
    return f"it has {len(grid)} leaves and the target {len(target)}"
  for g, t in zip(grid, target):
    if (g.key, g.shape, g.dtype) != (t.key, t.shape, t.dtype):
      return (
        f"its leaf {g.key} ({g.dtype}{list(g.shape)}) is not the target's {t.key} "
        f"({t.dtype}{list(t.shape)})"
      )
  return None
