"""The ``fnckpt`` command: look at (and export) checkpoints without devices or user code.

    fnckpt ls DIR            steps under a CheckpointManager directory (or one checkpoint)
    fnckpt inspect PATH      the saved tree: key path, kind, dtype, shape, sharding, bytes
    fnckpt verify PATH       read every chunk, check every checksum (PATH may be a run DIR)
    fnckpt diff A B          key paths added / removed / changed; --values compares the data
    fnckpt export CKPT OUT   the arrays as safetensors (OUT.safetensors, or a directory of shards)

Exit status: 0 all is well; 1 damage found (verify), differences found (diff) or nothing to
list (ls); 2 a usage error or a location that cannot be read.

Only the manifest, the commit marker, the zarr3 chunks and the ``pp/<process>`` files of
``fnckpt.PerProcess`` values are read (through TensorStore), so any location fnckpt writes
works: local paths, ``memory://`` (same process only), ``gs://``, ``s3://``. No JAX backend
is started. ``export`` writes local files only (``fnckpt._export.export``).
``--storage-option KEY=VALUE`` (repeatable, before or after the command) sets the
``storage_options`` of fnckpt.save/restore for every location the command reads; a checkpoint
is opened and read as restore does (``fnckpt._sources.source.open_source``, its read window
and context).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import dataclasses
import time
from typing import Any, Iterator, Sequence

import numpy as np
import tensorstore as ts

from .._layout import chunks as _layout
from .._format import (leaves as _leaves, manifest as _manifest, perprocess as _perprocess,
                       records as _records, refs as _refs, tree as _tree)
from .._io import commit as _commit, paths as _paths, arrays as _store
from .._sources import source as _source
from .._restore import restore as _restore
from .._export.export import export_safetensors
from .._manager import fork as _fork, steps as _steps
from .._errors import CheckpointError

__all__ = ["main"]

# --- small formatting helpers ----------------------------------------------------------------

def _human(n: int | None) -> str:
  if n is None:
    return "-"
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or unit == "TiB":
      return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


def _when(t: float | None) -> str:
  return "-" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _table(rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _shape(shape: Sequence[int]) -> str:
  return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _sharding(rec: _records.Leaf) -> str:
  s = rec.sharding
  if s is None:
    return "host" if rec.is_array else "-"
  if s.type != "named":
    return "single device" if s.type == "single" else s.type
  spec = ", ".join("None" if e is None else repr(e) if isinstance(e, str)
                   else "(" + ", ".join(repr(x) for x in e) + ")" for e in s.spec)
  mesh = ",".join(f"{a}={n}" for a, n in zip(s.axes, s.sizes))
  return f"P({spec}) mesh({mesh})"


def _compact(value: Any, limit: int = 60) -> str:
  text = value if isinstance(value, str) and limit < 0 else repr(value)
  limit = abs(limit)
  return text if len(text) <= limit else text[:limit - 3] + "..."


# --- reading ---------------------------------------------------------------------------------
# Every storage access goes through ``args.storage_options`` (the dict fnckpt.save/restore
# take); a checkpoint is opened the way restore opens it (``_source.open_source``), and its
# arrays are read in restore's window with the Source's kvstore spec and context.

def _storage_options(pairs: Sequence[str] | None) -> dict[str, Any] | None:
  """``--storage-option KEY=VALUE`` pairs as a ``storage_options`` dict (a VALUE that parses
  as JSON is taken as JSON, else as a string; a later KEY wins). None when none were given.

  >>> _storage_options(["endpoint=http://127.0.0.1:8333", "max_retries=2"])
  {'endpoint': 'http://127.0.0.1:8333', 'max_retries': 2}
  """
  if not pairs:
    return None
  options: dict[str, Any] = {}
  for pair in pairs:
    key, eq, text = pair.partition("=")
    if not eq or not key.strip():
      raise CheckpointError(
          f"--storage-option {pair!r}: expected KEY=VALUE, found "
          f"{'no KEY before' if eq else 'no'} '='. Write e.g. --storage-option "
          "endpoint=http://127.0.0.1:8333 or --storage-option max_retries=2.")
    try:
      value = json.loads(text)
    except ValueError:
      value = text
    options[key.strip()] = value
  return options


def _check_storage_options(locations: Sequence[str], options: dict[str, Any] | None) -> None:
  """Each location the command was given, checked with ``options`` by the code that save and
  restore use (``_paths.kvstore_spec``; no I/O), before anything is read. An error that the
  options cause (an unknown key, a bad value, options for a local path) names
  ``--storage-option``; one of the location itself (a bad URL) does not."""
  for path in locations:
    try:
      _paths.kvstore_spec(path, options)
    except CheckpointError as e:
      if not options:
        raise
      try:
        _paths.kvstore_spec(path)
      except CheckpointError:
        raise e from None
      raise CheckpointError(f"--storage-option: {e}") from None


def _nbytes(rec: _records.Leaf) -> int:
  return rec.nbytes


def _read_per_process(src: _source.Source, process: int) -> tuple[_records.Leaf, ...]:
  """Process ``process``'s ``fnckpt.PerProcess`` values (validated records, nothing decoded:
  a key would need a JAX backend); CheckpointError naming the file if missing or invalid."""
  key = _perprocess.values_key(src.manifest.data, process)
  where = f"{src.location}/{key}"
  got = src.kv.read(key).result()
  if got.state != "value":
    raise CheckpointError(f"missing data [{where} does not exist]")
  return _perprocess.decode(got.value, where)


def _values_under(leaves: Sequence[_records.Leaf], path: _tree.Path) -> list[tuple]:
  """The saved leaves below key path ``path``, comparable (floats by repr: -0.0 differs from
  0.0, NaN equals NaN)."""
  n, key = len(path), _tree.match_key(path)
  return [(_tree.match_key(l.path[n:]), l.kind, l.dtype, l.shape, l.impl, l.inline, l.type,
           repr(l.value)) for l in leaves if _tree.match_key(l.path[:n]) == key]


def _regions(shape: Sequence[int], inner: Sequence[int]) -> Iterator[_layout.Index]:
  """The read units of a stored array, lazily: its inner chunks (each checked by its own
  crc32c). Lazy, because an (untrusted) manifest may claim billions of them.

  >>> list(_regions((3, 2), (2, 2)))
  [((0, 2), (0, 2)), ((2, 3), (0, 2))]
  """
  if any(n == 0 for n in shape):
    return
  if not shape:
    yield ()
    return
  for a in range(0, shape[0], inner[0]):
    for rest in _regions(shape[1:], inner[1:]):
      yield ((a, min(a + inner[0], shape[0])),) + rest


def _spec(src: _source.Source, rec: _records.Leaf | int) -> dict[str, Any]:
  """The zarr3 spec of a stored leaf, or of pack number ``rec`` (as restore builds it)."""
  if isinstance(rec, int):
    pack = src.manifest.packs[rec]
    return _store.pack_spec(_base_spec(src, pack.base), pack.dir, pack.nbytes, pack.chunk,
                            pack.inner)
  return _store.zarr_spec(_base_spec(src, rec.stored.base), rec.stored,
                          rec.dtype, rec.shape)


def _base_spec(src: _source.Source, base: int | None) -> dict[str, Any]:
  return _refs.base_spec(src.kv_spec, src.manifest, base, src.location)


def _where(src: _source.Source, base: int | None, d: str) -> str:
  """A stored directory's location (in the referenced checkpoint for a reference)."""
  if base is None:
    return f"{src.location}/{d}"
  return f"{_refs.display(src.location, src.manifest.bases[base].dir)}/{d}"


