"""Format-3 checkpoints for tests before the format-3 writer lands: :func:`upgrade` rewrites a
format-2 checkpoint written by ``fnckpt.save`` into a valid format-3 one in place (README
"Version 3"), and :func:`tamper_*` change stored bytes behind the checksums' back (the files
stay valid zarr, crc32c included) so only the content hashes can tell.

The tree builders (:func:`trees`) make one state per storage kind; with the real writer they
serve its tests as well."""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

from fnckpt._format import hashes as _hashes, manifest as _manifest, records as _records, \
    runs as _runs
from fnckpt._io import arrays as _store
from fnckpt._layout import blocks as _blocks
from fnckpt._sources import read as _read, source as _source

ALG = "xxh3-128"


# --- trees, one per storage kind ------------------------------------------------------------

def mesh8():
  """A (2, 4) mesh of the 8 virtual CPU devices (tests/conftest.py)."""
  return jax.make_mesh((2, 4), ("a", "b"))


def trees() -> dict[str, dict]:
  """name -> a state whose arrays ``fnckpt.save`` stores that way (default options, but for
  ``q``, replicated over an axis: a piece only with ``_pieces.PIECE_BYTES`` of 2 MiB or more):
  ``inline`` (small), ``packed`` (16 KiB to 4 MiB, seen whole), ``pieces`` (device shards of
  at most 1 MiB of arrays over 4 MiB, over the 8 devices), ``stored`` (over 4 MiB, large
  shards), ``mixed`` (all of them, and scalars)."""
  mesh = mesh8()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 256)).astype(np.float32)         # 64 KiB
  big = rng.standard_normal((1024, 1280)).astype(np.float32)    # 5 MiB
  out = {
      "inline": {"a": np.arange(5, dtype=np.int32), "b": jnp.ones((3,), jnp.bfloat16)},
      "packed": {"w": x, "v": x[:32].astype(np.float16), "m": np.arange(8192) % 2 == 0},
      "pieces": {"p": put(big, P("a", "b")),                           # 640 KiB shards
                 "q": put(big, P(None, "b")),                          # replicated over a
                 "r": put(np.concatenate([big, big]).astype(jnp.bfloat16), P(("b", "a")))},
      "stored": {"big": big, "sh": put(big, P("a", None))},
  }
  out["mixed"] = {**{k: v for t in out.values() for k, v in t.items()}, "step": 7, "lr": 0.5}
  return out


def kinds(path: str) -> set[str]:
  """The storage kinds of a checkpoint's array leaves."""
  m = _source.open_source(path).manifest
  return {"inline" if l.inline is not None else "packed" if l.packed is not None else
          "pieces" if l.pieces is not None else "stored" for l in m.leaves if l.is_array}


# --- format 2 -> 3 ---------------------------------------------------------------------------

def upgrade(path: str) -> _records.Manifest:
  """Rewrite the format-2 checkpoint at local ``path`` as format 3 (same data; a format-3
  checkpoint, which every save writes now, is left as it is): xxh3 hashes
  of every stored chunk, packed leaf and pieces run, runs recorded where format 2 computed
  them, packs without ``process``/``pieces``, a new manifest and ``COMMIT``."""
  src = _source.open_source(path)
  m = src.manifest
  if m.version == 3:   # (saves write format 3 themselves now: nothing to do)
    return m
  assert m.version == 2, m.version
  opener = _read.Opener(src, check_hashes=False)
  leaves = tuple(_hashed(src, opener, rec) for rec in m.leaves)
  packs = tuple(dataclasses.replace(p, process=None, pieces=None) for p in m.packs)
  new = dataclasses.replace(m, version=3, hash=ALG, leaves=leaves, packs=packs)
  data = _manifest.pack(_records.encode(new))
  with open(os.path.join(path, _manifest.MANIFEST), "wb") as f:
    f.write(data)
  commit = _manifest.pack({"format": _manifest.FORMAT_NAME, "version": 3,
                           "manifest_sha256": _manifest.digest(data), "committed": time.time()})
  with open(os.path.join(path, _manifest.COMMIT), "wb") as f:
    f.write(commit)
  return _source.open_source(path).manifest


