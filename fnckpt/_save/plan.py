"""A save's plan, pure but for jax sharding queries (and the copy of the inline leaves' bytes):
each leaf's manifest record and storage (inline, packed, pieced or its own zarr array), every
process's pack and what this process writes. No I/O, threads or barriers: ``save`` agrees on
the plan across processes, then stages and writes what it says."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Protocol, cast

import jax
import numpy as np

from .. import _state
from .._errors import CheckpointError
from .._format import leaves as _leaves
from .._format import perprocess as _perprocess
from .._format import records as _records
from .._format import refs as _refs
from .._format import tree as _tree
from .._io import arrays as _arrays
from .._layout import chunks as _chunks
from .._layout import packing as _packing
from .._layout import pieces as _pieces
from . import piece_writes as _piece_writes
from .copies import Copies
from .options import SaveOptions
from .staged_leaf import Staged

__all__ = ["Array", "Base", "Plan", "deleted", "plan", "problems_error", "set_inline"]


@dataclasses.dataclass
class Array:
  """A large leaf's zarr array: its record (with ``stored``), spec and the chunks
  (``units``) this process writes."""

  index: int
  rec: _records.Leaf  # with ``stored``
  data: Any  # jax.Array or np.ndarray holding the bytes
  spec: dict[str, Any]
  units: list[_chunks.WriteUnit]


@dataclasses.dataclass
class Plan:
  """A save as planned: the manifest's leaf records (every one with its storage, but for the
  candidate packed leaves of a save with a base, placed when concluding; hashes are added
  then) and what this process writes. On processes other than 0 an inline leaf's ``inline``
  is ``b""`` (process 0 writes the manifest): their records serve the agreement only."""

  records: tuple[_records.Leaf, ...]
  arrays: list[Array]  # zarr arrays (this process writes ``units`` of each)
  packed: list[tuple[int, Any]]  # (record index, data) this process packs
  packs: tuple[_records.Pack, ...]  # every process's pack, for the manifest
  my_pack: _records.Pack | None
  data_dir: str
  values: bytes | None = None  # this process's fnckpt.PerProcess values (its pp/ file)
  holders: list[str | None] = dataclasses.field(default_factory=list)  # per record: _holders
  reusable: _refs.Candidates = dataclasses.field(default_factory=_refs.Candidates)
  maybe_packed: list[tuple[int, Any]] = dataclasses.field(default_factory=list)  # mine
  pieces: list[_piece_writes.PackPart] = dataclasses.field(default_factory=list)  # mine
  meshes: tuple[np.ndarray, ...] = ()  # the pieced leaves' meshes and layout (the manifest's)
  layout: _pieces.Layout | None = None
  regions: _pieces.Layout | None = None  # the pieced leaves in the packs' regions
  maybe_runs: list[tuple[int, list[_piece_writes.PackPart]]] = dataclasses.field(
    default_factory=list
  )  # mine, of pieced leaves that may reuse the base's runs
  # what the processes compare (``agreement.entries``); None: not made yet
  agreement: list[tuple[str, str, str]] | None = None


class Base(Protocol):
  """What planning asks of an incremental save's base (``save._Base``)."""

  def candidates(self, records, meshes=()) -> _refs.Candidates:
    """The leaves that may reuse the base's data."""
    ...

  @property
  def where(self) -> str:
    """The base's location, for messages."""
    ...


def deleted(path: Any) -> str:
  """The problem of a leaf whose array was deleted or donated before the save."""
  return (
    f"The array at {_tree.keystr(path)} was deleted (or donated) before save; "
    "save the state before the step that donates it."
  )


def problems_error(problems: list[str]) -> CheckpointError:
  """Every problem that keeps a tree from being saved, in one error."""
  return CheckpointError("Cannot save this tree:\n  " + "\n  ".join(problems))


def _holders(data: Any) -> str:
  """Who holds an array leaf: "host" (numpy), "local" (jax, on this process's devices only:
  process 0's value is saved), "all" (replicated on every process), or "some" (sharded, or
  replicated on some processes). Alike on every process but for "local" (on another
  process, an array held by one process is "some"), which the tree agreement then reports."""
  if isinstance(data, np.ndarray):
    return "host"
  if data.is_fully_addressable:
    return "local"
  if data.is_fully_replicated and len(_processes(data.sharding)) == jax.process_count():
    return "all"
  return "some"


@_state.memo(256)
def _processes(sharding: Any) -> frozenset[int]:
  return frozenset(d.process_index for d in sharding.device_set)