def _reused(src: _source.Source, rec: _records.Leaf) -> int | None:
  """The base index a leaf's bytes come from (None: written by this save, or inline)."""
  if rec.stored is not None:
    return rec.stored.base
  if rec.packed is not None:
    return src.manifest.packs[rec.packed.pack].base
  return None


def _lineage(src: _source.Source) -> str:
  fork = src.manifest.fork
  if fork is None:
    return ""
  return (f"fork of run {_refs.display(src.location, fork.run)!r} at step "
          f"{fork.step}")


def _open_stored(src: _source.Source, spec: dict[str, Any], *, check_metadata: bool
                 ) -> ts.TensorStore:
  """A zarr3 array in the Source's context; with ``check_metadata`` its zarr.json is read and
  compared with what the manifest says (a missing or altered zarr.json is an error)."""
  if not check_metadata:
    return _store.open_array(spec, src.ctx, mode="read").result()
  return ts.open({**spec, "fill_missing_data_reads": False}, read=True, open=True,
                 context=src.ctx).result()


def _read_regions(store: ts.TensorStore, regions: Iterator[_layout.Index], itemsize: int
                  ) -> Iterator[tuple[_layout.Index, Any]]:
  """Yield ``(region, np.ndarray or Exception)`` in order, at most restore's read window of
  bytes in flight (a region larger than the window is read alone)."""
  pending: list[tuple[_layout.Index, ts.Future, int]] = []
  held = 0
  for region in regions:
    n = _layout.nbytes([b - a for a, b in region], itemsize)
    while pending and held + n > _source.READ_WINDOW_BYTES:
      r, fut, m = pending.pop(0)
      held -= m
      yield r, _result(fut)
    pending.append((region, store[tuple(slice(a, b) for a, b in region)].read(), n))
    held += n
  for r, fut, _ in pending:
    yield r, _result(fut)


def _result(fut: ts.Future) -> Any:
  try:
    return fut.result()
  except Exception as e:  # TensorStore raises ValueError and others for damaged data
    return e


# TensorStore appends the spec of the array to some errors; the spec names the codecs
# (crc32c included) and paths, so no word in it says what went wrong.
def _cause(e: BaseException) -> str:
  """What a failed open or read means (:func:`_paths.read_failure`), with TensorStore's text."""
  text = _paths.error_text(e)
  what = {"checksum": "checksum mismatch (corrupt data)", "missing": "missing data",
          "corrupt": "corrupt data (cannot be decoded)",
          "metadata": "its zarr.json does not match the manifest"}.get(_paths.read_failure(e))
  return f"{what} [{text}]" if what else f"{type(e).__name__}: {text}"


