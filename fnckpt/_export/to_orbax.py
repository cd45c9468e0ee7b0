"""export_orbax(): a committed checkpoint as an Orbax PyTree checkpoint, streamed.

The plan (``orbax_plan``, pure) fixes every array's Orbax name, zarr chunks and metadata
before anything is read. The arrays are then read a chunk at a time through the one reader
(``_sources.read``) under a bounded window and written by TensorStore as Orbax writes them:
zarr (v2, zstd) arrays in a per-process OCDBT database (``ocdbt.process_0/``), merged into the
item's top-level OCDBT manifest at the end, then ``_METADATA``, ``_sharding``,
``array_metadatas/``, ``_strings.json``, ``commit_success.txt`` and ``_CHECKPOINT_METADATA``.
Local output only, written atomically: a temporary directory beside ``out``, renamed into
place; on any failure it is removed and ``out`` is untouched.

One process exports everything (any checkpoint, however many processes saved it): the
output is one local directory, and one process's reads and writes stream at disk speed.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import secrets
import shutil
import time
from typing import Any, Iterator

import tensorstore as ts

from .._errors import CheckpointError
from .._format import records as _records
from .._io import arrays as _arrays
from .._io import paths as _paths
from .._layout import blocks as _blocks
from .._sources import read as _read
from .._sources import source as _source
from . import orbax_plan as _plan
from . import to_safetensors as _st

__all__ = ["export_orbax", "OrbaxExport"]

PROCESS_DIR = "ocdbt.process_0"
# Orbax's OCDBT settings for writing (tensorstore_utils._add_ocdbt_write_options, 0.12.8).
_OCDBT = {
  "config": {
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100000000,
    "manifest_kind": "single",
  },
  "target_data_file_size": 2**31,
  "assume_config": True,
  "cache_pool": "cache_pool#ocdbt",
}
# What an Orbax item directory holds: only such a directory may be replaced (overwrite).
_ORBAX_NAME = re.compile(
  r"_METADATA|_CHECKPOINT_METADATA|_sharding|_strings\.json|commit_success\.txt|"
  r"manifest\.ocdbt|d|array_metadatas|descriptor|ocdbt\.process_[A-Za-z0-9_]+"
)


@dataclasses.dataclass(frozen=True)
class OrbaxExport:
  """What :func:`fnckpt.export_orbax` wrote: the item directory, how many arrays (numbers
  included) and bytes of array data, the time taken, and the read window's peak (bytes held
  at once: reads in flight and chunks being written; at most ``budget_bytes``)."""

  out: str
  arrays: int
  bytes: int
  seconds: float
  peak_read_bytes: int


def export_orbax(
  checkpoint: str,
  out: str | os.PathLike,
  *,
  storage_options: dict[str, Any] | None = None,
  overwrite: bool = False,
  budget_bytes: int | None = None,
) -> OrbaxExport:
  """Write a committed checkpoint as an Orbax PyTree checkpoint that orbax-checkpoint's own
  readers restore (``StandardCheckpointer().restore(out, target)``, ``PyTreeCheckpointer``),
  laid out as its ``StandardCheckpointer().save(out, tree)`` (0.12.8) lays one out; streamed.

  Each leaf keeps its key path: arrays saved from ``jax.Array`` s (typed PRNG keys
  included) are ``jax.Array`` s with their saved mesh axes and PartitionSpec, numpy arrays
  ``np.ndarray`` s, Python and numpy numbers Orbax scalars (restored as Python numbers),
  strings go to ``_strings.json`` and None and empty containers stay empty.

  Args:
    checkpoint: a committed fnckpt checkpoint (any location fnckpt reads).
    out: a local directory, new or empty; refused if it holds anything unless
      ``overwrite`` (which replaces only an Orbax checkpoint). For a
      ``CheckpointManager`` step, export to ``ROOT/STEP/default``.
    storage_options: settings for a ``gs://``/``s3://`` checkpoint.
    overwrite: replace an existing Orbax checkpoint at ``out``.
    budget_bytes: host memory for chunks held at once, read and being written, each charged
      three times its size (default: restore's 128 MiB window; at least 64 KiB). Chunks are
      at most a sixteenth of it.

  ``PerProcess`` values, ints outside int64/uint64, ``bytes``, numpy Generators and arrays
  of dtype float8_e4m3, uint2 or uint4 are refused, naming their key paths, before anything
  is written.

  >>> import numpy as np, fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> tree = {"params": {"w": np.ones((2, 3), np.float32)}, "step": 7}
  >>> _ = fnckpt.save(tree, f"{d}/c").wait()
  >>> r = fnckpt.export_orbax(f"{d}/c", f"{d}/orbax")
  >>> r.arrays, r.bytes
  (2, 32)
  >>> got = fnckpt.restore(f"{d}/orbax")
  >>> float(got["params"]["w"].sum()), got["step"]
  (6.0, 7)
  """
  started = time.monotonic()
  target = _output(out)
  window = _read.Window(
    _arrays.budget_arg(
      budget_bytes, "export_orbax", _source.READ_WINDOW_BYTES, _st.MIN_WINDOW_BYTES
    )
  )
  src = _source.open_source(checkpoint, storage_options)
  _check_apart(target, src.location)
  p = _plan.plan(
    src.manifest.leaves, src.location, window=window.limit, metadata=src.manifest.metadata
  )
  _check_target(target, overwrite)
  _write_export(src, p, target, window, overwrite)
  return OrbaxExport(
    out=target,
    arrays=len(p.arrays),
    bytes=p.total_bytes,
    seconds=time.monotonic() - started,
    peak_read_bytes=window.peak,
  )


def _output(out: str | os.PathLike) -> str:
  text = os.fspath(out)
  if "://" in text:
    raise CheckpointError(
      f"out={text!r}: export writes local files only. Export to a local "
      "path, then copy it (e.g. gsutil cp -r / aws s3 cp --recursive)."
    )
  target = os.path.abspath(text)
  if not os.path.basename(target) or len(os.fsencode(os.path.basename(target))) > 200:
    raise CheckpointError(f"out={text!r}: give a directory name of at most 200 bytes.")
  return target


def _check_target(target: str, overwrite: bool) -> None:
  """``target`` must be new or an empty directory, or (``overwrite``) an Orbax checkpoint."""
  if not os.path.lexists(target) or (
    os.path.isdir(target) and not os.path.islink(target) and not os.listdir(target)
  ):
    _st.make_parent(target)
    return
  if not overwrite:
    raise CheckpointError(
      f"{target!r} already exists and is not empty. Pass overwrite=True (CLI: --overwrite) "
      "to replace an Orbax checkpoint there, or choose another path."
    )
  if not os.path.isdir(target) or os.path.islink(target):
    raise CheckpointError(
      f"{target!r} is a file or a link, not an Orbax checkpoint; overwrite=True replaces "
      "only an Orbax checkpoint. Export to a new or empty directory."
    )
  others = [n for n in os.listdir(target) if not _ORBAX_NAME.fullmatch(n)]
  if others:
    raise CheckpointError(
      f"{target!r} is not an Orbax checkpoint (it holds {sorted(others)[0]!r}); "
      "overwrite=True replaces only an Orbax checkpoint. Export to a new or empty "
      "directory, or remove that one yourself."
    )


def _check_apart(target: str, location: str) -> None:
  """``target`` must be neither the checkpoint, inside it, nor hold it (a local one)."""
  if "://" in location:
    return
  here, there = os.path.realpath(target), os.path.realpath(location)
  if os.path.commonpath([here, there]) in (here, there):
    raise CheckpointError(
      f"out={target!r} and the checkpoint {location!r} overlap (one is the other or "
      "inside it). Export to a directory outside the checkpoint."
    )


def _write_export(
  src: _source.Source, p: _plan.OrbaxPlan, target: str, window: _read.Window, overwrite: bool
) -> None:
  """Write the planned checkpoint into a temporary directory beside ``target``, then move it
  into place; on any failure the temporary is removed and ``target`` is untouched."""
  tmp = os.path.join(
    os.path.dirname(target), f".{os.path.basename(target)}.tmp-{secrets.token_hex(8)}"
  )
  started = time.time_ns()
  try:
    os.mkdir(tmp)
    ctx = ts.Context({"cache_pool#ocdbt": {"total_bytes_limit": 32 << 20}})
    _write_arrays(src, p, tmp, ctx, window, target)
    _merge(tmp, ctx, target)
    os.mkdir(os.path.join(tmp, "array_metadatas"))
    for name, data in p.files.items():
      _st._write_bytes(os.path.join(tmp, name), data, target)
    _st._write_bytes(
      os.path.join(tmp, "commit_success.txt"),
      f"Checkpoint commit was successful to {target}".encode(),
      target,
    )
    _st._write_bytes(
      os.path.join(tmp, "_CHECKPOINT_METADATA"), _checkpoint_metadata(started), target
    )
    _st._publish(tmp, target, overwrite)
  except BaseException:  # clean up (best effort: never in place of the error being raised)
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _checkpoint_metadata(started_ns: int) -> bytes:
  return json.dumps(
    {
      "item_handlers": _plan.HANDLER,
      "metrics": {},
      "performance_metrics": {},
      "init_timestamp_nsecs": started_ns,
      "commit_timestamp_nsecs": time.time_ns(),
      "custom_metadata": {},
    }
  ).encode()


def _kvstore(directory: str, name: str | None = None) -> dict[str, Any]:
  spec: dict[str, Any] = {"driver": "ocdbt", "base": f"file://{directory}/", **_OCDBT}
  if name is not None:
    spec["path"] = name + "/"
  return spec


def _open_array(a: _plan.OrbaxArray, directory: str, ctx: ts.Context) -> ts.Future:
  spec = {
    "driver": "zarr",
    "kvstore": _kvstore(directory, a.name),
    "metadata": {
      "shape": list(a.shape),
      "chunks": list(a.chunks),
      "compressor": {"id": "zstd", "level": 1},
    },
    "dtype": a.dtype,
    "store_data_equal_to_fill_value": True,
    "recheck_cached_data": False,
    "recheck_cached_metadata": False,
  }
  return ts.open(spec, create=True, context=ctx)


def _regions(opener: _read.Opener, p: _plan.OrbaxPlan) -> Iterator[_read.Region]:
  """Each array's zarr chunks in order, charged three times their bytes (the read's raw and
  decoded bytes, then TensorStore's copy being written); a leaf the plan reads whole (stored
  inline or in a pack, read as C-order ranges only) in one read."""
  for k, a in enumerate(p.arrays):
    if a.value is not None:
      continue
    leaf = opener.leaf(a.leaf)
    size = _records.itemsize(a.dtype)
    boxes = [tuple((0, n) for n in a.shape)] if a.whole else _blocks.grid(a.shape, a.chunks)
    for box in boxes:
      yield _read.Region(leaf, box, 3 * size * _box_size(box), (k, box))


def _box_size(box: tuple[tuple[int, int], ...]) -> int:
  n = 1
  for lo, hi in box:
    n *= hi - lo
  return n


def _write_arrays(
  src: _source.Source,
  p: _plan.OrbaxPlan,
  tmp: str,
  ctx: ts.Context,
  window: _read.Window,
  target: str,
) -> None:
  """Every array of the plan into ``tmp/ocdbt.process_0``: numbers first (tiny), then each
  chunk as it lands, a window's worth of reads and writes in flight (a landed chunk's
  charge is released when its write has committed)."""
  directory = os.path.join(tmp, PROCESS_DIR)
  opens = {k: _open_array(a, directory, ctx) for k, a in enumerate(p.arrays)}
  stores = {k: _opened(f, p.arrays[k], target) for k, f in opens.items()}
  writes: collections.deque = collections.deque()  # (write future, charge, array)

  def finish_oldest() -> None:
    fut, charge, a = writes.popleft()
    _committed(fut, a, target)
    window.release(charge)

  def drain() -> None:
    while writes:
      finish_oldest()

  window.drain = drain
  for k, a in enumerate(p.arrays):
    if a.value is not None:
      writes.append((stores[k].write(a.value), 0, a))
  since_trim = 0
  for got in _read.read_regions(_regions(_read.Opener(src), p), window, release=False):
    k, box = got.region.tag
    assert got.data is not None  # (errors raised)
    data = got.data.reshape([hi - lo for lo, hi in box])
    index = tuple(slice(lo, hi) for lo, hi in box)
    writes.append((stores[k][index].write(data), got.region.cost, p.arrays[k]))
    while writes and writes[0][0].done():
      finish_oldest()
    since_trim += got.region.cost
    if since_trim >= window.limit:
      since_trim = _st._give_back_freed_memory()
  drain()


def _opened(fut: ts.Future, a: _plan.OrbaxArray, target: str) -> ts.TensorStore:
  try:
    return fut.result()
  except Exception as e:
    raise _write_error(e, a, target) from None


def _committed(fut: Any, a: _plan.OrbaxArray, target: str) -> None:
  try:
    fut.result()
  except Exception as e:
    raise _write_error(e, a, target) from None


def _write_error(e: Exception, a: _plan.OrbaxArray, target: str) -> CheckpointError:
  return CheckpointError(
    f"Cannot write {a.leaf.where} (Orbax array {a.name!r}) of the export to {target!r} "
    f"({type(e).__name__}: {_paths.error_text(e)}). Check the free space and permissions "
    "there."
  )


def _merge(tmp: str, ctx: ts.Context, target: str) -> None:
  """Copy the per-process OCDBT database's keys into the item's top-level one (its data
  files stay where they are, referred to), as Orbax's ``merge_ocdbt_per_process_files``."""
  try:
    child = ts.KvStore.open(_kvstore(os.path.join(tmp, PROCESS_DIR)), context=ctx).result()
    parent = ts.KvStore.open(_kvstore(tmp), context=ctx).result()
    txn = ts.Transaction(atomic=True)
    child.experimental_copy_range_to(parent.with_transaction(txn)).result()
    txn.commit_async().result()
  except Exception as e:
    raise CheckpointError(
      f"Cannot write the OCDBT manifest of the export to {target!r} "
      f"({type(e).__name__}: {_paths.error_text(e)})."
    ) from None
