"""PURE: references between checkpoints (incremental saves, forks) and content hashes.

A checkpoint may refer to data another committed checkpoint wrote (docs/format.md "References and
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
import struct
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .._errors import CheckpointError
from .._layout import pieces as _pieces
from . import hashes as _hashes
from . import parse as _parse
from . import records as _records

__all__ = [
  "digest",
  "array_digest",
  "Location",
  "locate",
  "relative",
  "resolve",
  "StoredCand",
  "PackCand",
  "RunCand",
  "Candidates",
  "candidates",
  "Report",
  "finalize",
  "chunk_pos",
  "chunk_key",
  "run_writers",
  "same_split",
  "split_of",
]


def digest(data: Any) -> bytes:
  """SHA-256 of a bytes-like object: format 2's content hashes (format 3's are
  :mod:`fnckpt._format.hashes`).

  >>> digest(b"").hex()[:8]
  'e3b0c442'
  """
  return hashlib.sha256(data).digest()


NO_HASH = bytes(_records.HASH_BYTES)  # format 2: a chunk_hashes entry for a chunk not hashed


def array_digest(host: np.ndarray) -> bytes:
  """SHA-256 of an array's C-order little-endian bytes (format 2's chunk hashes)."""
  a = np.ascontiguousarray(host)
  if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and np.little_endian is False):
    a = a.astype(a.dtype.newbyteorder("<"))
  return digest(memoryview(a.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]  # (numpy)


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
      "checkpoint's directory, or save without base=."
    ) from None


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
        "an earlier checkpoint."
      )
  return "/" + "/".join(parts)


# --- which leaves may reuse a base's data ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StoredCand:
  """A stored array leaf whose base has the same layout: reusable if every chunk's hash equals
  the base's (``chunk_hashes``, 16 bytes each in grid order)."""

  base: _records.Base  # relative to the *new* checkpoint's parent
  dir: str
  chunk_hashes: bytes

  def expect(self, pos: int) -> bytes:
    n = _hashes.NBYTES
    return self.chunk_hashes[pos * n : (pos + 1) * n]


@dataclasses.dataclass(frozen=True)
class PackCand:
  """A packed leaf, or one process's run of a pieced leaf, whose base stored the same bytes
  positions: reusable if its hash matches (the base's ``pack`` record, ``base`` dropped)."""

  base: _records.Base
  pack: _records.Pack
  offset: int
  hash: bytes


@dataclasses.dataclass(frozen=True)
class RunCand:
  """A pieced leaf whose base has the same pieces layout (dtype, shape, chunks, sharding, mesh
  processes and writer rule): per writing process, its run in the base."""

  runs: Mapping[int, PackCand]  # process -> its run in the base


@dataclasses.dataclass(frozen=True)
class Candidates:
  """Per new leaf record, the base data it may reuse (see :func:`candidates`)."""

  stored: Mapping[int, StoredCand] = dataclasses.field(default_factory=dict)
  packed: Mapping[int, PackCand] = dataclasses.field(default_factory=dict)
  pieced: Mapping[int, RunCand] = dataclasses.field(default_factory=dict)
  # leaves whose value could be compared with the base's but whose layout differs:
  # (key path, why); they are written in full (save warns)
  not_compared: tuple[tuple[str, str], ...] = ()


def _rebased(
  base: _records.Manifest, base_loc: Location, new_loc: Location, k: int | None
) -> _records.Base | None:
  """The checkpoint holding the bytes of a base's record (``k``: its ``base`` index, None for
  the base's own data), as a reference from the new checkpoint; ``None`` when that is the new
  checkpoint's own path (its old data is replaced: nothing there may be referred to)."""
  start = posixpath.dirname(new_loc.path)
  target = base_loc.path if k is None else resolve(base_loc, base.bases[k].dir, base_loc.path)
  if target == new_loc.path:
    return None  # the new checkpoint's own path (overwrite=True): its old data goes
  data = base.data if k is None else base.bases[k].data
  assert data is not None  # (a comparable base, format 3, names its data directory)
  return _records.Base(relative(target, start), data)


def comparable(base: _records.Manifest) -> bool:
  """Whether ``base`` records hashes a new save can compare with (format 3, xxh3-128)."""
  return base.version >= 3 and base.hash == _hashes.ALG