def _region_str(region: _layout.Index) -> str:
  return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


# --- ls --------------------------------------------------------------------------------------

def _ls(args: argparse.Namespace) -> int:
  root, options = args.dir, args.storage_options
  keys = _paths.list_keys(root, options)
  if args.local is None and (_manifest.COMMIT in keys or _manifest.MANIFEST in keys):
    print(f"{_paths.display(root)} is a single checkpoint (not a run directory):")
    rows, lineage = _step_rows([(".", root)], keys, options)
    print(_table([_LS_HEADER] + rows))
    if lineage:
      print(f"this checkpoint is a {lineage}")
    return 0
  if args.local is not None and (not keys or _manifest.COMMIT in keys
                                 or _manifest.MANIFEST in keys):
    what = "holds nothing" if not keys else "is a single checkpoint"
    print(f"{_paths.display(root)!r} {what}, not a run directory: with --local, DIR must be "
          "the manager's durable directory (check the path).", file=sys.stderr)
    return 1
  local_options = None  # the durable tier's --storage-option settings are not the local tier's
  tiers = [("durable", root, keys, options)] + ([("local", args.local, _paths.list_keys(
      args.local, local_options), local_options)] if args.local is not None else [])
  rows, notes, restorable, lineage = [], [], set(), ""
  for tier, location, tier_keys, options in tiers:
    listing = _steps.StepIndex(location, options).list()
    restorable |= set(listing.steps)
    tier_rows, found = _step_rows([(str(s), _paths.join(location, str(s)))
                                   for s in listing.steps], tier_keys, options)
    lineage = lineage or _fork.lineage(location, options) or found
    rows += [([tier] if len(tiers) > 1 else []) + r
             for r in tier_rows + _other_rows(listing, tier_keys)]
    notes.append(f"{len(listing.steps)} committed, {len(listing.uncommitted)} uncommitted"
                 + (f", {len(listing.damaged)} marked damaged" if listing.damaged else "")
                 + (f", {len(listing.held)} referenced" if listing.held else "")
                 + (f" in {tier} {_paths.display(location)}" if len(tiers) > 1 else ""))
  if not rows:
    print(f"No checkpoints under {_paths.display(root)!r}.", file=sys.stderr)
    return 1
  rows.sort(key=lambda r: int(r[1] if len(tiers) > 1 else r[0]))
  print(_table([(["TIER"] if len(tiers) > 1 else []) + _LS_HEADER] + rows))
  if lineage:
    print(f"this run is a {lineage}")
  forks = [k for k in keys if k.startswith(_fork.FORKS + "/")]
  if forks:
    print(f"{len(forks)} fork(s) of this run refer to its data (records in {_fork.FORKS}/)")
  latest = f"; latest: {max(restorable)}" if restorable else ""
  print("; ".join(notes) + latest)
  return 0


_LS_HEADER = ["STEP", "STATUS", "DATA", "WRITTEN", "LEAVES", "FILES", "COMMITTED", "METRICS"]


def _files_of(keys: list[str], name: str) -> str:
  return str(sum(1 for k in keys if k.partition("/")[0] == name) if name != "." else len(keys))


def _other_rows(listing: _steps.Listing, keys: list[str]) -> list[list[str]]:
  """``ls`` rows of a tier's steps marked damaged, leftovers and referenced (deleted) steps."""
  return ([[str(s), "DAMAGED", "-", "-", "-", "-", "-", f"marked damaged ({_compact(d, 60)})"
            f"; skipped by the manager; manager.delete({s}) removes it"]
           for s, d in sorted(listing.damaged.items())]
          + [[str(s), "UNCOMMITTED", "-", "-", "-", _files_of(keys, str(s)), "-",
              "interrupted save: ignored; CheckpointManager.cleanup() removes it"]
             for s in listing.uncommitted]
          + [[str(s), "referenced", "-", "-", "-", _files_of(keys, str(s)), "-",
              "deleted step: data kept while later steps or forks refer to it"]
             for s in listing.held])


def _step_rows(steps: list[tuple[str, str]], keys: list[str], options: dict[str, Any] | None
               ) -> tuple[list[list[str]], str]:
  """One ``ls`` row per committed checkpoint (``DAMAGED`` where it cannot be opened), and
  the lineage of the first forked one ('' if none)."""
  rows, lineage = [], ""
  for name, path in steps:
    try:
      src = _source.open_source(path, options)
    except CheckpointError as e:
      rows.append([name, "DAMAGED", "-", "-", "-", _files_of(keys, name), "-", str(e)])
      continue
    manifest, commit = src.manifest, _manifest.decode_commit(src.commit, src.location)
    meta = manifest.metadata
    metrics = meta.get("metrics") if isinstance(meta, dict) else None
    metric_text = (", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in metrics.items())
                   if isinstance(metrics, dict) else "-")
    leaves = manifest.leaves
    lineage = lineage or _lineage(src)
    own = sum(_nbytes(r) for r in leaves if _reused(src, r) is None)
    rows.append([name, "committed", _human(sum(_nbytes(r) for r in leaves)), _human(own),
                 str(len(leaves)), _files_of(keys, name), _when(commit.get("committed")),
                 metric_text])
  return rows, lineage


