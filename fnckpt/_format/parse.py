"""PURE: a manifest's msgpack data -> frozen, validated records (formats 1, 2 and 3; the records
and their encoding are :mod:`fnckpt._format.records`).

Everything read from storage is untrusted. :func:`parse` turns a decoded manifest into
:class:`Manifest` (with :class:`Leaf` records) or raises one :class:`CheckpointError` naming the
leaf (key path, or index when the path itself is bad) and the field; :func:`parse_values` does
the same for a list of leaf records (per-process values). What validation bounds: every field's
type; dtypes, leaf kinds, PRNG implementations and bit generators from allow-lists; shapes,
chunk grids and byte sizes consistent with each other; key paths well formed (no duplicates, no
leaf that is also a parent, sequence indices dense, so rebuilding the tree allocates no more
than the leaves); storage directories relative, normalized and inside the checkpoint
(:func:`check_dir`; references to other checkpoints, :func:`check_rel`). Unknown keys and kinds
are refused (a newer writer's manifest is refused by its version number first). Parsing is the
one validator: ``parse(encode(m), location, v) == m`` for every valid record (v = 2, 3).

This module holds the manifest's top level (its fields, ``packs``, ``bases``, ``fork``,
``meshes``), the leaf records' dispatch by kind (the non-array kinds validated here) and the key
paths' tree; array records and the pieced leaves' layout are :mod:`fnckpt._format.parse_arrays`,
the field checks both use (and :func:`check_dir`, :func:`check_rel`, re-exported here) are
:mod:`fnckpt._format.parse_fields`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import numpy as np

from .._errors import CheckpointError
from .parse_arrays import _array, _check_pieces, _check_runs, _Context
from .parse_fields import (
  _Bad,
  _base_of,
  _dtype,
  _error,
  _int,
  _keys,
  _list,
  _req,
  _shape,
  _short,
  _str,
  check_dir,
  check_rel,
)
from .records import (
  _DATA_NAME,
  BIT_GENERATORS,
  HASH_ALGS,
  HASH_BYTES,
  LEAF_KINDS,
  MAX_BIGINT_DIGITS,
  MAX_DEPTH,
  MAX_PACK_CHUNK,
  PATH_KINDS,
  SCALAR_TYPES,
  Base,
  Fork,
  Leaf,
  Manifest,
  Pack,
  itemsize,
)
from .tree import MAX_PATH_DEPTH, key_problem, keystr

__all__ = ["parse", "parse_values", "check_dir", "check_rel"]


_TOP_V1 = ("format", "version", "created", "process_count", "versions", "metadata", "leaves")
_TOP_V2 = _TOP_V1 + ("data", "packs")
_TOP_V2_OPTIONAL = ("bases", "fork", "meshes")
_TOP_V3 = _TOP_V2 + ("hash",)


def _top_keys(version: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(required, optional) top-level keys of a manifest of ``version``."""
  if version == 1:
    return _TOP_V1, ()
  return (_TOP_V2 if version == 2 else _TOP_V3), _TOP_V2_OPTIONAL


def _alg(v: Any) -> str:
  """Format 3's ``hash``: an algorithm of the allow-list."""
  _req(
    isinstance(v, str) and v in HASH_ALGS,
    lambda: (
      f"'hash' names the content hash algorithm {_short(v)}, which this fnckpt does "
      f"not know (known: {sorted(HASH_ALGS)})"
    ),
  )
  return v


