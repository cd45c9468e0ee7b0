"""export_safetensors(): a committed checkpoint's arrays as safetensors files, streamed.

The plan (``_export_plan``, pure) fixes every file's header before anything is read, so each
file is written front to back: the header, then every tensor's bytes as ```_slices.pieces``
reads them (a bounded window), cast piece by piece when asked. Local output only, written
atomically: a temporary file (or directory, for shards) beside ``out``, fsynced, renamed
into place; on any failure it is removed and ``out`` is untouched.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shutil
import sys
import time
from typing import Any, Mapping, Sequence

import numpy as np

from .._errors import CheckpointError
from .._format import leaves as _leaves
from .._format import records as _records
from .._io import arrays as _arrays
from .._sources import slices as _slices
from .._sources import source as _source
from . import plan as _export_plan

__all__ = ["export_safetensors", "ExportResult", "make_parent"]


@dataclasses.dataclass(frozen=True)
class ExportResult:
  """What :func:`fnckpt.export_safetensors` wrote: the files (shards, then the index), how
  many tensors and bytes of tensor data, the header's ``__metadata__``, the key paths left out
  (and why), the time taken, and the read window's peak (bytes held at once, each read
  charged twice its size; at most ``budget_bytes``)."""

  out: str
  files: tuple[str, ...]
  tensors: int
  bytes: int
  metadata: Mapping[str, str]
  skipped: tuple[str, ...]
  seconds: float
  peak_read_bytes: int


def export_safetensors(
  checkpoint: str,
  out: str | os.PathLike,
  *,
  select: str | Sequence[Any] | None = None,
  dtype: Any = None,
  prefix: str | None = None,
  rename: Mapping[str, str] | None = None,
  max_shard_size: int | str | None = None,
  overwrite: bool = False,
  budget_bytes: int | None = None,
  storage_options: dict[str, Any] | None = None,
) -> ExportResult:
  """Write a committed checkpoint's arrays as safetensors, streaming (bounded memory).

  Tensor names are key paths joined with ``.`` (``params.dense.kernel``; sequence indices as
  digits). ``out`` ending in ``.safetensors`` is one file; anything else is a directory of
  ``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_size`` (default
  ``"5GB"``) with ``model.safetensors.index.json``.

  Args:
    checkpoint: a committed checkpoint (any location fnckpt reads).
    out: a local path (see above); refused if it exists unless ``overwrite``.
    select: a subtree, as a key path (``"params"``, ``"params.dense"``, or a sequence of
      keys); names are relative to it.
    dtype: convert floating-point arrays to this dtype (e.g. ``"bfloat16"``); integer and
      bool arrays keep theirs.
    prefix: prepended to every name (``"model"``: ``model.dense.kernel``).
    rename: ``{OLD: NEW}`` key prefixes (whole keys) replaced in the names, before ``prefix``.
    budget_bytes: host memory for reads held at once, each read charged twice its size
      (default: restore's 128 MiB window; at least 64 KiB).
    storage_options: settings for a ``gs://``/``s3://`` checkpoint.

  Arrays of a dtype safetensors cannot hold (int4, complex128, ...) and PRNG keys are refused
  naming their key paths: ``select`` a subtree without them. Python and numpy numbers, bools
  and strings go into each file's ``__metadata__`` as text, beside ``"format": "pt"``; other
  leaves (None, empty containers, numpy Generators, ``PerProcess``) are skipped and listed in
  ``ExportResult.skipped``.

  >>> import numpy as np, fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> state = {"params": {"w": np.ones((2, 3), np.float32)}, "step": 7}
  >>> _ = fnckpt.save(state, f"{d}/c").wait()
  >>> r = fnckpt.export_safetensors(f"{d}/c", f"{d}/model.safetensors", select="params")
  >>> r.tensors, r.bytes, dict(r.metadata)
  (1, 24, {'format': 'pt'})
  >>> from safetensors.numpy import load_file
  >>> float(load_file(f"{d}/model.safetensors")["w"].sum())
  6.0
  """
  started = time.monotonic()
  target, single = _output(out)
  window = _read_window(budget_bytes)
  src = _source.open_source(checkpoint, storage_options)
  p = _export_plan.plan(
    src.manifest.leaves,
    src.location,
    single=single,
    select=select,
    dtype=dtype,
    prefix=prefix,
    rename=rename,
    max_shard_size=max_shard_size,
  )
  _check_target(target, overwrite)
  files = _write_export(src, p, target, single is not None, window, overwrite)
  return ExportResult(
    out=target,
    files=files,
    tensors=sum(len(f.tensors) for f in p.files),
    bytes=p.total_bytes,
    metadata=dict(p.metadata),
    skipped=p.skipped,
    seconds=time.monotonic() - started,
    peak_read_bytes=window.peak,
  )


def _read_window(budget_bytes: int | None) -> _slices.Window:
  """The read window: ``budget_bytes`` checked (at least :data:`MIN_WINDOW_BYTES`), by default
  restore's."""
  return _slices.Window(
    _arrays.budget_arg(
      budget_bytes, "export_safetensors", _source.READ_WINDOW_BYTES, MIN_WINDOW_BYTES
    )
  )


def _write_export(
  src: _source.Source,
  p: _export_plan.Plan,
  target: str,
  single: bool,
  window: _slices.Window,
  overwrite: bool,
) -> tuple[str, ...]:
  """Write the planned file(s) into a temporary file or directory beside ``target``, then move
  it into place; on any failure the temporary is removed and ``target`` is untouched. Returns
  the paths written: the file, or the shards then the index."""
  # (the name stays within NAME_MAX whatever the target's length: 1 + 200 + 21 bytes)
  tmp = os.path.join(
    os.path.dirname(target), f".{os.path.basename(target)[:200]}.tmp-{secrets.token_hex(8)}"
  )
  try:
    if single:
      _write_file(src, p.files[0], tmp, window, target)
    else:
      os.mkdir(tmp)
      for f in p.files:
        _write_file(src, f, os.path.join(tmp, f.name), window, target)
      assert p.index is not None  # (sharded output)
      _write_bytes(os.path.join(tmp, _export_plan.INDEX_NAME), p.index, target)
    _publish(tmp, target, overwrite)
  except BaseException:  # clean up (best effort: never in place of the error being raised)
    shutil.rmtree(tmp, ignore_errors=True) if os.path.isdir(tmp) else _unlink(tmp)
    raise
  if single:
    return (target,)
  names = [os.path.join(target, f.name) for f in p.files]
  return (*names, os.path.join(target, _export_plan.INDEX_NAME))


def _output(out: str | os.PathLike) -> tuple[str, str | None]:
  """The absolute output path, and its file name if it is one file (``.safetensors``)."""
  text = os.fspath(out)
  if "://" in text:
    raise CheckpointError(
      f"out={text!r}: export writes local files only. Export to a local "
      "path, then copy it (e.g. gsutil cp / aws s3 cp)."
    )
  target = os.path.abspath(text)  # "hf/" is the directory "hf"
  if not os.path.basename(target):
    raise CheckpointError(f"out={text!r}: give a file (NAME.safetensors) or a directory name.")
  name = len(os.fsencode(os.path.basename(target)))
  if name > 255:
    raise CheckpointError(
      f"out=...{text[-40:]!r}: its last name is {name} bytes long; file "
      "systems allow at most 255. Choose a shorter name."
    )
  single = target.endswith(".safetensors") and not text.endswith(os.sep)
  return target, (os.path.basename(target) if single else None)


# A smaller read window would read in pieces too small to finish in reasonable time.
MIN_WINDOW_BYTES = 64 << 10

_EXPORT_NAME = re.compile(
  r"model-[0-9]{5}-of-[0-9]{5}\.safetensors|model\.safetensors\.index\.json"
)


def make_parent(target: str) -> None:
  """The directory an export's ``target`` goes into, made if missing (or a clear error)."""
  parent = os.path.dirname(target)
  try:
    os.makedirs(parent, exist_ok=True)
  except OSError as e:
    raise CheckpointError(
      f"Cannot create the directory {parent!r} for the export ({type(e).__name__}: {e})."
    ) from None


def _check_target(target: str, overwrite: bool) -> None:
  make_parent(target)
  if overwrite and os.path.isdir(target) and not os.path.islink(target):
    # Replacing a directory removes it whole: only one that holds nothing but an export.
    others = [n for n in os.listdir(target) if not _EXPORT_NAME.fullmatch(n)]
    if others:
      raise CheckpointError(
        f"{target!r} holds files that are not part of a safetensors export (e.g. "
        f"{sorted(others)[0]!r}); overwrite=True would delete them. Export into an empty or "
        "new directory (then move the files), or remove that directory yourself."
      )
  if os.path.lexists(target) and not overwrite:
    empty_dir = os.path.isdir(target) and not os.listdir(target)
    if not (empty_dir and not target.endswith(".safetensors")):
      raise CheckpointError(
        f"{target!r} already exists. Pass overwrite=True (CLI: "
        "--overwrite) to replace it, or choose another path."
      )


def _to_bytes(data: np.ndarray) -> np.ndarray:
  """A piece's bytes, little endian, as a flat uint8 view (no copy on little-endian hosts)."""
  if sys.byteorder != "little" and data.dtype.itemsize > 1:
    data = data.byteswap()
  return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _write_file(
  src: _source.Source, f: _export_plan.OutFile, path: str, window: _slices.Window, target: str
) -> None:
  """One safetensors file: the header, then each tensor's pieces in order (checking that
  every tensor gets exactly its bytes), fsynced."""
  try:
    with open(path, "xb") as fh:
      fh.write(f.header)
      written = since_trim = 0
      by_leaf = {t.leaf.index: t for t in f.tensors}
      for piece in _slices.pieces(
        src,
        [t.leaf for t in f.tensors],
        window,
        lambda leaf: _records.itemsize(by_leaf[leaf.index].dtype),
      ):
        t = by_leaf[piece.leaf.index]
        if written != t.begin + piece.start * _records.itemsize(t.dtype):
          raise AssertionError(
            f"{t.name}: a piece lands at {written}, not at "
            f"{t.begin + piece.start * _records.itemsize(t.dtype)}"
          )
        data = (
          piece.data
          if piece.data.dtype.name == t.dtype
          else _leaves.cast(piece.data, _records.np_dtype(t.dtype), t.leaf.where)
        )
        written += fh.write(_to_bytes(data))  # type: ignore[arg-type]  # (numpy's stubs)
        since_trim += data.nbytes
        if since_trim >= window.limit:
          since_trim = _give_back_freed_memory()
      if written != (f.tensors[-1].end if f.tensors else 0):
        raise AssertionError(
          f"{written} bytes of tensor data written, the header says {f.tensors[-1].end}"
        )
      fh.flush()
      os.fsync(fh.fileno())
  except (CheckpointError, AssertionError):
    raise
  except OSError as e:
    raise CheckpointError(
      f"Cannot write {os.path.join(target, f.name)!r} "
      f"({type(e).__name__}: {e}). Check the free space and "
      "permissions there."
    ) from None


def _malloc_trim() -> Any:
  try:
    import ctypes

    return ctypes.CDLL("libc.so.6").malloc_trim
  except (OSError, AttributeError):  # not glibc
    return None


_TRIM = _malloc_trim()


def _give_back_freed_memory() -> int:
  """Return freed heap memory to the OS (glibc's ``malloc_trim``; elsewhere nothing). Without
  it, glibc keeps the read buffers TensorStore's threads freed (their sizes are under its
  adaptive mmap threshold), and the process's RSS grows with the bytes exported, not with the
  window: 304 MiB over the baseline for 1 GiB through a 64 MiB window, measured."""
  if _TRIM is not None:
    _TRIM(0)
  return 0


def _write_bytes(path: str, data: bytes, target: str) -> None:
  try:
    with open(path, "xb") as fh:
      fh.write(data)
      fh.flush()
      os.fsync(fh.fileno())
  except OSError as e:
    raise CheckpointError(f"Cannot write {target!r} ({type(e).__name__}: {e}).") from None


def _publish(tmp: str, target: str, overwrite: bool) -> None:
  """Move the finished file or directory into place (rename; fsync the parent). A file
  replaces an old one atomically; a directory replaces an old one by moving it aside first
  (the old one is deleted after), so ``target`` never holds a mix."""
  parent = os.path.dirname(target)
  try:
    if os.path.isfile(tmp):
      if overwrite:
        os.replace(tmp, target)
      else:  # exclusive: fails if it appeared meanwhile
        _link_or_rename(tmp, target)
    else:
      _publish_dir(tmp, target, overwrite)
    fd = os.open(parent, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  except FileExistsError:
    raise CheckpointError(
      f"{target!r} already exists. Pass overwrite=True (CLI: "
      "--overwrite) to replace it, or choose another path."
    ) from None
  except OSError as e:
    raise CheckpointError(
      f"Cannot move the export into place at {target!r} ({type(e).__name__}: {e})."
    ) from None


def _link_or_rename(tmp: str, target: str) -> None:
  """Move a file to ``target`` unless something is there: ``os.link`` (atomic), or, where the
  file system has no hard links, a check then ``os.rename``."""
  try:
    os.link(tmp, target)
  except FileExistsError:
    raise
  except OSError:
    if os.path.lexists(target):
      raise FileExistsError(target) from None
    os.rename(tmp, target)
    return
  os.unlink(tmp)


def _publish_dir(tmp: str, target: str, overwrite: bool) -> None:
  try:
    os.rename(tmp, target)  # onto nothing, or onto an empty directory
    return
  except OSError as e:
    if not overwrite or not os.path.lexists(target):
      raise FileExistsError(target) from e
  old = f"{tmp}.old"
  os.rename(target, old)
  os.rename(tmp, target)
  shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else _unlink(old)


def _unlink(path: str) -> None:
  """Remove a leftover file if it is there; an error doing so (gone, a name too long, no
  permission) is not the caller's concern: the error that led here is raised instead."""
  try:
    os.unlink(path)
  except OSError:
    pass
