"""PURE: what a checkpoint's records are (formats 1, 2 and 3): the format's constants and
allow-lists (dtypes, leaf kinds, PRNG implementations, bit generators, the bounds parsing
enforces), the dtype helpers (:func:`np_dtype`, :func:`itemsize`), the frozen records
(:class:`Manifest` with its :class:`Leaf` records, :class:`Stored`, :class:`Pack`,
:class:`Packed`, :class:`Pieces`, :class:`Sharding`, :class:`Base`, :class:`Fork`),
:func:`evolve`, and :func:`encode`.

Other modules read these records, never the raw dicts. Records read from storage come from
:func:`fnckpt._format.parse.parse`, the one validator (untrusted data in, records or one
:class:`~fnckpt._errors.CheckpointError` out). The writers build the same records and
:func:`encode` turns them into the msgpack data (formats 2 and 3: fnckpt writes 3, a fork
keeps its parent's 2): ``parse(encode(m), location, 3) == m`` for every valid record.
Encoding never validates, and the records have no checks of their own.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

import numpy as np

from .. import _state
from .codecs import BLOSC
from .tree import keystr

__all__ = [
  "Manifest",
  "Leaf",
  "Stored",
  "Packed",
  "Pack",
  "Pieces",
  "Sharding",
  "Base",
  "Fork",
  "encode",
  "evolve",
  "DTYPES",
  "PRNG_IMPLS",
  "BIT_GENERATORS",
  "itemsize",
  "np_dtype",
  "MAX_DIMS",
  "HASH_BYTES",
  "HASH_ALGS",
  "RUN_BYTES",
]

# Every dtype a leaf may have: numpy's numeric types and ml_dtypes' (bfloat16, int4, float8...).
DTYPES = frozenset(
  (
    "bool int2 int4 int8 int16 int32 int64 uint2 uint4 uint8 uint16 uint32 uint64 "
    "float8_e3m4 float8_e4m3 float8_e4m3fn float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 "
    "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn float16 bfloat16 float32 float64 "
    "complex64 complex128"
  ).split()
)
PRNG_IMPLS = {"threefry2x32": 2, "rbg": 4, "unsafe_rbg": 4}  # impl -> key data words
BIT_GENERATORS = frozenset(("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"))
LEAF_KINDS = frozenset(
  ("array", "key", "scalar", "bigint", "npscalar", "npgen", "empty", "perprocess")
)
SCALAR_TYPES = frozenset(("bool", "int", "float", "complex", "str", "bytes"))
PATH_KINDS = frozenset(("dict", "seq", "attr", "flat"))
MAX_DIMS = 64
MAX_PACK_CHUNK = 64 << 20  # a pack's chunk (one file, one write)
MAX_ELEMENTS = 1 << 62
MAX_CHUNKS = 1 << 32  # chunks of one stored array
MAX_DEPTH = 32  # nesting of a Generator's state
MAX_BIGINT_DIGITS = 4000  # below Python's int() digit limit
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DATA_NAME = re.compile(r"data-[0-9a-f]{32}")
HASH_BYTES = 32  # SHA-256 (format 2's content hashes)
HASH_ALGS = {"xxh3-128": 16}  # format 3's ``hash`` algorithm -> digest bytes
RUN_BYTES = 12  # a pieces run: pack u32 LE, offset u64 LE (format 3)
FP_BYTES = 8  # a chunk's fingerprint (fnckpt._format.refs.fingerprint)
MAX_UP = 64  # '..' names at the front of a reference


def np_dtype(name: str) -> np.dtype:
  """An allow-listed dtype name -> numpy dtype (ml_dtypes' types included)."""
  import jax.numpy as jnp

  return np.dtype(jnp.dtype(name))


@_state.memo(256)
def itemsize(name: str) -> int:
  """Bytes per element of the dtype ``name`` (cached: asked for every array leaf)."""
  return np_dtype(name).itemsize


@dataclasses.dataclass(frozen=True)
class Base:
  """A referenced checkpoint: ``dir`` relative to the parent of the referring checkpoint's
  directory, and the ``data`` directory (of the save that wrote the bytes) referred to."""

  dir: str
  data: str


@dataclasses.dataclass(frozen=True)
class Fork:
  """Lineage of a forked run: the parent ``run`` (relative to this run's directory), ``step``."""

  run: str
  step: int


@dataclasses.dataclass(frozen=True)
class Sharding:
  """A saved sharding: ``type`` "named" (mesh ``axes``/``sizes`` and ``spec``), "single", or
  another JAX sharding's class name with its device count."""

  type: str
  axes: tuple[str, ...] = ()
  sizes: tuple[int, ...] = ()
  spec: tuple[Any, ...] = ()  # None, an axis name, or a tuple of axis names per dim
  devices: int = 1
  mesh: int | None = None  # a pieced leaf's: index in the manifest's ``meshes``

  @property
  def dim_axes(self) -> tuple[tuple[int, ...], ...]:
    """Per spec entry, the positions (in ``axes``) of the mesh axes splitting it."""
    out = []
    for e in self.spec:
      names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
      out.append(tuple(self.axes.index(n) for n in names))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Stored:
  """A zarr3 array holding a leaf: ``dir`` relative to the checkpoint root."""

  dir: str
  chunks: tuple[int, ...]
  inner: tuple[int, ...]
  zstd: int | None
  blosc: tuple[tuple[str, Any], ...] | None = None  # blosc's configuration (sorted items)
  base: int | None = None  # index in the manifest's ``bases``: ``dir`` is relative to it


@dataclasses.dataclass(frozen=True)
class Pack:
  """A process's pack (format 2): a 1-D uint8 zarr3 array at ``dir`` of ``nbytes`` bytes,
  ``chunk``-byte chunks of ``inner``-byte inner chunks."""

  dir: str
  nbytes: int
  chunk: int
  inner: int
  base: int | None = None
  process: int | None = None  # the process that wrote it (set when the save has pieces)
  pieces: int | None = None  # where that process's pieces region starts in it


@dataclasses.dataclass(frozen=True)
class Pieces:
  """A leaf stored as pieces (docs/format.md): its chunks (device shards) are byte ranges of
  their writers' packs. Format 2: placed by ``Manifest.layout`` (rule 2). Format 3: ``runs``
  (12 bytes per writing process, increasing: pack u32 LE, offset u64 LE) says where each
  writer's chunks lie, ``hashes`` (16 bytes per writer) their hash."""

  chunks: tuple[int, ...]
  mesh: int
  runs: bytes | None = None
  hashes: bytes | None = None


@dataclasses.dataclass(frozen=True)
class Packed:
  """A leaf stored in a pack: bytes ``[offset, offset + nbytes)`` of pack ``pack``."""

  pack: int
  offset: int
  nbytes: int


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One validated leaf record. Array kinds ("array", "key") have ``dtype``/``shape`` and
  exactly one of ``inline``/``stored``/``packed``/``pieces`` (where the bytes are); other
  kinds hold ``value`` (checked). ``hash`` is the leaf's content hash (format 3: of every
  array outside the manifest; format 2: when saved with hashes), ``chunk_hashes`` a stored
  leaf's per-chunk hashes, ``chunk_fps`` format 2's chunk fingerprints (read only)."""

  index: int
  path: tuple[tuple[str, Any], ...]
  kind: str
  dtype: str | None = None
  shape: tuple[int, ...] | None = None
  source: str | None = None
  sharding: Sharding | None = None
  impl: str | None = None
  inline: bytes | None = None
  stored: Stored | None = None
  packed: Packed | None = None
  pieces: Pieces | None = None
  type: str | None = None  # scalar type, or the empty container's type
  name: str | None = None  # an empty container's class
  value: Any = None
  hash: bytes | None = None  # content hash (docs/format.md "References and hashes")
  chunk_hashes: bytes | None = None
  chunk_fps: bytes | None = None
  subtype: str | None = None  # a scalar's subclass ("module.Name"; informative only)

  @property
  def where(self) -> str:
    return keystr(self.path)

  @property
  def is_array(self) -> bool:
    return self.kind in ("array", "key")

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape or ()) * itemsize(self.dtype) if self.is_array else 0


@dataclasses.dataclass(frozen=True)
class Manifest:
  version: int
  created: float
  process_count: int
  versions: Mapping[str, str]
  metadata: Any
  leaves: tuple[Leaf, ...]
  data: str | None = None  # format 2: the directory of this save's data
  packs: tuple[Pack, ...] = ()
  bases: tuple[Base, ...] = ()  # checkpoints whose data this one refers to
  fork: Fork | None = None
  # per mesh of pieced leaves: the process of each position; the pieced leaves' layout
  meshes: tuple[np.ndarray, ...] = dataclasses.field(default=(), compare=False)
  layout: Any = dataclasses.field(default=None, compare=False)  # ``_pieces.Layout`` or None
  hash: str | None = None  # format 3: the content hashes' algorithm ("xxh3-128")

  def pack_of(self, process: int) -> int:
    """The index in ``packs`` of ``process``'s own pack (with its pieces region)."""
    return self._pack_index[process]

  @property
  def _pack_index(self) -> dict[int, int]:
    got = self.__dict__.get("_pack_index_cache")
    if got is None:
      got = {p.process: k for k, p in enumerate(self.packs) if p.process is not None}
      object.__setattr__(self, "_pack_index_cache", got)
    return got