# --- inspect ---------------------------------------------------------------------------------

def _value_text(rec: _records.Leaf) -> str:
  kind = rec.kind
  if kind in ("array", "key"):
    if rec.inline is not None:
      value = np.frombuffer(rec.inline, dtype=_leaves.dtype_of(rec.dtype))
      text = np.array2string(value.reshape(rec.shape), threshold=8, edgeitems=2,
                             separator=", ").replace("\n", "")
      return f"inline {_compact(text, -60)}"
    if rec.packed is not None:
      return f"pack {rec.packed.pack} bytes {rec.packed.offset}+{rec.packed.nbytes}"
    if rec.pieces is not None:
      return f"pieces {_shape(rec.pieces.chunks)} in the packs (mesh {rec.pieces.mesh})"
    store = rec.stored
    blosc = dict(store.blosc or ())
    return f"{store.dir}/ chunks {_shape(store.chunks)}" + (
        f" zstd {store.zstd}" if store.zstd else "") + (
        f" blosc {blosc['cname']} {blosc['shuffle']}" if blosc else "")
  if kind == "npgen":
    return f"numpy Generator ({rec.value['bit_generator']})"
  if kind == "empty":
    return {"none": "None", "dict": "{}", "list": "[]", "tuple": "()"}[rec.type]
  if kind == "perprocess":
    return "fnckpt.PerProcess: one value per saving process (in pp/<process>)"
  return _compact(_leaves.decode_value(rec))


def _inspect(args: argparse.Namespace) -> int:
  src = _source.open_source(args.path, args.storage_options)
  location, manifest = src.location, src.manifest
  commit = _manifest.decode_commit(src.commit, location)
  v = manifest.versions
  print(f"{location}: fnckpt format {manifest.version}, written by fnckpt "
        f"{v.get('fnckpt', '?')} (jax {v.get('jax', '?')}, tensorstore "
        f"{v.get('tensorstore', '?')}) on {manifest.process_count} process(es); "
        f"created {_when(manifest.created)}, committed {_when(commit.get('committed'))}")
  if manifest.metadata is not None:
    print(f"metadata: {json.dumps(manifest.metadata, default=repr)}")
  if manifest.fork is not None:
    print(f"lineage: {_lineage(src)}")
  rows = [["KEY PATH", "KIND", "DTYPE", "SHAPE", "SAVED SHARDING", "BYTES", "STORED / VALUE"]]
  total = 0
  for rec in manifest.leaves:
    kind = rec.kind
    if kind in ("array", "key"):
      n = _nbytes(rec)
      total += n
      dtype = rec.dtype + (f" ({rec.impl})" if kind == "key" else "")
      base = _reused(src, rec)
      where = _value_text(rec) + (
          f" <- reused from {_refs.display(location, manifest.bases[base].dir)}"
          if base is not None else "")
      rows.append([_tree.keystr(rec.path), kind, dtype, _shape(rec.shape),
                   _sharding(rec), _human(n), where])
    else:
      t = rec.type or rec.dtype or "-"
      rows.append([_tree.keystr(rec.path), kind, str(t), "-", "-", "-", _value_text(rec)])
  print(_table(rows))
  arrays = sum(1 for r in manifest.leaves if r.is_array)
  stored = sum(1 for r in manifest.leaves if r.stored is not None)
  packed = sum(1 for r in manifest.leaves if r.packed is not None)
  pieced = sum(1 for r in manifest.leaves if r.pieces is not None)
  print(f"{len(manifest.leaves)} leaves ({arrays} arrays: {stored} stored in their own "
        f"arrays, {packed} in {len(manifest.packs)} pack(s)"
        + (f", {pieced} as pieces in the packs" if pieced else "")
        + f"), {_human(total)} of array data")
  reused = [r for r in manifest.leaves if _reused(src, r) is not None]
  if reused or manifest.bases:
    print(f"written by this save: {_human(total - sum(map(_nbytes, reused)))} in "
          f"{arrays - len(reused)} array(s); reused (references to {len(manifest.bases)} "
          f"earlier checkpoint(s)): {_human(sum(map(_nbytes, reused)))} in {len(reused)} "
          "array(s)")
  return 0


# --- verify ----------------------------------------------------------------------------------

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
            f"{self.chunks} chunks {_human(self.done_bytes)}/{_human(self.total)}")
    sys.stderr.write(("\r" + line + ("\n" if final else "")) if self.tty else line + "\n")
    sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class _Unit:
  """What verify reads: a stored array, or a pack (labelled with the leaves in it)."""
  label: str
  here: str                        # its storage path
  spec: dict[str, Any] | str       # a str: why it cannot be opened (e.g. a bad reference)
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
      units.append(_Unit(rec.where, _where(src, rec.stored.base, rec.stored.dir),
                         _spec_or_error(src, rec),
                         rec.shape, rec.stored.inner, _leaves.dtype_of(rec.dtype).itemsize))
  for k, pack in enumerate(manifest.packs):
    names = [r.where for r in manifest.leaves if r.packed is not None and r.packed.pack == k]
    if pack.process is not None and manifest.layout is not None and int(
        manifest.layout.region[pack.process]):
      names.append(f"pieces of process {pack.process}")
    label = f"pack {k} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
    units.append(_Unit(label, _where(src, pack.base, pack.dir), _spec_or_error(src, k),
                       (pack.nbytes,), (pack.inner,), 1))
  return units