def candidates(
  records: Sequence[_records.Leaf],
  base: _records.Manifest,
  base_loc: Location,
  new_loc: Location,
  meshes: Sequence[np.ndarray] = (),
) -> Candidates:
  """Per new leaf record (planned: ``stored`` set for a zarr array, ``pieces`` for a pieced
  one, no storage yet for one that may be packed), the base data it may reuse. Equal key
  path, kind, dtype and shape; for stored arrays also chunks, inner chunks and codecs; for
  pieced ones the chunks, sharding, mesh processes (``meshes``: the new save's) and writer
  rule. Only a base with comparable hashes (:func:`comparable`) has candidates."""
  if not comparable(base):
    return Candidates()
  by_path = {l.path: l for l in base.leaves}
  stored, packed, pieced, apart = {}, {}, {}, []
  for i, rec in enumerate(records):
    old = by_path.get(rec.path)
    if old is None or old.kind != rec.kind or not old.is_array or old.hash is None:
      continue
    if old.dtype != rec.dtype or old.shape != rec.shape:
      continue
    if old.kind == "key" and old.impl != rec.impl:
      continue
    s = rec.stored
    if rec.inline is not None:
      continue  # (in the manifest: nothing to write)
    if s is not None and old.stored is not None:
      if (old.stored.chunks, old.stored.inner, old.stored.zstd, old.stored.blosc) != (
        s.chunks,
        s.inner,
        s.zstd,
        s.blosc,
      ):
        apart.append((rec.where, "its chunking or compression differs from the base's"))
        continue
      where = _rebased(base, base_loc, new_loc, old.stored.base)
      if where is not None:
        assert old.chunk_hashes is not None  # (a hashed stored leaf's)
        stored[i] = StoredCand(where, old.stored.dir, old.chunk_hashes)
    elif rec.pieces is not None and old.pieces is not None:
      got = _run_cand(
        base=base, old=old, rec=rec, i=i, meshes=meshes, base_loc=base_loc, new_loc=new_loc
      )
      if got is None:
        apart.append((rec.where, "its sharding or mesh differs from the base's"))
        continue
      pieced[i] = got
    elif s is None and rec.pieces is None and old.packed is not None:
      pack = base.packs[old.packed.pack]
      where = _rebased(base, base_loc, new_loc, pack.base)
      if where is not None:
        packed[i] = PackCand(
          where, dataclasses.replace(pack, base=None), old.packed.offset, old.hash
        )
    else:
      apart.append(
        (
          rec.where,
          f"it is stored {_kind(rec)} here but {_kind(old)} in the base "
          "(its sharding, or the save's inline_bytes/pack_bytes/compression differ)",
        )
      )
  return Candidates(stored, packed, pieced, tuple(apart))


def _kind(rec: _records.Leaf) -> str:
  """How a leaf is stored (for messages)."""
  return (
    "as a zarr array"
    if rec.stored is not None
    else "as pieces"
    if rec.pieces is not None
    else "inline"
    if rec.inline is not None
    else "packed"
  )


def run_writers(layout: Any, index: int) -> np.ndarray:
  """The processes writing chunks of pieced leaf ``index`` (rule 1), increasing."""
  k = layout.position[index]
  return np.flatnonzero(layout.groups[layout.group_of[k]].counts)


def split_of(s: _records.Sharding, ndim: int) -> tuple[tuple[int, ...], ...]:
  """Per array dimension, the mesh axes (positions) splitting it: ``P('y')`` and
  ``P('y', None)`` (what ``x + 1`` gives) are the same split."""
  return s.dim_axes + ((),) * (ndim - len(s.dim_axes))


def same_split(a: _records.Sharding, b: _records.Sharding, ndim: int) -> bool:
  """Whether two saved named shardings split an array of rank ``ndim`` alike (same mesh axes
  and sizes, same axes per dimension, however the specs spell it)."""
  return (a.axes, a.sizes) == (b.axes, b.sizes) and split_of(a, ndim) == split_of(b, ndim)