def evolve(r: Any, **changes: Any) -> Any:
  """``dataclasses.replace(r, **changes)`` at a fifth of its cost (1 us, not 5), for the
  writer's path: ``save`` plans every leaf before it returns, and sets the storage of most
  records after building them. The fields are not re-checked (no ``__init__`` runs; the
  records have no checks of their own); cached state (attributes that are not fields, as
  ``Manifest``'s pack index) is dropped.

  >>> evolve(Packed(0, 8, 4), offset=16)
  Packed(pack=0, offset=16, nbytes=4)
  """
  names = r.__dataclass_fields__
  if not changes.keys() <= names.keys():
    raise TypeError(f"{type(r).__name__} has no field {sorted(changes.keys() - names.keys())[0]!r}")
  out = object.__new__(type(r))
  state = r.__dict__
  out.__dict__.update(
    state if len(state) == len(names) else {k: v for k, v in state.items() if k in names}
  )
  out.__dict__.update(changes)
  return out


# --- records -> the wire format (docs/format.md, versions 3 and 2) ------------------------
# Keys in the order the writer has always written them (so the manifest of a tree is the same
# bytes as before the writer built records). Derived and record-only fields (``Leaf.index``,
# ``Packed.nbytes``, ``Pieces.mesh``, a named sharding's ``devices``, ``Manifest.layout``) are
# not written; nothing a record lacks is added.