def parse(m: Any, location: str, reader_version: int) -> Manifest:
  """Validate a decoded manifest; one :class:`CheckpointError` names what is wrong."""
  try:
    version = _int(
      m.get("version") if isinstance(m, dict) else None, "'version'", 1, reader_version
    )
    top = _keys(m, "it", *_top_keys(version))
    alg = _alg(top["hash"]) if version >= 3 else None
    hash_bytes = HASH_ALGS[alg] if alg is not None else HASH_BYTES
    _req(top["format"] == "fnckpt", "'format' must be 'fnckpt'")
    created = top["created"]
    _req(
      isinstance(created, (int, float))
      and not isinstance(created, bool)
      and math.isfinite(created)
      and abs(created) < 1e11,
      "'created' must be a Unix time",
    )
    nproc = _int(top["process_count"], "'process_count'", 1, 1 << 24)
    versions = top["versions"]
    _req(
      isinstance(versions, dict)
      and all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()),
      "'versions' must map names to version strings",
    )
    data = check_dir(top["data"], "'data'") if version >= 2 else None
    bases = _bases(top.get("bases", []))
    fork = _fork(top.get("fork"))
    packs = tuple(
      _pack(p, i, bases, nproc, version)
      for i, p in enumerate(_list(top.get("packs", []), "'packs'"))
    )
    _req(
      len({p.process for p in packs if p.process is not None})
      == sum(p.process is not None for p in packs),
      "two 'packs' name the same 'process'",
    )
    meshes = _meshes(top.get("meshes", []), nproc)
    raw = _list(top["leaves"], "'leaves'")
  except _Bad as e:  # "it lacks 'data'", "its 'created' must be ..."
    raise _error(location, str(e) if e.whole else f"its {e}") from None
  leaves: list[Leaf] = []
  context = _Context(
    version=version, packs=packs, bases=bases, meshes=meshes, hash_bytes=hash_bytes, heads={}
  )
  for i, rec in enumerate(raw):
    try:
      leaves.append(_leaf(i, rec, context))
    except (TypeError, ValueError, KeyError, OverflowError) as e:  # a check this file lacks
      raise _error(location, f"the record of leaf #{i} is malformed ({type(e).__name__})") from None
    except _Bad as e:
      where = keystr(rec["path"]) if _path_ok(rec) else f"leaf #{i}"
      raise _error(location, f"the record of {where} is invalid: {e}") from None
  try:
    _check_tree([l.path for l in leaves])
  except _Bad as e:
    raise _error(location, str(e)) from None
  layout = _check_pieces(location, leaves, packs, meshes, nproc, version == 2)
  if version >= 3 and layout is not None:
    _check_runs(location, leaves, packs, layout, hash_bytes)
  return Manifest(
    version=version,
    created=float(created),
    process_count=nproc,
    versions=dict(versions),
    metadata=top["metadata"],
    leaves=tuple(leaves),
    data=data,
    packs=packs,
    bases=bases,
    fork=fork,
    meshes=meshes,
    layout=layout,
    hash=alg,
  )


def _meshes(v: Any, nproc: int) -> tuple[np.ndarray, ...]:
  out = []
  for m, entry in enumerate(_list(v, "'meshes'", 1 << 16)):
    _list(entry, f"'meshes'[{m}]", 1 << 24)
    _req(
      all(type(x) is int and 0 <= x < nproc for x in entry),
      lambda: f"'meshes'[{m}] must list process indices in [0, {nproc})",
    )
    a = np.array(entry, np.int64)
    a.flags.writeable = False
    out.append(a)
  return tuple(out)


def parse_values(m: Any, where: str) -> tuple[Leaf, ...]:
  """Validate one process's per-process values (format 2, ``<data>/pp/<process>``): a map
  ``{"leaves": [records]}`` whose arrays are all inline.

  >>> [l.value for l in parse_values({"leaves": [
  ...     {"path": [["dict", "a"]], "kind": "scalar", "type": "int", "value": 7}]}, "x")]
  [7]
  """
  leaves = []
  try:
    raw = _list(_keys(m, "it", ("leaves",))["leaves"], "'leaves'")
    for i, rec in enumerate(raw):
      leaf = _leaf(i, rec, _Context(version=2))
      _req(
        leaf.kind != "perprocess" and leaf.stored is None,
        lambda: f"leaf #{i} must hold its value inline",
      )
      leaves.append(leaf)
    _check_tree([l.path for l in leaves])
  except (_Bad, TypeError, ValueError, KeyError, OverflowError) as e:
    raise CheckpointError(
      f"The per-process values at {where!r} are invalid: {e}. The checkpoint is damaged; "
      "restore an earlier one."
    ) from None
  return tuple(leaves)


def _bases(v: Any) -> tuple[Base, ...]:
  out = []
  for i, b in enumerate(_list(v, "'bases'", 1 << 16)):
    _keys(b, f"'bases'[{i}]", ("dir", "data"))
    data = _str(b["data"], f"'bases'[{i}].data", 64)
    _req(
      _DATA_NAME.fullmatch(data) is not None,
      lambda: f"'bases'[{i}].data must be data-<32 hex digits>, found {_short(data)}",
    )
    out.append(Base(check_rel(b["dir"], f"'bases'[{i}].dir"), data))
  _req(len(set(out)) == len(out), "'bases' entries must be distinct")
  return tuple(out)


def _fork(v: Any) -> Fork | None:
  if v is None:
    return None
  _keys(v, "'fork'", ("run", "step"))
  return Fork(check_rel(v["run"], "'fork'.run"), _int(v["step"], "'fork'.step", 0, 1 << 62))


