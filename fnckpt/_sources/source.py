"""An opened checkpoint: what restore, a save's ``base``, export and the CLI share.

:func:`open_source` opens a committed fnckpt checkpoint (its validated manifest and the commit
marker's bytes as read); :func:`open_any` also an Orbax or safetensors one (``detect``).
:data:`READ_WINDOW_BYTES` is the default window of reads in flight. Its stored bytes are read
through ``read`` (``read.Opener``, ``read.read_regions``, ``read.leaf_error``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import tensorstore as ts

from .._errors import CheckpointError, NotCommittedError
from .._format import manifest as _manifest
from .._format import records as _records
from .._io import commit as _commit
from .._io import paths as _paths

__all__ = ["Source", "open_source", "open_any", "READ_WINDOW_BYTES"]

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
  reader: Any = None  # a foreign format's slice reader (detect); None for fnckpt's own


def open_any(where: _paths.Location | str, options: Mapping[str, Any] | None = None) -> Source:
  """fnckpt's own checkpoint at ``where`` (whatever its name: also ``run.json``), else an
  Orbax or safetensors one (``detect``). An interrupted fnckpt save stays one (never the
  contents of a stray file in it); only a directory with no fnckpt manifest or ``data-*``
  may be an Orbax checkpoint (whose OCDBT ``d/`` looks like format 1's data). ``options``:
  the storage options of a ``where`` given as a path."""
  from .._errors import NoCheckpointError

  where = _paths.Location.of(where, options)
  try:
    return open_source(where)
  except NotCommittedError:
    from . import detect as _foreign  # (imported only when needed: ~15 ms in a new process)

    opened = None if _has_own_files(where) else _foreign.open_orbax(where.path, where.options)
    if opened is None:
      raise
  except CheckpointError as e:
    from . import detect as _foreign

    opened = None if _has_own_files(where) else _foreign.open_foreign(where.path, where.options)
    if opened is None and isinstance(e, NoCheckpointError):
      raise NoCheckpointError(
        f"{e} Nor is it an Orbax checkpoint (_METADATA, "
        "_CHECKPOINT_METADATA) or safetensors (*.safetensors, "
        "model.safetensors.index.json)."
      ) from None
    if opened is None:
      raise
  return Source(
    location=opened.location,
    kv_spec=opened.kv_spec,
    ctx=opened.ctx,
    kv=opened.kv,
    manifest=opened.manifest,
    commit=b"",
    format=opened.format,
    reader=opened.reader,
  )


def _has_own_files(where: _paths.Location) -> bool:
  """Whether ``where`` is a directory holding a fnckpt commit marker, manifest or format 2
  data (empty byte-range reads: existence only)."""
  try:
    kv = _paths.resolve(where)[2]
    marks = [kv.read(k, byte_range=slice(0, 0)) for k in (_manifest.COMMIT, _manifest.MANIFEST)]
    data = kv.list(
      range=ts.KvStore.KeyRange(_manifest.DATA_PREFIX, _manifest.DATA_PREFIX[:-1] + ".")
    )
    return any(m.result().state == "value" for m in marks) or bool(data.result())
  except Exception:  # (not a directory: a file of that name)
    return False


def open_source(where: _paths.Location | str, options: Mapping[str, Any] | None = None) -> Source:
  """The committed fnckpt checkpoint at ``where`` (its manifest read and validated;
  ``options``: the storage options of a ``where`` given as a path)."""
  where = _paths.Location.of(where, options)
  location = where.display
  try:
    kv_spec, ctx, kv = _paths.resolve(where)
    manifest, _, commit = _commit.read_header(kv, location)
  except CheckpointError:
    raise
  except Exception as e:  # TensorStore's I/O errors: a file in the way, no permission, ...
    raise CheckpointError(
      f"Cannot read a checkpoint at {location!r} ({type(e).__name__}: {e}). Check that the "
      "path is a checkpoint directory and that it is readable."
    ) from e
  return Source(location, kv_spec, ctx, kv, manifest, commit)
