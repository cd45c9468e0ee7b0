"""``fnckpt.PerProcess``: a value saved once per process and restored on each process from its
own saved value (data-loader positions, per-host numpy Generators, host-local arrays).

On disk (format 2) the manifest holds ``{"path", "kind": "perprocess"}`` for each one; every
process writes all of its per-process values to ``<data>/pp/<process index>``: msgpack
``{"sha256", "payload"}`` whose payload is msgpack ``{"leaves": [records]}`` (the manifest's
leaf records, full key paths, arrays inline) and sha256 its SHA-256 in hex.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import jax
import msgpack

from .._errors import CheckpointError, DamagedError
from . import leaves as _leaves
from . import manifest as _manifest
from . import parse as _parse
from . import records as _records
from . import tree as _tree

__all__ = ["PerProcess", "values_key", "encode", "decode", "value_at"]


@dataclasses.dataclass(frozen=True)
class PerProcess:
  """A leaf whose value may differ per process. ``fnckpt.save`` stores each process's value;
  ``fnckpt.restore`` gives each process its own back (``.value``) where the target holds a
  ``PerProcess`` (its ``value`` a template of the same tree, or ``None``). The value is any
  tree of what ``save`` stores (msgpack-able data, numpy arrays and Generators, arrays this
  process holds whole); it is kept inline in one small file per process, so keep it small.

  >>> import fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> loader = fnckpt.PerProcess({"epoch": 3, "offset": 17})
  >>> _ = fnckpt.save({"loader": loader}, f"{d}/c").wait()
  >>> fnckpt.restore(f"{d}/c", {"loader": fnckpt.PerProcess(None)})["loader"].value
  {'epoch': 3, 'offset': 17}
  """

  value: Any


def values_key(data_dir: str, process: int) -> str:
  """Where process ``process`` keeps its per-process values, relative to the checkpoint."""
  return f"{data_dir}/pp/{process}"


def encode(items: Sequence[tuple[_tree.Path, PerProcess]]) -> bytes:
  """This process's per-process values -> the bytes of its ``pp/<process>`` file (one
  error listing every value that cannot be stored)."""
  records: list[_records.Leaf] = []
  problems: list[str] = []
  for path, pp in items:
    for sub, leaf in _tree.flatten(pp.value)[0]:
      try:
        records.append(_record(len(records), path + sub, leaf))
      except CheckpointError as e:
        problems.append(str(e))
  if problems:
    raise CheckpointError("\n  ".join(problems))
  payload = msgpack.packb({"leaves": [_records.encode(r) for r in records]}, use_bin_type=True)
  return msgpack.packb(
    {"sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}, use_bin_type=True
  )


def _record(index: int, where: _tree.Path, leaf: Any) -> _records.Leaf:
  if isinstance(leaf, PerProcess):
    raise CheckpointError(
      f"fnckpt.PerProcess at {_tree.keystr(where)} is inside another "
      "PerProcess; wrap only the outer value."
    )
  rec, data = _leaves.leaf_record(index, where, leaf)
  if data is None:
    return rec
  if isinstance(data, jax.Array) and not (data.is_fully_addressable or data.is_fully_replicated):
    raise CheckpointError(
      f"The array at {_tree.keystr(where)} is inside fnckpt.PerProcess but spans several "
      "processes; a per-process value must be held whole by its process."
    )
  return dataclasses.replace(rec, inline=_leaves.host_bytes(data))


def decode(data: bytes, where: str) -> tuple[_records.Leaf, ...]:
  """The bytes of a ``pp/<process>`` file -> validated records (untrusted input): its
  SHA-256 must match (a flipped bit is an error, never another value), then the records are
  validated like the manifest's."""
  try:
    outer = _manifest.unpack(data)
    ok = (
      isinstance(outer, dict)
      and set(outer) == {"sha256", "payload"}
      and isinstance(outer["payload"], bytes)
      and isinstance(outer["sha256"], str)
    )
    if ok and hashlib.sha256(outer["payload"]).hexdigest() != outer["sha256"]:
      raise DamagedError(
        f"The per-process values at {where!r} are corrupt (SHA-256 "
        "mismatch); restore an earlier checkpoint."
      )
    m = _manifest.unpack(outer["payload"]) if ok else None
  except CheckpointError:
    raise
  except Exception as e:  # msgpack raises several unrelated types
    raise DamagedError(
      f"The per-process values at {where!r} are corrupt "
      f"({type(e).__name__}); restore an earlier checkpoint."
    ) from None
  if not ok:
    raise DamagedError(
      f"The per-process values at {where!r} are corrupt (not a "
      "{sha256, payload} map); restore an earlier checkpoint."
    )
  return _parse.parse_values(m, where)


def value_at(
  leaves: Sequence[_records.Leaf], path: _tree.Path, template: Any, where: str
) -> PerProcess:
  """The ``PerProcess`` saved at ``path``, rebuilt from ``leaves`` (in ``template``'s tree
  structure when it has one, else plain dicts and lists)."""
  n = len(path)
  key = _tree.match_key(path)
  mine = [l for l in leaves if _tree.match_key(l.path[:n]) == key]
  if not mine:
    raise CheckpointError(
      f"{where!r} holds no per-process value for {_tree.keystr(path)}; "
      "the checkpoint is damaged. Restore an earlier one."
    )
  values = [_value(l) for l in mine]
  subs = [l.path[n:] for l in mine]
  if template is None:
    return PerProcess(_tree.unflatten_from_paths(subs, values))
  pairs, treedef = _tree.flatten(template)
  if [_tree.match_key(p) for p, _ in pairs] != [_tree.match_key(s) for s in subs]:
    saved = ", ".join(_tree.keystr(path + s) for s in subs[:4])
    raise CheckpointError(
      f"fnckpt.PerProcess at {_tree.keystr(path)}: the target's value has another tree "
      f"structure than the saved one (saved leaves: {saved}{', ...' if len(subs) > 4 else ''})."
      " Pass fnckpt.PerProcess(None) to take the saved structure."
    )
  return PerProcess(jax.tree_util.tree_unflatten(treedef, values))


def _value(leaf: _records.Leaf) -> Any:
  if not leaf.is_array:
    return _leaves.decode_value(leaf)
  host = _leaves.inline_array(leaf)
  return jax.random.wrap_key_data(host, impl=leaf.impl) if leaf.kind == "key" else host  # type: ignore[arg-type]
