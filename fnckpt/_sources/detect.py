"""Checkpoints written by other libraries, read the way fnckpt reads its own.

:func:`open_foreign` finds what a location holds (after fnckpt's own reader found no commit
marker, manifest or data there; probes are empty byte-range reads, existence only): an Orbax
PyTree checkpoint (``_METADATA``: an item directory; ``_CHECKPOINT_METADATA``: a step
directory of a ``CheckpointManager`` or ``ocp.v1`` save holding one PyTree item), a
``.safetensors`` file, a ``model.safetensors.index.json``, or a directory of ``.safetensors``
files. It returns an :class:`Opened`: the leaves as validated
:class:`fnckpt._format.records.Manifest` records, the same records fnckpt's manifests give (so
restore's matching, tree checks, budget and placement are shared), and a reader of array
slices (``slice_reader(rec)(index, batch)`` -> a future of the slice;
``read_error(rec, e)`` -> a :class:`CheckpointError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import tensorstore as ts

from .._errors import CheckpointError, NotCommittedError
from .._format import records as _records
from .._io import paths as _paths
from . import orbax as _orbax_in
from . import safetensors as _safetensors_in

__all__ = ["Opened", "open_foreign", "open_orbax", "is_file_location"]

_OCDBT_CACHE_BYTES = 32 << 20  # OCDBT's B-tree nodes, per restore (its context, not global)


@dataclasses.dataclass(frozen=True)
class Opened:
  """A foreign checkpoint, opened: where, its format, its directory's kvstore, its records."""

  location: str
  format: str  # "orbax" or "safetensors"
  kv_spec: dict[str, Any]
  ctx: ts.Context
  kv: ts.KvStore
  manifest: _records.Manifest
  reader: Any


def is_file_location(path: str) -> bool:
  """Whether ``path`` names a safetensors file or index rather than a directory.

  >>> is_file_location("/m/model.safetensors"), is_file_location("/m/run/3")
  (True, False)
  """
  name = str(path).rstrip("/").rsplit("/", 1)[-1]
  return name.endswith(".safetensors") or name.endswith(".json")


def _resolve(
  path: str, options: Mapping[str, Any] | None
) -> tuple[dict[str, Any], ts.Context, ts.KvStore]:
  """Like :func:`fnckpt._io.paths.resolve`, with a bounded cache for OCDBT's B-tree nodes."""
  spec = _paths.kvstore_spec(path, options)
  resources: dict[str, Any] = {"cache_pool#ocdbt": {"total_bytes_limit": _OCDBT_CACHE_BYTES}}
  if spec["driver"] in ("s3", "gcs"):
    from .._io import object_stores as _object_stores

    spec, extra = _object_stores.split_context_resources(spec)
    resources.update(extra)
  ctx = _paths.context(resources=resources)
  try:
    return spec, ctx, ts.KvStore.open(spec, context=ctx).result()
  except Exception as e:
    raise _paths.io_error(e, path, "opening the location") from e


def open_foreign(path: str, options: Mapping[str, Any] | None) -> Opened | None:
  """The foreign checkpoint at ``path``, or None if there is none of a known format."""
  location = _paths.display(path)
  if is_file_location(path):
    parent, _, name = str(path).rstrip("/").rpartition("/")
    kv_spec, ctx, kv = _resolve(parent or ".", options)
    prefix = location[: len(location) - len(name)]
    if name.endswith(".json"):
      manifest, reader = _safetensors_in.open_index(kv, name, prefix)
    else:
      manifest, reader = _safetensors_in.open_file(kv, name, location, prefix)
    return _safetensors(location, (kv_spec, ctx, kv), manifest, reader)
  kv_spec, ctx, kv = _resolve(path, options)
  found = _present(
    kv, (_orbax_in.METADATA, _orbax_in.CHECKPOINT_METADATA, _safetensors_in.INDEX_NAME)
  )
  if found is None:  # (fnckpt's own reader looked first: its error says more about this place)
    return None
  if found & {_orbax_in.METADATA, _orbax_in.CHECKPOINT_METADATA}:
    return _open_orbax(path, location, kv_spec, ctx, kv, options)
  if _safetensors_in.INDEX_NAME in found:
    manifest, reader = _safetensors_in.open_index(kv, _safetensors_in.INDEX_NAME, location + "/")
    return _safetensors(location, (kv_spec, ctx, kv), manifest, reader)
  try:
    files = [k.decode("utf-8", "replace") for k in kv.list().result()]
  except Exception:
    return None
  files = [f for f in files if "/" not in f and f.endswith(".safetensors")]
  if files:
    manifest, reader = _safetensors_in.open_dir(kv, files, location)
    return _safetensors(location, (kv_spec, ctx, kv), manifest, reader)
  return None


