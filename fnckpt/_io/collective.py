"""One save attempt across processes: an agreed id, barriers named by it, fail-fast errors.

With several processes (``jax.distributed``) a save is a collective call. :class:`Session`
gives each attempt a random id agreed through the coordination service's key-value store
(process 0 draws it, the others read it under the attempt's key: the k-th save to a location on
every process). Barrier ids and the data directory come from that id, so a retry after any
failure starts clean. When a process fails, it publishes its error and then *arrives* at every
remaining barrier of the attempt; every process checks for published errors after each
barrier (and while waiting for process 0's shared data), so all of them learn of the failure
at the next barrier (not at its deadline) and walk the remaining barriers too: nobody is left
waiting. It fails closed: a process that cannot publish its error arrives at no further
barrier (the others time out; none commits without its data), and a process that cannot read
the published errors stops the save. With one process all of this is a no-op.

Keys of attempt k live under ``fnckpt/<location hash>/<k>/``. Process 0 deletes the nonce and
the shared data once every process has passed the first barrier (all have read them then), and
the keys of attempt k-1 (its published errors) at the same point: every process has finished
attempt k-1 by the time it reaches attempt k's first barrier.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import jax

from .. import _state
from .._errors import BarrierTimeoutError, CheckpointError, SaveOutcome
from . import commit as _commit

__all__ = ["Session", "PHASES", "PeerFailedError"]

# Every attempt passes these barriers, in this order (also when it fails: see abort()).
PHASES = ("agreed", "checked", "cleared", "hashed", "written", "committed")

# How long one wait for process 0's shared data lasts before looking for published errors.
_POLL_S = 0.5
# The most characters of an error published to the other processes.
_MAX_ERROR_CHARS = 4000


class PeerFailedError(CheckpointError):
  """Another process failed during the same collective save."""


def _next_attempt(key: str) -> int:
  """The k-th attempt at a location (hash) on this process (``_state.sessions``): bounded, and
  evicted alike on every process (which all make the same sequence of saves)."""
  sessions = _state.sessions
  with sessions.lock:
    k = sessions.attempts.pop(key, -1) + 1
    sessions.attempts[key] = k
    while len(sessions.attempts) > _state.MAX_LOCATIONS:
      sessions.attempts.popitem(last=False)
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
    self.broken = False  # a barrier failed (deadline, lost process): walking on is pointless
    self.unpublished = False  # fail() could not publish: arrive nowhere (fail closed)
    self._lock = threading.Lock()
    if not self.multi:
      self.nonce = secrets.token_hex(16)
      return
    self.client = _commit._client()
    self.base = f"fnckpt/{_commit._key(location)}"
    self.attempt = _next_attempt(self.base)
    self.prefix = f"{self.base}/{self.attempt}"
    if jax.process_index() == 0:
      self.client.key_value_set(f"{self.prefix}/nonce", secrets.token_hex(16), allow_overwrite=True)
    try:
      self.nonce = self.client.blocking_key_value_get(f"{self.prefix}/nonce", self._ms())
    except Exception as e:
      raise BarrierTimeoutError(
        f"Saving to {location!r}: process 0 did not start this save within {timeout_s:g}s "
        f"(this is process {jax.process_index()}; {str(e).splitlines()[0] if str(e) else e!r})"
        ". Every process must call save for the same location, in the same order; raise "
        "barrier_timeout_s if process 0 is merely slow."
      ) from None

  @property
  def _errors(self) -> str:
    """Where this attempt's failures are published (``fnckpt/<location hash>/`` + this)."""
    return f"{self.attempt}/{self.nonce}/error"

  def _ms(self, seconds: float | None = None) -> int:
    return max(1, int((self.timeout_s if seconds is None else seconds) * 1000))

  def share(self, name: str, data: bytes) -> bytes:
    """Process 0 publishes ``data`` under ``name``; every process returns process 0's. While
    waiting, a published failure of another process raises :class:`PeerFailedError` at once."""
    if not self.multi:
      return data
    key = f"{self.prefix}/{self.nonce}/share/{name}"
    if jax.process_index() == 0:
      self.client.key_value_set_bytes(key, data, allow_overwrite=True)
      return data
    deadline = time.monotonic() + self.timeout_s
    while True:
      start = time.monotonic()
      try:
        return self.client.blocking_key_value_get_bytes(
          key, self._ms(min(_POLL_S, deadline - start))
        )
      except Exception:  # the wait's deadline (or a lost service): look for a reason
        self.raise_peer_error(f"while waiting for process 0's {name!r}")
        if time.monotonic() >= deadline:
          raise BarrierTimeoutError(
            f"Saving to {self.location!r}: process {jax.process_index()} waited "
            f"{self.timeout_s:g}s (barrier_timeout_s) for process 0's {name!r} and it never "
            "came. Every process must call save for the same location, in the same order; "
            "raise barrier_timeout_s if process 0 is merely slow."
          ) from None
        time.sleep(max(0.0, _POLL_S - (time.monotonic() - start)))  # (an error at once)

  def gather(self, phase: str, data: bytes) -> list[bytes] | None:
    """Every process publishes ``data`` and arrives at barrier ``phase``; process 0 returns
    every process's data (in process order), the others ``None``. One process: ``[data]``."""
    if not self.multi:
      return [data]
    key = f"{self.prefix}/{self.nonce}/gather/{phase}"
    self.client.key_value_set_bytes(f"{key}/{jax.process_index()}", data, allow_overwrite=True)
    self.barrier(phase)
    if jax.process_index() != 0:
      return None
    return [
      self.client.blocking_key_value_get_bytes(f"{key}/{p}", self._ms())
      for p in range(jax.process_count())
    ]

  def barrier(self, phase: str) -> None:
    """Wait for every process at ``phase``; then raise if any process has failed."""
    if not self.multi:
      return
    with self._lock:
      try:
        self._arrive(phase)
      except CheckpointError:
        # A failure another process published explains a failed barrier better (say this
        # process came late to a barrier whose deadline had passed for process 0).
        if phase != PHASES[-1]:
          self.raise_peer_error(f"at barrier '{phase}', which failed", strict=False)
        raise
    if phase == PHASES[0] and jax.process_index() == 0:
      self._tidy()
    # (past the last barrier the checkpoint is committed: an unreadable list is no failure)
    self.raise_peer_error(f"at barrier '{phase}'", phase, strict=phase != PHASES[-1])

  def _arrive(self, phase: str) -> None:
    try:
      _commit.barrier_id(
        f"{self.prefix}/{self.nonce}/{phase}", self.location, phase, self.timeout_s
      )
    except BaseException:
      self.broken = True
      raise
    self.passed.append(phase)

  def _tidy(self) -> None:
    """(Process 0, past the first barrier.) Every process has read the nonce and the shared
    data, and has finished the previous attempt: drop those keys."""
    stale = [f"{self.prefix}/nonce", f"{self.prefix}/{self.nonce}/share"]
    if self.attempt > 0:
      stale.append(f"{self.base}/{self.attempt - 1}")
    for key in stale:
      try:
        self.client.key_value_delete(key)
      except Exception:  # tidiness only
        pass

  def peer_error(self, strict: bool = True) -> tuple[int, str, bool | None] | None:
    """The first published error of another process, as (process, text, committed: whether
    that process had written the commit marker, see :meth:`fail`); None if none.
    ``strict``: a list that cannot be read is an error (fail closed: not knowing is not "no
    error"); else it reads as none (when a failure is being raised anyway)."""
    if not self.multi:
      return None
    try:
      found = _commit.published(self.location, self._errors)
    except Exception as e:
      if not strict:
        return None
      raise CheckpointError(
        f"Saving to {self.location!r}: cannot read the other processes' errors from the "
        f"coordination service ({type(e).__name__}: {e}), so this process stops the save "
        "rather than risk committing without another's data. Check the job's "
        "coordinator."
      ) from e
    return (found[0][0], *_unpublish(found[0][1])) if found else None

  def raise_peer_error(self, when: str, phase: str | None = None, strict: bool = True) -> None:
    """Raise :class:`PeerFailedError` if another process published a failure (``when``: what
    this process was doing; ``phase``: the barrier it just passed). Its ``outcome`` is the
    other process's word where that decides: process 0's (it writes the commit marker), or
    committed when another process failed past the last barrier (process 0 wrote the marker
    after every process had made its data durable); else none (this process's own state
    decides, when the save finishes)."""
    found = self.peer_error(strict)
    if found is None:
      return
    who, text, committed = found
    if phase == "written" and who != 0 and committed is None:
      # That process failed after passing 'written' itself (so every process's data was
      # durable): the commit goes on, and its error is seen at the next barrier. (Raising
      # here made the outcome depend on whether its error was published before this check.)
      return
    err = PeerFailedError(
      f"Saving to {self.location!r} failed on process {who} (process "
      f"{jax.process_index()} learned of it {when}): {text.rstrip()}"
    )
    if who == 0:
      err.outcome = SaveOutcome(committed)
    elif phase == PHASES[-1]:  # (an error from before 'written' was seen there)
      err.outcome = SaveOutcome(True)
    raise err

  def fail(self, error: BaseException, committed: bool | None = False) -> None:
    """Publish this process's failure (before arriving at the remaining barriers) and whether
    it had written the commit marker (``committed``: the writer's)."""
    if not self.multi or isinstance(error, PeerFailedError):
      return
    text = error.core if isinstance(error, CheckpointError) else str(error)
    text = text or type(error).__name__
    if not isinstance(error, CheckpointError):
      text = f"{type(error).__name__}: {text}"
    published = json.dumps({"text": text[:_MAX_ERROR_CHARS], "committed": committed})
    if not _commit.publish(self.location, self._errors, published):
      self.unpublished = True  # abort() must not arrive anywhere: the others would commit

  def abort(self) -> None:
    """Arrive at every barrier not yet passed, so no other process waits for this one. A
    barrier that fails (a deadline, a lost process) ends the walk, and a walk after one has
    failed does not start: the service has already failed it for every process."""
    if not self.multi or self.unpublished:  # fail closed: the others time out, never commit
      return
    with self._lock:
      for phase in PHASES:
        if self.broken:
          return
        if phase in self.passed:
          continue
        try:
          self._arrive(phase)
        except Exception:
          return

  def close(self) -> None:
    """After the attempt (committed, or every barrier walked): drop this process's progress
    entry, so that a later timeout at this location does not quote this attempt. (Published
    errors stay until the next attempt to this location drops them.)"""
    if self.multi:
      _commit.forget(self.location)


def _unpublish(value: str) -> tuple[str, bool | None]:
  """(text, committed) of an error :meth:`Session.fail` published."""
  try:
    got = json.loads(value)
    return str(got["text"]), got["committed"] if got["committed"] in (True, False) else None
  except (ValueError, TypeError, KeyError):  # (not ours: its text, and no word on the marker)
    return value, None
