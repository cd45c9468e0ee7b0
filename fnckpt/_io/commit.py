"""Barriers with deadlines, the commit marker, and reading a checkpoint's header safely.

Barriers go through the ``jax.distributed`` coordination service. A save's barrier ids come
from its attempt's random id (:class:`fnckpt._io.collective.Session`); the manager's come from the
location and a name (the service counts repeated uses of an id itself). Never from a
process-global counter, so a process that skipped a save cannot shift every later barrier. A
timeout names the phase, the location and the processes that did not arrive, with the phase
each of them last reported (:func:`report`).
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import jax
import tensorstore as ts

from .._errors import (
  BarrierTimeoutError,
  CheckpointError,
  DamagedError,
  NoCheckpointError,
  NotCommittedError,
)
from .._format import manifest as _manifest
from .._format import records as _records
from . import paths as _paths

__all__ = [
  "barrier",
  "barrier_id",
  "report",
  "forget",
  "publish",
  "unpublish",
  "published",
  "read_header",
  "write_commit",
  "is_committed",
  "unchanged",
  "changed_error",
]

DEFAULT_BARRIER_TIMEOUT_S = 600.0


def _state() -> Any:
  # No public accessor exists for the coordination client or the preemption sync manager
  # (jax.distributed exposes only initialize/shutdown/is_initialized), so this is the one
  # private import we allow; every other module goes through it.
  from jax._src import distributed

  return distributed.global_state


def _client() -> Any:
  return _state().client


def _key(location: str) -> str:
  return hashlib.sha256(_paths.display(location).encode()).hexdigest()[:24]


def report(location: str, phase: str) -> None:
  """Publish the phase this process has reached for ``location`` (multi-process only), so a
  barrier timeout on another process can say where the missing processes are."""
  if jax.process_count() == 1:
    return
  try:
    _client().key_value_set(
      f"fnckpt/{_key(location)}/progress/{jax.process_index()}",
      f"{phase}@{time.time():.3f}",
      allow_overwrite=True,
    )
  except Exception:  # diagnostics only: never fail a save for them
    pass


def forget(location: str) -> None:
  """Drop this process's progress entry for ``location`` (the save is over)."""
  if jax.process_count() == 1:
    return
  try:
    _client().key_value_delete(f"fnckpt/{_key(location)}/progress/{jax.process_index()}")
  except Exception:
    pass


def publish(location: str, name: str, text: str) -> bool:
  """Publish this process's ``text`` under ``name`` for ``location`` (multi-process: the
  coordination service's key-value store); whether it was published."""
  for _ in range(3):
    try:
      _client().key_value_set(
        f"fnckpt/{_key(location)}/{name}/{jax.process_index()}", text, allow_overwrite=True
      )
      return True
    except Exception:
      time.sleep(0.2)
  return False


def unpublish(location: str, name: str) -> None:
  """Drop what this process published under ``name`` for ``location`` (if anything)."""
  try:
    _client().key_value_delete(f"fnckpt/{_key(location)}/{name}/{jax.process_index()}")
  except Exception:  # nothing there, or the service is gone: the next read says so
    pass


def published(location: str, name: str) -> list[tuple[int, str]]:
  """What the other processes published under ``name`` for ``location``: (process, text), in
  process order. Raises (fail closed) when the store cannot be read."""
  me = jax.process_index()
  entries = _client().key_value_dir_get(f"fnckpt/{_key(location)}/{name}/")
  found = ((k.rsplit("/", 1)[-1], v) for k, v in entries)
  return sorted((int(p), v) for p, v in found if p.isdigit() and int(p) != me)


def _progress(client: Any, key: str, missing: list[int]) -> str:
  """Where the missing processes last said they were (from :func:`report`)."""
  try:
    entries = dict(client.key_value_dir_get(f"fnckpt/{key}/progress/"))
  except Exception:
    return ""
  now, parts = time.time(), []
  for p in missing:
    value = next((v for k, v in entries.items() if k.rsplit("/", 1)[-1] == str(p)), None)
    if value is None:
      parts.append(f"process {p} has not started this save")
    else:
      phase, _, when = value.rpartition("@")
      try:
        ago = f" {now - float(when):.1f}s ago"
      except ValueError:
        ago = ""
      parts.append(f"process {p} last reported phase '{phase}'{ago}")
  return f" ({'; '.join(parts)})" if parts else ""


def barrier(location: str, phase: str, timeout_s: float) -> None:
  """Wait until every process reaches ``phase`` for ``location``; no-op with one process.

  The barrier id is the location's hash and the phase; the coordination service counts
  repeated uses of one id. (Saves use :class:`fnckpt._io.collective.Session`, whose barrier ids
  are unique per attempt.)"""
  if jax.process_count() == 1:
    return
  barrier_id(f"fnckpt/{_key(location)}/{phase}", location, phase, timeout_s)