def _run_cand(
  base: _records.Manifest,
  old: _records.Leaf,
  rec: _records.Leaf,
  i: int,
  meshes: Sequence[np.ndarray],
  base_loc: Location,
  new_loc: Location,
) -> RunCand | None:
  """The base's runs of a pieced leaf whose chunks land on the same writers as ``rec``'s."""
  a, b = old.sharding, rec.sharding
  assert old.pieces is not None and rec.pieces is not None and rec.shape is not None
  assert a is not None and b is not None and a.mesh is not None and b.mesh is not None
  if (
    old.pieces.chunks != rec.pieces.chunks
    or not same_split(a, b, len(rec.shape))
    or (not np.array_equal(base.meshes[a.mesh], meshes[b.mesh]))
  ):
    return None
  dims = split_of(b, len(rec.shape))
  if _pieces.shift_of(old.index, b.sizes, dims) != _pieces.shift_of(i, b.sizes, dims):
    return None  # rule 1 depends on the leaf's index: its writers moved
  assert old.pieces.runs is not None and old.pieces.hashes is not None  # (format 3)
  got = np.frombuffer(old.pieces.runs, dtype=[("pack", "<u4"), ("offset", "<u8")])
  n = _hashes.NBYTES
  runs = {}
  for w, (proc, (k, offset)) in enumerate(
    zip(run_writers(base.layout, old.index).tolist(), got.tolist())
  ):
    pack = base.packs[k]
    where = _rebased(base, base_loc, new_loc, pack.base)
    if where is None:
      return None
    runs[proc] = PackCand(
      where,
      dataclasses.replace(pack, base=None),
      int(offset),
      old.pieces.hashes[w * n : (w + 1) * n],
    )
  return RunCand(runs)


# --- the final records ----------------------------------------------------------------------


def chunk_pos(index: Sequence[tuple[int, int]], chunks: Sequence[int], shape: Sequence[int]) -> int:
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
    return {
      "chunks": {k: list(v.items()) for k, v in self.chunks.items()},
      "changed": sorted(self.changed),
      "packed": self.packed,
      "maybe": {k: list(v) for k, v in self.maybe.items()},
      "segments": [list(s) for s in self.segments],
    }

  @staticmethod
  def from_msgpack(d: Mapping[str, Any]) -> Report:
    return Report(
      {int(k): {int(p): bytes(h) for p, h in v} for k, v in d["chunks"].items()},
      set(d["changed"]),
      {int(k): bytes(v) for k, v in d["packed"].items()},
      {int(k): (bytes(v[0]), int(v[1]), int(v[2])) for k, v in d["maybe"].items()},
      [tuple(s) for s in d["segments"]],
    )


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


def finalize(
  records: Sequence[_records.Leaf],
  packs: Sequence[_records.Pack],
  reports: Sequence[Report],
  reusable: Candidates,
  changed: set[int],
  location: str,
  layout: Any = None,
  regions: Any = None,
) -> tuple[tuple[_records.Leaf, ...], tuple[_records.Pack, ...], tuple[_records.Base, ...]]:
  """(leaf records, packs, bases) of a format-3 manifest: hashes added, reused leaves
  referring to their base's data, candidate packed leaves and pieces runs placed in their
  segment or the base's pack. ``layout``: the pieced leaves' writer rule (all of them);
  ``regions``: the layout of the pieces regions of this save's own packs (the pieced leaves
  that were not candidates)."""
  records, packs = list(records), list(packs)
  bases = _Bases()
  chunks: dict[int, dict[int, bytes]] = {}
  for proc, r in enumerate(reports):
    for i, hashes in r.chunks.items():
      mine = chunks.setdefault(i, {})
      if set(mine) & set(hashes):
        raise CheckpointError(
          f"Saving to {location!r}: two processes wrote one chunk of "
          f"leaf #{i} (process {proc} among them)."
        )
      mine.update(hashes)
    for i, h in r.packed.items():
      if records[i].pieces is None:
        records[i] = _records.evolve(records[i], hash=h)
  for i, hashes in chunks.items():
    records[i] = _stored_hashes(
      records[i], hashes, reusable.stored.get(i), i in changed, bases, location
    )
  place = _Placer(packs, reports, bases)
  _place_packed(records, reports, reusable.packed, place)
  own = {p.process: k for k, p in enumerate(packs) if p.process is not None}
  for i, rec in enumerate(records):
    if rec.pieces is not None:
      records[i] = _runs(
        rec=rec,
        reports=reports,
        cand=reusable.pieced.get(i),
        layout=layout,
        regions=regions,
        own=own,
        packs=packs,
        place=place,
        location=location,
      )
  packs = [dataclasses.replace(p, process=None, pieces=None) for p in place.packs]
  return tuple(records), tuple(packs), tuple(bases.items)


