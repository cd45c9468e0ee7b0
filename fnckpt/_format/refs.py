"""PURE: references between checkpoints (incremental saves, forks) and content hashes.

A checkpoint may refer to data another committed checkpoint wrote (README "References and
hashes"). This module holds the path arithmetic (where a referenced checkpoint is, relative to
the referring one), which leaves of a new save may reuse a base's data (:func:`candidates`),
and the final leaf records once the writer has hashed what it staged (:func:`finalize`).
Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from . import parse as _parse, records as _records
from .._errors import CheckpointError

__all__ = ["digest", "array_digest", "Location", "locate", "relative", "resolve",
           "StoredCand", "PackCand", "candidates", "Report", "finalize", "chunk_pos",
           "chunk_key"]


def digest(data: Any) -> bytes:
  """SHA-256 of a bytes-like object (hashlib releases the GIL for large buffers).

  >>> digest(b"").hex()[:8]
  'e3b0c442'
  """
  return hashlib.sha256(data).digest()


FP_BYTES = 8
NO_HASH = bytes(_records.HASH_BYTES)   # a chunk_hashes entry for a chunk not hashed
_FP_WINDOWS, _FP_WINDOW = 16, 512     # elements sampled by a fingerprint


def fingerprint(host: np.ndarray) -> bytes:
  """A cheap 64-bit fingerprint of an array's bytes: BLAKE2b of 16 windows of 512 elements
  spread over it (and its size). Equal bytes give equal fingerprints, so a different
  fingerprint proves a change; equality is only ever decided by :func:`array_digest`."""
  n = host.size
  if n <= _FP_WINDOWS * _FP_WINDOW:
    idx = np.arange(n)
  else:
    starts = np.linspace(0, n - _FP_WINDOW, _FP_WINDOWS).astype(np.int64)
    idx = (starts[:, None] + np.arange(_FP_WINDOW)[None, :]).reshape(-1)
  sample = np.ascontiguousarray(host.flat[idx])
  if sample.dtype.byteorder == ">":
    sample = sample.astype(sample.dtype.newbyteorder("<"))
  h = hashlib.blake2b(digest_size=FP_BYTES)
  h.update(n.to_bytes(8, "little"))
  h.update(memoryview(sample.reshape(-1).view(np.uint8)))
  return h.digest()


def array_digest(host: np.ndarray) -> bytes:
  """SHA-256 of an array's C-order little-endian bytes (what the checkpoint stores)."""
  a = np.ascontiguousarray(host)
  if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and np.little_endian is False):
    a = a.astype(a.dtype.newbyteorder("<"))
  return digest(memoryview(a.reshape(-1).view(np.uint8)))


# --- where things are -------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Location:
  """A checkpoint directory as a kvstore spec split in two: ``store`` (everything but the path,
  as canonical JSON: two locations on one store compare equal) and ``path`` (absolute, with a
  leading ``/``, no trailing ``/``), plus whether the driver's paths are absolute."""
  store: str
  path: str
  absolute: bool
  spec: Mapping[str, Any]

  def spec_at(self, path: str) -> dict[str, Any]:
    """The kvstore spec of the directory ``path`` (as :attr:`path`) on the same store."""
    out = dict(self.spec)
    out["path"] = (path if self.absolute else path.lstrip("/")).rstrip("/") + "/"
    return out


def locate(kv_spec: Mapping[str, Any]) -> Location:
  """The :class:`Location` of a directory's kvstore spec.

  >>> locate({"driver": "memory", "path": "run/7/"}).path
  '/run/7'
  """
  rest = {k: v for k, v in kv_spec.items() if k != "path"}
  raw = str(kv_spec.get("path", ""))
  path = posixpath.normpath("/" + raw.strip("/")) if raw.strip("/") else "/"
  return Location(json.dumps(rest, sort_keys=True), path, raw.startswith("/"), dict(kv_spec))


