"""fnckpt._format.manifest, fnckpt._format.records and fnckpt._format.parse: manifest and commit
marker <-> msgpack bytes, versioning, validation into frozen records (parse), records back to
msgpack (encode). No files: leaf records come from fnckpt._format.leaves.leaf_record, manifests
are built here as a writer would (docs/format.md), as msgpack maps and as records."""

import collections
import enum
import hashlib
import math
import os
import struct
from dataclasses import replace

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from fnckpt import CheckpointError
from fnckpt._layout import pieces as _pieces
from fnckpt._format import (hashes as _hashes, leaves as _leaves, manifest as _manifest,
                            records as _records, runs as _runs, tree as _tree)
from fnckpt._format.codecs import BLOSC_CNAMES, BLOSC_SHUFFLES

LOC = "/ckpt/7"
DATA = "data-" + "0123456789abcdef" * 2
VERSIONS = {"fnckpt": "0.2.0", "jax": jax.__version__, "tensorstore": "0.1"}


def _manifest_dict(leaves=(), packs=(), version=_manifest.FORMAT_VERSION, **extra):
  """A manifest of ``version`` (by default the one fnckpt writes) with every top-level key
  the README lists for it: format 3 adds ``hash``."""
  alg = {"hash": _hashes.ALG} if version >= 3 else {}
  return {"format": _manifest.FORMAT_NAME, "version": version,
          "created": 1.5, "process_count": 1, "versions": dict(VERSIONS), "metadata": None,
          "data": DATA, "packs": list(packs), "leaves": list(leaves), **alg, **extra}


def _v1_dict(leaves=(), **extra):
  """A format-1 manifest: no 'data', no 'packs', arrays at d/<n>."""
  m = _manifest_dict(leaves, version=1, **extra)
  del m["data"], m["packs"]
  return m


def _scalar(key, value):
  return {"path": [["dict", key]], "kind": "scalar", "type": type(value).__name__,
          "value": value}


def _array(key, version=_manifest.FORMAT_VERSION, **storage):
  """A float32[4] record (16 bytes) stored as ``storage`` says; in format 3 a packed or
  stored one carries its content hashes (16 bytes each; a stored one one per chunk)."""
  rec = {"path": [["dict", key]], "kind": "array", "dtype": "float32", "shape": [4],
         "source": "numpy", "sharding": None, **storage}
  if version >= 3 and "pack" in storage:
    rec["hash"] = _hashes.digest(bytes(16))
  if version >= 3 and "store" in storage:
    chunks = -(-4 // storage["store"]["chunks"][0])
    rec["chunk_hashes"] = _hashes.digest(bytes(16)) * chunks
    rec["hash"] = _hashes.digest(rec["chunk_hashes"])
  return rec


def _wire_v1(m):
  """A format-1 :class:`_records.Manifest` as the msgpack map it was parsed from (encode
  refuses format 1 manifests: fnckpt writes format 2; its leaves encode alike)."""
  return {"format": _manifest.FORMAT_NAME, "version": m.version, "created": m.created,
          "process_count": m.process_count, "versions": dict(m.versions),
          "metadata": m.metadata, "leaves": [_records.encode(l) for l in m.leaves]}


def _canonical(obj):
  """msgpack bytes independent of map key order: equal iff the data is equal *and* of the
  same msgpack types (1 vs 1.0 vs True, -0.0 vs 0.0, str vs bytes all differ)."""
  def sort(x):
    if isinstance(x, dict):
      return {k: sort(x[k]) for k in sorted(x, key=lambda k: (type(k).__name__, k))}
    if isinstance(x, (list, tuple)):
      return [sort(v) for v in x]
    return x
  return msgpack.packb(sort(obj), use_bin_type=True)


# --- strategies ---------------------------------------------------------------------------

_ints = st.integers(-(1 << 63), (1 << 64) - 1)
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False),
                     st.text(max_size=8), st.binary(max_size=8))
_data = st.recursive(
    _scalars,
    lambda c: st.one_of(st.lists(c, max_size=4),
                        st.dictionaries(st.one_of(st.text(max_size=4), _ints), c, max_size=4)),
    max_leaves=12)

Pair = collections.namedtuple("Pair", "x y")  # attribute keys ("attr")


class Color(enum.IntEnum):  # scalars of a subclass: the record's 'subtype'
  RED = 1


class Name(str):
  pass

_ARRAY_DTYPES = ["bool", "int4", "uint8", "int16", "float32", "bfloat16", "float8_e4m3fn",
                 "complex64", "float64"]
_NP_SCALARS = [np.float32(1.5), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True),
               np.float16(-0.0), np.complex64(1 - 2j), np.int64(-(1 << 63))]


def _jax_arrays():
  """Arrays with each kind of saved sharding, and typed PRNG keys (built once)."""
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  return [jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
          jax.device_put(x, NamedSharding(mesh, P(("b", "a")))),
          jax.device_put(x, NamedSharding(mesh, P(None, "b"))),
          jax.device_put(x, NamedSharding(mesh, P())),
          jnp.ones((2, 3), jnp.bfloat16),
          jax.random.key(0), jax.random.key(1, impl="rbg"),
          jax.random.split(jax.random.key(2), 3)]


_JAX_ARRAYS = _jax_arrays()


@st.composite
def _np_arrays(draw):
  dtype = np.dtype(jnp.dtype(draw(st.sampled_from(_ARRAY_DTYPES))))
  shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
  n = math.prod(shape) * dtype.itemsize
  return np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype).reshape(shape)


_generators = st.sampled_from(sorted(_records.BIT_GENERATORS)).flatmap(
    lambda name: st.integers(0, 1 << 32).map(
        lambda seed: np.random.Generator(getattr(np.random, name)(seed))))

_arrays = st.one_of(_np_arrays(), st.sampled_from(_JAX_ARRAYS))
_leaf_values = st.one_of(
    _arrays, _arrays, _arrays, _arrays,  # weighted: arrays carry the most fields
    st.none(), st.booleans(), _ints, st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False), st.text(max_size=8), st.binary(max_size=8),
    st.integers().filter(lambda v: not -(1 << 63) <= v < (1 << 64)),  # bigint kind
    st.sampled_from(_NP_SCALARS), _generators, st.sampled_from([Color.RED, Name("n")]),
    st.sampled_from(["dict", "list", "tuple"]).map(lambda t: {"dict": {}, "list": [],
                                                              "tuple": ()}[t]))