def _spec_or_error(src: _source.Source, rec: _records.Leaf | int) -> dict[str, Any] | str:
  try:
    return _spec(src, rec)
  except CheckpointError as e:  # a reference that leads nowhere valid: a problem of this leaf
    return str(e)


def _verify_one(path: str, options: dict[str, Any] | None, quiet: bool) -> list[str]:
  """Every problem found in one checkpoint (each names the leaf), after reading all of it.
  Values were validated with the manifest (an invalid one makes the whole checkpoint
  unreadable, reported as such). When something could not be read because the checkpoint
  was replaced or deleted meanwhile (its commit marker changed), that is the one problem."""
  try:
    src = _source.open_source(path, options)
  except CheckpointError as e:
    return [f"{_paths.display(path)}: {e}"]
  problems = (_verify_arrays(src, quiet) + _verify_bools(src) + _verify_per_process(src)
              + _verify_hashes(src))
  if problems and not _commit.unchanged(src.kv, src.commit):
    return [f"{src.location}: {_commit.changed_error(src.location)}"]
  return problems


def _verify_arrays(src: _source.Source, quiet: bool) -> list[str]:
  """Every inner chunk of every stored array and pack read (each checked by its crc32c)."""
  problems = []
  units = _units(src)
  progress = _Progress(sum(u.nbytes for u in units), sum(u.chunks for u in units),
                       src.location, quiet)
  for u in units:
    if isinstance(u.spec, str):
      problems.append(f"{u.label} ({u.here}): cannot open its array: {u.spec}")
      progress.advance(u.nbytes, u.chunks)
      continue
    try:
      store = _open_stored(src, u.spec, check_metadata=True)
    except Exception as e:
      problems.append(f"{u.label} ({u.here}): cannot open its array: {_cause(e)}")
      progress.advance(u.nbytes, u.chunks)
      continue
    bad, first = 0, None
    for region, value in _read_regions(store, _regions(u.shape, u.inner), u.itemsize):
      progress.advance(_layout.nbytes([b - a for a, b in region], u.itemsize))
      if isinstance(value, Exception):
        bad, first = bad + 1, first or (region, value)
    if first is not None:
      more = f" (and {bad - 1} more damaged chunk(s))" if bad > 1 else ""
      problems.append(f"{u.label} ({u.here}): chunk {_region_str(first[0])}: "
                      f"{_cause(first[1])}{more}")
  progress.draw(final=True)
  return problems


def _verify_bools(src: _source.Source) -> list[str]:
  """Inline and packed bool arrays hold only bytes 0 and 1 (their checksums, if any, cannot
  tell; TensorStore checks stored bool arrays itself)."""
  problems = []
  for rec in src.manifest.leaves:
    if rec.is_array and rec.dtype == "bool" and rec.stored is None and rec.kind == "array":
      try:
        _leaves.checked_bools(np.ascontiguousarray(
            _chunks_of_array(src, rec)(tuple((0, n) for n in rec.shape))), rec)
      except Exception as e:
        problems.append(str(e) if isinstance(e, CheckpointError) else f"{rec.where}: {_cause(e)}")
  return problems


def _verify_hashes(src: _source.Source) -> list[str]:
  """Every recorded content hash (README "References and hashes") against the bytes read:
  each chunk of a stored array, each packed leaf (referenced data too)."""
  problems = []
  for rec in src.manifest.leaves:
    if rec.hash is None or (rec.stored is None and rec.packed is None):
      continue
    try:
      bad = _hash_mismatch(src, rec)
    except Exception as e:  # a read or reference error was reported by the checksum pass
      bad = None if isinstance(e, (ValueError, CheckpointError)) else f"{type(e).__name__}: {e}"
    if bad:
      base = _reused(src, rec)
      ref = f" (referenced: {_refs.describe(src.location, src.manifest, base)})" \
          if base is not None else ""
      problems.append(f"{rec.where}{ref}: content hash mismatch: {bad}")
  return problems


def _hash_mismatch(src: _source.Source, rec: _records.Leaf) -> str | None:
  itemsize = _leaves.dtype_of(rec.dtype).itemsize
  if rec.packed is not None:
    store = _open_stored(src, _spec(src, rec.packed.pack), check_metadata=False)
    p = rec.packed
    got = _refs.digest(store[p.offset:p.offset + p.nbytes].read().result().tobytes())
    return None if got == rec.hash else "its bytes do not hash to the recorded SHA-256"
  if rec.chunk_hashes is None:
    return None
  store = _open_stored(src, _spec(src, rec), check_metadata=False)
  chunks, n = rec.stored.chunks, _records.HASH_BYTES
  if _refs.digest(rec.chunk_hashes) != rec.hash:
    return "its chunk hashes do not hash to its recorded hash"
  grid = _regions(rec.shape, chunks)
  for pos, region in enumerate(grid):
    data = store[tuple(slice(a, b) for a, b in region)].read().result()
    want = rec.chunk_hashes[pos * n:(pos + 1) * n]
    if want != _refs.NO_HASH and _refs.array_digest(np.asarray(data)) != want:
      return f"chunk {_region_str(region)} differs from what was saved"
  del itemsize
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
      leaves = _read_per_process(src, p)
    except CheckpointError as e:
      problems.append(f"per-process values of process {p} ({names}) ({here}): {e}")
      continue
    except Exception as e:  # TensorStore I/O errors are ValueErrors
      problems.append(f"per-process values of process {p} ({names}) ({here}): {_cause(e)}")
      continue
    for rec in wanted:
      if not _values_under(leaves, rec.path):
        problems.append(f"{rec.where} ({here}): missing data [process {p} saved no value]")
  return problems