@dataclasses.dataclass
class _Sorted:
  """The leaves sorted one by one (``add``): their records, who holds each array, and where
  each goes: inline, a pack candidate, pieced (``pieced``) or its own zarr array; the
  problems that keep the tree from being saved."""

  kv_spec: dict
  data_dir: str
  options: SaveOptions
  me: int
  nproc: int
  pieced: _piece_writes.Planner
  records: list[_records.Leaf] = dataclasses.field(default_factory=list)
  holders: list[str | None] = dataclasses.field(default_factory=list)
  arrays: list[Array] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)
  candidates: list[tuple[int, Any, _packing.PackItem]] = dataclasses.field(default_factory=list)
  per_process: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
  inline: list[tuple[int, Any]] = dataclasses.field(default_factory=list)

  def add(self, path, leaf) -> None:
    """The next leaf's record, and (an array's) its storage."""
    i = len(self.records)
    if isinstance(leaf, _perprocess.PerProcess):
      self.records.append(_records.Leaf(i, path, "perprocess"))
      self.holders.append(None)
      self.per_process.append((path, leaf))
      return
    try:
      rec, data = _leaves.leaf_record(i, path, leaf)
    except CheckpointError as e:
      self.problems.append(str(e))
      return
    self.records.append(rec)
    self.holders.append(None if data is None else _holders(data))
    if data is None:
      return
    if isinstance(data, jax.Array) and data.is_deleted():
      self.problems.append(deleted(path))
      return
    self._place(i, rec, data)

  def _place(self, i: int, rec: _records.Leaf, data: Any) -> None:
    """Where array leaf ``i`` goes: inline, the packs, pieces, or its own zarr array."""
    assert rec.shape is not None
    size = _chunks.nbytes(rec.shape, np.dtype(data.dtype).itemsize)
    held = self.holders[-1]
    whole = held != "some"  # process 0 has all of it (its own value, if local)
    if size <= self.options.inline_bytes and whole:
      self.inline.append((i, data))
    elif size <= self.options.pack_bytes and whole:
      owner = None if held == "all" and self.nproc > 1 else 0
      self.candidates.append((i, data, _packing.PackItem(i, size, owner)))
    elif (held != "local" or self.nproc == 1) and (got := self.pieced.consider(i, rec, data)):
      self.records[i] = got
    else:
      a = _zarr_array(i, rec, data, self.kv_spec, self.data_dir, self.options.codecs)
      self.arrays.append(a)
      self.records[i] = a.rec
      if held == "local" and self.me != 0:
        a.units = []  # a non-global array: process 0's value, written by it alone

  def values(self) -> bytes | None:
    """This process's fnckpt.PerProcess values; raises the problems found, all at once."""
    values = None
    try:
      values = _perprocess.encode(self.per_process) if self.per_process else None
    except CheckpointError as e:
      self.problems.append(str(e))
    if self.problems:
      raise problems_error(self.problems)
    return values


def plan(
  leaves, kv_spec: dict, data_dir: str, options: SaveOptions, base: Base | None = None
) -> Plan:
  """Leaf records for the manifest and what this process writes (pure but for jax sharding
  queries). With ``options.pieces``, small shards of sharded arrays go into the packs
  (docs/format.md "Pieces"). A record gets its storage as it is decided (packed ones: once
  the packs are laid out)."""
  me, nproc = jax.process_index(), jax.process_count()
  pieced = _piece_writes.Planner(_pieces.PIECE_BYTES if options.pieces else 0)
  sorting = _Sorted(kv_spec, data_dir, options, me, nproc, pieced)
  for path, leaf in leaves:
    sorting.add(path, leaf)
  values = sorting.values()
  set_inline(sorting.records, sorting.inline, me)
  reusable = _candidates(base, sorting.records, pieced.meshes)  # (here: its stacklevel)
  return _packed(sorting, values, reusable)


def _packed(leaves: _Sorted, values: bytes | None, reusable: _refs.Candidates) -> Plan:
  """The plan of the sorted ``leaves``, once the packs are laid out: the pack candidates that
  may reuse the base's data are staged apart (each by one process), the others packed."""
  me, nproc, pieced, records = leaves.me, leaves.nproc, leaves.pieced, leaves.records
  candidates, data_dir = leaves.candidates, leaves.data_dir
  maybe = [c for c in candidates if c[0] in reusable.packed]
  owners = _packing.assign([c[2] for c in maybe], nproc).where
  packs, packed = _assign_packs(
    records,
    [c for c in candidates if c[0] not in reusable.packed],
    data_dir,
    nproc,
    me,
    pieced.finish(reusable.pieced),
  )
  mine = [p for p in packs if p.dir == f"{data_dir}/p/{me}"]
  parts = pieced.parts(cast(int, mine[0].pieces), me) if pieced.regions is not None and mine else []
  return Plan(
    records=tuple(records),
    arrays=leaves.arrays,
    packed=packed,
    packs=packs,
    my_pack=mine[0] if mine else None,
    data_dir=data_dir,
    values=values,
    holders=leaves.holders,
    reusable=reusable,
    maybe_packed=[(i, d) for i, d, _ in maybe if owners[i][0] == me],
    pieces=parts,
    meshes=tuple(pieced.meshes),
    layout=pieced.layout,
    regions=pieced.regions,
    maybe_runs=pieced.runs(me) if reusable.pieced else [],
  )