def _present(kv: ts.KvStore, keys) -> set[str] | None:
  """Which of ``keys`` exist (empty byte-range reads: no value is transferred), or None if the
  location cannot be read."""
  probes = {k: _orbax_in.exists(kv, k) for k in keys}
  try:
    return {k for k, f in probes.items() if f.result().state == "value"}
  except Exception:
    return None


def open_orbax(path: str, options: Mapping[str, Any] | None) -> Opened | None:
  """The Orbax checkpoint at the directory ``path``, or None if there is none."""
  kv_spec, ctx, kv = _resolve(path, options)
  if not _present(kv, (_orbax_in.METADATA, _orbax_in.CHECKPOINT_METADATA)):
    return None
  return _open_orbax(path, _paths.display(path), kv_spec, ctx, kv, options)


def _open_orbax(path: str, location: str, kv_spec, ctx, kv, options) -> Opened:
  if ".orbax-checkpoint-tmp" in location.rsplit("/", 1)[-1]:
    raise NotCommittedError(
      f"{location!r} is an Orbax save in progress or interrupted (a temporary directory). "
      "Restore a finished checkpoint (its name has no .orbax-checkpoint-tmp suffix)."
    )
  if _orbax_in.exists(kv, _orbax_in.METADATA).result().state != "value":  # a step directory
    _check_committed(kv, path, options, location)
    item = _item_of(kv, location)
    path, location = _paths.join(path, item), f"{location}/{item}"
    kv_spec, ctx, kv = _resolve(path, options)
  else:
    _check_committed(kv, path, options, location)
  manifest, reader = _orbax_in.open_item(kv_spec, ctx, kv, location)
  return Opened(
    location=location,
    format="orbax",
    kv_spec=kv_spec,
    ctx=ctx,
    kv=kv,
    manifest=manifest,
    reader=reader,
  )


def _item_of(kv: ts.KvStore, location: str) -> str:
  """The one PyTree item of an Orbax step directory (from ``_CHECKPOINT_METADATA``)."""
  meta = _orbax_in._read_json(kv, _orbax_in.CHECKPOINT_METADATA, location)
  handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
  names = [k for k in handlers if isinstance(k, str)] if isinstance(handlers, dict) else []
  names = [n for n in names if _records._NAME.fullmatch(n)]
  probes = [_orbax_in.exists(kv, f"{n}/{_orbax_in.METADATA}") for n in names]
  items = [n for n, f in zip(names, probes) if f.result().state == "value"]
  if len(items) == 1:
    return items[0]
  if not items:
    raise CheckpointError(
      f"The Orbax checkpoint at {location!r} holds no PyTree item (items: "
      f"{', '.join(names) or 'none'}; none has a {_orbax_in.METADATA}). fnckpt reads Orbax "
      "PyTree/StandardSave items; give the item's directory."
    )
  raise CheckpointError(
    f"The Orbax checkpoint at {location!r} holds several PyTree items ({', '.join(items)}). "
    f"Restore one of them: e.g. fnckpt.restore('{location}/{items[0]}', target)."
  )


def _committed_here(kv: ts.KvStore, location: str) -> bool | None:
  """True: Orbax finished this directory; False: it says it did not; None: it says nothing."""
  if _orbax_in.exists(kv, _orbax_in.COMMIT_SUCCESS).result().state == "value":
    return True
  try:
    meta = _orbax_in._read_json(kv, _orbax_in.CHECKPOINT_METADATA, location, required=False)
  except CheckpointError:
    return False
  if meta is None:
    return None
  stamp = meta.get("commit_timestamp_nsecs") if isinstance(meta, dict) else None
  return isinstance(stamp, int) and not isinstance(stamp, bool)


def _check_committed(kv: ts.KvStore, path: str, options, location: str) -> None:
  """Orbax marks a finished save with ``commit_success.txt`` (0.12, every file system) or a
  ``commit_timestamp_nsecs`` in ``_CHECKPOINT_METADATA``; an item directory given on its own
  may carry neither, then its step directory (the parent) must."""
  state = _committed_here(kv, location)
  if state is None:
    parent = str(path).rstrip("/").rpartition("/")[0]
    if parent:
      state = _committed_here(_resolve(parent, options)[2], location)
  if not state:
    raise NotCommittedError(
      f"{location!r} is not a finished Orbax checkpoint: neither it nor its step directory "
      f"has {_orbax_in.COMMIT_SUCCESS} or a commit time in "
      f"{_orbax_in.CHECKPOINT_METADATA}. The save was interrupted; restore an earlier step."
    )


def _safetensors(location: str, opened: tuple, manifest: Any, reader: Any) -> Opened:
  """A safetensors file or index opened at ``location`` (``opened``: spec, context, kvstore)."""
  kv_spec, ctx, kv = opened
  return Opened(
    location=location,
    format="safetensors",
    kv_spec=kv_spec,
    ctx=ctx,
    kv=kv,
    manifest=manifest,
    reader=reader,
  )