def _verify(args: argparse.Namespace) -> int:
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
    problems = _verify_one(path, options, args.quiet)
    where = _paths.display(path)
    if problems:
      failed += 1
      for p in problems:
        print(f"DAMAGED {p}")
      print(f"FAILED {where}: {len(problems)} problem(s).")
    else:
      print(f"OK {where}")
  if len(targets) > 1:
    print(f"{len(targets) - failed} of {len(targets)} checkpoints OK.")
  return 1 if failed else 0


# --- diff ------------------------------------------------------------------------------------

def _desc(rec: _records.Leaf) -> str:
  if rec.kind in ("array", "key"):
    what = "key" if rec.kind == "key" else "array"
    return f"{what} {rec.dtype}{list(rec.shape)}"
  if rec.kind == "scalar":
    return rec.type
  if rec.kind == "perprocess":
    return "fnckpt.PerProcess"
  return rec.kind if rec.kind != "empty" else f"empty {rec.type}"


def _chunks_of_array(src: _source.Source, rec: _records.Leaf) -> Any:
  """A function region -> np.ndarray for an array leaf (inline, packed, pieced or stored)."""
  dtype = _leaves.dtype_of(rec.dtype)
  if rec.pieces is not None:
    read = _source.pieces_reader(src, rec, {})
    return lambda region: read(region).result()
  if rec.stored is None:
    if rec.inline is not None:
      raw = rec.inline
    else:
      p = rec.packed
      _restore._check_memory(p.nbytes, rec, src.location)  # a lying manifest: an error
      pack = _open_stored(src, _spec(src, p.pack), check_metadata=False)
      raw = pack[p.offset:p.offset + p.nbytes].read().result().tobytes()
    full = np.frombuffer(raw, dtype=dtype).reshape(rec.shape)
    return lambda region: full[tuple(slice(a, b) for a, b in region)]
  store = _open_stored(src, _spec(src, rec), check_metadata=False)
  return lambda region: store[tuple(slice(a, b) for a, b in region)].read().result()


def _count_different(a: np.ndarray, b: np.ndarray) -> int:
  """Elements whose bytes differ (bitwise: NaN equals the same NaN, -0.0 differs from 0.0)."""
  itemsize = a.dtype.itemsize
  a8 = np.ascontiguousarray(a).view(np.uint8).reshape(-1, itemsize)
  b8 = np.ascontiguousarray(b).view(np.uint8).reshape(-1, itemsize)
  return int(np.any(a8 != b8, axis=1).sum())


def _per_process_differ(src_a: _source.Source, rec_a: _records.Leaf,
                        src_b: _source.Source, rec_b: _records.Leaf) -> str | None:
  """Per-process values compared process by process (by saved records, bitwise)."""
  n_a, n_b = src_a.manifest.process_count, src_b.manifest.process_count
  if n_a != n_b:
    return f"saved by {n_a} -> {n_b} processes"
  differ = [p for p in range(n_a)
            if _values_under(_read_per_process(src_a, p), rec_a.path)
            != _values_under(_read_per_process(src_b, p), rec_b.path)]
  return f"the values of process(es) {differ} differ" if differ else None


def _values_differ(src_a: _source.Source, rec_a: _records.Leaf, src_b: _source.Source,
                   rec_b: _records.Leaf) -> str | None:
  if rec_a.kind == "perprocess":
    return _per_process_differ(src_a, rec_a, src_b, rec_b)
  if rec_a.kind in ("array", "key"):
    return _arrays_differ(src_a, rec_a, src_b, rec_b)
  va, vb = (_leaves.decode_value(r) for r in (rec_a, rec_b))
  if rec_a.kind == "npgen":
    va, vb = va.bit_generator.state, vb.bit_generator.state
    same = json.dumps(va, default=repr, sort_keys=True) == json.dumps(vb, default=repr,
                                                                      sort_keys=True)
  elif isinstance(va, float) and isinstance(vb, float):
    same = np.float64(va).tobytes() == np.float64(vb).tobytes()
  else:
    same = type(va) is type(vb) and va == vb
  return None if same else f"{_compact(va, 30)} -> {_compact(vb, 30)}"