def relative(target: str, start: str) -> str:
  """``target`` relative to the directory ``start`` (both absolute paths of one store).

  >>> relative("/runs/a/5", "/runs/a"), relative("/runs/a/5", "/runs/b")
  ('5', '../a/5')
  """
  rel = posixpath.relpath(target, start)
  try:
    return _parse.check_rel(rel, "a reference")
  except Exception as e:  # e.g. '.': the target holds the checkpoint that would refer to it
    raise CheckpointError(
        f"Cannot refer to {target!r} from a checkpoint in {start!r}: the reference would be "
        f"{rel!r} ({e}). A checkpoint can refer only to checkpoints beside it, not to a "
        "directory that contains it. Choose a base (or fork directory) outside the new "
        "checkpoint's directory, or save without base=.") from None


def resolve(loc: Location, rel: str, where: str) -> str:
  """The absolute path of ``rel`` (relative to the parent of ``loc``'s directory).

  >>> resolve(locate({"driver": "memory", "path": "r/7/"}), "../s/5", "x")
  '/s/5'
  """
  parts = [p for p in posixpath.dirname(loc.path).split("/") if p]
  for name in rel.split("/"):
    if name != "..":
      parts.append(name)
    elif parts:
      parts.pop()
    else:
      raise CheckpointError(
          f"{where}: the reference {rel!r} leads above the root of its storage location. The "
          "manifest is damaged, or the checkpoint was moved without what it refers to; restore "
          "an earlier checkpoint.")
  return "/" + "/".join(parts)


# --- which leaves may reuse a base's data ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StoredCand:
  """A stored array leaf whose base has the same layout: reusable if every chunk's hash equals
  the base's (``chunk_hashes``, ``HASH_BYTES`` each in grid order)."""
  base: _records.Base               # relative to the *new* checkpoint's parent
  dir: str
  chunk_hashes: bytes
  chunk_fps: bytes | None = None

  def expect(self, pos: int) -> bytes:
    n = _records.HASH_BYTES
    return self.chunk_hashes[pos * n:(pos + 1) * n]

  def expect_fp(self, pos: int) -> bytes | None:
    if self.chunk_fps is None:
      return None
    return self.chunk_fps[pos * FP_BYTES:(pos + 1) * FP_BYTES]


@dataclasses.dataclass(frozen=True)
class PackCand:
  """A packed leaf whose base packed the same dtype and shape: reusable if its hash matches."""
  base: _records.Base
  pack: _records.Pack               # the base's pack record (its ``base`` dropped)
  offset: int
  hash: bytes


def _rebased(base: _records.Manifest, base_loc: Location, new_loc: Location,
             k: int | None) -> _records.Base | None:
  """The checkpoint holding the bytes of a base's record (``k``: its ``base`` index, None for
  the base's own data), as a reference from the new checkpoint; ``None`` when that is the new
  checkpoint's own path (its old data is replaced: nothing there may be referred to)."""
  start = posixpath.dirname(new_loc.path)
  target = base_loc.path if k is None else resolve(base_loc, base.bases[k].dir, base_loc.path)
  if target == new_loc.path:
    return None  # the new checkpoint's own path (overwrite=True): its old data goes
  return _records.Base(relative(target, start), base.data if k is None else base.bases[k].data)


def candidates(records: Sequence[_records.Leaf], base: _records.Manifest,
               base_loc: Location, new_loc: Location
               ) -> tuple[dict[int, StoredCand], dict[int, PackCand]]:
  """Per new leaf record (planned: ``stored`` set for a zarr array, no storage yet for one
  that may be packed), the base data it may reuse. Equal key path, kind, dtype and shape; for
  stored arrays also chunks, inner chunks and codecs; the base must have recorded hashes."""
  if base.version < 2:
    return {}, {}
  by_path = {l.path: l for l in base.leaves}
  stored, packed = {}, {}
  for i, rec in enumerate(records):
    old = by_path.get(rec.path)
    if old is None or old.kind != rec.kind or not old.is_array or old.hash is None:
      continue
    if old.dtype != rec.dtype or old.shape != rec.shape:
      continue
    if old.kind == "key" and old.impl != rec.impl:
      continue
    s = rec.stored
    if s is not None and old.stored is not None and old.chunk_hashes is not None and (
        old.stored.chunks, old.stored.inner, old.stored.zstd, old.stored.blosc) == (
            s.chunks, s.inner, s.zstd, s.blosc):
      where = _rebased(base, base_loc, new_loc, old.stored.base)
      if where is not None:
        stored[i] = StoredCand(where, old.stored.dir, old.chunk_hashes, old.chunk_fps)
    elif (s is None and rec.inline is None and rec.pieces is None
          and old.packed is not None):
      pack = base.packs[old.packed.pack]
      where = _rebased(base, base_loc, new_loc, pack.base)
      if where is not None:
        packed[i] = PackCand(where, dataclasses.replace(pack, base=None), old.packed.offset,
                             old.hash)
  return stored, packed


