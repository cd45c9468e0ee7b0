"""``fnckpt verify PATH``: read every chunk of a checkpoint (or of every committed step of a
run directory) through the one reader, checking crc32c checksums, bool bytes, per-process
values and content hashes (format 3: XXH3-128 of every stored chunk, packed leaf and pieces
run; format 2: SHA-256 where an incremental save recorded them); every problem is reported,
naming the leaf and its storage path. A checkpoint without content hashes is checked by its
checksums only, and says so."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

from .._layout import blocks as _blocks, chunks as _layout
from .._format import hashes as _hashes, manifest as _manifest, perprocess as _perprocess, \
    records as _records, refs as _refs, runs as _runs
from .._io import commit as _commit, paths as _paths
from .._sources import read as _read, source as _source
from .._manager import steps as _steps
from .._errors import CheckpointError
from .perprocess import read_values, values_under
from .text import cause, human, region

__all__ = ["run"]


class _Progress:
  """A one-line text progress bar on stderr (redrawn in place on a terminal, else a line
  every 10%)."""

  def __init__(self, total_bytes: int, total_chunks: int, label: str, quiet: bool):
    self.total, self.chunks, self.label, self.quiet = total_bytes, total_chunks, label, quiet
    self.done_bytes = self.done_chunks = 0
    self.tty = sys.stderr.isatty()
    self.last_draw = 0.0
    self.last_decile = -1

  def advance(self, n: int, chunks: int = 1) -> None:
    self.done_bytes += n
    self.done_chunks += chunks
    self.draw()

  def draw(self, final: bool = False) -> None:
    if self.quiet:
      return
    frac = self.done_bytes / self.total if self.total else 1.0
    if self.tty:
      now = time.monotonic()
      if not final and now - self.last_draw < 0.1:
        return
      self.last_draw = now
    else:
      decile = int(frac * 10)
      if decile == self.last_decile:
        return
      self.last_decile = decile
    bar = "#" * int(frac * 30)
    line = (f"verify {self.label} [{bar:<30}] {frac * 100:5.1f}% {self.done_chunks}/"
            f"{self.chunks} chunks {human(self.done_bytes)}/{human(self.total)}")
    sys.stderr.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
    sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class _Unit:
  """What verify reads: a stored array, or a pack (labelled with the leaves in it)."""
  label: str
  here: str                                           # its storage path
  open: Callable[[_read.Opener], _read.StoredLeaf]    # opened by an Opener checking zarr.json
  shape: tuple[int, ...]
  inner: tuple[int, ...]
  itemsize: int

  @property
  def nbytes(self) -> int:
    return _layout.nbytes(self.shape, self.itemsize)

  @property
  def chunks(self) -> int:
    return 0 if 0 in self.shape else math.prod(-(-n // c) for n, c in zip(self.shape,
                                                                         self.inner))


def _units(src: _source.Source) -> list[_Unit]:
  manifest = src.manifest
  units = []
  for rec in manifest.leaves:
    if rec.stored is not None:
      units.append(_Unit(rec.where, _read.data_location(src, rec.stored.base, rec.stored.dir),
                         lambda o, rec=rec: o.leaf(rec), rec.shape, rec.stored.inner,
                         _records.itemsize(rec.dtype)))
  for k, pack in enumerate(manifest.packs):
    names = [r.where for r in manifest.leaves if r.packed is not None and r.packed.pack == k]
    if pack.process is not None and manifest.layout is not None and int(
        manifest.layout.region[pack.process]):
      names.append(f"pieces of process {pack.process}")
    label = f"pack {k} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
    units.append(_Unit(label, _read.data_location(src, pack.base, pack.dir),
                       lambda o, k=k: o.pack(k), (pack.nbytes,), (pack.inner,), 1))
  return units


def _verify_one(path: str, options: dict[str, Any] | None, quiet: bool
                ) -> tuple[list[str], str]:
  """(every problem found in one checkpoint (each names the leaf), after reading all of it;
  what was checked, for the OK line). Values were validated with the manifest (an invalid
  one makes the whole checkpoint unreadable, reported as such). When something could not be
  read because the checkpoint was replaced or deleted meanwhile (its commit marker changed),
  that is the one problem."""
  try:
    src = _source.open_source(path, options)
  except CheckpointError as e:
    return [f"{_paths.display(path)}: {e}"], ""
  # (bools and hashes: the arrays' zarr.json was checked before; hashes are checked by
  # _verify_hashes alone, which names every mismatch)
  opener = _read.Opener(src, check_hashes=False)
  problems = (_verify_arrays(src, quiet) + _verify_bools(src, opener)
              + _verify_per_process(src) + _verify_hashes(src, opener))
  if problems and not _commit.unchanged(src.kv, src.commit):
    return [f"{src.location}: {_commit.changed_error(src.location)}"], ""
  return problems, _checked(src.manifest)


def _checked(m: _records.Manifest) -> str:
  """What verify could check of ``m``'s data beyond reading it: content hashes, or only the
  storage's crc32c checksums."""
  stored = [l for l in m.leaves if l.is_array and l.inline is None]
  if not stored:
    return ""
  if m.hash is not None:
    return f" (crc32c and {m.hash} content hashes)"
  hashed = sum(l.hash is not None for l in stored)
  if not hashed:
    return " (crc32c only: this checkpoint records no content hashes)"
  return f" (crc32c; SHA-256 content hashes of {hashed} of {len(stored)} stored leaves)"