def barrier_id(barrier: str, location: str, phase: str, timeout_s: float) -> None:
  """Wait at the coordination service barrier ``barrier``; a timeout raises
  :class:`BarrierTimeoutError` naming the phase, the location and the missing processes."""
  client = _client()
  key = _key(location)
  start = time.monotonic()
  try:
    client.wait_at_barrier(barrier, max(1, int(timeout_s * 1000)))
  except Exception as e:  # jaxlib raises its own runtime error type
    text = str(e)
    # The service lists the processes that did not arrive ("Some timed out task names:").
    # (Never ask it which nodes are alive here: that call is itself a barrier.)
    found = re.search(r"timed out task names:\s*(.*?)(?:\n\s*\n|$)", text, re.S)
    names = found.group(1) if found else ""
    missing = sorted(
      {int(p) for p in re.findall(r"task:(\d+)" if "task:" in names else r"\d+", names)}
    )
    who = (
      f"process(es) {', '.join(map(str, missing))} did not arrive{_progress(client, key, missing)}"
      if missing
      else "not every process arrived"
    )
    raise BarrierTimeoutError(
      f"Barrier '{phase}' for {_paths.display(location)!r} failed after "
      f"{time.monotonic() - start:.1f}s (deadline {timeout_s:g}s) on process "
      f"{jax.process_index()}: {who}. Every process must call the same fnckpt "
      f"save/restore for this location; raise barrier_timeout_s if they are merely slow. "
      f"({text.splitlines()[0] if text else type(e).__name__})"
    ) from None


def read_header(kv: ts.KvStore, location: str) -> tuple[_records.Manifest, bytes, bytes]:
  """The validated manifest of a *committed* checkpoint, its bytes and the commit marker's
  bytes. Clear errors for: no such location, an interrupted save, a marker that does not
  match its manifest (also when an overwrite replaced it between the two reads)."""
  manifest_bytes, commit_bytes = read_committed(kv, location)
  return (_manifest.decode(manifest_bytes, location), manifest_bytes, commit_bytes)


def read_committed(kv: ts.KvStore, location: str) -> tuple[bytes, bytes]:
  """The manifest's bytes of a *committed* checkpoint, checked against its commit marker
  (not decoded: :func:`read_header` decodes them), and the marker's bytes; errors as
  :func:`read_header`'s."""
  try:  # TensorStore I/O errors (no such bucket, access denied, unreachable) name the URL
    commit_r = kv.read(_manifest.COMMIT)
    manifest_r = kv.read(_manifest.MANIFEST)
    commit_raw, manifest_raw = commit_r.result(), manifest_r.result()
    leftovers = commit_raw.state != "value" and (manifest_raw.state == "value" or _has_data(kv))
  except Exception as e:
    raise _paths.io_error(e, location, "reading its commit marker and manifest") from e
  if commit_raw.state != "value":
    if leftovers:
      raise NotCommittedError(
        f"{location!r} holds an interrupted save: its data is (partly) there but it has no "
        f"commit marker, so it is not a checkpoint. Restore an earlier step, or delete "
        f"{location!r} and save again."
      )
    raise NoCheckpointError(
      f"No checkpoint at {location!r} (no {_manifest.COMMIT} marker, no {_manifest.MANIFEST}). "
      "Check the path; a checkpoint directory holds manifest.msgpack and COMMIT."
    )
  commit = _manifest.decode_commit(bytes(commit_raw.value), location)
  manifest_bytes = bytes(manifest_raw.value) if manifest_raw.state == "value" else b""
  if _manifest.digest(manifest_bytes) != commit["manifest_sha256"]:
    if not unchanged(kv, bytes(commit_raw.value)):
      raise changed_error(location)
    raise DamagedError(
      f"The manifest of {location!r} does not match its commit marker (missing or "
      "modified after the commit). The checkpoint cannot be trusted; restore an earlier one."
    )
  return manifest_bytes, bytes(commit_raw.value)


def _has_data(kv: ts.KvStore) -> bool:
  """Whether any save's data is there: format 1's ``d/``, format 2's ``data-<hex>/``."""
  ranges = [
    (_manifest.DATA_DIR + "/", _manifest.DATA_DIR + "0"),  # '0' follows '/'
    (_manifest.DATA_PREFIX, _manifest.DATA_PREFIX[:-1] + "."),
  ]  # '.' follows '-'
  lists = [kv.list(range=ts.KvStore.KeyRange(lo, hi)) for lo, hi in ranges]
  return any(bool(f.result()) for f in lists)


def unchanged(kv: ts.KvStore, commit_bytes: bytes) -> bool:
  """Whether the commit marker still holds ``commit_bytes`` (no overwrite or delete since)."""
  try:
    now = kv.read(_manifest.COMMIT).result()
  except Exception:
    return False
  return now.state == "value" and bytes(now.value) == commit_bytes


def changed_error(location: str) -> CheckpointError:
  return CheckpointError(
    f"The checkpoint at {location!r} changed while being read (it was overwritten or "
    "deleted by another save, a retention pass or a cleanup). Nothing was returned; read it "
    "again, or read a checkpoint that is not being replaced."
  )


def is_committed(kv: ts.KvStore) -> bool:
  try:
    return kv.read(_manifest.COMMIT).result().state == "value"
  except Exception as e:
    raise _paths.io_error(e, _paths.location_of(kv), "reading its commit marker") from e


def write_commit(
  kv: ts.KvStore, manifest_bytes: bytes, version: int = _manifest.FORMAT_VERSION
) -> None:
  """Write the commit marker of ``manifest_bytes`` (of format ``version``)."""
  kv.write(_manifest.COMMIT, _manifest.encode_commit(manifest_bytes, time.time(), version)).result()