# --- the final records ----------------------------------------------------------------------

def chunk_pos(index: Sequence[tuple[int, int]], chunks: Sequence[int],
              shape: Sequence[int]) -> int:
  """The C-order position in the chunk grid of the chunk whose region is ``index``.

  >>> chunk_pos(((4, 8), (0, 2)), (4, 2), (8, 4))
  2
  """
  pos = 0
  for (start, _), c, n in zip(index, chunks, shape):
    pos = pos * -(-n // c) + start // c
  return pos


def chunk_key(pos: int, chunks: Sequence[int], shape: Sequence[int]) -> str:
  """The zarr v3 ``default`` chunk key (``c/i/j/...``) of grid position ``pos``.

  >>> chunk_key(2, (4, 2), (8, 4))
  'c/1/0'
  """
  grid = [-(-n // c) for n, c in zip(shape, chunks)]
  idx = np.unravel_index(pos, grid) if grid else ()
  return "/".join(["c"] + [str(int(i)) for i in idx])


@dataclasses.dataclass
class Report:
  """What one process's writer learned: hashes of the stored chunks it wrote or skipped
  (leaf -> {pos: hash}), candidate stored leaves where one of its chunks differed, hashes of
  the leaves it packed, where its candidate packed leaves went (leaf -> (hash, segment or -1
  for the base's pack, offset)) and the pack segments it wrote ``(dir, nbytes, chunk, inner)``."""
  chunks: dict[int, dict[int, bytes]] = dataclasses.field(default_factory=dict)
  changed: set[int] = dataclasses.field(default_factory=set)
  packed: dict[int, bytes] = dataclasses.field(default_factory=dict)
  maybe: dict[int, tuple[bytes, int, int]] = dataclasses.field(default_factory=dict)
  segments: list[tuple[str, int, int, int]] = dataclasses.field(default_factory=list)

  def to_msgpack(self) -> dict[str, Any]:
    return {"chunks": {k: list(v.items()) for k, v in self.chunks.items()},
            "changed": sorted(self.changed), "packed": self.packed,
            "maybe": {k: list(v) for k, v in self.maybe.items()},
            "segments": [list(s) for s in self.segments]}

  @staticmethod
  def from_msgpack(d: Mapping[str, Any]) -> "Report":
    return Report({int(k): {int(p): bytes(h) for p, h in v} for k, v in d["chunks"].items()},
                  set(d["changed"]), {int(k): bytes(v) for k, v in d["packed"].items()},
                  {int(k): (bytes(v[0]), int(v[1]), int(v[2])) for k, v in d["maybe"].items()},
                  [tuple(s) for s in d["segments"]])


class _Bases:
  """The ``bases`` list of a new manifest: entries added as leaves come to refer to them."""

  def __init__(self) -> None:
    self.items: list[_records.Base] = []

  def index(self, b: _records.Base) -> int:
    if b not in self.items:
      self.items.append(b)
    return self.items.index(b)


def changed_leaves(reports: Iterable[Report], stored: Mapping[int, StoredCand]) -> set[int]:
  """Candidate stored leaves that some process found changed."""
  out: set[int] = set()
  for r in reports:
    out |= r.changed
  return out & set(stored)


def finalize(records: Sequence[_records.Leaf], packs: Sequence[_records.Pack],
             reports: Sequence[Report], stored: Mapping[int, StoredCand],
             packed: Mapping[int, PackCand], changed: set[int], location: str
             ) -> tuple[tuple[_records.Leaf, ...], tuple[_records.Pack, ...],
                        tuple[_records.Base, ...]]:
  """(leaf records, packs, bases) of the manifest: hashes added, reused leaves referring to
  their base's data, candidate packed leaves placed in their segment or the base's pack."""
  records, packs = list(records), list(packs)
  bases = _Bases()
  chunks: dict[int, dict[int, bytes]] = {}
  for proc, r in enumerate(reports):
    for i, hashes in r.chunks.items():
      mine = chunks.setdefault(i, {})
      if set(mine) & set(hashes):
        raise CheckpointError(f"Saving to {location!r}: two processes wrote one chunk of "
                              f"leaf #{i} (process {proc} among them).")
      mine.update(hashes)
    for i, h in r.packed.items():
      records[i] = dataclasses.replace(records[i], hash=h)
  for i, hashes in chunks.items():
    rec = records[i]
    grid = [-(-n // c) for n, c in zip(rec.shape, rec.stored.chunks)]
    n = int(np.prod(grid)) if all(rec.shape) else 0
    if sorted(hashes) != list(range(n)):
      raise CheckpointError(f"Saving to {location!r}: the chunk hashes of leaf #{i} are "
                            f"incomplete ({len(hashes)} of {n}).")
    chunk_hashes = b"".join(hashes[p][:_records.HASH_BYTES] for p in range(n))
    where = rec.stored
    if i in stored and i not in changed:
      where = dataclasses.replace(where, dir=stored[i].dir, base=bases.index(stored[i].base))
    records[i] = dataclasses.replace(
        rec, stored=where, chunk_hashes=chunk_hashes, hash=digest(chunk_hashes),
        chunk_fps=b"".join(hashes[p][_records.HASH_BYTES:] for p in range(n)))
  _place_packed(records, packs, reports, packed, bases)
  return tuple(records), tuple(packs), tuple(bases.items)


def _place_packed(records: list[_records.Leaf], packs: list[_records.Pack],
                  reports: Sequence[Report], packed: Mapping[int, PackCand],
                  bases: _Bases) -> None:
  seg_index: dict[tuple[int, int], int] = {}
  ref_index: dict[tuple[int, str], int] = {}
  for proc, r in enumerate(reports):
    for k, (d, nbytes, chunk, inner) in enumerate(r.segments):
      seg_index[(proc, k)] = len(packs)
      packs.append(_records.Pack(d, nbytes, chunk, inner))
  for proc, r in enumerate(reports):
    for i, (h, seg, offset) in sorted(r.maybe.items()):
      rec = records[i]
      if seg >= 0:
        records[i] = dataclasses.replace(rec, hash=h, packed=_records.Packed(
            seg_index[(proc, seg)], offset, rec.nbytes))
        continue
      cand = packed[i]
      b = bases.index(cand.base)
      key = (b, cand.pack.dir)
      if key not in ref_index:
        ref_index[key] = len(packs)
        p = cand.pack  # ('process' and 'pieces' name this save's writers of pieces: none)
        packs.append(_records.Pack(p.dir, p.nbytes, p.chunk, p.inner, b))
      records[i] = dataclasses.replace(rec, hash=h, packed=_records.Packed(
          ref_index[key], cand.offset, rec.nbytes))


# --- reading ------------------------------------------------------------------------------------

def base_spec(kv_spec: Mapping[str, Any], manifest: _records.Manifest, base: int | None,
              location: str) -> dict[str, Any]:
  """The kvstore spec of the checkpoint holding data of ``base`` (an index in the manifest's
  ``bases``; None: the checkpoint at ``kv_spec`` itself)."""
  if base is None:
    return dict(kv_spec)
  loc = locate(kv_spec)
  return loc.spec_at(resolve(loc, manifest.bases[base].dir, location))


def display(location: str, rel: str) -> str:
  """The location of the checkpoint ``rel`` refers to, as users write locations.

  >>> display("s3://b/run/7", "../x/5"), display("/r/7", "5")
  ('s3://b/x/5', '/r/5')
  """
  scheme, sep, rest = location.rpartition("://")
  head = f"{scheme}{sep}" if sep else ""
  rest = rest if sep else location
  lead = "/" if rest.startswith("/") else ""
  joined = posixpath.normpath(posixpath.join("/" + posixpath.dirname(rest.strip("/")), rel))
  return head + lead + joined.lstrip("/")


def describe(location: str, manifest: _records.Manifest, base: int | None) -> str:
  """Where a leaf's bytes are, for messages: '' for its own data, else 'data of <loc>'."""
  if base is None:
    return ""
  b = manifest.bases[base]
  return f"the data {b.data} of the checkpoint at {display(location, b.dir)!r}"
