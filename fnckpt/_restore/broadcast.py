"""Which process reads which part of a replicated target (pure: no I/O, no collectives).

``restore(..., broadcast=True)``: for each array whose target sharding replicates it across
processes, a *reader* sharding on the same mesh splits each distinct shard over the axes that
replicate it (``_layout.spread.reader_spec``), so each stored byte is read by one process; the
leaves are grouped into waves whose per-process reader bytes fit the restore budget, and each
wave is resharded onto the targets' shardings (``reshard``). Every process computes the same
plan from the same target (no messages): the mesh, the specs and the leaf order are global.

The default (``broadcast=None``) is the rule of :func:`decide`: on with several processes when
some target array is replicated across them, on accelerators or from an object store
(docs/guides/multi-process.md: the figures behind it).

>>> import jax, numpy as np
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> s = NamedSharding(jax.make_mesh((1,), ("x",)), P())
>>> reader_of(s, (8, 4), 4, packed=False) is None   # one process: nothing to spread
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence, Sized, cast

import jax
import numpy as np

from .. import _state
from .._layout import spread as _spread

__all__ = ["Reader", "reader_of", "decide", "waves", "grid_of"]


@dataclasses.dataclass(frozen=True)
class Reader:
  """How one leaf is read once: onto ``sharding`` (each distinct part on one process), then
  resharded onto ``target``. ``groups``: processes holding each target shard; ``factor``: how
  many parts each shard is read in; ``cost``: the most bytes a process reads (the wave
  budget's unit, the same on every process)."""

  sharding: jax.sharding.NamedSharding
  target: jax.sharding.NamedSharding
  groups: int
  factor: int
  cost: int


def grid_of(mesh: jax.sharding.Mesh) -> _spread.Grid:
  """A mesh's :class:`~fnckpt._layout.spread.Grid` (the process of every device)."""
  procs = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
  return _spread.Grid(tuple(mesh.axis_names), tuple(mesh.devices.shape), procs)


def _spec(spec: jax.sharding.PartitionSpec, ndim: int) -> _spread.Spec | None:
  """A PartitionSpec as per-dimension axis tuples (None: one ``spread`` cannot plan)."""
  out: list[tuple[str, ...]] = []
  for d in range(ndim):
    e = spec[d] if d < len(spec) else None
    if e is None:
      out.append(())
    elif isinstance(e, str):
      out.append((e,))
    elif isinstance(e, tuple) and all(isinstance(a, str) for a in e):
      out.append(tuple(e))
    else:  # (UNCONSTRAINED and such: not in a placed target)
      return None
  return tuple(out)


def reader_of(
  sharding: Any,
  shape: Sequence[int],
  itemsize: int,
  *,
  packed: bool,
  align: Sequence[int] | None = None,
) -> Reader | None:
  """The read-once plan of an array of ``shape`` placed with ``sharding``; None when no
  process would read less (not a NamedSharding, no replication across processes, no
  dimension the replicas divide evenly, or a packed leaf whose parts would not be single
  byte ranges). ``align``: the stored chunk shape (reads fetch whole chunks). Cached per
  argument set (O(devices) each: a model has a few distinct ones)."""
  if (
    not isinstance(sharding, jax.sharding.NamedSharding)
    or isinstance(sharding.mesh, jax.sharding.AbstractMesh)
    or jax.process_count() == 1
  ):
    return None
  return _reader(
    sharding,
    tuple(int(n) for n in shape),
    itemsize,
    packed,
    None if align is None else tuple(align),
  )


@_state.memo(1024)
def _reader(
  sharding: jax.sharding.NamedSharding,
  shape: tuple[int, ...],
  itemsize: int,
  packed: bool,
  align: tuple[int, ...] | None,
) -> Reader | None:
  spec = _spec(sharding.spec, len(shape))
  if spec is None:
    return None
  grid = grid_of(cast(jax.sharding.Mesh, sharding.mesh))  # (a concrete sharding's)
  rspec, factor = _spread.reader_spec(grid, spec, shape, align)
  if factor == 1 or (packed and not _spread.contiguous_blocks(grid, rspec, shape)):
    return None
  cost = int(_spread.bytes_per_process(grid, rspec, shape, itemsize).max())
  reader = jax.sharding.NamedSharding(
    sharding.mesh,
    jax.sharding.PartitionSpec(*(a if a else None for a in rspec)),
    memory_kind=sharding.memory_kind,
  )
  return Reader(reader, sharding, _spread.replica_groups(grid, spec), factor, cost)


def decide(broadcast: bool | None, readers: Sized, *, cpu: bool, remote: bool) -> bool:
  """Whether to read once and broadcast: as asked; by default (None) when several processes
  hold copies of some target array (``readers`` not empty) and the bytes would travel faster
  between devices than from storage: accelerators (ICI, NVLink, IB), or storage over a
  network (``remote``: ``gs://``, ``s3://``). CPU processes reading local files: off (the
  page cache gives local reads at memory speed; a Gloo reshard over TCP was 2.6-7x slower
  in docs/guides/multi-process.md).

  >>> decide(None, {0: None}, cpu=True, remote=False), decide(None, {0: None}, cpu=False,
  ...                                                         remote=False)
  (False, True)
  >>> decide(None, {}, cpu=False, remote=True), decide(True, {}, cpu=True, remote=False)
  (False, True)
  """
  if broadcast is not None and not isinstance(broadcast, bool):
    raise TypeError(
      f"broadcast={broadcast!r}: expected True, False or None (the default: "
      "on when the target replicates arrays across processes, on accelerators "
      "or from an object store)."
    )
  if broadcast is None:
    return bool(readers) and (remote or not cpu)
  return broadcast


def waves(readers: dict[int, Reader], budget: int) -> list[list[int]]:
  """The leaves of ``readers`` (in their order, the same on every process) in waves whose
  per-process reader bytes fit ``budget`` (a leaf larger than it alone)."""
  keys = list(readers)
  return [
    [keys[k] for k in wave] for wave in _spread.waves([readers[i].cost for i in keys], budget)
  ]