def _arrays_differ(src_a: _source.Source, rec_a: _records.Leaf, src_b: _source.Source,
                   rec_b: _records.Leaf) -> str | None:
  """Two arrays of one shape and dtype compared bitwise, a slab along the leading dimension
  at a time (each at most restore's read window, unless one row is larger)."""
  read_a, read_b = _chunks_of_array(src_a, rec_a), _chunks_of_array(src_b, rec_b)
  shape = rec_a.shape
  itemsize = _leaves.dtype_of(rec_a.dtype).itemsize
  if any(n == 0 for n in shape):
    return None
  row = _layout.nbytes(shape[1:], itemsize) if shape else itemsize
  step = max(1, _source.READ_WINDOW_BYTES // max(1, row)) if shape else 1
  differ = 0
  for start in range(0, shape[0] if shape else 1, step):
    region = (((start, min(start + step, shape[0])),) + tuple((0, n) for n in shape[1:])
              if shape else ())
    differ += _count_different(np.asarray(read_a(region)), np.asarray(read_b(region)))
  total = math.prod(shape)
  return f"{differ} of {total} elements differ" if differ else None


def _value_lines(src_a: _source.Source, src_b: _source.Source,
                 pairs: Sequence[tuple[_records.Leaf, _records.Leaf]]) -> list[str]:
  """``!`` lines for the leaves (of the same structure) whose values differ. A read that
  fails because either checkpoint changed meanwhile is that CheckpointError, as in restore."""
  lines = []
  for ra, rb in pairs:
    try:
      text = _values_differ(src_a, ra, src_b, rb)
    except Exception as e:
      for src in (src_a, src_b):
        if not _commit.unchanged(src.kv, src.commit):
          raise _commit.changed_error(src.location) from None
      text = f"cannot compare: {_cause(e)}"
    if text:
      lines.append(f"! {_tree.keystr(ra.path)}: values differ ({text})")
  man_a, man_b = src_a.manifest, src_b.manifest
  if man_a.metadata != man_b.metadata:
    lines.append(f"! metadata: {_compact(man_a.metadata)} -> {_compact(man_b.metadata)}")
  return lines


def _diff(args: argparse.Namespace) -> int:
  src_a = _source.open_source(args.a, args.storage_options)
  src_b = _source.open_source(args.b, args.storage_options)
  loc_a, man_a = src_a.location, src_a.manifest
  loc_b, man_b = src_b.location, src_b.manifest
  recs_a = {_tree.match_key(r.path): r for r in man_a.leaves}
  recs_b = {_tree.match_key(r.path): r for r in man_b.leaves}
  lines = []
  for key, rec in recs_a.items():
    if key not in recs_b:
      lines.append(f"- {_tree.keystr(rec.path)}: {_desc(rec)}")
  for key, rec in recs_b.items():
    if key not in recs_a:
      lines.append(f"+ {_tree.keystr(rec.path)}: {_desc(rec)}")
  same_structure = []
  for key, ra in recs_a.items():
    rb = recs_b.get(key)
    if rb is None:
      continue
    if _desc(ra) != _desc(rb) or ra.impl != rb.impl:
      lines.append(f"~ {_tree.keystr(ra.path)}: {_desc(ra)} -> {_desc(rb)}")
    else:
      same_structure.append((ra, rb))
  if args.values:
    lines += _value_lines(src_a, src_b, same_structure)
  if not lines:
    what = "trees and values" if args.values else "trees (key paths, kinds, dtypes, shapes)"
    print(f"{loc_a} and {loc_b}: same {what}.")
    return 0
  print(f"--- {loc_a}\n+++ {loc_b}")
  print("\n".join(lines))
  return 1


# --- export --------------------------------------------------------------------------------

def _renames(pairs: Sequence[str] | None) -> dict[str, str]:
  """``--rename OLD=NEW`` pairs as export_safetensors' ``rename``.

  >>> _renames(["params=model", "head.out=lm_head"])
  {'params': 'model', 'head.out': 'lm_head'}
  """
  out = {}
  for pair in pairs or ():
    old, eq, new = pair.partition("=")
    if not eq or not old.strip("."):
      raise CheckpointError(f"--rename {pair!r}: expected OLD=NEW, e.g. --rename "
                            "params=model (NEW may be empty to drop OLD).")
    out[old] = new
  return out


def _export(args: argparse.Namespace) -> int:
  r = export_safetensors(args.checkpoint, args.out, select=args.select, dtype=args.dtype,
                         prefix=args.prefix, rename=_renames(args.rename),
                         max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                         storage_options=args.storage_options)
  for line in r.skipped:
    print(f"note: skipped {line}", file=sys.stderr)
  rate = r.bytes / r.seconds / 1e6 if r.seconds > 0 else 0.0
  extra = {k: v for k, v in r.metadata.items() if k != "format"}
  print(f"wrote {r.tensors} tensor(s), {_human(r.bytes)}, to {r.out} in {r.seconds:.2f} s "
        f"({rate:.0f} MB/s)" + (f"; {len(r.files) - 1} shard(s) and "
                                 "model.safetensors.index.json" if len(r.files) > 1 else ""))
  if extra:
    print(f"__metadata__: {_compact(json.dumps(extra), -200)}")
  return 0


# --- entry point -----------------------------------------------------------------------------

_STORAGE_OPTION_HELP = (
    "a storage option for every location the command reads (the storage_options of "
    "fnckpt.save/restore: endpoint, region, credentials, max_retries, ...); VALUE is JSON if "
    "it parses, else a string; repeat it for several, e.g. --storage-option "
    "endpoint=http://127.0.0.1:8333 --storage-option max_retries=2")


def _add_storage_option(p: argparse.ArgumentParser, dest: str) -> None:
  p.add_argument("--storage-option", action="append", dest=dest, metavar="KEY=VALUE",
                 help=_STORAGE_OPTION_HELP)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="fnckpt", description="Inspect, check and export fnckpt checkpoints (no devices "
      "needed).",
      epilog="Exit status: 0 ok; 1 damage (verify), differences (diff) or nothing to list "
             "(ls); 2 usage error or unreadable location.")
  # Accepted before and after the command; two dests, since a subparser's value would replace
  # the main parser's.
  _add_storage_option(p, "storage_option_pairs")
  common = argparse.ArgumentParser(add_help=False)
  _add_storage_option(common, "storage_option_pairs_after")
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  ls = sub.add_parser("ls", parents=[common], help="list the steps of a run directory",
                      description="Committed steps (uncommitted leftovers, steps marked "
                      "damaged) of a CheckpointManager directory: data size, leaves, files, "
                      "commit time, metrics; with --local, of both tiers.")
  ls.add_argument("dir")
  ls.add_argument("--local", metavar="FAST", default=None,
                  help="also list the manager's local tier (local_directory); "
                       "--storage-option settings apply to DIR only")
  ls.set_defaults(run=_ls, locations=("dir",))
  ins = sub.add_parser("inspect", parents=[common], help="show the saved tree of one checkpoint",
                       description="Key path, kind, dtype, shape, saved sharding, bytes and "
                       "inline values of every leaf.")
  ins.add_argument("path")
  ins.set_defaults(run=_inspect, locations=("path",))
  ver = sub.add_parser("verify", parents=[common], help="read every chunk and check its checksum",
                       description="Read every chunk of a checkpoint (or of every committed "
                       "step of a run directory), checking crc32c checksums; exit 1 naming "
                       "each damaged leaf.")
  ver.add_argument("path")
  ver.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
  ver.set_defaults(run=_verify, locations=("path",))
  dif = sub.add_parser("diff", parents=[common], help="compare two checkpoints",
                       description="Key paths only in A (-), only in B (+), changed in kind, "
                       "dtype or shape (~); with --values, leaves whose values differ (!). "
                       "Exit 1 when they differ.")
  dif.add_argument("a")
  dif.add_argument("b")
  dif.add_argument("--values", action="store_true", help="also compare the data, bitwise")
  dif.set_defaults(run=_diff, locations=("a", "b"))
  _add_export(sub, common)
  return p