def encode(r: Manifest | Leaf) -> dict[str, Any]:
  """A record -> its msgpack map: the inverse of :func:`fnckpt._format.parse.parse` for every
  valid record of format 2 or 3. A :class:`Manifest` of format 1 is refused (fnckpt reads
  format 1, writes 3; a fork keeps its parent's 2 or 3).

  >>> encode(Leaf(0, (("dict", "step"),), "scalar", type="int", value=3))
  {'path': [['dict', 'step']], 'kind': 'scalar', 'type': 'int', 'value': 3}
  """
  return _encode_manifest(r) if isinstance(r, Manifest) else _encode_leaf(r)


def _encode_manifest(m: Manifest) -> dict[str, Any]:
  if m.version not in (2, 3) or m.data is None:
    raise ValueError(f"format {m.version} records are read-only: fnckpt writes formats 2, 3")
  out = {
    "format": "fnckpt",
    "version": m.version,
    "created": float(m.created),
    "process_count": m.process_count,
    "versions": dict(m.versions),
    "metadata": m.metadata,
    "data": m.data,
    "packs": [_encode_pack(p) for p in m.packs],
    "leaves": [_encode_leaf(l) for l in m.leaves],
  }
  if m.hash is not None:
    out["hash"] = m.hash
  if m.meshes:
    out["meshes"] = [np.asarray(a).tolist() for a in m.meshes]
  if m.bases:
    out["bases"] = [{"dir": b.dir, "data": b.data} for b in m.bases]
  if m.fork is not None:
    out["fork"] = {"run": m.fork.run, "step": m.fork.step}
  return out


