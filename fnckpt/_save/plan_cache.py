"""A save's plan made once per structure (docs/performance.md, "Cost per call").

A training loop saves a tree of the same structure again and again; only the values change.
The first save of a structure plans it (:func:`fnckpt._save.plan.plan`) and keeps a
:class:`Template`: the plan without any array and without the save's location. A later save
whose :func:`key` equals it (every leaf's key path and key types, and per leaf: a jax array's
dtype, shape and sharding, a numpy array's dtype and shape, another value's type; the save
options; the process index and count) binds the template to its own arrays, values, location
and data directory (:meth:`Template.bind`): no leaf is sorted, no chunk or pack laid out, no
write planned again. Saves with a base plan afresh (what they may reuse depends on the base).

The key holds values, never object identities (a new array may reuse a freed one's id), and
the template holds no array (it would keep the first save's device buffers alive). The cache
is bounded (``_state.plans``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

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
from . import agreement as _agreement
from . import piece_writes as _piece_writes
from . import plan as _plan
from .copies import buffers
from .options import SaveOptions

__all__ = ["Template", "key", "plan"]


def key(leaves: list[tuple[Any, Any]], options: SaveOptions) -> tuple:
  """What a plan depends on, by value: per leaf its key path with the type of every key (``1``
  and ``True`` are equal dict keys, and name different leaves), and a jax array's dtype,
  shape and sharding (its mesh, device order, spec and memory kind), a numpy array's dtype
  (byte order included) and shape, or another value's type; the options; the processes."""
  sig: list[tuple[Any, ...]] = []
  for path, leaf in leaves:
    types = tuple([type(k) for _, k in path])
    if isinstance(leaf, jax.Array):
      sig.append((path, types, "jax", leaf.dtype, leaf.shape, leaf.sharding))
    elif isinstance(leaf, np.ndarray):
      sig.append((path, types, "numpy", leaf.dtype, leaf.shape))
    else:
      sig.append((path, types, type(leaf)))
  return (tuple(sig), options, jax.process_index(), jax.process_count())


def plan(tree: Any, kv_spec: dict, data_dir: str, options: SaveOptions) -> _plan.Plan:
  """The plan of a save of ``tree`` without a base: the template of an earlier save of the
  same structure bound to its leaves, else planned (its key paths checked: a kept template's
  passed) and kept as a template."""
  leaves = _tree.flatten(tree, check=False)[0]
  k = key(leaves, options)
  template = _state.plans.get("saves", k)
  if template is not None:
    return template.bind(leaves, kv_spec, data_dir)
  _tree.check_paths(leaves)
  made = _plan.plan(leaves, kv_spec, data_dir, options)
  _state.plans.put("saves", k, Template.of(made))
  return made


@dataclasses.dataclass(frozen=True)
class _Part:
  """A pieced leaf's chunk in this process's pack, without its data."""

  offset: int
  nbytes: int
  leaf: int
  device: Any


