"""An opened checkpoint and the reading of its stored bytes: what restore, a save's ``base``,
export and the CLI share.

:func:`open_source` opens a committed fnckpt checkpoint (its validated manifest and the commit
marker's bytes as read); :func:`open_any` also an Orbax or safetensors one (``detect``).
:func:`pieces_reader` reads slices of a pieced leaf, :func:`read_error` says why a read failed
(the checkpoint changed while being read, a referenced checkpoint is gone, damage), and
:data:`READ_WINDOW_BYTES` is the default window of reads in flight.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorstore as ts

from .._format import manifest as _manifest, records as _records, refs as _refs
from .._io import commit as _commit, paths as _paths, arrays as _store
from . import pieces as _pieces_read
from .._errors import CheckpointError, DamagedError, NotCommittedError

__all__ = ["Source", "open_source", "open_any", "pieces_reader", "read_error",
           "READ_WINDOW_BYTES"]

# Reads in flight by default. More only adds memory (TensorStore's raw bytes beside each decoded
# slice): on the bench's 250 MiB state, 32 MiB to 256 MiB windows restore equally fast.
READ_WINDOW_BYTES = 128 << 20


@dataclasses.dataclass(frozen=True)
class Source:
  """An opened, committed checkpoint: where it is, its validated manifest, and the commit
  marker's bytes as read (to tell whether it changed while being read)."""
  location: str
  kv_spec: dict[str, Any]
  ctx: ts.Context
  kv: ts.KvStore
  manifest: _records.Manifest
  commit: bytes
  format: str = "fnckpt"
  reader: Any = None       # a foreign format's slice reader (detect); None for fnckpt's own


def open_any(path: str, storage_options: dict[str, Any] | None) -> Source:
  """fnckpt's own checkpoint at ``path`` (whatever its name: also ``run.json``), else an
  Orbax or safetensors one (``detect``). An interrupted fnckpt save stays one (never the
  contents of a stray file in it); only a directory with no fnckpt manifest or ``data-*``
  may be an Orbax checkpoint (whose OCDBT ``d/`` looks like format 1's data)."""
  from . import detect as _foreign  # (imported here: the CLI and save never need it)
  from .._errors import NoCheckpointError
  try:
    return open_source(path, storage_options)
  except NotCommittedError:
    opened = None if _has_own_files(path, storage_options) else \
        _foreign.open_orbax(path, storage_options)
    if opened is None:
      raise
  except CheckpointError as e:
    opened = None if _has_own_files(path, storage_options) else \
        _foreign.open_foreign(path, storage_options)
    if opened is None and isinstance(e, NoCheckpointError):
      raise NoCheckpointError(f"{e} Nor is it an Orbax checkpoint (_METADATA, "
                            "_CHECKPOINT_METADATA) or safetensors (*.safetensors, "
                            "model.safetensors.index.json).") from None
    if opened is None:
      raise
  return Source(opened.location, opened.kv_spec, opened.ctx, opened.kv, opened.manifest, b"",
                opened.format, opened.reader)


def _has_own_files(path: str, storage_options: dict[str, Any] | None) -> bool:
  """Whether ``path`` is a directory holding a fnckpt commit marker, manifest or format 2
  data (empty byte-range reads: existence only)."""
  try:
    kv = _paths.resolve(path, storage_options)[2]
    marks = [kv.read(k, byte_range=slice(0, 0)) for k in (_manifest.COMMIT, _manifest.MANIFEST)]
    data = kv.list(range=ts.KvStore.KeyRange(_manifest.DATA_PREFIX,
                                             _manifest.DATA_PREFIX[:-1] + "."))
    return any(m.result().state == "value" for m in marks) or bool(data.result())
  except Exception:  # (not a directory: a file of that name)
    return False


def open_source(path: str, storage_options: dict[str, Any] | None = None) -> Source:
  """The committed fnckpt checkpoint at ``path`` (its manifest read and validated)."""
  location = _paths.display(path)
  try:
    kv_spec, ctx, kv = _paths.resolve(path, storage_options)
    manifest, _, commit = _commit.read_header(kv, location)
  except CheckpointError:
    raise
  except Exception as e:  # TensorStore's I/O errors: a file in the way, no permission, ...
    raise CheckpointError(
        f"Cannot read a checkpoint at {location!r} ({type(e).__name__}: {e}). Check that the "
        "path is a checkpoint directory and that it is readable.") from e
  return Source(location, kv_spec, ctx, kv, manifest, commit)


def pieces_reader(src: Source, rec: _records.Leaf, packs: dict[int, ts.TensorStore]) -> Any:
  """A :class:`fnckpt._sources.pieces.SliceReader` of pieced leaf ``rec``; opened packs are kept
  in ``packs`` (opening does no I/O: the manifest says everything)."""

  def open_pack(k: int) -> ts.TensorStore:
    if k not in packs:
      pack = src.manifest.packs[k]
      packs[k] = _store.open_array(_store.pack_spec(
          _refs.base_spec(src.kv_spec, src.manifest, pack.base, src.location), pack.dir,
          pack.nbytes, pack.chunk, pack.inner), src.ctx, mode="read").result()
    return packs[k]

  return _pieces_read.SliceReader(src.manifest, rec, open_pack)


def read_error(src: Source, rec: _records.Leaf, e: Exception) -> CheckpointError:
  """Why reading ``rec``'s stored bytes failed, as restore reports it: the checkpoint changed
  while being read, a referenced checkpoint is missing, damage (a :class:`DamagedError`: a
  checksum mismatch, corrupt or missing data), or another read failure; a foreign format's
  reader words its own."""
  if src.reader is not None:
    return src.reader.read_error(rec, e)
  location = src.location
  if not _commit.unchanged(src.kv, src.commit):
    return _commit.changed_error(location)
  where = rec.where
  base = None
  if rec.packed is not None:
    base = src.manifest.packs[rec.packed.pack].base
    store = f"{location}/{src.manifest.packs[rec.packed.pack].dir}"
  elif rec.pieces is not None:
    store = f"{location}/{src.manifest.data}/p (pieces of {rec.where})"
  else:
    base = rec.stored.base if rec.stored is not None else None
    store = f"{location}/{rec.stored.dir}" if rec.stored is not None else location
  text = _paths.error_text(e)
  if base is not None:
    ref = _refs.describe(location, src.manifest, base)
    store = _refs.display(location, src.manifest.bases[base].dir) + store[len(location):]
    if _paths.read_failure(e) == "missing":  # (damage: self-healing restores skip the step)
      return DamagedError(
          f"Cannot restore {where} from {location!r}: it refers to {ref}, which is missing "
          f"(no data at {store!r}: that checkpoint was deleted or moved). This checkpoint "
          "cannot be restored without it; restore another step, or put the referenced "
          f"checkpoint back. [{text}]")
  cause = {"checksum": "its data is corrupt (crc32c checksum mismatch)",
           "corrupt": "its data is corrupt or truncated",
           "missing": "a chunk of its data is missing",
           "metadata": "its zarr.json does not match the manifest"}.get(_paths.read_failure(e))
  error = DamagedError if cause else CheckpointError  # else: not known to be damage
  cause = cause or f"reading failed ({type(e).__name__}: {text})"
  return error(
      f"Cannot restore {where} from {store!r}: {cause}. The checkpoint is damaged; restore an "
      f"earlier one (fnckpt verify {location} lists every damaged leaf). [{text}]")