def _hashed(src, opener, rec: _records.Leaf) -> _records.Leaf:
  """``rec`` with its format-3 hashes (and runs, for pieces)."""
  if not rec.is_array or rec.inline is not None:
    return rec
  if rec.packed is not None:
    return dataclasses.replace(rec, hash=_hashes.array_digest(_whole(opener, rec)))
  if rec.stored is not None:
    leaf = opener.leaf(rec)
    grid = list(_blocks.grid(rec.shape, rec.stored.chunks)) if all(rec.shape) else []
    got = _read.read_regions([_read.Region(leaf, i, 0) for i in grid], _read.Window(1 << 30))
    ch = b"".join(_hashes.array_digest(g.data) for g in got)
    return dataclasses.replace(rec, hash=_hashes.digest(ch), chunk_hashes=ch, chunk_fps=None)
  runs, hashes = [], b""
  for r in _runs.writer_runs(src.manifest, rec):
    runs.append((r.pack, r.lo))
    hashes += _hashes.array_digest(read_pack(opener, r.pack, r.lo, r.hi))
  pieces = dataclasses.replace(rec.pieces, runs=np.array(runs, _runs.RUN).tobytes(),
                               hashes=hashes)
  return dataclasses.replace(rec, hash=_hashes.digest(hashes), pieces=pieces)


def _whole(opener, rec) -> np.ndarray:
  (got,) = _read.read_regions([_read.Region(opener.leaf(rec), tuple((0, n) for n in rec.shape),
                                            rec.nbytes)], _read.Window(1 << 30))
  return got.data


def read_pack(opener, k: int, lo: int, hi: int) -> np.ndarray:
  """Bytes ``[lo, hi)`` of pack ``k``."""
  (got,) = _read.read_regions([_read.Region(opener.pack(k), ((lo, hi),), hi - lo)],
                              _read.Window(1 << 30))
  return got.data


# --- tampering: valid files, changed values ---------------------------------------------------

def tamper_pack(path: str, k: int, lo: int, hi: int) -> None:
  """Flip the bits of bytes ``[lo, hi)`` of pack ``k`` (rewritten through TensorStore)."""
  src = _source.open_source(path)
  p = src.manifest.packs[k]
  spec = _store.pack_spec(src.kv_spec, p.dir, p.nbytes, p.chunk, p.inner)
  arr = ts.open(spec, open=True, read=True, write=True).result()
  old = arr[lo:hi].read().result()
  arr[lo:hi].write(old ^ 0xFF).result()


def tamper_packed(path: str, key: str) -> None:
  """Change packed leaf ``key``'s bytes."""
  rec = leaf(path, key)
  tamper_pack(path, rec.packed.pack, rec.packed.offset, rec.packed.offset + 1)


def tamper_run(path: str, key: str, writer: int = 0) -> _runs.Run:
  """Change one byte of pieced leaf ``key``'s ``writer``-th run; returns the run."""
  src = _source.open_source(path)
  r = _runs.writer_runs(src.manifest, leaf(path, key))[writer]
  tamper_pack(path, r.pack, r.hi - 1, r.hi)
  return r


def tamper_chunk(path: str, key: str) -> tuple:
  """Change the values of stored leaf ``key``'s first chunk; returns its region."""
  rec = leaf(path, key)
  spec = _store.zarr_spec(_source.open_source(path).kv_spec, rec.stored, rec.dtype, rec.shape)
  arr = ts.open(spec, open=True, read=True, write=True).result()
  box = tuple(slice(0, min(c, n)) for c, n in zip(rec.stored.chunks, rec.shape))
  old = arr[box].read().result()
  arr[box].write(old + 1).result()
  return box


def leaf(path: str, key: str) -> _records.Leaf:
  """The record of top-level dict key ``key``."""
  m = _source.open_source(path).manifest
  return next(l for l in m.leaves if l.path == (("dict", key),))


def nbytes(rec: _records.Leaf) -> int:
  return math.prod(rec.shape) * _records.itemsize(rec.dtype)
