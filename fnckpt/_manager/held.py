"""What each process's fast tier holds, for recovery from peers (several processes).

With several processes and a per-host ``local_directory``, every local save also writes, on
each process, every distinct shard its devices hold (replicas included) into
``<local>/<step>/held/<p>/<leaf>/<position>`` and then, last, a record of them,
``held/<p>.json`` (:class:`HeldRecord`). At recovery the processes exchange a short report
of the records they hold intact (:class:`HeldReport`), and process 0 picks, with the pure
:func:`choose`, the newest step whose every distinct shard is held by some process; the
shards then move between processes over the interconnect (:mod:`fnckpt._manager.peers`).

A leaf's *layout* is its key path, shape, dtype and, for each distinct shard (an index of
slices), the processes whose devices hold it. Two trees with the same layouts place every
shard on the same processes, so a process that held a shard at the save holds a device that
needs it at the restore. Supported trees: ``jax.Array`` leaves with a ``NamedSharding`` (every
sharded dimension divisible, dtypes of 1, 2, 4 or 8 bytes, not complex) and small host leaves
(numpy arrays, Python scalars; process 0's values). Any other leaf: no record is written and
recovery reads a complete local copy or the durable tier, as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import socket
import zlib
from typing import Any, Mapping, Sequence

import numpy as np

from .._save import copies as _copies
from . import regrid as _regrid

__all__ = [
  "LeafLayout",
  "HeldRecord",
  "HeldReport",
  "Choice",
  "layouts_of",
  "choose",
  "holders",
  "stage",
  "norm_index",
  "host_value",
  "make_record",
  "Staged",
  "covered",
  "digest",
  "record_key",
  "piece_key",
  "HOST_MAX_BYTES",
  "grid_of",
]

HOST_MAX_BYTES = 1 << 20  # host leaves travel through the coordination service
_SCALARS = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """One leaf: ``key`` (its key path), ``shape``, ``dtype`` (``"host"`` for a host leaf),
  ``indices`` (each distinct shard: ``((start, stop), ...)`` per dimension, sorted) and
  ``owners`` (for each index, the processes whose devices hold it)."""

  key: str
  shape: tuple[int, ...]
  dtype: str
  indices: tuple[tuple[tuple[int, int], ...], ...]
  owners: tuple[tuple[int, ...], ...]

  def as_json(self) -> list:
    return [
      self.key,
      list(self.shape),
      self.dtype,
      [list(map(list, i)) for i in self.indices],
      [list(o) for o in self.owners],
    ]


def digest(layouts: Sequence[LeafLayout]) -> str:
  """PURE: a short name for a list of layouts (equal layouts, equal digests)."""
  text = json.dumps([l.as_json() for l in layouts], separators=(",", ":"))
  return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class HeldRecord:
  """``held/<p>.json``: process ``process`` of ``count`` (on ``host``) holds, for step
  ``step`` of layouts ``layout`` (:func:`digest`), the shard positions ``held[i]`` of leaf
  ``i`` (host leaves: ``[0]``), each piece's length and crc32 in ``sizes``/``crcs``."""

  step: int
  process: int
  count: int
  host: str
  layout: str
  counts: tuple[int, ...]
  held: tuple[tuple[int, ...], ...]
  sizes: tuple[tuple[int, ...], ...]
  crcs: tuple[tuple[int, ...], ...]
  grid: tuple[_regrid.LeafGrid, ...] = ()

  def encode(self) -> bytes:
    d = dataclasses.asdict(self)
    d["grid"] = _regrid.grid_json(self.grid)
    return json.dumps(d).encode()

  @staticmethod
  def decode(raw: bytes) -> HeldRecord:
    d = json.loads(raw)
    held, sizes, crcs = (
      tuple(tuple(int(x) for x in row) for row in d[k]) for k in ("held", "sizes", "crcs")
    )
    return HeldRecord(
      step=int(d["step"]),
      process=int(d["process"]),
      count=int(d["count"]),
      host=str(d["host"]),
      layout=str(d["layout"]),
      counts=tuple(d["counts"]),
      held=held,
      sizes=sizes,
      crcs=crcs,
      grid=_regrid.grid_of_json(d.get("grid", [])),
    )