def _open_text(e: BaseException) -> str:
  return str(e) if isinstance(e, CheckpointError) else cause(e)


def _verify_arrays(src: _source.Source, quiet: bool) -> list[str]:
  """Every inner chunk of every stored array and pack read (each checked by its crc32c), all
  in one window; a unit that cannot be opened is a problem, its chunks not enumerated."""
  units = _units(src)
  progress = _Progress(sum(u.nbytes for u in units), sum(u.chunks for u in units),
                       src.location, quiet)
  unopened: dict[int, str] = {}
  damaged: dict[int, list] = {}                # unit -> [damaged chunks, the first, its error]

  def regions() -> Iterator[_read.Region]:
    opener = _read.Opener(src, check_metadata=True, check_hashes=False)
    for k, u in enumerate(units):
      try:
        leaf = u.open(opener)
      except Exception as e:
        unopened[k] = _open_text(e)
        progress.advance(u.nbytes, u.chunks)
        continue
      for index in _blocks.grid(u.shape, u.inner):
        yield _read.Region(leaf, index, _layout.nbytes([b - a for a, b in index], u.itemsize), k)

  for got in _read.read_regions(regions(), _read.Window(_source.READ_WINDOW_BYTES),
                                errors="yield"):
    progress.advance(got.region.cost)
    if got.error is not None:
      damaged.setdefault(got.region.tag, [0, got.region.index, got.error])[0] += 1
  progress.draw(final=True)
  problems = []
  for k, u in enumerate(units):
    if k in unopened:
      problems.append(f"{u.label} ({u.here}): cannot open its array: {unopened[k]}")
    elif k in damaged:
      bad, index, e = damaged[k]
      more = f" (and {bad - 1} more damaged chunk(s))" if bad > 1 else ""
      problems.append(f"{u.label} ({u.here}): chunk {region(index)}: "
                      f"{cause(e)}{more}")
  return problems