def set_inline(records: list[_records.Leaf], inline: list[tuple[int, Any]], me: int) -> None:
  """The inline leaves' bytes into their records (process 0's; the others' stay empty). A
  jax leaf's bytes are staged as larger leaves are (``copies``): every copy started before
  any is waited for, and none left cached on the caller's array (``np.array(x)`` would cache
  its copy there: on CPU too, for a sharded array)."""
  copies = Copies()
  staged = [
    (
      i,
      data
      if isinstance(data, np.ndarray) or me != 0
      else Staged.of(data, copies.at(records[i].path)),
    )
    for i, data in inline
  ]
  copies.wait()
  for i, data in staged:
    raw = (
      b""
      if me != 0
      else _leaves.host_bytes(data)
      if isinstance(data, np.ndarray)
      else data.raw().tobytes()
    )
    records[i] = _records.evolve(records[i], inline=raw)


def _candidates(
  base: Base | None, records: list[_records.Leaf], meshes: list[np.ndarray]
) -> _refs.Candidates:
  """The leaves that may reuse the base's data; (process 0) one warning for those that cannot
  because their layout differs (``(key path, why)``)."""
  if base is None:
    return _refs.Candidates()
  reusable = base.candidates(records, meshes)
  leaves = reusable.not_compared
  if not leaves or jax.process_index() != 0:
    return reusable
  where, why = leaves[0]
  more = f" (and {len(leaves) - 1} more leaves)" if len(leaves) > 1 else ""
  warnings.warn(
    f"save(base={base.where!r}): {where}{more} cannot reuse the base's data: {why}. Such "
    "leaves are written in full; save with the same settings and shardings as the base to "
    "write only what changed.",
    RuntimeWarning,
    stacklevel=5,
  )
  return reusable


def _assign_packs(
  records: list[_records.Leaf],
  candidates,
  data_dir: str,
  nproc: int,
  me: int,
  regions: dict[int, int],
) -> tuple[tuple[_records.Pack, ...], list]:
  """Every process's pack (for the manifest; each candidate's record in ``records`` replaced
  by one with its ``packed``) and the (record index, data) this process packs. ``regions``:
  each process's pieces bytes."""
  plan = _packing.assign(
    [c[2] for c in candidates],
    nproc,
    extra=regions,
    chunk_bytes=_pieces.PACK_CHUNK_BYTES if regions else _packing.PACK_CHUNK_BYTES,
  )
  packs: list[_records.Pack] = []
  index_of = {}
  for p, (nbytes, chunk, inner) in sorted(plan.sizes.items()):
    index_of[p] = len(packs)
    packs.append(
      _records.Pack(
        f"{data_dir}/p/{p}",
        nbytes,
        chunk,
        inner,
        None,
        *((p, plan.pieces[p]) if regions else (None, None)),
      )
    )
  packed = []
  for i, data, item in candidates:
    p, offset = plan.where[i]
    records[i] = _records.evolve(
      records[i], packed=_records.Packed(index_of[p], offset, item.nbytes)
    )
    if p == me:
      packed.append((i, data))
  return tuple(packs), packed


def _zarr_array(
  i: int, rec: _records.Leaf, data, kv_spec, data_dir: str, codecs: _arrays.Codecs
) -> Array:
  """A large leaf's zarr array (its record with ``stored``) and the chunks this process
  writes: planned from the sharding's structure (O(local devices), cached), ``salt=i``
  spreading replicated leaves' writes over processes."""
  dtype, shape = np.dtype(data.dtype), tuple(data.shape)
  if isinstance(data, np.ndarray):
    whole = tuple((0, n) for n in shape)
    chunks = _chunks.chunk_shape(shape, 1, dtype.itemsize)
    units = [_chunks.WriteUnit(whole, "host", whole)] if jax.process_index() == 0 else []
  else:
    chunks, units = _chunks.plan_write(data.sharding, shape, dtype.itemsize, salt=i)
  inner = _chunks.inner_chunk_shape(chunks, dtype.itemsize)
  stored = _records.Stored(
    f"{data_dir}/a/{i}", tuple(int(c) for c in chunks), tuple(int(c) for c in inner), *codecs
  )
  units = units if _chunks.nbytes(shape, 1) else []
  return Array(
    i,
    _records.evolve(rec, stored=stored),
    data,
    _arrays.zarr_spec(kv_spec, stored, cast(str, rec.dtype), shape),
    units,
  )
