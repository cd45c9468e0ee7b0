"""One save attempt across processes: an agreed id, barriers named by it, fail-fast errors.

With several processes (``jax.distributed``) a save is a collective call. :class:`Session`
gives each attempt a random id agreed through the coordination service's key-value store
(process 0 draws it, the others read it under the attempt's key: the k-th save to a location on
every process). Barrier ids and the data directory come from that id, so a retry after any
failure starts clean. When a process fails, it publishes its error and then *arrives* at every
remaining barrier of the attempt; every process checks for published errors after each
barrier, so all of them learn of the failure at the next barrier (not at its deadline) and walk
the remaining barriers too: nobody is left waiting. With one process all of this is a no-op.
"""

from __future__ import annotations

import collections
import secrets
import threading

import jax

from . import _commit
from ._errors import CheckpointError

__all__ = ["Session", "PHASES", "PeerFailedError"]

# Every attempt passes these barriers, in this order (also when it fails: see abort()).
PHASES = ("agreed", "checked", "cleared", "written", "committed")

_attempts_lock = threading.Lock()
# The k-th attempt per location (hash); bounded, and evicted alike on every process (which all
# make the same sequence of saves), so it never grows without limit.
_attempts: "collections.OrderedDict[str, int]" = collections.OrderedDict()
_MAX_LOCATIONS = 4096


class PeerFailedError(CheckpointError):
  """Another process failed during the same collective save."""


def _next_attempt(key: str) -> int:
  with _attempts_lock:
    k = _attempts.pop(key, -1) + 1
    _attempts[key] = k
    while len(_attempts) > _MAX_LOCATIONS:
      _attempts.popitem(last=False)
    return k


class Session:
  """One save attempt's collective state. ``nonce``: 32 hex digits, the same on every process.

  >>> s = Session("memory://doc/session", 10.0)   # one process: local, no I/O
  >>> len(s.nonce), s.multi
  (32, False)
  """

  def __init__(self, location: str, timeout_s: float):
    self.location = location
    self.timeout_s = timeout_s
    self.multi = jax.process_count() > 1
    self.passed: list[str] = []
    self._lock = threading.Lock()
    if not self.multi:
      self.nonce = secrets.token_hex(16)
      return
    self.client = _commit._client()
    self.prefix = f"fnckpt/{_commit._key(location)}/{_next_attempt(_commit._key(location))}"
    if jax.process_index() == 0:
      self.client.key_value_set(f"{self.prefix}/nonce", secrets.token_hex(16),
                                allow_overwrite=True)
    try:
      self.nonce = self.client.blocking_key_value_get(f"{self.prefix}/nonce", self._ms())
    except Exception as e:
      raise CheckpointError(
          f"Saving to {location!r}: process 0 did not start this save within "
          f"{timeout_s:g}s ({e}). Every process must call save for the same location.") from None

  def _ms(self) -> int:
    return max(1, int(self.timeout_s * 1000))

  def share(self, name: str, data: bytes) -> bytes:
    """Process 0 publishes ``data`` under ``name``; every process returns process 0's."""
    if not self.multi:
      return data
    key = f"{self.prefix}/{self.nonce}/{name}"
    if jax.process_index() == 0:
      self.client.key_value_set_bytes(key, data, allow_overwrite=True)
      return data
    return self.client.blocking_key_value_get_bytes(key, self._ms())

  def barrier(self, phase: str) -> None:
    """Wait for every process at ``phase``; then raise if any process has failed."""
    if not self.multi:
      return
    with self._lock:
      self._arrive(phase)
    self.raise_peer_error()

  def _arrive(self, phase: str) -> None:
    _commit.barrier_id(f"{self.prefix}/{self.nonce}/{phase}", self.location, phase,
                       self.timeout_s)
    self.passed.append(phase)

  def peer_error(self) -> str | None:
    """The first published error of another process, as 'process N: text' (None if none)."""
    if not self.multi:
      return None
    try:
      entries = self.client.key_value_dir_get(f"{self.prefix}/{self.nonce}/error/")
    except Exception:
      return None
    me = str(jax.process_index())
    found = sorted((int(k.rsplit("/", 1)[-1]), v) for k, v in entries
                   if k.rsplit("/", 1)[-1] != me)
    return f"process {found[0][0]}: {found[0][1]}" if found else None

  def raise_peer_error(self) -> None:
    text = self.peer_error()
    if text is not None:
      raise PeerFailedError(
          f"Saving to {self.location!r} failed on {text} Nothing was committed; earlier "
          "checkpoints are intact.")

  def fail(self, error: BaseException) -> None:
    """Publish this process's failure (before arriving at the remaining barriers)."""
    if not self.multi or isinstance(error, PeerFailedError):
      return
    try:
      self.client.key_value_set(f"{self.prefix}/{self.nonce}/error/{jax.process_index()}",
                                str(error).splitlines()[0][:2000], allow_overwrite=True)
    except Exception:
      pass

  def abort(self) -> None:
    """Arrive at every barrier not yet passed, so no other process waits for this one. A
    barrier that fails (a process is gone) ends the walk."""
    if not self.multi:
      return
    with self._lock:
      for phase in PHASES:
        if phase in self.passed:
          continue
        try:
          self._arrive(phase)
        except Exception:
          return

  def close(self) -> None:
    """After the last barrier: process 0 drops this attempt's keys."""
    if self.multi and jax.process_index() == 0:
      try:
        self.client.key_value_delete(self.prefix)
      except Exception:
        pass

