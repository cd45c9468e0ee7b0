"""Recovery from peers after a change of process count or device order (collective): a step
only records another job wrote hold, read as a source and resharded onto the target.

The plan is :func:`fnckpt._manager.regrid.plan` (pure; every process makes the same one from
the same reports). Each process reads the pieces it is the reader of from its own fast tier
(:func:`fnckpt._manager.peers.read_pieces`), the processes agree that every read succeeded
(else every process returns None and the manager falls back, with a warning), and then, per
leaf: on a *source mesh* of the target's devices (the step's blocks, then ``R`` copies of
each) the reader's device carries the block's bytes and the ``R - 1`` others zeros, one
jitted ``psum`` over the copies fills them (bitwise: unsigned views), and one reshard
(``jax.device_put``, a jitted collective) lays every leaf out on the target's sharding. A
device holds one block of the step and its target shard at once, never the whole array
(unless the step's leaf was replicated).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from .._io import attempt as _attempt
from .._io import paths as _paths
from . import held as _held
from . import peers as _peers
from . import regrid as _regrid

__all__ = ["target_of", "restore"]


def target_of(target: Any) -> tuple[tuple[_regrid.LeafGrid, ...], list[list[int]]] | None:
  """The target's leaves (key, shape, dtype) and, per leaf, the process of each device of
  its sharding in device-id order (host leaves: none); None when recovery from peers does
  not support the target."""
  layouts = _held.layouts_of(target)
  if layouts is None:
    return None
  devices = [
    []
    if l.dtype == "host"
    else [d.process_index for d in sorted(leaf.sharding.device_set, key=lambda d: d.id)]
    for l, leaf in zip(layouts, jax.tree_util.tree_leaves(target))
  ]
  return _held.grid_of(layouts), devices


def plan_for(reports: Sequence[_held.HeldReport], step: int, target: Any) -> _regrid.Plan | str:
  """:func:`fnckpt._manager.regrid.plan` for ``step`` and ``target`` (None: any target)."""
  foreign = {r.process: r.foreign[step] for r in reports if step in r.foreign}
  if target is None:
    return _regrid.plan(foreign, None, None)
  got = target_of(target)
  if got is None:
    return "the target has a leaf recovery from peers does not support"
  return _regrid.plan(foreign, *got)


def restore(
  location: str,
  where: _paths.Location,
  step: int,
  reports: Sequence[_held.HeldReport],
  target: Any,
  timeout_s: float,
) -> Any:
  """Collective: ``step`` restored into ``target`` from the pieces of another job's records
  the processes hold, resharded; or None on every process (with a warning) when some
  process could not read its pieces. One attempt, as :func:`fnckpt._manager.peers.restore`."""
  with _attempt.collective(f"{location}#peers", "peers", timeout_s, on=True) as attempt:
    plan = plan_for(reports, step, target)
    assert not isinstance(plan, str), plan  # (chosen only with a plan)
    p = jax.process_index()
    want: dict[int, list[tuple[int, int]]] = {}
    for i, move in enumerate(plan.leaves):
      for j, (reader, q) in enumerate(move.readers):
        if reader == p:
          want.setdefault(q, []).append((i, j))
    hosts = [
      i for i, g in enumerate(plan.grid) if g.dtype == "host" and plan.leaves[i].readers[0][0] == p
    ]
    got = _peers.exchange(attempt, step, lambda: _peers.read_pieces(where, want, step), hosts)
    if got is None:
      return None
    mine, host = got
    leaves, treedef = jax.tree_util.tree_flatten(target)
    arrays = {
      i: _source(leaf, plan.grid[i], plan.leaves[i], mine, i)
      for i, leaf in enumerate(leaves)
      if plan.grid[i].dtype != "host"
    }
    shardings = [leaves[i].sharding for i in arrays]

    def reshard(xs: list[jax.Array]) -> list[jax.Array]:
      return [jax.device_put(x, s) for x, s in zip(xs, shardings)]

    moved = _peers.spread(attempt, location, step, list(arrays.values()), timeout_s, reshard)
    out = dict(zip(arrays, moved))
    return jax.tree_util.tree_unflatten(
      treedef, [host[i] if i in host else out[i] for i in range(len(leaves))]
    )


def _source(
  leaf: Any,
  grid: _regrid.LeafGrid,
  move: _regrid.LeafMove,
  mine: dict[tuple[int, int], bytes],
  i: int,
) -> tuple[jax.Array, np.dtype]:
  """The leaf on its source mesh (unsigned view): block ``b``'s first device (its reader's)
  carries the block's bytes, its other ``R - 1`` devices zeros."""
  devices = sorted(leaf.sharding.device_set, key=lambda d: d.id)
  r = move.mesh[-1]
  names = tuple(f"g{d}" for d in range(len(grid.shape))) + ("copies",)
  mesh = jax.sharding.Mesh(np.array([devices[k] for k in move.order]).reshape(move.mesh), names)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*names[:-1]))
  dtype = np.dtype(leaf.dtype)
  slot = {devices[k]: n for n, k in enumerate(move.order)}
  bufs = []
  for device in sharding.addressable_devices:
    b, copy = divmod(slot[device], r)
    if copy == 0:
      data = np.frombuffer(mine[(i, b)], dtype=dtype).reshape(grid.block).view(_peers.uint(dtype))
    else:
      data = np.zeros(grid.block, _peers.uint(dtype))
    bufs.append(jax.device_put(data, device))
  return jax.make_array_from_single_device_arrays(grid.shape, sharding, bufs), dtype