def _pack(
  p: Any, i: int, bases: tuple[Base, ...] = (), nproc: int = 1 << 24, version: int = 2
) -> Pack:
  _keys(
    p,
    f"'packs'[{i}]",
    ("dir", "nbytes", "chunk", "inner"),
    ("base",) if version >= 3 else ("base", "process", "pieces"),
  )
  nbytes = _int(p["nbytes"], f"'packs'[{i}].nbytes", 1)
  chunk = _int(p["chunk"], f"'packs'[{i}].chunk", 1, min(nbytes, MAX_PACK_CHUNK))
  inner = _int(p["inner"], f"'packs'[{i}].inner", 1, chunk)
  _req(
    chunk % inner == 0 and nbytes % inner == 0,
    lambda: f"'packs'[{i}].inner must divide its chunk and nbytes",
  )
  d = check_dir(p["dir"], f"'packs'[{i}].dir")
  _req(
    ("process" in p) == ("pieces" in p),
    lambda: f"'packs'[{i}] needs both 'process' and 'pieces' or neither",
  )
  process = pieces = None
  if "process" in p:
    process = _int(p["process"], f"'packs'[{i}].process", 0, nproc - 1)
    pieces = _int(p["pieces"], f"'packs'[{i}].pieces", 0, nbytes)
  return Pack(
    dir=d,
    nbytes=nbytes,
    chunk=chunk,
    inner=inner,
    base=_base_of(p.get("base"), d, f"'packs'[{i}]", bases),
    process=process,
    pieces=pieces,
  )


def _path_ok(rec: Any) -> bool:
  try:
    _path(rec["path"])
    return True
  except Exception:
    return False


def _path(p: Any) -> tuple[tuple[str, Any], ...]:
  _list(p, "'path'", MAX_PATH_DEPTH)
  out = []
  for e in p:
    _req(
      isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and e[0] in PATH_KINDS,
      lambda: (
        f"key path entry {_short(e)} must be [kind, key] with kind one of {sorted(PATH_KINDS)}"
      ),
    )
    kind, key = e
    problem = key_problem(kind, key)
    _req(not problem, lambda: f"key path entry {_short(e)} is {problem}")
    out.append((kind, key))
  return tuple(out)


def _leaf(i: int, rec: Any, context: _Context) -> Leaf:
  """Leaf record ``i`` of a manifest, validated in ``context``."""
  version = context.version
  _req(isinstance(rec, dict), lambda: f"it must be a map, found {_short(rec)}")
  kind = rec.get("kind")
  _req(
    isinstance(kind, str) and kind in LEAF_KINDS,
    lambda: f"unknown leaf kind {_short(kind)} (known: {sorted(LEAF_KINDS)})",
  )
  path = _path(rec.get("path"))
  common = ("path", "kind")
  if kind == "perprocess":  # format 2: the values are in each process's own file
    _req(version >= 2, "kind 'perprocess' needs format 2")
    _keys(rec, "it", common)
    return Leaf(i, path, kind)
  if kind in ("array", "key"):
    return _array(i, path, rec, context)
  if kind == "empty":
    _keys(rec, "it", common + ("type", "name"))
    _req(rec["type"] in ("none", "dict", "list", "tuple"), "'type' must be none/dict/list/tuple")
    return Leaf(i, path, kind, type=rec["type"], name=_str(rec["name"], "'name'"))
  if kind == "scalar":
    _keys(rec, "it", common + ("type", "value"), ("subtype",))
    subtype = _str(rec["subtype"], "'subtype'", 256) if "subtype" in rec else None
    return Leaf(
      i, path, kind, type=rec["type"], value=_scalar(rec["type"], rec["value"]), subtype=subtype
    )
  if kind == "bigint":
    _keys(rec, "it", common + ("value",))
    v = _str(rec["value"], "'value'", MAX_BIGINT_DIGITS + 1)
    _req(
      re.fullmatch(r"-?[0-9]{1,%d}" % MAX_BIGINT_DIGITS, v) is not None,  # noqa: UP031
      "'value' must be a decimal integer",
    )
    return Leaf(i, path, kind, value=int(v))
  if kind == "npscalar":
    _keys(rec, "it", common + ("dtype", "value"))
    dtype = _dtype(rec["dtype"])
    _req(
      isinstance(rec["value"], bytes) and len(rec["value"]) == itemsize(dtype),
      lambda: f"'value' must be {itemsize(dtype)} bytes",
    )
    return Leaf(i, path, kind, dtype=dtype, value=rec["value"])
  _keys(rec, "it", common + ("value",))  # npgen
  return Leaf(i, path, kind, value=_generator_state(rec["value"]))


