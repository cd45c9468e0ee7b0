"""``fnckpt verify PATH``: read every chunk of a checkpoint once (or of every committed step
of a run directory) through the one reader, checking crc32c checksums, bool bytes, per-process
values and, on the same bytes, content hashes (format 3: XXH3-128 of every stored chunk, packed
leaf and pieces run; format 2: SHA-256 where an incremental save recorded them); every problem
is reported, naming the leaf and its storage path. A checkpoint without content hashes is
checked by its checksums only, and says so."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import sys
import time
from typing import Any, Callable, Iterator, cast

import numpy as np

from .._errors import CheckpointError
from .._format import hashes as _hashes
from .._format import manifest as _manifest
from .._format import perprocess as _perprocess
from .._format import records as _records
from .._format import refs as _refs
from .._format import runs as _runs
from .._io import commit as _commit
from .._io import paths as _paths
from .._layout import blocks as _blocks
from .._layout import chunks as _chunks
from .._manager import steps as _steps
from .._sources import read as _read
from .._sources import source as _source
from .perprocess_values import read_values, values_under
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
    line = (
      f"verify {self.label} [{bar:<30}] {frac * 100:5.1f}% {self.done_chunks}/"
      f"{self.chunks} chunks {human(self.done_bytes)}/{human(self.total)}"
    )
    sys.stderr.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
    sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class _Unit:
  """What verify reads: a stored array, or a pack (labelled with the leaves in it), block by
  block over ``grid``: a stored array's write chunks where their content hashes are checked
  (``hashed``: its leaf), else its inner chunks (a damage report then names the inner chunk).
  ``pack``: the pack's index."""

  label: str
  here: str  # its storage path
  open: Callable[[_read.Opener], _read.StoredLeaf]  # opened by an Opener checking zarr.json
  shape: tuple[int, ...]
  grid: tuple[int, ...]
  itemsize: int
  hashed: _records.Leaf | None = None
  pack: int | None = None

  @property
  def nbytes(self) -> int:
    return _chunks.nbytes(self.shape, self.itemsize)

  @property
  def chunks(self) -> int:
    return 0 if 0 in self.shape else math.prod(-(-n // c) for n, c in zip(self.shape, self.grid))


def _units(src: _source.Source, hashes: _Hashes) -> list[_Unit]:
  """Every stored array (by write chunks where ``hashes`` checks them), then every pack."""
  manifest = src.manifest
  units = []
  for rec in manifest.leaves:
    if rec.stored is not None:
      hashed = rec if rec.index in hashes.chunked else None
      assert rec.shape is not None
      units.append(
        _Unit(
          label=rec.where,
          here=_read.data_location(src, rec.stored.base, rec.stored.dir),
          open=lambda o, rec=rec: o.leaf(rec),  # type: ignore[misc]  # (mypy: a lambda with defaults)
          shape=rec.shape,
          grid=rec.stored.chunks if hashed else rec.stored.inner,
          itemsize=_records.itemsize(rec.dtype),
          hashed=hashed,
        )
      )
  for k, pack in enumerate(manifest.packs):
    names = [r.where for r in manifest.leaves if r.packed is not None and r.packed.pack == k]
    if (
      pack.process is not None
      and manifest.layout is not None
      and int(manifest.layout.region[pack.process])
    ):
      names.append(f"pieces of process {pack.process}")
    label = f"pack {k} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
    units.append(
      _Unit(
        label=label,
        here=_read.data_location(src, pack.base, pack.dir),
        open=lambda o, k=k: o.pack(k),  # type: ignore[misc]  # (mypy: a lambda with defaults)
        shape=(pack.nbytes,),
        grid=(pack.inner,),
        itemsize=1,
        pack=k,
      )
    )
  return units


def _verify_one(path: str, options: dict[str, Any] | None, quiet: bool) -> tuple[list[str], str]:
  """(every problem found in one checkpoint (each names the leaf), after reading all of it;
  what was checked, for the OK line). Values were validated with the manifest (an invalid
  one makes the whole checkpoint unreadable, reported as such). When something could not be
  read because the checkpoint was replaced or deleted meanwhile (its commit marker changed),
  that is the one problem."""
  try:
    src = _source.open_source(path, options)
  except CheckpointError as e:
    return [f"{_paths.display(path)}: {e}"], ""
  # (bools: the arrays' zarr.json was checked before; content hashes are checked by
  # _Hashes alone, on the bytes _verify_arrays reads, and it names every mismatch)
  opener = _read.Opener(src, check_hashes=False)
  hashes = _Hashes(src)
  problems = (
    _verify_arrays(src, quiet, hashes)
    + _verify_bools(src, opener)
    + _verify_per_process(src)
    + hashes.problems()
  )
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


def _verify_arrays(src: _source.Source, quiet: bool, hashes: _Hashes) -> list[str]:
  """Every stored array and pack read once, all in one window, block by block in order (each
  inner chunk checked by its crc32c inside the read), each landed block handed to ``hashes``;
  a unit that cannot be opened is a problem, its blocks not enumerated (nor hash-checked)."""
  units = _units(src, hashes)
  progress = _Progress(
    sum(u.nbytes for u in units), sum(u.chunks for u in units), src.location, quiet
  )
  unopened: dict[int, str] = {}
  damaged: dict[int, list] = {}  # unit -> [damaged chunks, the first, its error]

  def regions() -> Iterator[_read.Region]:
    opener = _read.Opener(src, check_metadata=True, check_hashes=False)
    for k, u in enumerate(units):
      try:
        leaf = u.open(opener)
      except Exception as e:
        unopened[k] = _open_text(e)
        progress.advance(u.nbytes, u.chunks)
        continue
      for pos, index in enumerate(_blocks.grid(u.shape, u.grid)):
        yield _read.Region(
          leaf, index, _chunks.nbytes([b - a for a, b in index], u.itemsize), (k, pos)
        )

  for got in _read.read_regions(regions(), _read.Window(_source.READ_WINDOW_BYTES), errors="yield"):
    k, pos = got.region.tag
    progress.advance(got.region.cost)
    if got.error is not None:
      damaged.setdefault(k, [0, got.region.index, got.error])[0] += 1
    hashes.landed(units[k], pos, got)
  progress.draw(final=True)
  problems = []
  for k, u in enumerate(units):
    if k in unopened:
      problems.append(f"{u.label} ({u.here}): cannot open its array: {unopened[k]}")
    elif k in damaged:
      bad, index, e = damaged[k]
      more = f" (and {bad - 1} more damaged chunk(s))" if bad > 1 else ""
      problems.append(f"{u.label} ({u.here}): chunk {region(index)}: {cause(e)}{more}")
  return problems


def _verify_bools(src: _source.Source, opener: _read.Opener) -> list[str]:
  """Inline, packed and pieced bool arrays hold only bytes 0 and 1 (their checksums, if any,
  cannot tell; TensorStore checks stored bool arrays itself): read in blocks of an eighth of
  the window, the first problem of each leaf reported."""
  found: dict[int, str] = {}
  wanted = [
    rec
    for rec in src.manifest.leaves
    if rec.is_array and rec.dtype == "bool" and rec.stored is None and rec.kind == "array"
  ]
  limit = _source.READ_WINDOW_BYTES

  def regions() -> Iterator[_read.Region]:
    for rec in wanted:
      try:
        leaf = opener.leaf(rec)
      except CheckpointError as e:
        found[rec.index] = str(e)
        continue
      assert rec.shape is not None
      for index in _blocks.blocks(rec.shape, 1, limit // 8, leaf.align):
        yield _read.Region(leaf, index, math.prod(b - a for a, b in index), rec)

  for got in _read.read_regions(regions(), _read.Window(limit), errors="yield"):
    rec, e = got.region.tag, got.error
    if e is not None and rec.index not in found:
      found[rec.index] = str(e) if isinstance(e, CheckpointError) else f"{rec.where}: {cause(e)}"
  return [found[rec.index] for rec in wanted if rec.index in found]


@dataclasses.dataclass(frozen=True)
class _Alg:
  """A checkpoint's content hash: format 3's XXH3-128, or format 2's SHA-256."""

  name: str
  nbytes: int
  digest: Callable[[Any], bytes]
  array_digest: Callable[[np.ndarray], bytes]
  hasher: Callable[[], Any]  # a streaming one: update(bytes), digest()


def _alg(m: _records.Manifest) -> _Alg:
  """``m``'s content hash (format 2 records none in the manifest: SHA-256)."""
  if m.hash is not None:
    return _Alg(
      m.hash, _records.HASH_ALGS[m.hash], _hashes.digest, _hashes.array_digest, _hashes.hasher
    )
  return _Alg("SHA-256", _records.HASH_BYTES, _refs.digest, _refs.array_digest, hashlib.sha256)


@dataclasses.dataclass
class _Item:
  """Bytes ``[lo, hi)`` of a pack that hash to ``want``: packed leaf ``rec``, or a writer's run
  of its pieces (``order``: the writer's number; the first mismatch of a leaf is reported).
  ``text``: the mismatch, given the pack's location. ``hasher``: streaming, once its first
  block lands; None when a block of it failed to read (the crc32c pass reports that)."""

  lo: int
  hi: int
  want: bytes
  rec: _records.Leaf
  order: int
  text: Callable[[str], str]
  hasher: Any = None
  spoiled: bool = False


class _Stream:
  """The items lying in one pack, hashed as its blocks land in order."""

  def __init__(self, items: list[_Item], alg: _Alg):
    self.waiting = sorted(items, key=lambda it: (it.lo, it.hi))
    self.next, self.alg = 0, alg
    self.open: list[_Item] = []

  def feed(self, lo: int, hi: int, data: np.ndarray | None) -> Iterator[_Item]:
    """Feed block ``[lo, hi)`` of the pack (``data`` None: it failed to read) to the items it
    overlaps; yield each item, hashed whole, whose last byte it holds (not one spoiled)."""
    while self.next < len(self.waiting) and self.waiting[self.next].lo <= hi:
      self.waiting[self.next].hasher = self.alg.hasher()
      self.open.append(self.waiting[self.next])
      self.next += 1
    still = []
    for it in self.open:
      a, b = max(it.lo, lo), min(it.hi, hi)
      if a < b and data is None:
        it.spoiled = True
      elif a < b and not it.spoiled:
        assert data is not None
        it.hasher.update(memoryview(data[a - lo : b - lo]))  # type: ignore[arg-type]  # (numpy)
      if it.hi > hi:
        still.append(it)
      elif not it.spoiled:
        yield it
    self.open = still


class _Hashes:
  """The recorded content hashes (docs/format.md "References and hashes") checked against
  the bytes :func:`_verify_arrays` reads once: each write chunk of a stored array as it lands,
  each packed leaf and writer's run of pieces (referenced data too) streamed as its pack's
  blocks land in order. A manifest's hashes of hashes that disagree need no read."""

  def __init__(self, src: _source.Source):
    self.src, self.alg = src, _alg(src.manifest)
    self.found: dict[int, tuple[int, str]] = {}  # leaf index -> (order, its first mismatch)
    self.chunked: set[int] = set()  # stored leaves checked chunk by chunk
    items: dict[int, list[_Item]] = {}
    for rec in src.manifest.leaves:
      if rec.hash is not None:
        for k, item in self._plan(rec):
          items.setdefault(k, []).append(item)
    self.streams = {k: _Stream(v, self.alg) for k, v in items.items()}

  def _plan(self, rec: _records.Leaf) -> list[tuple[int, _Item]]:
    """(pack, item) of ``rec`` to stream; a stored leaf checked by chunks joins ``chunked``."""
    alg = self.alg
    assert rec.hash is not None  # (only hashed leaves are planned)
    if rec.packed is not None:
      lo, n = rec.packed.offset, rec.nbytes
      text = lambda where: (  # noqa: E731
        f"its bytes [{lo}, {lo + n}) of the pack at {where} do not hash to the recorded {alg.name}"
      )
      return [(rec.packed.pack, _Item(lo, lo + rec.packed.nbytes, rec.hash, rec, 0, text))]
    if rec.pieces is not None:
      hashes, n = rec.pieces.hashes, alg.nbytes
      if hashes is None:
        return []
      if alg.digest(hashes) != rec.hash:
        self.mismatch(rec, 0, "its runs' hashes do not hash to its recorded hash")
        return []
      return [
        (
          r.pack,
          _Item(
            r.lo,
            r.hi,
            hashes[w * n : (w + 1) * n],
            rec,
            w,
            lambda where, r=r: (  # type: ignore[misc]
              f"the chunks process {r.process} wrote (bytes [{r.lo}, {r.hi}) of the pack at "
              f"{where}) differ from what was saved"
            ),
          ),
        )
        for w, r in enumerate(_runs.writer_runs(self.src.manifest, rec))
      ]
    if rec.stored is not None and rec.chunk_hashes is not None:
      if alg.digest(rec.chunk_hashes) != rec.hash:
        self.mismatch(rec, 0, "its chunk hashes do not hash to its recorded hash")
      else:
        self.chunked.add(rec.index)
    return []

  def mismatch(self, rec: _records.Leaf, order: int, bad: str) -> None:
    """``rec``'s bytes differ from its hash: ``bad`` says where (the first ``order`` kept)."""
    if rec.index not in self.found or order < self.found[rec.index][0]:
      self.found[rec.index] = (order, bad)

  def landed(self, u: _Unit, pos: int, got: _read.Landed) -> None:
    """Block ``pos`` of unit ``u`` landed (``got.data`` None: it failed to read)."""
    if u.hashed is not None:
      rec, n = u.hashed, self.alg.nbytes
      assert rec.chunk_hashes is not None
      want = rec.chunk_hashes[pos * n : (pos + 1) * n]
      if got.data is not None and want != _refs.NO_HASH and self.alg.array_digest(got.data) != want:
        self.mismatch(
          rec, pos, f"chunk {region(got.region.index)} ({u.here}) differs from what was saved"
        )
    elif u.pack in self.streams:
      ((lo, hi),) = got.region.index
      for it in self.streams[u.pack].feed(lo, hi, got.data):
        if it.hasher.digest() != it.want:
          self.mismatch(it.rec, it.order, it.text(u.here))

  def problems(self) -> list[str]:
    """A line for each leaf whose bytes differ from its hash, in the manifest's order."""
    problems = []
    for rec in self.src.manifest.leaves:
      if rec.index in self.found:
        base = _read.base_of(self.src.manifest, rec)
        ref = (
          f" (referenced: {_refs.describe(self.src.location, self.src.manifest, base)})"
          if base is not None
          else ""
        )
        problems.append(f"{rec.where}{ref}: content hash mismatch: {self.found[rec.index][1]}")
    return problems


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
    here = f"{src.location}/{_perprocess.values_key(cast(str, manifest.data), p)}"
    try:
      leaves = read_values(src, p)
    except CheckpointError as e:
      problems.append(f"per-process values of process {p} ({names}) ({here}): {e}")
      continue
    except Exception as e:  # TensorStore I/O errors are ValueErrors
      problems.append(f"per-process values of process {p} ({names}) ({here}): {cause(e)}")
      continue
    for rec in wanted:
      if not values_under(leaves, rec.path):
        problems.append(f"{rec.where} ({here}): missing data [process {p} saved no value]")
  return problems


def run(args: argparse.Namespace) -> int:
  options = args.storage_options
  keys = _paths.list_keys(_paths.Location.of(args.path, options))
  if _manifest.COMMIT in keys or _manifest.MANIFEST in keys or not keys:
    targets = [args.path]
  else:  # a run directory: verify every committed step
    committed, uncommitted = _steps.scan(_paths.Location.of(args.path, options))
    if not committed and not uncommitted:
      targets = [args.path]
    else:
      targets = [_paths.join(args.path, str(s)) for s in committed]
      if uncommitted:
        print(
          f"note: uncommitted steps {uncommitted} (interrupted saves) are not checkpoints; "
          "not verified."
        )
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
