"""A restore's matching of target and checkpoint made once per structure (docs/performance.md,
"Cost per call").

Matching a target to a checkpoint's leaves (key paths, shapes, dtypes, target shardings
resolved and checked against this job's devices) depends on the target's structure and
shardings and on the checkpoint's layout, not on the values. A restore whose :func:`key`
equals an earlier one's takes that match and binds it to this checkpoint's records: the array
leaves' placements are reused; the other leaves (plain values, which a 0-d array target checks
by value) are matched again. The key holds values, never identities: per target leaf its key
path and key types, and a jax array's or ``ShapeDtypeStruct``'s dtype, shape, sharding and
format, a numpy array's dtype and shape, or another value's type; per saved leaf its key path,
kind, dtype, shape and key implementation; ``partial`` and ``cast``; the mesh in context (an
abstract target mesh becomes it). Bounded: ``_state.plans``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from .. import _state
from .._format import records as _records
from .._format import tree as _tree

__all__ = ["key", "matched"]

_VALUE_KINDS = frozenset({"array", "key"})  # records whose match is reused (the others: per call)


def _target(leaf: Any) -> tuple:
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return ("sds", leaf.dtype, leaf.shape, leaf.sharding, getattr(leaf, "format", None))
  if isinstance(leaf, jax.Array):
    return ("jax", leaf.dtype, leaf.shape, leaf.sharding)
  if isinstance(leaf, np.ndarray):
    return ("numpy", leaf.dtype, leaf.shape)
  return ("value", type(leaf))


def key(
  pairs: list[tuple[Any, Any]], records: list[_records.Leaf], partial: bool, cast: bool
) -> tuple | None:
  """What a match depends on, by value (None: not kept, e.g. a sharding that cannot be read
  without a mesh)."""
  try:
    target = tuple((path, tuple([type(k) for _, k in path]), _target(leaf)) for path, leaf in pairs)
    saved = tuple((r.path, r.kind, r.dtype, r.shape, r.impl, r.type) for r in records)
    k = (target, saved, partial, cast, jax.sharding.get_mesh())
    hash(k)
  except Exception:  # (a ShapeDtypeStruct's bare PartitionSpec, an unhashable format)
    return None
  return k


@dataclasses.dataclass(frozen=True)
class _Match:
  """Per target leaf, the index of its record and (an array leaf's) its want without a record."""

  index: tuple[int, ...]
  wants: tuple[Any, ...]  # None: matched per call


def matched(
  location: str,
  records: list[_records.Leaf],
  target: Any,
  partial: bool,
  cast: bool,
  match: Callable[..., tuple[list[Any], Any]],
  want: Callable[[Any, _records.Leaf], Any],
) -> tuple[list[Any], Any]:
  """``match(location, records, pairs, treedef, partial, cast)`` of the flattened target, or
  the kept match of the same key bound to these ``records`` (``want(leaf, rec)`` for the
  leaves matched per call: if one no longer matches, the whole match runs, for its error)."""
  pairs, treedef = _tree.flatten(target)
  k = key(pairs, records, partial, cast)
  kept = _state.plans.get("restores", k) if k is not None else None
  if kept is not None:
    wants = []
    for (_, leaf), i, w in zip(pairs, kept.index, kept.wants):
      got = want(leaf, records[i]) if w is None else dataclasses.replace(w, rec=records[i])
      if isinstance(got, str):
        return match(location, records, pairs, treedef, partial, cast)
      wants.append(got)
    return wants, treedef
  wants, treedef = match(location, records, pairs, treedef, partial, cast)
  if k is not None:
    at = {id(r): i for i, r in enumerate(records)}
    _state.plans.put(
      "restores",
      k,
      _Match(
        tuple(at[id(w.rec)] for w in wants),
        tuple(
          dataclasses.replace(w, rec=None)
          if w.rec.kind in _VALUE_KINDS and w.array_target and w.value is None
          else None
          for w in wants
        ),
      ),
    )
  return wants, treedef