def _verify_bools(src: _source.Source, opener: _read.Opener) -> list[str]:
  """Inline, packed and pieced bool arrays hold only bytes 0 and 1 (their checksums, if any,
  cannot tell; TensorStore checks stored bool arrays itself): read in blocks of an eighth of
  the window, the first problem of each leaf reported."""
  found: dict[int, str] = {}
  wanted = [rec for rec in src.manifest.leaves if rec.is_array and rec.dtype == "bool"
            and rec.stored is None and rec.kind == "array"]
  limit = _source.READ_WINDOW_BYTES

  def regions() -> Iterator[_read.Region]:
    for rec in wanted:
      try:
        leaf = opener.leaf(rec)
      except CheckpointError as e:
        found[rec.index] = str(e)
        continue
      for index in _blocks.blocks(rec.shape, 1, limit // 8, leaf.align):
        yield _read.Region(leaf, index, math.prod(b - a for a, b in index), rec)

  for got in _read.read_regions(regions(), _read.Window(limit), errors="yield"):
    rec, e = got.region.tag, got.error
    if e is not None and rec.index not in found:
      found[rec.index] = str(e) if isinstance(e, CheckpointError) else \
          f"{rec.where}: {cause(e)}"
  return [found[rec.index] for rec in wanted if rec.index in found]


def _verify_hashes(src: _source.Source, opener: _read.Opener) -> list[str]:
  """Every recorded content hash (README "Version 3", "References and hashes") against the
  bytes read: each chunk of a stored array, each packed leaf, each writer's run of pieces
  (referenced data too)."""
  problems = []
  for rec in src.manifest.leaves:
    if rec.hash is None:
      continue
    try:
      bad = _hash_mismatch(src, opener, rec)
    except Exception as e:  # a read or reference error was reported by the checksum pass
      bad = None if isinstance(e, (ValueError, CheckpointError)) else f"{type(e).__name__}: {e}"
    if bad:
      base = _read.base_of(src.manifest, rec)
      ref = f" (referenced: {_refs.describe(src.location, src.manifest, base)})" \
          if base is not None else ""
      problems.append(f"{rec.where}{ref}: content hash mismatch: {bad}")
  return problems


@dataclasses.dataclass(frozen=True)
class _Alg:
  """A checkpoint's content hash: format 3's XXH3-128, or format 2's SHA-256."""
  name: str
  nbytes: int
  digest: Callable[[Any], bytes]
  array_digest: Callable[[np.ndarray], bytes]


def _alg(m: _records.Manifest) -> _Alg:
  if m.hash is not None:
    return _Alg(m.hash, _records.HASH_ALGS[m.hash], _hashes.digest, _hashes.array_digest)
  return _Alg("SHA-256", _records.HASH_BYTES, _refs.digest, _refs.array_digest)


def _hash_mismatch(src: _source.Source, opener: _read.Opener, rec: _records.Leaf) -> str | None:
  """How ``rec``'s bytes differ from its recorded hash (None: they do not), naming the chunk
  or writer and the storage path; a packed leaf is read whole, a stored one a write chunk at
  a time and pieces a writer's run at a time, several in flight."""
  alg = _alg(src.manifest)
  window = _read.Window(_source.READ_WINDOW_BYTES)
  if rec.packed is not None:
    leaf = opener.leaf(rec)
    whole = tuple((0, n) for n in rec.shape)
    (got,) = _read.read_regions([_read.Region(leaf, whole, rec.nbytes)], window)
    if alg.array_digest(got.data) == rec.hash:
      return None
    return (f"its bytes [{rec.packed.offset}, {rec.packed.offset + rec.nbytes}) of the pack at "
            f"{leaf.where} do not hash to the recorded {alg.name}")
  if rec.pieces is not None:
    return _runs_mismatch(src, opener, rec, alg, window)
  if rec.chunk_hashes is None:
    return None
  if alg.digest(rec.chunk_hashes) != rec.hash:
    return "its chunk hashes do not hash to its recorded hash"
  leaf = opener.leaf(rec)
  n, size = alg.nbytes, _records.itemsize(rec.dtype)
  regions = (_read.Region(leaf, index, _layout.nbytes([b - a for a, b in index], size), pos)
             for pos, index in enumerate(_blocks.grid(rec.shape, rec.stored.chunks)))
  for got in _read.read_regions(regions, window):
    pos = got.region.tag
    want = rec.chunk_hashes[pos * n:(pos + 1) * n]
    if want != _refs.NO_HASH and alg.array_digest(got.data) != want:
      return (f"chunk {region(got.region.index)} ({leaf.where}) differs from what was saved")
  return None


def _runs_mismatch(src: _source.Source, opener: _read.Opener, rec: _records.Leaf, alg: _Alg,
                   window: _read.Window) -> str | None:
  """The first writer's run of pieced ``rec`` (format 3) whose bytes differ from its hash."""
  hashes = rec.pieces.hashes
  if hashes is None:
    return None
  if alg.digest(hashes) != rec.hash:
    return "its runs' hashes do not hash to its recorded hash"
  runs = _runs.writer_runs(src.manifest, rec)
  regions = (_read.Region(opener.pack(r.pack), ((r.lo, r.hi),), r.hi - r.lo, w)
             for w, r in enumerate(runs))
  n = alg.nbytes
  for got in _read.read_regions(regions, window):
    w = got.region.tag
    if alg.digest(got.data) != hashes[w * n:(w + 1) * n]:
      r = runs[w]
      return (f"the chunks process {r.process} wrote (bytes [{r.lo}, {r.hi}) of the pack at "
              f"{got.region.leaf.where}) differ from what was saved")
  return None


def _verify_per_process(src: _source.Source) -> list[str]:
  """Each saving process's ``pp/<process>`` file: there, valid, and holding a value for every
  ``fnckpt.PerProcess`` leaf."""
  manifest = src.manifest
  wanted = [r for r in manifest.leaves if r.kind == "perprocess"]
  if not wanted:
    return []
  names = ", ".join(r.where for r in wanted[:3]) + (", ..." if len(wanted) > 3 else "")
  problems = []
  for p in range(manifest.process_count):
    here = f"{src.location}/{_perprocess.values_key(manifest.data, p)}"
    try:
      leaves = read_values(src, p)
    except CheckpointError as e:
      problems.append(f"per-process values of process {p} ({names}) ({here}): {e}")
      continue
    except Exception as e:  # TensorStore I/O errors are ValueErrors
      problems.append(f"per-process values of process {p} ({names}) ({here}): "
                      f"{cause(e)}")
      continue
    for rec in wanted:
      if not values_under(leaves, rec.path):
        problems.append(f"{rec.where} ({here}): missing data [process {p} saved no value]")
  return problems


def run(args: argparse.Namespace) -> int:
  options = args.storage_options
  keys = _paths.list_keys(args.path, options)
  if _manifest.COMMIT in keys or _manifest.MANIFEST in keys or not keys:
    targets = [args.path]
  else:  # a run directory: verify every committed step
    committed, uncommitted = _steps.scan(args.path, options)
    if not committed and not uncommitted:
      targets = [args.path]
    else:
      targets = [_paths.join(args.path, str(s)) for s in committed]
      if uncommitted:
        print(f"note: uncommitted steps {uncommitted} (interrupted saves) are not checkpoints; "
              "not verified.")
  failed = 0
  for path in targets:
    problems, checked = _verify_one(path, options, args.quiet)
    where = _paths.display(path)
    if problems:
      failed += 1
      for p in problems:
        print(f"DAMAGED {p}")
      print(f"FAILED {where}: {len(problems)} problem(s).")
    else:
      print(f"OK {where}{checked}")
  if len(targets) > 1:
    print(f"{len(targets) - failed} of {len(targets)} checkpoints OK.")
  return 1 if failed else 0