def _scalar(t: Any, v: Any) -> Any:
  _req(
    isinstance(t, str) and t in SCALAR_TYPES,
    lambda: f"scalar type {_short(t)} is not one of {sorted(SCALAR_TYPES)}",
  )
  if t == "complex":
    _req(
      isinstance(v, list)
      and len(v) == 2
      and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
      "a complex value must be [re, im]",
    )
    return complex(v[0], v[1])
  ok = {
    "bool": isinstance(v, bool),
    "str": isinstance(v, str),
    "bytes": isinstance(v, bytes),
    "int": isinstance(v, int) and not isinstance(v, bool),
    "float": isinstance(v, (int, float)) and not isinstance(v, bool),
  }[t]
  _req(ok, lambda: f"a {t} value was expected, found {_short(v)}")
  return float(v) if t == "float" else v


def _generator_state(v: Any) -> dict:
  _req(
    isinstance(v, dict)
    and isinstance(v.get("bit_generator"), str)
    and v["bit_generator"] in BIT_GENERATORS,
    lambda: f"a Generator state needs 'bit_generator' in {sorted(BIT_GENERATORS)}",
  )
  _plain_ok(v, 0)
  return v


def _plain_ok(v: Any, depth: int) -> None:
  """A Generator's state: bounded nesting, tagged arrays/ints well formed."""
  _req(depth <= MAX_DEPTH, "a Generator state is nested too deeply")
  if isinstance(v, dict):
    if "__ndarray__" in v:
      a = v["__ndarray__"]
      _req(
        isinstance(a, list) and len(a) == 3 and isinstance(a[2], bytes),
        "a tagged array must be [dtype, shape, bytes]",
      )
      dtype, shape = _dtype(a[0]), _shape(a[1])
      _req(
        len(a[2]) == math.prod(shape) * itemsize(dtype),
        "a tagged array's bytes do not match its shape",
      )
      return
    if "__int__" in v:
      _req(
        isinstance(v["__int__"], str)
        and re.fullmatch(r"-?[0-9]{1,%d}" % MAX_BIGINT_DIGITS, v["__int__"]) is not None,  # noqa: UP031
        "a tagged int must be a decimal string",
      )
      return
    for k, x in v.items():
      _req(isinstance(k, str), "a Generator state's keys must be strings")
      _plain_ok(x, depth + 1)
  elif isinstance(v, list):
    for x in v:
      _plain_ok(x, depth + 1)


def _check_tree(paths: Sequence[tuple[tuple[str, Any], ...]]) -> None:
  """Key paths form a tree: unique, no leaf above another, one container type per node,
  sequence indices dense (0..n-1). Linear in the total number of keys: each node is a number
  (the root 0), found from its parent's number and its key, never a prefix tuple."""
  ids: dict[tuple[int, Any], int] = {}  # (parent node, key) -> node
  depth_of = [0]
  leaves: set[int] = set()
  groups: dict[int, str] = {}  # node -> "seq" or "map": one kind of children per node
  indices: dict[int, list[int]] = {}  # a "seq" node's children's indices
  for path in paths:
    node = 0
    for depth, (kind, key) in enumerate(path):
      group = "seq" if kind in ("seq", "flat") else "map"
      _req(
        groups.setdefault(node, group) == group,
        lambda: f"{keystr(path[:depth])} mixes sequence and mapping children",
      )
      child = ids.get((node, key if group == "map" else ("#", key)))
      if child is None:
        child = ids[(node, key if group == "map" else ("#", key))] = len(depth_of)
        depth_of.append(depth + 1)
        if group == "seq":
          indices.setdefault(node, []).append(key)
      node = child
    _req(node not in leaves, lambda: f"key path {keystr(path)} appears twice")
    leaves.add(node)
  for node in groups:
    _req(
      node not in leaves,
      lambda: f"a leaf is also a parent of other leaves (at depth {depth_of[node]})",
    )
  for node, group in groups.items():
    if group == "seq":
      idx = sorted(indices[node])
      _req(idx == list(range(len(idx))), "sequence indices must be 0..n-1 without gaps")
  _req(len(leaves) <= 1 or all(paths), "the root is a leaf but there are other leaves")
