"""``fnckpt.PerProcess`` values as verify and diff read them: one saving process's records
(validated, nothing decoded: a key would need a JAX backend), and those under a key path."""

from __future__ import annotations

from typing import Sequence, cast

from .._errors import CheckpointError
from .._format import perprocess as _perprocess
from .._format import records as _records
from .._format import tree as _tree
from .._sources import source as _source

__all__ = ["read_values", "values_under"]


def read_values(src: _source.Source, process: int) -> tuple[_records.Leaf, ...]:
  """Process ``process``'s ``fnckpt.PerProcess`` values; CheckpointError naming the file if
  missing or invalid."""
  key = _perprocess.values_key(cast(str, src.manifest.data), process)
  where = f"{src.location}/{key}"
  got = src.kv.read(key).result()
  if got.state != "value":
    raise CheckpointError(f"missing data [{where} does not exist]")
  return _perprocess.decode(got.value, where)


def values_under(leaves: Sequence[_records.Leaf], path: _tree.Path) -> list[tuple]:
  """The saved leaves below key path ``path``, comparable (floats by repr: -0.0 differs from
  0.0, NaN equals NaN)."""
  n, key = len(path), _tree.match_key(path)
  return [
    (_tree.match_key(l.path[n:]), l.kind, l.dtype, l.shape, l.impl, l.inline, l.type, repr(l.value))
    for l in leaves
    if _tree.match_key(l.path[:n]) == key
  ]