_trees = st.recursive(
    _leaf_values,
    lambda c: st.one_of(st.lists(c, max_size=3), st.lists(c, max_size=3).map(tuple),
                        st.dictionaries(st.text(max_size=4), c, max_size=3),
                        st.dictionaries(st.integers(-3, 3), c, max_size=3),
                        st.builds(Pair, c, c)),
    max_leaves=8)


def _divisors(n):
  return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _manifests(draw):
  """A valid format-2 or format-3 manifest of a random pytree, as a writer would build it:
  every leaf record from leaf_record, each array inline, in its own zarr array, or in one of
  the packs; in format 3 each stored or packed one with its content hashes."""
  version = draw(st.sampled_from([2, 3]))
  records, used = [], {}
  turn = draw(st.integers(0, 2))  # storages in turn: every manifest with arrays mixes them
  for i, (path, leaf) in enumerate(_tree.flatten(draw(_trees))[0]):
    rec, data = _leaves.leaf_record(i, path, leaf)
    rec = _records.encode(rec)
    if data is None and draw(st.integers(0, 9)) == 0:  # an fnckpt.PerProcess leaf
      rec = {"path": rec["path"], "kind": "perprocess"}
    if data is not None:
      raw = _leaves.to_little_endian(np.asarray(data)).tobytes()
      where = ("inline", "store", "pack")[(turn + i) % 3]
      if where == "inline":
        rec["inline"] = raw
      elif where == "store":
        chunks = [draw(st.integers(1, max(n, 1))) for n in rec["shape"]]
        rec["store"] = {"dir": f"{DATA}/a/{i}", "chunks": chunks,
                        "inner": [draw(st.sampled_from(_divisors(c))) for c in chunks],
                        "zstd": draw(st.sampled_from([None, 0, 3, -5]))}
        if not rec["store"]["zstd"] and draw(st.booleans()):
          rec["store"]["blosc"] = {"cname": draw(st.sampled_from(["lz4", "zstd"])),
                                   "clevel": draw(st.integers(0, 9)),
                                   "shuffle": draw(st.sampled_from(["shuffle", "bitshuffle"]))}
        if version >= 3:   # one hash per chunk of the grid (none if the array is empty)
          n = math.prod(-(-s // c) for s, c in zip(rec["shape"], chunks)) if all(
              rec["shape"]) else 0
          rec["chunk_hashes"] = draw(st.binary(min_size=16 * n, max_size=16 * n))
          rec["hash"] = _hashes.digest(rec["chunk_hashes"])
      else:
        k = draw(st.integers(0, 2))
        offset = used.get(k, 0) + draw(st.integers(0, 3))  # leaves may have gaps between
        used[k] = offset + len(raw)
        rec["pack"] = {"index": k, "offset": offset}
        if version >= 3:
          rec["hash"] = _hashes.digest(raw)
    records.append(rec)
  packs = []
  for k in range(max(used, default=-1) + 1):
    nbytes = max(1, used.get(k, 0) + draw(st.integers(0, 5)))  # padded to whole inner chunks
    inner = draw(st.sampled_from(_divisors(nbytes)))
    chunk = inner * draw(st.integers(1, nbytes // inner))
    packs.append({"dir": f"{DATA}/p/{k}", "nbytes": nbytes, "chunk": chunk, "inner": inner})
  return _manifest_dict(records, packs, version, created=draw(st.floats(0, 1e10)),
                        process_count=draw(st.integers(1, 4096)), metadata=draw(_data))


# --- records, generated directly (every field: pieces, bases, fork, hashes, meshes) -------

_names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,7}", fullmatch=True)
_rels = st.builds(lambda up, rest: "/".join([".."] * up + rest), st.integers(0, 3),
                  st.lists(_names, min_size=1, max_size=3))
_data_names = st.binary(min_size=16, max_size=16).map(lambda b: "data-" + b.hex())
_blosc = st.builds(lambda c, l, s: tuple(sorted({"cname": c, "clevel": l, "shuffle": s}.items())),
                   st.sampled_from(sorted(BLOSC_CNAMES)), st.integers(0, 9),
                   st.sampled_from(sorted(BLOSC_SHUFFLES)))
_codecs = st.one_of(st.tuples(st.sampled_from([None, 0, 3, -5, 22]), st.none()),
                    st.tuples(st.sampled_from([None, 0]), _blosc))


def _under(draw, bases, what):
  """(directory, base index) of a storage: this save's data or a referenced one's."""
  k = (None, *range(len(bases)))[draw(st.integers(0, 2)) % (len(bases) + 1)]
  return f"{bases[k].data if k is not None else DATA}/{what}", k


def _stored_leaf(draw, leaf, bases, version=2):
  chunks = tuple(draw(st.integers(1, max(n, 1))) for n in leaf.shape)
  inner = tuple(draw(st.sampled_from(_divisors(c))) for c in chunks)
  d, k = _under(draw, bases, f"a/{leaf.index}")
  zstd, blosc = draw(_codecs)
  leaf = replace(leaf, stored=_records.Stored(d, chunks, inner, zstd, blosc, k))
  if version >= 3:   # hashes required, 16 bytes each, no fingerprints
    n = math.prod(-(-s // c) for s, c in zip(leaf.shape, chunks)) if all(leaf.shape) else 0
    ch = draw(st.binary(min_size=16 * n, max_size=16 * n))
    return replace(leaf, hash=_hashes.digest(ch), chunk_hashes=ch)
  how = ("chunks", "none", "hash")[(draw(st.integers(0, 2)) + leaf.index) % 3]
  if how == "hash":
    return replace(leaf, hash=draw(st.binary(min_size=32, max_size=32)))
  if how == "chunks":
    n = math.prod(-(-s // c) for s, c in zip(leaf.shape, chunks)) if all(leaf.shape) else 0
    ch = draw(st.binary(min_size=32 * n, max_size=32 * n))
    fps = draw(st.binary(min_size=8 * n, max_size=8 * n)) if draw(st.booleans()) else None
    return replace(leaf, hash=hashlib.sha256(ch).digest(), chunk_hashes=ch, chunk_fps=fps)
  return leaf


def _pack_record(draw, d, used, base=None, process=None, pieces=None):
  """A pack of at least ``used`` bytes (padded to whole inner chunks)."""
  nbytes = max(1, used + draw(st.integers(0, 5)))
  inner = draw(st.sampled_from(_divisors(nbytes)))
  chunk = inner * draw(st.integers(1, nbytes // inner))
  return _records.Pack(d, nbytes, chunk, inner, base, process, pieces)


@st.composite
def _pieced_leaves(draw, first, nproc):
  """Named-sharded leaves stored as pieces over one or two meshes, their meshes (the process
  of each position) and their layout's region per process."""
  meshes, leaves = [], []
  for _ in range(draw(st.integers(1, 2))):
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    procs = np.array(draw(st.lists(st.integers(0, nproc - 1), min_size=math.prod(sizes),
                                   max_size=math.prod(sizes))), np.int64)
    procs.flags.writeable = False
    meshes.append(procs)
  for j in range(draw(st.integers(1, 3))):
    m = draw(st.integers(0, len(meshes) - 1))
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    if math.prod(sizes) != len(meshes[m]):
      sizes = (len(meshes[m]),)
    axes = ("x", "y")[:len(sizes)]
    spec = tuple(draw(st.sampled_from([None, *axes, tuple(reversed(axes))]))
                 for _ in range(draw(st.integers(0, 2))))
    used = [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]
    if len(set(used)) != len(used):
      spec = ()
    sharding = _records.Sharding("named", axes, sizes, spec, math.prod(sizes), m)
    grid = [math.prod(sizes[a] for a in axes_) for axes_ in sharding.dim_axes]
    chunk = tuple(draw(st.integers(1, 3)) for _ in range(len(spec) + draw(st.integers(0, 1))))
    shape = tuple(c * (grid[d] if d < len(grid) else 1) for d, c in enumerate(chunk))
    dtype = draw(st.sampled_from(["float32", "int8", "bfloat16"]))
    leaves.append(_records.Leaf(first + j, (("dict", "p"), ("seq", j)), "array", dtype, shape,
                                "jax", sharding, pieces=_records.Pieces(chunk, m)))
  todo = [_pieces.PieceLeaf(l.index, m_, l.sharding.sizes,
                            l.sharding.dim_axes + ((),) * (len(l.shape) - len(l.sharding.spec)),
                            _pieces.shift_of(l.index, l.sharding.sizes, l.sharding.dim_axes),
                            l.pieces.chunks, math.prod(l.pieces.chunks) * _records.itemsize(
                                l.dtype)) for l in leaves for m_ in [l.pieces.mesh]]
  layout = _pieces.build(tuple(meshes), todo, nproc)
  return leaves, tuple(meshes), layout


def _v3_runs(draw, pieced, layout, packs):
  """Format 3: each pieced leaf's runs (each writer's chunks back to back somewhere in a
  pack: appended to that writer's own pack, or anywhere in any pack they fit) and hashes.
  Appends the writers' packs to ``packs``; returns the leaves."""
  own = {}
  for p in np.flatnonzero(layout.region).tolist():
    start = draw(st.integers(0, 3))
    own[p] = (len(packs), start)
    packs.append(_pack_record(draw, f"{DATA}/p/{p}", start + int(layout.region[p])))
  out = []
  for leaf in pieced:
    runs, m = [], _rmanifest(packs, layout)
    procs = _runs.writers(m, leaf)
    for p, n in zip(procs.tolist(), _runs.group(m, leaf).counts[procs].tolist()):
      size = n * layout.leaf(leaf.index).nbytes
      fits = [k for k, pk in enumerate(packs) if pk.nbytes >= size]
      if draw(st.booleans()) and fits:
        k = draw(st.sampled_from(fits))
        runs.append((k, draw(st.integers(0, packs[k].nbytes - size))))
      else:
        k, start = own[p]
        runs.append((k, start + layout.mine(leaf.index, p)[1]))
    hashes = draw(st.binary(min_size=16 * len(runs), max_size=16 * len(runs)))
    out.append(replace(leaf, hash=_hashes.digest(hashes), pieces=replace(
        leaf.pieces, runs=np.array(runs, _runs.RUN).tobytes(), hashes=hashes)))
  return out


def _rmanifest(packs, layout):
  """A manifest as far as :mod:`fnckpt._format.runs` reads it."""
  return _records.Manifest(3, 0.0, 1, {}, None, (), DATA, tuple(packs), layout=layout)


@st.composite
def _record_manifests(draw, versions=(2, 3)):
  """A valid format-2 or -3 :class:`_records.Manifest`, built as records: leaves from
  leaf_record (under ['a'] and ['t']), arrays inline, stored (codecs, hashes, in a base's data),
  packed (in this save's packs or a base's, with a hash or not; always in format 3) or pieced
  (under ['p']: regions in format 2, recorded runs in 3); perprocess leaves."""
  version = draw(st.sampled_from(versions))
  nproc = draw(st.integers(1, 4))
  bases = tuple(draw(st.lists(st.builds(_records.Base, _rels, _data_names), unique=True,
                              max_size=2)) if draw(st.booleans()) else ())
  leaves, used = [], {}                   # used: pack -> bytes so far
  turn = draw(st.integers(0, 2))          # storages in turn: every manifest mixes them
  tree = {"a": draw(st.lists(_arrays, max_size=4)), "t": draw(_trees)}
  for i, (path, value) in enumerate(_tree.flatten(tree)[0]):
    leaf, data = _leaves.leaf_record(i, path, value)
    if data is not None:
      raw = _leaves.to_little_endian(np.asarray(data)).tobytes()
      how = ("inline", "store", "pack")[(turn + i) % 3]
      if how == "inline":
        leaf = replace(leaf, inline=raw)
      elif how == "store":
        leaf = _stored_leaf(draw, leaf, bases, version)
      else:
        k = draw(st.integers(0, 2))
        offset = used.get(k, 0) + draw(st.integers(0, 3))
        used[k] = offset + len(raw)
        hashed = st.binary(min_size=16, max_size=16) if version >= 3 else (
            st.none() | st.binary(min_size=32, max_size=32))
        leaf = replace(leaf, packed=_records.Packed(k, offset, len(raw)), hash=draw(hashed))
    elif draw(st.integers(0, 9)) == 0:
      leaf = _records.Leaf(i, leaf.path, "perprocess")
    leaves.append(leaf)
  packs = []
  for k in range(max(used, default=-1) + 1):
    d, b = _under(draw, bases, f"p/{k}")
    packs.append(_pack_record(draw, d, used.get(k, 0), b))
  meshes, layout = (), None
  if draw(st.booleans()):
    pieced, meshes, layout = draw(_pieced_leaves(len(leaves), nproc))
    if version >= 3:
      pieced = _v3_runs(draw, pieced, layout, packs)
    leaves += pieced
    for p in np.flatnonzero(layout.region).tolist() if version == 2 else ():
      start = draw(st.integers(0, 3))
      packs.append(_pack_record(draw, f"{DATA}/p/{p}", start + int(layout.region[p]),
                                process=p, pieces=start))
  return _records.Manifest(
      version, draw(st.floats(0, 1e10)), nproc, dict(VERSIONS), draw(_data), tuple(leaves),
      DATA, tuple(packs), bases, draw(st.none() | st.builds(_records.Fork, _rels,
                                                            st.integers(0, 1 << 62))),
      meshes, layout, "xxh3-128" if version >= 3 else None)


# --- round trips -------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(_manifests())
def test_property_encode_decode_round_trip(manifest):
  _manifest.check_msgpackable(manifest, "manifest")
  data = _manifest.pack(manifest)
  assert isinstance(data, bytes)
  decoded = _manifest.decode(data, LOC)
  assert isinstance(decoded, _records.Manifest)
  assert [l.index for l in decoded.leaves] == list(range(len(manifest["leaves"])))
  # the records say exactly what the manifest said: same values, same msgpack types
  assert _canonical(_records.encode(decoded)) == _canonical(manifest)
  # frozen: what a reader validated cannot change under it
  with pytest.raises(AttributeError):
    decoded.version = 1
  for leaf in decoded.leaves:
    with pytest.raises(AttributeError):
      leaf.kind = "array"


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    _scalars.filter(lambda v: v is not None),
    st.integers().filter(lambda v: not -(1 << 63) <= v < (1 << 64)),  # bigint kind
    st.complex_numbers(allow_nan=True),
    st.floats(allow_nan=True),
    st.sampled_from(_NP_SCALARS + [np.float64("nan")])))
def test_property_leaf_values_survive_the_manifest(value):
  rec, data = _leaves.leaf_record(0, (("dict", "v"),), value)
  assert data is None  # values go inline, no array data
  rec = _records.encode(rec)
  back = _manifest.decode(_manifest.pack(_manifest_dict([rec])), LOC).leaves[0]
  assert isinstance(back, _records.Leaf) and back.path == (("dict", "v"),)
  restored = _leaves.decode_value(back)
  assert type(restored) is type(value)
  assert _bits(restored) == _bits(value)  # bit-exact: -0.0, NaN payloads, numpy dtypes


@settings(max_examples=300, deadline=None)
@given(_record_manifests())
def test_property_records_encode_then_parse_to_themselves(m):
  """What the writer builds, encoded, is what a reader parses: every field of every record."""
  wire = _records.encode(m)
  back = _manifest.decode(_manifest.pack(wire), LOC)   # through msgpack bytes
  assert back == m
  assert [a.tolist() for a in back.meshes] == [a.tolist() for a in m.meshes]  # compare=False
  assert (back.layout is None) == (m.layout is None)
  assert _manifest.pack(_records.encode(back)) == _manifest.pack(wire)  # bit-exact, key order


def test_encode_refuses_format_1():
  with open(os.path.join(os.path.dirname(__file__), "fixtures", "format1",
                         "manifest.msgpack"), "rb") as f:
    m = _manifest.decode(f.read(), LOC)
  assert m.version == 1
  with pytest.raises(ValueError, match="format 1 records are read-only: fnckpt writes formats 2, 3"):
    _records.encode(m)


def _bits(v):
  if isinstance(v, np.generic):
    return v.dtype.name, v.tobytes()
  if isinstance(v, (float, complex)):
    return struct.pack("<dd", v.real, v.imag)
  return v


def test_numpy_generators_survive_the_manifest():
  for name in sorted(_records.BIT_GENERATORS):
    gen = np.random.Generator(getattr(np.random, name)(7))
    gen.random(3)  # a state past the seed
    rec = _records.encode(_leaves.leaf_record(0, (("seq", 0),), gen)[0])
    back = _manifest.decode(_manifest.pack(_manifest_dict([rec])), LOC).leaves[0]
    restored = _leaves.decode_value(back)
    assert type(restored.bit_generator).__name__ == name
    np.testing.assert_array_equal(restored.random(5), gen.random(5))


def test_manifest_bytes_are_plain_msgpack():
  manifest = _manifest_dict([_scalar("a", 1)])
  m = _manifest.decode(_manifest.pack(manifest), LOC)
  assert msgpack.unpackb(_manifest.encode(m), raw=False) == manifest
  with pytest.raises(TypeError, match=r"takes a records\.Manifest, not dict \(manifest\.pack"):
    _manifest.encode(manifest)


def test_constants_name_the_files():
  assert (_manifest.MANIFEST, _manifest.COMMIT) == ("manifest.msgpack", "COMMIT")
  assert (_manifest.DATA_DIR, _manifest.DATA_PREFIX) == ("d", "data-")  # format 1, format 2
  assert _manifest.FORMAT_VERSION == _manifest.READ_VERSION == 3
  # the leaf kinds and path kinds the README lists (a reader refuses any other)
  assert _records.LEAF_KINDS == {"array", "key", "scalar", "bigint", "npscalar", "npgen",
                                 "empty", "perprocess"}
  assert _records.PATH_KINDS == {"dict", "seq", "attr", "flat"}


# --- decode: bad bytes and invalid manifests ---------------------------------------------

def _packed(m):
  return msgpack.packb(m, use_bin_type=True)


def _without(m, key):
  return {k: v for k, v in m.items() if k != key}


_INVALID = r"The manifest of '/ckpt/7' is invalid: "
_RESTORE = r"\. The checkpoint cannot be read safely; restore an earlier one"
_ONE_PACK = [{"dir": f"{DATA}/p/0", "nbytes": 32, "chunk": 32, "inner": 16}]


@pytest.mark.parametrize("data, match", [
    (b"", r"The manifest of '/ckpt/7' is corrupt \(.*\)\. The checkpoint cannot be read; "
          r"restore an earlier one\."),
    (b"\xc1", r"manifest of '/ckpt/7' is corrupt"),
    (_manifest.pack(_manifest_dict()) + b"x", r"manifest of '/ckpt/7' is corrupt \(ExtraData"),
    (msgpack.packb([1, 2]), r"manifest of '/ckpt/7' is corrupt or not an fnckpt manifest "
                            r"\(no 'format': 'fnckpt' header\)"),
    (msgpack.packb({"format": "orbax", "version": 1, "leaves": []}),
     r"not an fnckpt manifest"),
    (msgpack.packb({"format": "fnckpt", "leaves": []}),
     r"manifest of '/ckpt/7' is corrupt: no format version"),
    (msgpack.packb({"format": "fnckpt", "version": "1", "leaves": []}), r"no format version"),
    (_packed({**_manifest_dict(), "version": 0}), r"corrupt: no format version"),
    (_packed(_without(_manifest_dict(), "leaves")), _INVALID + r"it lacks 'leaves'" + _RESTORE),
    (_packed(_without(_manifest_dict(), "data")), _INVALID + r"it lacks 'data'" + _RESTORE),
    (_packed(_manifest_dict(extra=1)),
     _INVALID + r"it has an unknown field 'extra' \(written by a newer fnckpt\?\)"),
    (_packed({**_manifest_dict(), "leaves": 3}),
     _INVALID + r"its 'leaves' must be a list, found 3"),
    (_packed(_manifest_dict(created="now")), _INVALID + r"its 'created' must be a Unix time"),
    (_packed(_manifest_dict(data="/etc")),
     _INVALID + r"its 'data' must be a relative path of plain names inside the checkpoint, "
                r"found '/etc'"),
    (_packed(_manifest_dict(data="data-1/../..")), r"its 'data' must be a relative path"),
    (_packed(_manifest_dict(packs=[{**_ONE_PACK[0], "inner": 5}])),
     _INVALID + r"its 'packs'\[0\]\.inner must divide its chunk and nbytes"),
    (_packed(_manifest_dict(packs=[{**_ONE_PACK[0], "dir": "../x"}])),
     r"its 'packs'\[0\]\.dir must be a relative path of plain names"),
    (_packed(_manifest_dict([{"path": [], "kind": "x"}])),
     _INVALID + r"the record of <root> is invalid: unknown leaf kind 'x' \(known: \[.*'array'"),
    (_packed(_manifest_dict([{"kind": "array"}])),
     _INVALID + r"the record of leaf #0 is invalid: 'path' must be a list, found None"),
    (_packed(_manifest_dict([3])), _INVALID + r"the record of leaf #0 is invalid: it must be a "
                                              r"map, found 3"),
    (_packed(_manifest_dict([{**_scalar("a", 1), "future": True}])),
     r"the record of \['a'\] is invalid: it has an unknown field 'future'"),
    (_packed(_manifest_dict([{**_scalar("a", 1), "subtype": 3}])),
     r"the record of \['a'\] is invalid: 'subtype' must be a string, found 3"),
    (_packed(_manifest_dict([_array("a", inline=b"\0" * 15)])),
     r"the record of \['a'\] is invalid: 'inline' must hold 16 bytes"),
    (_packed(_manifest_dict([{**_array("a", inline=b"\0" * 16), "dtype": "object"}])),
     r"the record of \['a'\] is invalid: dtype 'object' is not one fnckpt stores"),
    (_packed(_manifest_dict([_array("a", inline=b"\0" * 16, pack={"index": 0, "offset": 0})],
                            _ONE_PACK)),
     r"the record of \['a'\] is invalid: exactly one of 'inline', 'store', 'pack', 'pieces' must be "
     r"present"),
    (_packed(_manifest_dict([_array("a", pack={"index": 0, "offset": 17})], _ONE_PACK)),
     r"the record of \['a'\] is invalid: 'pack' bytes \[17, 33\) lie outside pack 0 \(32 "
     r"bytes\)"),
    (_packed(_manifest_dict([_array("a", pack={"index": 1, "offset": 0})], _ONE_PACK)),
     r"the record of \['a'\] is invalid: 'pack'\.index must be an integer in \[0, 0\], found 1"),
    (_packed(_manifest_dict([_array("a", pack={"index": 0, "offset": 0})])),
     r"the record of \['a'\] is invalid: 'pack'\.index names no pack"),
    (_packed(_manifest_dict([_array("a", store={"dir": "/abs", "chunks": [4], "inner": [4],
                                                "zstd": None})])),
     r"the record of \['a'\] is invalid: 'store'\.dir must be a relative path of plain names"),
    (_packed(_manifest_dict([_array("a", store={"dir": f"{DATA}/a/0", "chunks": [8],
                                                "inner": [8], "zstd": None})])),
     r"the record of \['a'\] is invalid: a chunk is larger than the array"),
    (_packed(_manifest_dict([_array("a", store={"dir": f"{DATA}/a/0", "chunks": [4],
                                                "inner": [3], "zstd": None})])),
     r"the record of \['a'\] is invalid: inner chunks must divide chunks"),
    (_packed(_manifest_dict([_array("a", store={
        "dir": f"{DATA}/a/0", "chunks": [4], "inner": [4], "zstd": None,
        "blosc": {"cname": "snappy", "clevel": 5, "shuffle": "shuffle"}})])),
     r"the record of \['a'\] is invalid: 'store'\.blosc\.cname must be one of \['blosclz', "
     r"'lz4', 'lz4hc', 'zlib', 'zstd'\], found 'snappy'"),
    (_packed(_manifest_dict([_array("a", store={
        "dir": f"{DATA}/a/0", "chunks": [4], "inner": [4], "zstd": 3,
        "blosc": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle"}})])),
     r"the record of \['a'\] is invalid: 'store' has both zstd and blosc"),
    (_packed(_manifest_dict([{"path": [["dict", "a"]], "kind": "perprocess", "value": 1}])),
     r"the record of \['a'\] is invalid: it has an unknown field 'value'"),
    (_packed(_manifest_dict([_scalar("a", 1), _scalar("a", 2)])),
     _INVALID + r"key path \['a'\] appears twice"),
    (_packed(_manifest_dict([_scalar("a", 1), {**_scalar("a", 2),
                                               "path": [["dict", "a"], ["seq", 0]]}])),
     _INVALID + r"a leaf is also a parent of other leaves"),
    (_packed(_manifest_dict([{**_scalar("a", 1), "path": [["seq", 1]]}])),
     _INVALID + r"sequence indices must be 0\.\.n-1 without gaps"),
    (_packed(_manifest_dict([{**_scalar("a", 1), "path": [["seq", 0]]}, _scalar("b", 1)])),
     _INVALID + r"<root> mixes sequence and mapping children"),
], ids=["empty", "reserved-byte", "trailing", "list", "foreign", "no-version", "str-version",
        "zero-version", "no-leaves", "no-data", "unknown-key", "leaves-not-a-list", "created",
        "absolute-data", "dotdot-data", "pack-inner", "pack-dir", "bad-kind", "no-path",
        "not-a-record", "unknown-record-key", "subtype", "inline-size", "dtype", "two-storages",
        "pack-range", "pack-index", "no-pack", "store-dir", "chunk-too-large", "inner-chunk",
        "blosc-cname", "zstd-and-blosc", "perprocess-value", "duplicate-path", "leaf-and-parent", "sequence-gap", "mixed-children"])
def test_decode_rejects_bad_manifests_with_a_clear_error(data, match):
  with pytest.raises(CheckpointError, match=match):
    _manifest.decode(data, LOC)


def test_decode_rejects_a_newer_format_version_and_says_to_upgrade():
  data = _manifest.pack({**_manifest_dict(), "version": _manifest.READ_VERSION + 1})
  with pytest.raises(CheckpointError, match=(
      rf"'/ckpt/7' was written in fnckpt format version {_manifest.READ_VERSION + 1}, newer "
      rf"than this fnckpt reads \(up to {_manifest.READ_VERSION}\)\. Upgrade fnckpt: "
      r"pip install -U fnckpt\.")):
    _manifest.decode(data, LOC)


def test_decode_reads_older_format_versions():
  """Format 1 (fnckpt 0.1.0): no 'data' or 'packs', arrays at d/<n>."""
  store = {"dir": "d/1", "chunks": [4], "inner": [2], "zstd": None}
  manifest = _v1_dict([_scalar("step", 3), _array("w", 1, store=store)])
  decoded = _manifest.decode(_manifest.pack(manifest), LOC)
  assert decoded.version == 1 and decoded.data is None and decoded.packs == ()
  assert decoded.leaves[1].stored == _records.Stored("d/1", (4,), (2,), None)
  assert _canonical(_wire_v1(decoded)) == _canonical(manifest)
  with pytest.raises(ValueError, match="format 1 records are read-only"):
    _records.encode(decoded)
  # ... and only format 1: format-2 keys and records are refused in it
  for bad, match in [
      ({**manifest, "data": DATA}, r"it has an unknown field 'data'"),
      (_v1_dict([_array("w", 1, pack={"index": 0, "offset": 0})]),
       r"the record of \['w'\] is invalid: 'pack' needs format 2"),
      (_v1_dict([_array("w", 1, store={**store, "dir": f"{DATA}/a/1"})]),
       r"the record of \['w'\] is invalid: 'store'\.dir must be d/<n>"),
      (_v1_dict([{"path": [["dict", "w"]], "kind": "perprocess"}]),
       r"the record of \['w'\] is invalid: kind 'perprocess' needs format 2")]:
    with pytest.raises(CheckpointError, match=_INVALID + match):
      _manifest.decode(_manifest.pack(bad), LOC)


_loose_records = st.fixed_dictionaries(
    {"path": st.lists(st.one_of(st.tuples(st.sampled_from(["dict", "attr"]),
                                          st.text(max_size=4)),
                                st.tuples(st.sampled_from(["seq", "flat", "dict", "other"]),
                                          st.integers(-1, 99))).map(list), max_size=4),
     "kind": st.sampled_from(sorted(_records.LEAF_KINDS) + ["pickle"])},
    optional={"value": _data, "dtype": st.sampled_from(["float32", "bfloat16", "int4", "<U1"]),
              "shape": st.lists(st.integers(-1, 9), max_size=3), "inline": st.binary(max_size=16),
              "source": st.sampled_from(["jax", "numpy", "torch"]), "sharding": _data,
              "type": st.sampled_from(["int", "str", "none", "dict", "set"]), "name": _data,
              "impl": st.sampled_from(["threefry2x32", "rbg", "x"]), "store": _data,
              "pack": st.fixed_dictionaries({"index": _ints, "offset": _ints})})


def _is_decoded_or_refused(data):
  try:
    manifest = _manifest.decode(data, LOC)
  except CheckpointError as e:
    assert LOC in str(e)
    return False
  assert isinstance(manifest, _records.Manifest)
  assert manifest.version in range(1, _manifest.READ_VERSION + 1)
  assert isinstance(manifest.leaves, tuple)
  assert all(isinstance(l, _records.Leaf) for l in manifest.leaves)
  return True


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), _data.map(lambda d: msgpack.packb(d)),
                 st.lists(_loose_records, max_size=6).map(
                     lambda r: _manifest.pack(_manifest_dict(r)))))
def test_property_decode_of_any_bytes_is_a_manifest_or_a_checkpoint_error(data):
  _is_decoded_or_refused(data)


@settings(max_examples=300, deadline=None)
@given(_manifests(), st.data())
def test_property_a_changed_field_is_valid_or_a_checkpoint_error(manifest, data):
  """A valid manifest with one field replaced, added or removed (top level, a leaf record,
  or a record's storage) decodes to records or raises a CheckpointError, nothing else."""
  where = [manifest] + manifest["leaves"] + [r[k] for r in manifest["leaves"]
                                             for k in ("store", "pack") if k in r]
  target = data.draw(st.sampled_from(where))
  key = data.draw(st.sampled_from(sorted(target) + ["extra"]))
  if data.draw(st.booleans()):
    target.pop(key, None)
  else:
    target[key] = data.draw(_data)
  _is_decoded_or_refused(_manifest.pack(manifest))


# --- the commit marker -------------------------------------------------------------------

def test_commit_marker_names_the_manifest_by_sha256():
  manifest_bytes = _manifest.pack(_manifest_dict())
  commit = _manifest.decode_commit(_manifest.encode_commit(manifest_bytes, 12.5), LOC)
  assert commit["manifest_sha256"] == hashlib.sha256(manifest_bytes).hexdigest()
  assert commit["manifest_sha256"] == _manifest.digest(manifest_bytes)
  assert commit["committed"] == 12.5
  assert commit["format"] == _manifest.FORMAT_NAME
  assert commit["version"] == _manifest.FORMAT_VERSION


@pytest.mark.parametrize("data, match", [
    (b"\xc1", r"The commit marker of '/ckpt/7' is corrupt"),
    (msgpack.packb({"format": "fnckpt", "version": 1}),
     r"commit marker of '/ckpt/7' is corrupt: no manifest hash"),
    (msgpack.packb({"format": "fnckpt", "version": 1, "manifest_sha256": 5}),
     r"no manifest hash"),
    (msgpack.packb({"version": 1, "manifest_sha256": "ab"}),
     r"commit marker of '/ckpt/7' is corrupt or not an fnckpt commit marker"),
    (msgpack.packb({"format": "fnckpt", "version": 99, "manifest_sha256": "ab"}),
     r"format version 99, newer than this fnckpt reads"),
])
def test_decode_commit_rejects_bad_markers(data, match):
  with pytest.raises(CheckpointError, match=match):
    _manifest.decode_commit(data, LOC)


def test_decode_commit_reads_format_3_markers():
  data = msgpack.packb({"format": "fnckpt", "version": 3, "manifest_sha256": "ab",
                        "committed": 1.0})
  assert _manifest.decode_commit(data, LOC)["version"] == 3


# --- format 3: hashes required, pieces placed by recorded runs ---------------------------

def _v3_wire():
  """A valid format-3 manifest (msgpack map) of 2 processes: ['i'] inline, ['s'] stored (2
  chunks), ['k'] packed, ['p'] pieced over a (2, 2) mesh (one chunk per process: runs of
  process 0 in pack 0 after ['k'], of process 1 at the start of pack 1)."""
  mesh = np.array([0, 0, 1, 1])
  mesh.flags.writeable = False
  sh = _records.Sharding("named", ("x", "y"), (2, 2), ("x",), 4, 0)
  pl = _pieces.PieceLeaf(3, 0, (2, 2), ((0,), ()), _pieces.shift_of(3, (2, 2), ((0,),)),
                         (2, 2), 16)
  layout = _pieces.build((mesh,), [pl], 2)
  x = np.arange(4, dtype=np.float32).tobytes()
  f32 = dict(kind="array", dtype="float32", source="numpy")
  ch = bytes(range(32))
  hashes = bytes(32)
  leaves = (
      _records.Leaf(0, (("dict", "i"),), shape=(4,), inline=x, **f32),
      _records.Leaf(1, (("dict", "s"),), shape=(4,), hash=_hashes.digest(ch), chunk_hashes=ch,
                    stored=_records.Stored(f"{DATA}/a/1", (2,), (2,), None), **f32),
      _records.Leaf(2, (("dict", "k"),), shape=(4,), packed=_records.Packed(0, 0, 16),
                    hash=_hashes.digest(x), **f32),
      _records.Leaf(3, (("dict", "p"),), "array", "float32", (4, 2), "jax", sh,
                    hash=_hashes.digest(hashes), pieces=_records.Pieces(
                        (2, 2), 0, np.array([(0, 16), (1, 0)], _runs.RUN).tobytes(), hashes)))
  packs = (_records.Pack(f"{DATA}/p/0", 32, 32, 16), _records.Pack(f"{DATA}/p/1", 16, 16, 16))
  m = _records.Manifest(3, 1.5, 2, dict(VERSIONS), None, leaves, DATA, packs, meshes=(mesh,),
                        layout=layout, hash="xxh3-128")
  assert _runs.writers(m, leaves[3]).tolist() == [0, 1]
  return _records.encode(m)


def _v3(change):
  m = _v3_wire()
  change(m)
  return _packed(m)


def _rec(m, i):
  return m["leaves"][i]


_LEAF = _INVALID + r"the record of \['{}'\] is invalid: "


@pytest.mark.parametrize("change, match", [
    (lambda m: m.pop("hash"), _INVALID + r"it lacks 'hash'"),
    (lambda m: m.update(hash="sha256"), _INVALID + r"its 'hash' names the content hash algorithm "
     r"'sha256', which this fnckpt does not know \(known: \['xxh3-128'\]\)"),
    (lambda m: m.update(hash=None), r"content hash algorithm None"),
    (lambda m: _rec(m, 0).update(hash=bytes(16)), _LEAF.format("i") + "an inline array has no "
     "'hash'"),
    (lambda m: _rec(m, 1).pop("hash"), _LEAF.format("s") + r"it lacks 'hash' \(format 3"),
    (lambda m: _rec(m, 1).update(hash=bytes(32)), _LEAF.format("s") + r"'hash' must be 16 bytes"),
    (lambda m: _rec(m, 1).pop("chunk_hashes"), _LEAF.format("s") + r"it lacks 'chunk_hashes'"),
    (lambda m: _rec(m, 1).update(chunk_hashes=bytes(48)),
     _LEAF.format("s") + r"'chunk_hashes' \(one hash per chunk\) must be 32 bytes"),
    (lambda m: _rec(m, 1).update(chunk_fps=bytes(16)),
     _LEAF.format("s") + r"it has an unknown field 'chunk_fps'"),
    (lambda m: _rec(m, 2).pop("hash"), _LEAF.format("k") + r"it lacks 'hash'"),
    (lambda m: _rec(m, 2).update(hash=b"x"), _LEAF.format("k") + r"'hash' must be 16 bytes"),
    (lambda m: _rec(m, 3).pop("hash"), _LEAF.format("p") + r"it lacks 'hash'"),
    (lambda m: _rec(m, 3).update(chunk_hashes=bytes(16)), _LEAF.format("p") + r"it has an "
     r"unknown field 'chunk_hashes'|a pieced array has no 'chunk_hashes'"),
    (lambda m: _rec(m, 3)["pieces"].pop("runs"), _LEAF.format("p") + r"'pieces' lacks 'runs'"),
    (lambda m: _rec(m, 3)["pieces"].pop("hashes"), _LEAF.format("p") + r"'pieces' lacks 'hashes'"),
    (lambda m: _rec(m, 3)["pieces"].update(runs=[0, 16]),
     _LEAF.format("p") + r"'pieces'.runs must be bytes, 12 per writing process"),
    (lambda m: _rec(m, 3)["pieces"].update(runs=bytes(13)),
     _LEAF.format("p") + r"'pieces'.runs must be bytes, 12 per writing process"),
    (lambda m: _rec(m, 3)["pieces"].update(runs=_rec(m, 3)["pieces"]["runs"][:12]),
     _LEAF.format("p") + r"'pieces'.runs and 'pieces'.hashes must hold 12 and 16 bytes per "
     r"process writing its chunks \(2 processes\), found 12 and 32"),
    (lambda m: _rec(m, 3)["pieces"].update(hashes=bytes(48)),
     _LEAF.format("p") + r"'pieces'.runs and .*found 24 and 48"),
    (lambda m: _rec(m, 3)["pieces"].update(runs=np.array([(0, 16), (2, 0)], _runs.RUN).tobytes()),
     _LEAF.format("p") + r"'pieces'.runs\[1\] \(process 1's chunks\) names pack 2, but there "
     r"are 2 packs"),
    (lambda m: _rec(m, 3)["pieces"].update(runs=np.array([(0, 17), (1, 0)], _runs.RUN).tobytes()),
     _LEAF.format("p") + r"'pieces'.runs\[0\] \(process 0's chunks\) bytes \[17, 33\) lie "
     r"outside pack 0 \(32 bytes\)"),
    (lambda m: _rec(m, 3)["pieces"].update(
        runs=np.array([(0, 0), (1, (1 << 64) - 1)], _runs.RUN).tobytes()),
     _LEAF.format("p") + r"'pieces'.runs\[1\] \(process 1's chunks\) bytes .* lie outside pack 1"),
    (lambda m: m["packs"][0].update(process=0, pieces=16),
     _INVALID + r"its 'packs'\[0\] has an unknown field 'process'"),
])
def test_decode_refuses_invalid_format_3_manifests(change, match):
  _manifest.decode(_v3(lambda m: None), LOC)   # (the unchanged one is valid)
  with pytest.raises(CheckpointError, match=match):
    _manifest.decode(_v3(change), LOC)


def test_format_2_refuses_format_3_fields():
  def to_v2(m):
    m["version"] = 2
    del m["hash"]
  with pytest.raises(CheckpointError, match=r"its unknown field 'hash'|it has an unknown field "
                     r"'hash'"):
    _manifest.decode(_v3(lambda m: m.update(version=2)), LOC)
  m = _v3_wire()
  to_v2(m)
  m["leaves"] = [m["leaves"][3]]
  m["leaves"][0].pop("hash")
  m["packs"][0].update(process=0, pieces=16)
  m["packs"][1].update(process=1, pieces=0)
  with pytest.raises(CheckpointError, match=_LEAF.format("p") + r"'pieces' has an unknown field "
                     r"'runs'"):
    _manifest.decode(_packed(m), LOC)
  del m["leaves"][0]["pieces"]["runs"], m["leaves"][0]["pieces"]["hashes"]
  assert _manifest.decode(_packed(m), LOC).version == 2


def test_pieces_runs_and_locate_read_the_recorded_runs():
  m = _manifest.decode(_v3(lambda m: None), LOC)
  p = m.leaves[3]
  assert [a.tolist() for a in _runs.pieces_runs(m, p)] == [[0, 1], [16, 0]]
  assert [a.tolist() for a in _runs.locate(m, p, np.array([1, 0]))] == [[1, 0], [0, 16]]
  assert _runs.writer_runs(m, p) == [(0, 0, 16, 32), (1, 1, 0, 16)]


# --- check_msgpackable -------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    None, True, 0, -(1 << 63), (1 << 64) - 1, 1.5, "s", b"b", [1, [2]], (1, 2),
    {"a": {1: [None]}},
])
def test_check_msgpackable_accepts_plain_data(value):
  _manifest.check_msgpackable(value, "meta")


@pytest.mark.parametrize("value, match", [
    (1 << 64, r"meta: integer 18446744073709551616 does not fit in 64 bits; store it as a str"),
    (-(1 << 63) - 1, r"meta: integer .* does not fit in 64 bits"),
    ({"a": [1, object()]}, r"meta\['a'\]\[1\]: value of type object cannot be stored as "
                           r"metadata; use None, bool, int, float, str, bytes"),
    ({(1, 2): 1}, r"meta: key \(1, 2\) must be str or int"),
    (np.int64(3), r"meta: value of type int64 cannot be stored"),
    ({1, 2}, r"meta: value of type set cannot be stored"),
])
def test_check_msgpackable_names_where_and_what(value, match):
  with pytest.raises(CheckpointError, match=match):
    _manifest.check_msgpackable(value, "meta")