@dataclasses.dataclass(frozen=True)
class HeldReport:
  """What one process tells the others at recovery: its host and, per step whose record it
  holds intact, ``(layout digest, counts, held positions)``; ``foreign``: per step, what it
  holds intact of records written by another job (another process count, or the records of
  other processes: :mod:`fnckpt._manager.regrid`); ``unusable``: steps it holds a record of
  that recovery from peers cannot use, with why."""

  process: int
  host: str
  steps: dict[int, tuple[str, tuple[int, ...], tuple[tuple[int, ...], ...]]]
  unusable: dict[int, str] = dataclasses.field(default_factory=dict)
  foreign: dict[int, _regrid.Foreign] = dataclasses.field(default_factory=dict)

  def as_json(self) -> dict:
    return {
      "process": self.process,
      "host": self.host,
      "steps": {
        str(s): [d, list(c), [list(h) for h in held]] for s, (d, c, held) in self.steps.items()
      },
      "unusable": {str(s): why for s, why in self.unusable.items()},
      "foreign": {str(s): f.as_json() for s, f in self.foreign.items()},
    }

  @staticmethod
  def from_json(d: dict) -> HeldReport:
    return HeldReport(
      int(d["process"]),
      str(d["host"]),
      {int(s): (v[0], tuple(v[1]), tuple(tuple(h) for h in v[2])) for s, v in d["steps"].items()},
      {int(s): str(why) for s, why in d.get("unusable", {}).items()},
      {int(s): _regrid.Foreign.from_json(f) for s, f in d.get("foreign", {}).items()},
    )


@dataclasses.dataclass(frozen=True)
class Choice:
  """Process 0's recovery decision: ``step`` (None: nothing), ``source`` ("local": every
  process's own complete copy; "peers": the held shards over the interconnect; "durable"),
  ``warning`` (a newer local step skipped, naming the processes lacking shards of it);
  "regrid": the pieces of records another job wrote, resharded (:mod:`.regrid`)."""

  step: int | None
  source: str
  warning: str | None = None


def record_key(process: int) -> str:
  return f"held/{process}.json"


def piece_key(process: int, leaf: int, position: int) -> str:
  return f"held/{process}/{leaf}/{position}"


