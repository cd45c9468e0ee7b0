"""Barriers with deadlines, the commit marker, and reading a checkpoint's header safely.

Barriers go through the ``jax.distributed`` coordination service. Their ids come from the
checkpoint location and the phase (the service counts repeated uses of an id itself), never
from a process-global counter, so a process that skipped a save cannot shift every later
barrier. A timeout names the phase, the location and the processes that did not arrive.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import jax
import tensorstore as ts

from . import _manifest, _paths
from ._errors import BarrierTimeoutError, CheckpointError, NotCommittedError

__all__ = ["barrier", "read_header", "write_commit", "is_committed"]

DEFAULT_BARRIER_TIMEOUT_S = 600.0


def _client() -> Any:
  # No public accessor exists for the coordination client (jax.distributed exposes only
  # initialize/shutdown/is_initialized), so this is the one private import we allow.
  from jax._src import distributed
  return distributed.global_state.client


def barrier(location: str, phase: str, timeout_s: float) -> None:
  """Wait until every process reaches ``phase`` for ``location``; no-op with one process."""
  n = jax.process_count()
  if n == 1:
    return
  client = _client()
  key = hashlib.sha256(_paths.display(location).encode()).hexdigest()[:24]
  start = time.monotonic()
  try:
    client.wait_at_barrier(f"fnckpt/{key}/{phase}", max(1, int(timeout_s * 1000)))
  except Exception as e:  # jaxlib raises its own runtime error type
    text = str(e)
    missing = re.search(r"timed out task names:\s*([\d\s,]+)", text)
    who = (f"process(es) {', '.join(missing.group(1).split())}" if missing
           else "some processes")
    alive = ""
    try:
      live = client.get_live_nodes(list(range(n)))
      dead = sorted(set(range(n)) - set(live))
      if dead:
        alive = f" Processes {dead} are no longer alive."
    except Exception:
      pass
    raise BarrierTimeoutError(
        f"Barrier '{phase}' for {_paths.display(location)!r} failed after "
        f"{time.monotonic() - start:.1f}s (deadline {timeout_s:g}s) on process "
        f"{jax.process_index()}: {who} did not arrive.{alive} Every process must call the same "
        f"fnckpt save/restore for this location; raise barrier_timeout_s if they are merely "
        f"slow. ({text.splitlines()[0] if text else type(e).__name__})") from None


def read_header(kv: ts.KvStore, location: str) -> tuple[dict[str, Any], bytes]:
  """The validated manifest of a *committed* checkpoint, and its bytes. Clear errors for: no
  such location, an interrupted save, a marker that does not match its manifest."""
  commit_r = kv.read(_manifest.COMMIT)
  manifest_r = kv.read(_manifest.MANIFEST)
  commit_raw, manifest_raw = commit_r.result(), manifest_r.result()
  if commit_raw.state != "value":
    if manifest_raw.state == "value" or kv.list(range=ts.KvStore.KeyRange(
        _manifest.DATA_DIR + "/", _manifest.DATA_DIR + "0")).result():
      raise NotCommittedError(
          f"{location!r} holds an interrupted save: its data is (partly) there but it has no "
          f"commit marker, so it is not a checkpoint. Restore an earlier step, or delete "
          f"{location!r} and save again.")
    raise CheckpointError(
        f"No checkpoint at {location!r} (no {_manifest.COMMIT} marker, no {_manifest.MANIFEST}). "
        "Check the path; a checkpoint directory holds manifest.msgpack and COMMIT.")
  commit = _manifest.decode_commit(bytes(commit_raw.value), location)
  manifest_bytes = bytes(manifest_raw.value) if manifest_raw.state == "value" else b""
  if _manifest.digest(manifest_bytes) != commit["manifest_sha256"]:
    raise CheckpointError(
        f"The manifest of {location!r} does not match its commit marker (missing or "
        "modified after the commit). The checkpoint cannot be trusted; restore an earlier one.")
  return _manifest.decode(manifest_bytes, location), manifest_bytes


def is_committed(kv: ts.KvStore) -> bool:
  return kv.read(_manifest.COMMIT).result().state == "value"


def write_commit(kv: ts.KvStore, manifest_bytes: bytes) -> None:
  kv.write(_manifest.COMMIT, _manifest.encode_commit(manifest_bytes, time.time())).result()