def _add_export(sub: Any, common: argparse.ArgumentParser) -> None:
  exp = sub.add_parser("export", parents=[common], help="write the arrays as safetensors",
                       description="Write a checkpoint's arrays as safetensors, streamed in "
                       "a bounded window: OUT ending in .safetensors is one file, anything "
                       "else a directory of model-0000i-of-0000N.safetensors shards with "
                       "model.safetensors.index.json. Names are key paths joined with '.'.")
  exp.add_argument("checkpoint")
  exp.add_argument("out")
  exp.add_argument("--select", help="export this subtree only (e.g. params, params.dense); "
                   "names are relative to it")
  exp.add_argument("--dtype", help="convert floating-point arrays (e.g. bfloat16)")
  exp.add_argument("--prefix", help="prepend to every name (e.g. model)")
  exp.add_argument("--rename", action="append", metavar="OLD=NEW",
                   help="replace the key prefix OLD of names by NEW (repeatable)")
  exp.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest shard of a directory OUT (default 5GB; e.g. 500MB, 2GiB)")
  exp.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
  exp.set_defaults(run=_export, locations=("checkpoint",))


def main(argv: Sequence[str] | None = None) -> int:
  """Run the ``fnckpt`` command line; return its exit status.

  >>> import numpy as np, fnckpt, fnckpt.cli, tempfile
  >>> d = tempfile.mkdtemp()
  >>> _ = fnckpt.save({"w": np.arange(4.0)}, f"{d}/c").wait()
  >>> fnckpt.cli.main(["verify", "--quiet", f"{d}/c"])  # doctest: +ELLIPSIS
  OK .../c
  0
  """
  args = _parser().parse_args(argv)
  try:
    args.storage_options = _storage_options(
        (args.storage_option_pairs or []) + (args.storage_option_pairs_after or []))
    _check_storage_options([getattr(args, n) for n in args.locations], args.storage_options)
    code = args.run(args)
    sys.stdout.flush()
    return code
  except BrokenPipeError:  # `fnckpt inspect X | head -1`: the reader has gone; so do we
    import os
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0
  except (CheckpointError, OSError, ValueError) as e:  # TensorStore I/O errors are ValueErrors
    text = " | ".join(line.strip() for line in str(e).splitlines() if line.strip())
    print(f"fnckpt {args.command}: error: {text}", file=sys.stderr)
    return 2