def norm_index(index: tuple, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
  out = []
  for s, n in zip(index, shape):
    start, stop, _ = s.indices(n)
    out.append((start, stop))
  return tuple(out)


def _array_layout(key: str, leaf: Any) -> LeafLayout | None:
  """The layout of a ``jax.Array`` or ``ShapeDtypeStruct`` with a NamedSharding, or None."""
  import jax

  sharding = getattr(leaf, "sharding", None)
  dtype = np.dtype(leaf.dtype)
  if (
    not isinstance(sharding, jax.sharding.NamedSharding)
    or dtype.kind == "c"
    or dtype.itemsize not in (1, 2, 4, 8)
  ):
    return None
  shape = tuple(int(n) for n in leaf.shape)
  owners: dict[tuple, set[int]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    owners.setdefault(norm_index(index, shape), set()).add(device.process_index)  # type: ignore[attr-defined]  # (jaxlib's Device)
  sizes = {tuple(b - a for a, b in i) for i in owners}
  if len(sizes) != 1:  # uneven shards: not supported
    return None
  indices = tuple(sorted(owners))
  return LeafLayout(
    key, shape, dtype.name, indices, tuple(tuple(sorted(owners[i])) for i in indices)
  )


def layouts_of(tree: Any) -> list[LeafLayout] | None:
  """The layouts of every leaf of ``tree`` (a state or a restore target), or None when a
  leaf is not supported (see the module docstring)."""
  import jax

  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = jax.tree_util.keystr(path)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
      layout = _array_layout(key, leaf)
      if layout is None:
        return None
    elif isinstance(leaf, (np.ndarray, np.generic) + _SCALARS):
      layout = LeafLayout(key, (), "host", (((0, 1),),), ((),))
    else:
      return None
    out.append(layout)
  return out


def grid_of(layouts: Sequence[LeafLayout]) -> tuple[_regrid.LeafGrid, ...]:
  """PURE: the grid of ``layouts`` (each leaf's key, shape, dtype and shard shape).

  >>> grid_of([LeafLayout("w", (4, 6), "int8", (((0, 2), (0, 6)), ((2, 4), (0, 6))), ())])
  (LeafGrid(key='w', shape=(4, 6), dtype='int8', block=(2, 6)),)
  """
  return tuple(
    _regrid.LeafGrid(
      l.key, l.shape, l.dtype, () if l.dtype == "host" else tuple(b - a for a, b in l.indices[0])
    )
    for l in layouts
  )


def covered(reports: Sequence[HeldReport], step: int, layout: str | None) -> bool:
  """PURE: whether the processes' intact records of ``step`` (those with the layout the
  first of them has, or ``layout`` when given) together hold every shard of every leaf.

  >>> r = lambda p, held: HeldReport(p, "h", {5: ("L", (2,), (held,))})
  >>> covered([r(0, (0, 1)), HeldReport(1, "h", {})], 5, "L")
  True
  >>> covered([r(0, (0,)), HeldReport(1, "h", {})], 5, None)
  False
  """
  entries = [r.steps[step] for r in reports if step in r.steps]
  if not entries:
    return False
  want = layout if layout is not None else entries[0][0]
  entries = [e for e in entries if e[0] == want]
  if not entries:
    return False
  counts = entries[0][1]
  return all(set(range(n)) <= {p for e in entries for p in e[2][i]} for i, n in enumerate(counts))


def holders(reports: Sequence[HeldReport], step: int, layout: str) -> list[list[int]]:
  """PURE: for each leaf and each shard position, the process that reads it: the lowest
  whose intact record of ``step`` (of ``layout``) holds it (-1: none).

  >>> r = lambda p, held: HeldReport(p, "h", {5: ("L", (2,), (held,))})
  >>> holders([r(0, (0, 1)), r(1, (1,))], 5, "L")
  [[0, 0]]
  """
  entries = sorted(
    (r.process, r.steps[step]) for r in reports if step in r.steps and r.steps[step][0] == layout
  )
  counts = entries[0][1][1] if entries else ()
  out = [[-1] * n for n in counts]
  for p, (_, _, held) in reversed(entries):
    for i, positions in enumerate(held):
      for j in positions:
        out[i][j] = p
  return out


def choose(
  reports: Sequence[HeldReport],
  local_common: Sequence[int],
  durable: Sequence[int],
  skipped: set[int],
  layout: str | None,
  moved: Mapping[int, str | None] | None = None,
) -> Choice:
  """PURE: the newest step every process can restore, and from where: its own complete
  local copy on every process (``local_common``), the processes' held shards together
  (``layout``: the target's digest, None: any), the pieces another job's records hold,
  resharded (``moved[step]``: None when :func:`fnckpt._manager.regrid.plan` found a plan,
  else why not), or the durable tier; not in ``skipped``. A newer step held in some fast
  tier but not restorable is named in a warning, with why.

  >>> r0 = HeldReport(0, "a", {25: ("L", (1,), ((0,),))})
  >>> choose([r0, HeldReport(1, "b", {})], [], [20], set(), "L").source
  'peers'
  >>> c = choose([r0, HeldReport(1, "b", {})], [], [20], set(), "other")
  >>> c.step, c.source, "process(es) 1 (host b)" in c.warning
  (20, 'durable', True)
  >>> f = {25: _regrid.Foreign(4, (), {})}
  >>> choose([HeldReport(0, "a", {}, {}, f)], [], [20], set(), "L", {25: None}).source
  'regrid'
  >>> c = choose([HeldReport(0, "a", {}, {}, f)], [], [20], set(), "L", {25: "no piece 3"})
  >>> c.step, c.warning.startswith("Step 25 is held") and "4 processes" in c.warning
  (20, True)
  """
  moved = moved or {}
  local, durable_steps = set(local_common) - skipped, set(durable) - skipped
  peers = {s for r in reports for s in r.steps if s not in skipped and covered(reports, s, layout)}
  regrid = {s for s, why in moved.items() if why is None and s not in skipped}
  step = max(local | peers | regrid | durable_steps, default=None)
  source = (
    "local"
    if step in local
    else "peers"
    if step in peers
    else "regrid"
    if step in regrid
    else "durable"
  )
  warning = _skipped(reports, skipped, step, moved)
  if warning is not None:
    warning += f"step {step} is restored" + (
      " from the durable tier." if source == "durable" else "."
    )
  return Choice(step, source, warning)


def _skipped(
  reports: Sequence[HeldReport], skipped: set[int], step: int | None, moved: Mapping[int, Any]
) -> str | None:
  """PURE: why the newest step some fast tier holds, if newer than ``step``, is skipped (the
  start of :func:`choose`'s warning), else None."""
  held = {s for r in reports for s in (*r.steps, *r.unusable, *r.foreign)} - skipped
  newest = max(held, default=None)
  if newest is None or (step is not None and newest <= step):
    return None
  start = f"Step {newest} is held in the fast tier of some processes but "
  end = f"; step {newest} is skipped and "
  foreign = [r for r in reports if newest in r.foreign]
  if foreign and isinstance(moved.get(newest), str):
    return (
      f"{start}cannot be restored from them: it was saved by "
      f"{foreign[0].foreign[newest].count} processes (this job has {len(reports)}) and "
      f"{moved[newest]}{end}"
    )
  who = [(r.process, r.host, r.unusable[newest]) for r in reports if newest in r.unusable]
  if who:
    return (
      f"{start}cannot be restored from them: {who[0][2]} (process {who[0][0]}, host "
      f"{who[0][1]}" + (f", and {len(who) - 1} more" if len(who) > 1 else "") + f"){end}"
    )
  lacking = [f"{r.process} (host {r.host})" for r in reports if newest not in r.steps]
  why = (
    "process(es) " + ", ".join(lacking) + " hold no copy of it"
    if lacking
    else "its records do not match the target's shardings"
  )
  return f"{start}not every shard of it is held by some process ({why}){end}"


@dataclasses.dataclass
class Staged:
  """A local save's held pieces, to be written after the save commits:
  ``pieces[(leaf, position)]``: bytes (host leaves), or a shard staged off its device as the
  save stages (``fnckpt._save.copies``: a view of the CPU buffer, or a copy in host memory
  the save owns on accelerators); :func:`materialize` turns them into bytes, in the
  background. Plus the record fields."""

  layout: str
  counts: tuple[int, ...]
  held: tuple[tuple[int, ...], ...]
  pieces: dict[tuple[int, int], Any]
  grid: tuple[_regrid.LeafGrid, ...] = ()


def materialize(staged: Staged) -> Staged:
  """``staged`` with every piece as bytes (C-order; a copy made now, off the caller's path)."""
  pieces = {
    k: v if isinstance(v, bytes) else np.ascontiguousarray(_copies.to_host(v)).tobytes()
    for k, v in staged.pieces.items()
  }
  return dataclasses.replace(staged, pieces=pieces)


def _host_bytes(leaf: Any) -> bytes:
  if isinstance(leaf, (np.ndarray, np.generic)):
    buf = io.BytesIO()
    np.save(buf, np.asarray(leaf), allow_pickle=False)
    return b"N" + buf.getvalue()
  return b"J" + json.dumps(leaf).encode()


def host_value(raw: bytes) -> Any:
  """A host leaf from its held bytes."""
  if raw[:1] == b"N":
    value = np.load(io.BytesIO(raw[1:]), allow_pickle=False)
    return value
  return json.loads(raw[1:])


def stage(tree: Any, process: int) -> Staged | None:
  """Host copies of every distinct shard this process's devices hold (and of the host
  leaves), or None when the tree has a leaf recovery from peers does not support."""
  import jax

  layouts = layouts_of(tree)
  if layouts is None:
    return None
  leaves = jax.tree_util.tree_leaves(tree)
  copies = _copies.Copies()
  pieces: dict[tuple[int, int], Any] = {}
  held: list[tuple[int, ...]] = []
  for i, (layout, leaf) in enumerate(zip(layouts, leaves)):
    if layout.dtype == "host":
      pieces[(i, 0)] = _host_bytes(leaf)
      if len(pieces[(i, 0)]) > HOST_MAX_BYTES:
        return None
      held.append((0,))
      continue
    position = {index: j for j, index in enumerate(layout.indices)}
    for shard in leaf.addressable_shards:
      j = position[norm_index(shard.index, layout.shape)]
      if (i, j) not in pieces:  # (no host copy cached on the caller's array; no memcpy now)
        pieces[(i, j)] = copies.get(shard.data)
    held.append(tuple(sorted(j for (k, j) in pieces if k == i)))
  copies.wait()  # (owned copies: landed before the caller may donate the arrays)
  counts = tuple(len(l.indices) for l in layouts)
  return Staged(digest(layouts), counts, tuple(held), pieces, grid_of(layouts))


def make_record(staged: Staged, step: int, process: int, count: int) -> HeldRecord:
  """The record of ``staged`` (written after its pieces)."""
  sizes = tuple(tuple(len(staged.pieces[(i, j)]) for j in h) for i, h in enumerate(staged.held))
  crcs = tuple(
    tuple(zlib.crc32(staged.pieces[(i, j)]) for j in h) for i, h in enumerate(staged.held)
  )
  return HeldRecord(
    step=step,
    process=process,
    count=count,
    host=socket.gethostname(),
    layout=staged.layout,
    counts=staged.counts,
    held=staged.held,
    sizes=sizes,
    crcs=crcs,
    grid=staged.grid,
  )
