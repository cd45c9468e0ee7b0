"""PURE: array records (kinds ``array`` and ``key``) -> validated :class:`Leaf` records, for
:mod:`fnckpt._format.parse`: the record's head (fields, dtype, shape, source, sharding, PRNG
implementation), its storage (``inline``, a ``store`` with its chunk hashes, a byte range in a
``pack``, or ``pieces``) and, across all pieced leaves of a manifest, their layout and format 3's
``runs`` (:func:`_check_pieces`, :func:`_check_runs`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import numpy as np

from .._errors import CheckpointError
from .._layout import pieces as _pieces
from .codecs import BLOSC_CNAMES, BLOSC_SHUFFLES
from .parse_fields import (
  _base_of,
  _dtype,
  _error,
  _hash,
  _int,
  _keys,
  _list,
  _req,
  _shape,
  _short,
  _str,
  check_dir,
)
from .records import (
  FP_BYTES,
  HASH_BYTES,
  MAX_CHUNKS,
  MAX_DIMS,
  MAX_ELEMENTS,
  PRNG_IMPLS,
  RUN_BYTES,
  Base,
  Leaf,
  Pack,
  Packed,
  Pieces,
  Sharding,
  Stored,
  evolve,
  itemsize,
)
from .runs import RUN
from .tree import keystr


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
      # (B023: _req calls the lambda at once, inside this iteration)
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