def _stored_hashes(
  rec: _records.Leaf,
  hashes: Mapping[int, bytes],
  cand: StoredCand | None,
  changed: bool,
  bases: _Bases,
  location: str,
) -> _records.Leaf:
  """A stored leaf's record with its chunk hashes (and its base's data when reused)."""
  assert rec.shape is not None and rec.stored is not None
  grid = [-(-n // c) for n, c in zip(rec.shape, rec.stored.chunks)]
  n = int(np.prod(grid)) if all(rec.shape) else 0
  if sorted(hashes) != list(range(n)):
    raise CheckpointError(
      f"Saving to {location!r}: the chunk hashes of leaf {rec.where} are "
      f"incomplete ({len(hashes)} of {n})."
    )
  chunk_hashes = b"".join(hashes[p] for p in range(n))
  where = rec.stored
  if cand is not None and not changed:
    where = dataclasses.replace(where, dir=cand.dir, base=bases.index(cand.base))
  return _records.evolve(
    rec, stored=where, chunk_hashes=chunk_hashes, hash=_hashes.digest(chunk_hashes)
  )


class _Placer:
  """Packs of the new manifest as items come to be placed: the writers' segments, and the
  base's packs that reused items point into (each added once)."""

  def __init__(self, packs: list[_records.Pack], reports: Sequence[Report], bases: _Bases):
    self.packs, self.bases = packs, bases
    self.segment: dict[tuple[int, int], int] = {}
    self._refs: dict[tuple[int, str], int] = {}
    for proc, r in enumerate(reports):
      for k, (d, nbytes, chunk, inner) in enumerate(r.segments):
        self.segment[(proc, k)] = len(packs)
        packs.append(_records.Pack(d, nbytes, chunk, inner))

  def reused(self, cand: PackCand) -> int:
    """The index of the base's pack ``cand`` is in."""
    b = self.bases.index(cand.base)
    key = (b, cand.pack.dir)
    if key not in self._refs:
      self._refs[key] = len(self.packs)
      p = cand.pack
      self.packs.append(_records.Pack(p.dir, p.nbytes, p.chunk, p.inner, b))
    return self._refs[key]

  def place(self, proc: int, seg: int, offset: int, cand: PackCand | None) -> tuple[int, int]:
    """(pack index, offset) of an item a writer placed (``seg`` -1: reused from ``cand``)."""
    if seg >= 0:
      return self.segment[(proc, seg)], offset
    assert cand is not None
    return self.reused(cand), cand.offset


def _place_packed(
  records: list[_records.Leaf],
  reports: Sequence[Report],
  packed: Mapping[int, PackCand],
  place: _Placer,
) -> None:
  for proc, r in enumerate(reports):
    for i, (h, seg, offset) in sorted(r.maybe.items()):
      rec = records[i]
      if rec.pieces is None:
        k, at = place.place(proc, seg, offset, packed.get(i))
        records[i] = _records.evolve(rec, hash=h, packed=_records.Packed(k, at, rec.nbytes))


def _runs(
  rec: _records.Leaf,
  reports: Sequence[Report],
  cand: RunCand | None,
  layout: Any,
  regions: Any,
  own: Mapping[int, int],
  packs: Sequence[_records.Pack],
  place: _Placer,
  location: str,
) -> _records.Leaf:
  """A pieced leaf's record with each writer's run (where, hash): one written apart (a
  candidate) from the writers' reports (segment or the base's), another's in its writer's own
  pack region."""
  i, runs, hashes = rec.index, [], []
  apart = any(i in r.maybe for r in reports)  # (written apart: it was a candidate)
  for proc in run_writers(layout, i).tolist():
    r = reports[proc]
    if apart:
      if i not in r.maybe:
        raise CheckpointError(
          f"Saving to {location!r}: process {proc} did not report its pieces of leaf {rec.where}."
        )
      h, seg, offset = r.maybe[i]
      k, at = place.place(proc, seg, offset, cand.runs.get(proc) if cand is not None else None)
    else:
      if i not in r.packed:
        raise CheckpointError(
          f"Saving to {location!r}: process {proc} did not report the "
          f"hash of its pieces of leaf {rec.where}."
        )
      h, k = r.packed[i], own[proc]
      at = packs[k].pieces + regions.mine(i, proc)[1]
    runs.append(struct.pack("<IQ", k, at))
    hashes.append(h)
  joined = b"".join(hashes)
  return _records.evolve(
    rec,
    hash=_hashes.digest(joined),
    pieces=_records.evolve(rec.pieces, runs=b"".join(runs), hashes=joined),
  )


# --- reading ------------------------------------------------------------------------------------


def base_spec(
  kv_spec: Mapping[str, Any], manifest: _records.Manifest, base: int | None, location: str
) -> dict[str, Any]:
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