@dataclasses.dataclass(frozen=True)
class Template:
  """A plan without arrays, values or location: what is bound per save (``bind``)."""

  records: tuple[_records.Leaf, ...]  # stored dirs relative (to the data directory)
  holders: tuple[str | None, ...]
  jax: tuple[int, ...]  # leaves that are jax arrays (typed keys too)
  numpy: tuple[int, ...]
  values: tuple[int, ...]  # leaves whose record holds their value (made per save)
  perprocess: tuple[int, ...]
  inline: tuple[int, ...]
  stored: tuple[int, ...]
  arrays: tuple[tuple[int, tuple[Any, ...]], ...]  # (leaf, the chunks this process writes)
  packed: tuple[int, ...]  # leaves this process packs
  packs: tuple[_records.Pack, ...]  # dirs relative
  my_pack: int | None
  parts: tuple[_Part, ...]
  meshes: tuple[np.ndarray, ...]
  layout: Any
  regions: Any
  entries: tuple[_agreement.Entry, ...] | None  # what the processes compare (several)

  @staticmethod
  def of(p: _plan.Plan) -> Template:
    """The template of a plan made without a base."""
    d = len(p.data_dir)
    by_kind: dict[str, list[int]] = {"jax": [], "numpy": [], "values": [], "perprocess": []}
    records = []
    for r in p.records:
      by_kind[_kind(r)].append(r.index)
      if r.stored is not None:
        r = _records.evolve(r, stored=_records.evolve(r.stored, dir=r.stored.dir[d:]))
      records.append(_records.evolve(r, inline=b"") if r.inline is not None else r)
    my = next((k for k, q in enumerate(p.packs) if q == p.my_pack), None)
    multi = jax.process_count() > 1
    return Template(
      records=tuple(records),
      holders=tuple(p.holders),
      jax=tuple(by_kind["jax"]),
      numpy=tuple(by_kind["numpy"]),
      values=tuple(by_kind["values"]),
      perprocess=tuple(by_kind["perprocess"]),
      inline=tuple(r.index for r in p.records if r.inline is not None),
      stored=tuple(r.index for r in p.records if r.stored is not None),
      arrays=tuple((a.index, tuple(a.units)) for a in p.arrays),
      packed=tuple(i for i, _ in p.packed),
      packs=tuple(_records.evolve(q, dir=q.dir[d:]) for q in p.packs),
      my_pack=my if p.my_pack is not None else None,
      parts=tuple(
        _Part(q.offset, q.nbytes, q.leaf, next(iter(q.shard.devices()))) for q in p.pieces
      ),
      meshes=p.meshes,
      layout=p.layout,
      regions=p.regions,
      entries=tuple(_agreement.entries(p.records, p.holders, p.data_dir)) if multi else None,
    )

  def bind(self, leaves: list[tuple[Any, Any]], kv_spec: dict, data_dir: str) -> _plan.Plan:
    """The plan of a save of ``leaves`` (of this template's key) to ``kv_spec``, its data in
    ``data_dir``: the arrays and values are these leaves', checked as planning checks them
    (a deleted array, a value no reader accepts)."""
    records = list(self.records)
    datas, values = self._data(leaves, records)
    for i in self.stored:
      s = records[i].stored
      assert s is not None
      records[i] = _records.evolve(records[i], stored=_records.evolve(s, dir=data_dir + s.dir))
    _plan.set_inline(records, [(i, datas[i]) for i in self.inline], jax.process_index())
    packs = tuple(_records.evolve(q, dir=data_dir + q.dir) for q in self.packs)
    return _plan.Plan(
      records=tuple(records),
      arrays=[self._array(i, records[i], datas[i], units, kv_spec) for i, units in self.arrays],
      packed=[(i, datas[i]) for i in self.packed],
      packs=packs,
      my_pack=packs[self.my_pack] if self.my_pack is not None else None,
      data_dir=data_dir,
      values=values,
      holders=list(self.holders),
      reusable=_refs.Candidates(),
      pieces=self._pieces(records, datas),
      meshes=self.meshes,
      layout=self.layout,
      regions=self.regions,
      agreement=self._entries(records, data_dir),
    )

  def _data(self, leaves, records: list[_records.Leaf]) -> tuple[list[Any], bytes | None]:
    """Per leaf the array whose bytes are stored (None: none), records made anew for the
    values, and this process's PerProcess values; every problem raised at once."""
    datas: list[Any] = [None] * len(records)
    problems = []
    for i in self.jax:
      path, leaf = leaves[i]
      if leaf.is_deleted():
        problems.append(_plan.deleted(path))
      else:
        datas[i] = jax.random.key_data(leaf) if records[i].kind == "key" else leaf
    for i in self.numpy:
      datas[i] = leaves[i][1]
    for i in self.values:
      try:
        records[i] = _leaves.leaf_record(i, *leaves[i])[0]
      except CheckpointError as e:
        problems.append(str(e))
    values = None
    try:
      pp = [leaves[i] for i in self.perprocess]
      values = _perprocess.encode(pp) if pp else None
    except CheckpointError as e:
      problems.append(str(e))
    if problems:
      raise _plan.problems_error(problems)
    return datas, values

  @staticmethod
  def _array(i: int, rec: _records.Leaf, data: Any, units, kv_spec: dict) -> _plan.Array:
    assert rec.stored is not None and rec.dtype is not None and rec.shape is not None
    spec = _arrays.zarr_spec(kv_spec, rec.stored, rec.dtype, rec.shape)
    return _plan.Array(i, rec, data, spec, list(units))

  def _pieces(self, records, datas: list[Any]) -> list[_piece_writes.PackPart]:
    """This process's chunks of pieced leaves, each a device buffer of this save's array."""
    held: dict[int, dict[Any, Any]] = {}
    out = []
    for p in self.parts:
      if p.leaf not in held:
        held[p.leaf] = dict(buffers(datas[p.leaf]))
      buffer = held[p.leaf][p.device]
      dtype = datas[p.leaf].dtype
      make = functools.partial(_piece_writes.stage_buffer, buffer, p.device, dtype)
      out.append(_piece_writes.PackPart(p.offset, p.nbytes, p.leaf, make, buffer))
    return out

  def _entries(self, records: list[_records.Leaf], data_dir: str) -> list[_agreement.Entry]:
    """The agreement's entries: the template's, but for the values' records (made anew)."""
    if self.entries is None:
      return []
    out = list(self.entries)
    for i in self.values:
      out[i] = _agreement.entry(records[i], self.holders[i], data_dir)
    return out


def _kind(r: _records.Leaf) -> str:
  """How a record is bound per save: "jax" / "numpy" (its array), "perprocess", or "values"
  (the record is made anew from the leaf)."""
  if r.kind == "perprocess":
    return "perprocess"
  if r.kind in ("array", "key"):
    return "jax" if r.source == "jax" else "numpy"
  return "values"