def _encode_leaf(l: Leaf) -> dict[str, Any]:
  rec: dict[str, Any] = {"path": [list(e) for e in l.path], "kind": l.kind}
  kind = l.kind
  if kind in ("array", "key"):
    if kind == "key":
      rec["impl"] = l.impl
    rec["source"], rec["dtype"] = l.source, l.dtype
    assert l.shape is not None
    rec["shape"], rec["sharding"] = list(l.shape), _encode_sharding(l.sharding)
    if l.inline is not None:
      rec["inline"] = l.inline
    elif l.stored is not None:
      rec["store"] = _encode_stored(l.stored)
    elif l.packed is not None:
      rec["pack"] = {"index": l.packed.pack, "offset": l.packed.offset}
    elif l.pieces is not None:
      rec["pieces"] = {"chunks": list(l.pieces.chunks)}
      if l.pieces.runs is not None:
        rec["pieces"]["runs"], rec["pieces"]["hashes"] = l.pieces.runs, l.pieces.hashes
    if l.chunk_hashes is not None:
      rec["chunk_hashes"] = l.chunk_hashes
    if l.chunk_fps is not None:
      rec["chunk_fps"] = l.chunk_fps
    if l.hash is not None:
      rec["hash"] = l.hash
  elif kind == "scalar":
    rec["type"] = l.type
    rec["value"] = [l.value.real, l.value.imag] if l.type == "complex" else l.value
    if l.subtype is not None:
      rec["subtype"] = l.subtype
  elif kind == "empty":
    rec["type"], rec["name"] = l.type, l.name
  elif kind == "bigint":
    rec["value"] = str(l.value)
  elif kind == "npscalar":
    rec["dtype"], rec["value"] = l.dtype, l.value
  elif kind == "npgen":
    rec["value"] = l.value
  return rec  # "perprocess": path and kind only


def _encode_sharding(s: Sharding | None) -> dict[str, Any] | None:
  if s is None:
    return None
  if s.type == "single":
    return {"type": "single"}
  if s.type != "named":
    return {"type": s.type, "devices": s.devices}
  out: dict[str, Any] = {
    "type": "named",
    "axes": list(s.axes),
    "sizes": list(s.sizes),
    "spec": [list(e) if isinstance(e, tuple) else e for e in s.spec],
  }
  if s.mesh is not None:
    out["mesh"] = s.mesh
  return out


_BLOSC_KEYS = tuple(BLOSC)  # "cname", "clevel", "shuffle": the order save writes


def _encode_stored(s: Stored) -> dict[str, Any]:
  out: dict[str, Any] = {
    "dir": s.dir,
    "chunks": list(s.chunks),
    "inner": list(s.inner),
    "zstd": s.zstd,
  }
  if s.blosc is not None:
    b = dict(s.blosc)
    out["blosc"] = {**{k: b[k] for k in _BLOSC_KEYS if k in b}, **b}
  if s.base is not None:
    out["base"] = s.base
  return out


def _encode_pack(p: Pack) -> dict[str, Any]:
  out = {"dir": p.dir, "nbytes": p.nbytes, "chunk": p.chunk, "inner": p.inner}
  if p.process is not None:
    out["process"], out["pieces"] = p.process, p.pieces
  if p.base is not None:
    out["base"] = p.base
  return out
