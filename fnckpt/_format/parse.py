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
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Sequence

import numpy as np

from .._errors import CheckpointError
from .._layout import pieces as _pieces
from .codecs import BLOSC_CNAMES, BLOSC_SHUFFLES
from .records import (
  _DATA_NAME,
  _NAME,
  BIT_GENERATORS,
  DTYPES,
  FP_BYTES,
  HASH_ALGS,
  HASH_BYTES,
  LEAF_KINDS,
  MAX_BIGINT_DIGITS,
  MAX_CHUNKS,
  MAX_DEPTH,
  MAX_DIMS,
  MAX_ELEMENTS,
  MAX_PACK_CHUNK,
  MAX_UP,
  PATH_KINDS,
  PRNG_IMPLS,
  RUN_BYTES,
  SCALAR_TYPES,
  Base,
  Fork,
  Leaf,
  Manifest,
  Pack,
  Packed,
  Pieces,
  Sharding,
  Stored,
  evolve,
  itemsize,
)
from .runs import RUN
from .tree import MAX_PATH_DEPTH, key_problem, keystr

__all__ = ["parse", "parse_values", "check_dir", "check_rel"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Context:
  """What a leaf record is validated against: the manifest's ``version``, its ``packs``,
  ``bases`` and ``meshes``, ``hash_bytes`` (a content hash's size: SHA-256's in format 2, else
  the manifest's ``hash`` algorithm's) and ``heads``, the array heads validated so far in this
  parse (see :func:`_array`; None: none kept)."""

  version: int
  packs: tuple[Pack, ...] = ()
  bases: tuple[Base, ...] = ()
  meshes: tuple[np.ndarray, ...] = ()
  hash_bytes: int = HASH_BYTES
  heads: dict | None = None


class _Bad(Exception):
  """A field is invalid: raised inside parsing, turned into a CheckpointError naming the leaf.
  ``whole``: the message is about the record itself ("it lacks 'data'"), not one of its
  fields ("'created' must be ...", which the manifest's error words "its 'created' ...")."""

  def __init__(self, message: str, whole: bool = False):
    super().__init__(message)
    self.whole = whole


def _req(cond: bool, what: str | Callable[[], str], whole: bool = False) -> None:
  """Raise ``_Bad(what)`` unless ``cond``; a callable ``what`` is only formatted on failure
  (messages quote the offending value: formatting them eagerly cost more than parsing)."""
  if not cond:
    raise _Bad(what() if callable(what) else what, whole)


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
  _req(
    isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi,
    lambda: f"{what} must be an integer in [{lo}, {hi}], found {_short(v)}",
  )
  return v


def _str(v: Any, what: str, limit: int = 4096) -> str:
  _req(
    isinstance(v, str) and len(v) <= limit, lambda: f"{what} must be a string, found {_short(v)}"
  )
  return v


def _short(v: Any) -> str:
  text = repr(v)
  return text if len(text) <= 60 else text[:57] + "..."


def _keys(d: Any, what: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict:
  """``d`` is a map with the ``required`` keys and no others than ``optional``. ``what``
  names it in the message: ``"it"`` for the record itself (its errors are ``whole``)."""
  whole = what == "it"
  _req(isinstance(d, dict), lambda: f"{what} must be a map, found {_short(d)}", whole)
  missing = [k for k in required if k not in d]
  _req(not missing, f"{what} lacks {missing[0]!r}" if missing else "", whole)
  unknown = [k for k in d if k not in required and k not in optional]
  _req(
    not unknown,
    lambda: (
      f"{what} has an unknown field {_short(unknown[0]) if unknown else ''} "
      "(written by a newer fnckpt?)"
    ),
    whole,
  )
  return d


def check_dir(path: Any, what: str) -> str:
  """A storage directory inside the checkpoint: relative, normalized, plain names only.

  >>> check_dir("a/3", "dir")
  'a/3'
  """
  _str(path, what, 512)
  parts = path.split("/")
  _req(
    bool(path) and all(_NAME.fullmatch(p) and p not in (".", "..") for p in parts),
    lambda: (
      f"{what} must be a relative path of plain names inside the checkpoint, found {_short(path)}"
    ),
  )
  return path


def check_rel(path: Any, what: str) -> str:
  """A reference to another checkpoint or run: up to 64 ``..`` names, then plain names.

  >>> check_rel("5", "dir"), check_rel("../../runs/a/5", "dir")
  ('5', '../../runs/a/5')
  """
  _str(path, what, 2048)
  parts = path.split("/")
  up = 0
  while up < len(parts) and parts[up] == "..":
    up += 1
  rest = parts[up:]
  _req(
    up <= MAX_UP and rest and all(_NAME.fullmatch(p) and p not in (".", "..") for p in rest),
    lambda: f"{what} must be up to {MAX_UP} '..' then plain names, found {_short(path)}",
  )
  return path


def _hash(v: Any, what: str, n: int = HASH_BYTES) -> bytes:
  _req(isinstance(v, bytes) and len(v) == n, lambda: f"{what} must be {n} bytes, found {_short(v)}")
  return v


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


def _check_pieces(
  location: str,
  leaves: Sequence[Leaf],
  packs: tuple[Pack, ...],
  meshes: tuple[np.ndarray, ...],
  nproc: int,
  regions: bool = True,
) -> Any:
  """The layout of the pieced leaves; with ``regions`` (format 2), every writer's region
  inside its pack."""
  todo = []
  for l in leaves:
    if l.pieces is None:
      continue
    assert l.sharding is not None and l.shape is not None  # (a pieced leaf's, checked)
    todo.append(
      _pieces.PieceLeaf(
        index=l.index,
        mesh=l.pieces.mesh,
        axis_sizes=l.sharding.sizes,
        dim_axes=l.sharding.dim_axes + ((),) * (len(l.shape) - len(l.sharding.spec)),
        shift=_pieces.shift_of(l.index, l.sharding.sizes, l.sharding.dim_axes),
        chunk=l.pieces.chunks,
        nbytes=math.prod(l.pieces.chunks) * itemsize(l.dtype),
      )
    )
  if not todo:
    return None
  try:
    layout = _pieces.build(meshes, todo, nproc)
  except ValueError as e:
    raise _error(location, f"its pieced leaves cannot be laid out: {e}") from None
  if not regions:
    return layout
  own = {p.process: (k, p) for k, p in enumerate(packs) if p.process is not None}
  for proc in np.flatnonzero(layout.region).tolist():
    size = int(layout.region[proc])
    if proc not in own:
      raise _pieces_error(
        location,
        leaves,
        layout,
        proc,
        f"'pieces' are written by process {proc}, which has no pack with 'process': {proc}",
      )
    k, pack = own[proc]
    if pack.pieces is None or pack.pieces + size > pack.nbytes:
      raise _pieces_error(
        location,
        leaves,
        layout,
        proc,
        f"process {proc}'s pieces region "
        f"({size} bytes from 'packs'[{k}].pieces = {pack.pieces}) lies "
        f"outside its pack ({pack.nbytes} bytes)",
      )
  return layout


def _pieces_error(
  location: str, leaves: Sequence[Leaf], layout: Any, proc: int, what: str
) -> CheckpointError:
  """The error naming the first pieced leaf that process ``proc`` writes."""
  first = next(
    l
    for l in layout.leaves
    if int(layout.groups[layout.group_of[layout.position[l.index]]].counts[proc])
  )
  return _error(location, f"the record of {keystr(leaves[first.index].path)} is invalid: {what}")


def _check_runs(
  location: str, leaves: Sequence[Leaf], packs: tuple[Pack, ...], layout: Any, hash_bytes: int
) -> None:
  """Format 3: each pieced leaf's ``runs`` and ``hashes`` have one entry per process writing
  its chunks (rule 1), and each run lies inside the pack it names (all runs of all leaves
  checked at once, numpy)."""
  pieced = [leaves[pl.index] for pl in layout.leaves]
  counts: dict[int, np.ndarray] = {}  # group -> chunks of each writing process
  runs, sizes = [], []
  for j, (rec, pl) in enumerate(zip(pieced, layout.leaves)):
    g = layout.group_of[j]
    if g not in counts:
      c = layout.groups[g].counts
      counts[g] = c[c > 0]
    w, p = len(counts[g]), rec.pieces
    if len(p.runs) != RUN_BYTES * w or len(p.hashes) != hash_bytes * w:
      raise _error(
        location,
        f"the record of {rec.where} is invalid: 'pieces'.runs and "
        f"'pieces'.hashes must hold {RUN_BYTES} and {hash_bytes} bytes per process writing "
        f"its chunks ({w} processes), found {len(p.runs)} and {len(p.hashes)}",
      )
    runs.append(p.runs)
    sizes.append(counts[g] * pl.nbytes)
  got = np.frombuffer(b"".join(runs), RUN)
  size = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
  k, off = got["pack"].astype(np.int64), got["offset"]
  known = k < len(packs)
  room = np.array([p.nbytes for p in packs] + [0], np.int64)[np.where(known, k, len(packs))]
  inside = known & (off <= room.astype(np.uint64))
  inside &= size <= room - np.where(inside, off, 0).astype(np.int64)
  bad = np.flatnonzero(~inside)
  if bad.size:
    first = int(bad[0])
    ends = np.cumsum([len(r) // RUN_BYTES for r in runs])
    j = int(np.searchsorted(ends, first, side="right"))
    w = first - (int(ends[j - 1]) if j else 0)
    proc = int(np.flatnonzero(layout.groups[layout.group_of[j]].counts)[w])
    kk, o, n = int(k[first]), int(off[first]), int(size[first])
    what = (
      f"names pack {kk}, but there are {len(packs)} packs"
      if kk >= len(packs)
      else f"bytes [{o}, {o + n}) lie outside pack {kk} ({packs[kk].nbytes} bytes)"
    )
    raise _error(
      location,
      f"the record of {pieced[j].where} is invalid: 'pieces'.runs[{w}] "
      f"(process {proc}'s chunks) {what}",
    )


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


def _error(location: str, what: str) -> CheckpointError:
  return CheckpointError(
    f"The manifest of {location!r} is invalid: {what}. The checkpoint cannot be read safely; "
    "restore an earlier one (or check the tool that wrote or edited it)."
  )


def _list(v: Any, what: str, limit: int = 1 << 26) -> list:
  _req(isinstance(v, list) and len(v) <= limit, lambda: f"{what} must be a list, found {_short(v)}")
  return v


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


def _base_of(v: Any, d: str, what: str, bases: tuple[Base, ...]) -> int | None:
  """A ``base`` index (or None): it names an entry of ``bases`` whose data holds ``d``."""
  if v is None:
    return None
  k = _int(v, f"{what}.base", 0, max(len(bases) - 1, 0))
  _req(k < len(bases), lambda: f"{what}.base names no entry of 'bases'")
  _req(
    d.startswith(bases[k].data + "/"),
    lambda: f"{what}.dir {_short(d)} lies outside the referenced data {bases[k].data!r}",
  )
  return k


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


def _dtype(v: Any) -> str:
  _req(
    v in DTYPES if isinstance(v, str) else False,
    lambda: f"dtype {_short(v)} is not one fnckpt stores",
  )
  return v


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


def _shape(v: Any) -> tuple[int, ...]:
  _list(v, "'shape'", MAX_DIMS)
  shape = tuple(_int(s, "a dimension", 0, MAX_ELEMENTS) for s in v)
  _req(math.prod(shape) <= MAX_ELEMENTS, lambda: f"shape {list(shape)} is too large")
  return shape


def _array(i: int, path: tuple, rec: dict, context: _Context) -> Leaf:
  """An array record. Its head (fields, dtype, shape, source, sharding, PRNG impl) is
  validated once per distinct head (``context.heads``: this parse's cache; a failure is never
  cached, so every record with a bad head fails with the same message as on its own)."""
  version, meshes, hash_bytes, heads = (
    context.version,
    context.meshes,
    context.hash_bytes,
    context.heads,
  )
  if heads is None:
    dtype, shape, sharding, impl = _array_head(rec, version, meshes)
  else:
    key = _head_key(rec)
    head = heads.get(key)
    if head is None:
      head = heads[key] = _array_head(rec, version, meshes)
    dtype, shape, sharding, impl = head
  if "inline" in rec:
    data = rec["inline"]
    nbytes = math.prod(shape) * itemsize(dtype)
    _req(
      isinstance(data, bytes) and len(data) == nbytes, lambda: f"'inline' must hold {nbytes} bytes"
    )
    _req(not {"hash", "chunk_hashes", "chunk_fps"} & set(rec), "an inline array has no 'hash'")
    return Leaf(
      index=i,
      path=path,
      kind=rec["kind"],
      dtype=dtype,
      shape=shape,
      source=rec["source"],
      sharding=sharding,
      impl=impl,
      inline=data,
    )
  if version >= 3:  # every array stored outside the manifest carries its hash
    _req(
      "hash" in rec,
      f"it lacks 'hash' (format {version}: every stored, packed and pieced array has one)",
    )
  digest = _hash(rec["hash"], "'hash'", hash_bytes) if "hash" in rec else None
  leaf = Leaf(
    index=i,
    path=path,
    kind=rec["kind"],
    dtype=dtype,
    shape=shape,
    source=rec["source"],
    sharding=sharding,
    impl=impl,
    hash=digest,
  )
  if "pieces" in rec:
    _req(
      not {"chunk_hashes", "chunk_fps"} & set(rec) and (version >= 3 or "hash" not in rec),
      "a pieced array has no 'chunk_hashes'" + ("" if version >= 3 else " or 'hash'"),
    )
    return evolve(leaf, pieces=_pieced(rec["pieces"], shape, sharding, version, hash_bytes))
  if "store" in rec:
    return _stored_leaf(leaf, rec, version, context.bases, hash_bytes)
  _req(
    "chunk_hashes" not in rec and "chunk_fps" not in rec,
    "'chunk_hashes' and 'chunk_fps' belong to stored arrays only",
  )
  _req(version >= 2, "'pack' needs format 2")
  return Leaf(
    index=i,
    path=path,
    kind=rec["kind"],
    dtype=dtype,
    shape=shape,
    source=rec["source"],
    sharding=sharding,
    impl=impl,
    packed=_packed(rec["pack"], leaf.nbytes, context.packs),
    hash=digest,
  )


def _head_key(rec: dict) -> tuple:
  """What an array record's head validation depends on: its field names (in order) and the
  values of its head fields, as ``repr`` (exact for msgpack data: str/bytes, int/bool/float,
  lists and maps differ in their reprs)."""
  g = rec.get  # (a missing field: its name is not in tuple(rec))
  return (
    tuple(rec),
    repr(g("kind")),
    repr(g("dtype")),
    repr(g("shape")),
    repr(g("source")),
    repr(g("sharding")),
    repr(g("impl")),
  )


def _array_head(
  rec: dict, version: int, meshes: tuple[np.ndarray, ...]
) -> tuple[str, tuple[int, ...], Sharding | None, str | None]:
  """An array record's fields and head checked, in the order of their messages: (dtype,
  shape, sharding, impl)."""
  kind = rec["kind"]
  storage = ("inline", "store", "pack") + (("pieces",) if version >= 2 else ())
  hashes = (
    ()
    if version == 1
    else ("hash", "chunk_hashes")
    if version >= 3
    else ("hash", "chunk_hashes", "chunk_fps")
  )
  optional = (("impl",) if kind == "key" else ()) + hashes
  _keys(rec, "it", ("path", "kind", "dtype", "shape", "source", "sharding"), storage + optional)
  where = [k for k in storage if k in rec]
  _req(len(where) == 1, "exactly one of 'inline', 'store', 'pack', 'pieces' must be present")
  dtype, shape = _dtype(rec["dtype"]), _shape(rec["shape"])
  _req(rec["source"] in ("jax", "numpy"), "'source' must be 'jax' or 'numpy'")
  impl = None
  if kind == "key":
    impl = rec.get("impl")
    _req(
      impl in PRNG_IMPLS if isinstance(impl, str) else False,
      lambda: f"PRNG implementation {_short(impl)} is not one of {sorted(PRNG_IMPLS)}",
    )
    assert isinstance(impl, str)
    _req(
      dtype == "uint32" and len(shape) >= 1 and shape[-1] == PRNG_IMPLS[impl],
      lambda: f"key data of {impl} must be uint32[..., {PRNG_IMPLS[impl]}]",
    )
  sharding = _sharding(rec["sharding"], len(shape), meshes)
  _req(
    sharding is None or sharding.mesh is None or "pieces" in rec,
    "'sharding'.mesh belongs to pieced leaves only",
  )
  return dtype, shape, sharding, impl


def _stored_leaf(
  leaf: Leaf, rec: dict, version: int, bases: tuple[Base, ...], hash_bytes: int
) -> Leaf:
  """A stored array's record: its ``store`` and chunk hashes (required in format 3)."""
  assert leaf.shape is not None and leaf.dtype is not None  # (an array leaf's)
  stored = _stored(rec["store"], leaf.shape, leaf.dtype, version, bases)
  _req(
    version < 3 or "chunk_hashes" in rec,
    f"it lacks 'chunk_hashes' (format {version}: every stored array has them)",
  )
  if "chunk_hashes" in rec:
    shape = leaf.shape
    n = math.prod(-(-s // c) for s, c in zip(shape, stored.chunks)) if all(shape) else 0
    _req(leaf.hash is not None, "'chunk_hashes' needs 'hash'")
    leaf = dataclasses.replace(
      leaf,
      chunk_hashes=_hash(
        rec["chunk_hashes"], "'chunk_hashes' (one hash per chunk)", hash_bytes * n
      ),
    )
    if "chunk_fps" in rec:
      leaf = dataclasses.replace(
        leaf,
        chunk_fps=_hash(rec["chunk_fps"], "'chunk_fps' (one fingerprint per chunk)", FP_BYTES * n),
      )
  _req("chunk_fps" not in rec or "chunk_hashes" in rec, "'chunk_fps' needs 'chunk_hashes'")
  return evolve(leaf, stored=stored)


def _packed(p: Any, nbytes: int, packs: tuple[Pack, ...]) -> Packed:
  """A packed array's ``pack``: a byte range inside an existing pack."""
  p = _keys(p, "'pack'", ("index", "offset"))
  k = _int(p["index"], "'pack'.index", 0, max(len(packs) - 1, 0))
  _req(k < len(packs), "'pack'.index names no pack")
  offset = _int(p["offset"], "'pack'.offset", 0, packs[k].nbytes)
  _req(
    offset + nbytes <= packs[k].nbytes,
    lambda: (
      f"'pack' bytes [{offset}, {offset + nbytes}) lie outside pack {k} ({packs[k].nbytes} bytes)"
    ),
  )
  return Packed(k, offset, nbytes)


def _pieced(
  p: Any,
  shape: tuple[int, ...],
  sharding: Sharding | None,
  version: int = 2,
  hash_bytes: int = HASH_BYTES,
) -> Pieces:
  """A pieced array's ``pieces``; format 3's ``runs`` and ``hashes`` (their lengths, one
  entry per writing process, are checked with the layout: :func:`_check_runs`)."""
  _keys(p, "'pieces'", ("chunks", "runs", "hashes") if version >= 3 else ("chunks",))
  runs = hashes = None
  if version >= 3:
    runs, hashes = p["runs"], p["hashes"]
    _req(
      isinstance(runs, bytes) and len(runs) % RUN_BYTES == 0,
      lambda: f"'pieces'.runs must be bytes, {RUN_BYTES} per writing process, found {_short(runs)}",
    )
    _req(
      isinstance(hashes, bytes) and len(hashes) % hash_bytes == 0,
      lambda: (
        f"'pieces'.hashes must be bytes, {hash_bytes} per writing process, found {_short(hashes)}"
      ),
    )
  chunks = tuple(
    _int(c, "a 'pieces' chunk dimension", 1, MAX_ELEMENTS)
    for c in _list(p["chunks"], "'pieces'.chunks", MAX_DIMS)
  )
  _req(
    sharding is not None and sharding.mesh is not None,
    "a pieced array needs a named 'sharding' with 'mesh'",
  )
  assert sharding is not None and sharding.mesh is not None
  grid = [math.prod(sharding.sizes[a] for a in axes) for axes in sharding.dim_axes]
  grid += [1] * (len(shape) - len(grid))
  implied = tuple(n // g for n, g in zip(shape, grid))
  _req(
    all(n % g == 0 for n, g in zip(shape, grid)) and chunks == implied and all(implied),
    lambda: (
      f"'pieces'.chunks must be the shard shape {list(implied)} its sharding implies "
      f"(non-empty), found {list(chunks)}"
    ),
  )
  return Pieces(chunks, sharding.mesh, runs, hashes)


def _stored(s: Any, shape, dtype: str, version: int, bases=()) -> Stored:
  _keys(s, "'store'", ("dir", "chunks", "inner", "zstd"), ("blosc", "base") if version >= 2 else ())
  d = check_dir(s["dir"], "'store'.dir")
  base = _base_of(s.get("base"), d, "'store'", bases)
  if version == 1:
    _req(re.fullmatch(r"d/[0-9]{1,9}", d) is not None, "'store'.dir must be d/<n>")
  chunks = tuple(
    _int(c, "a chunk dimension", 1, MAX_ELEMENTS)
    for c in _list(s["chunks"], "'store'.chunks", MAX_DIMS)
  )
  inner = tuple(
    _int(c, "an inner chunk dimension", 1, MAX_ELEMENTS)
    for c in _list(s["inner"], "'store'.inner", MAX_DIMS)
  )
  _req(
    len(chunks) == len(shape) == len(inner),
    "'store' chunks and inner chunks need one entry per dimension",
  )
  _req(all(c <= max(n, 1) for c, n in zip(chunks, shape)), "a chunk is larger than the array")
  _req(all(c % k == 0 for c, k in zip(chunks, inner)), "inner chunks must divide chunks")
  _req(math.prod(-(-n // c) for n, c in zip(shape, chunks)) <= MAX_CHUNKS, "too many chunks")
  _req(math.prod(chunks) * itemsize(dtype) <= MAX_ELEMENTS, "chunks too large")
  z = s["zstd"]
  _req(
    z is None or (isinstance(z, int) and not isinstance(z, bool) and -131072 <= z <= 22),
    "'store'.zstd must be nil or a zstd level",
  )
  blosc = _blosc(s.get("blosc"))
  _req(not z or blosc is None, "'store' has both zstd and blosc")
  return Stored(d, chunks, inner, z, blosc, base)


def _blosc(b: Any) -> tuple[tuple[str, Any], ...] | None:
  if b is None:
    return None
  _keys(b, "'store'.blosc", ("cname", "clevel", "shuffle"))
  _req(
    b["cname"] in BLOSC_CNAMES,
    lambda: (
      f"'store'.blosc.cname must be one of {sorted(BLOSC_CNAMES)}, found {_short(b['cname'])}"
    ),
  )
  _int(b["clevel"], "'store'.blosc.clevel", 0, 9)
  _req(
    b["shuffle"] in BLOSC_SHUFFLES,
    lambda: (
      f"'store'.blosc.shuffle must be one of {sorted(BLOSC_SHUFFLES)}, found {_short(b['shuffle'])}"
    ),
  )
  return tuple(sorted(b.items()))


def _sharding(s: Any, ndim: int, meshes: tuple[np.ndarray, ...] = ()) -> Sharding | None:
  if s is None:
    return None
  _req(isinstance(s, dict) and isinstance(s.get("type"), str), "'sharding' must be nil or a map")
  if s["type"] == "single":
    _keys(s, "'sharding'", ("type",))
    return Sharding("single")
  if s["type"] != "named":
    _keys(s, "'sharding'", ("type", "devices"))
    return Sharding(
      _str(s["type"], "'sharding'.type", 128),
      devices=_int(s["devices"], "'sharding'.devices", 1, 1 << 24),
    )
  _keys(s, "'sharding'", ("type", "axes", "sizes", "spec"), ("mesh",))
  axes = tuple(_str(a, "a mesh axis name", 128) for a in _list(s["axes"], "axes", MAX_DIMS))
  sizes = tuple(_int(n, "a mesh axis size", 1, 1 << 24) for n in _list(s["sizes"], "sizes", 64))
  _req(
    len(axes) == len(sizes) and len(set(axes)) == len(axes),
    "'sharding' axes must be distinct and have one size each",
  )
  _req(math.prod(sizes) <= 1 << 24, "'sharding' mesh is too large")
  spec: list[Any] = []
  used: list[str] = []
  for e in _list(s["spec"], "'sharding'.spec", ndim):
    names = [] if e is None else [e] if isinstance(e, str) else e
    _req(
      isinstance(names, list) and all(isinstance(n, str) for n in names),
      lambda: f"'sharding'.spec entry {_short(e)} must be nil, an axis name or a list of them",
    )
    used.extend(names)
    spec.append(e if not isinstance(e, list) else tuple(e))
  _req(
    all(n in axes for n in used) and len(set(used)) == len(used),
    "'sharding'.spec must name each mesh axis at most once",
  )
  mesh = None
  if "mesh" in s:
    mesh = _int(s["mesh"], "'sharding'.mesh", 0, max(len(meshes) - 1, 0))
    _req(mesh < len(meshes), "'sharding'.mesh names no entry of 'meshes'")
    _req(
      len(meshes[mesh]) == math.prod(sizes),
      lambda: (
        f"'meshes'[{mesh}] has "
        f"{len(meshes[mesh])} entries, but the sharding's mesh {list(sizes)} has "
        f"{math.prod(sizes)} devices"
      ),
    )
  return Sharding("named", axes, sizes, tuple(spec), math.prod(sizes), mesh)


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
