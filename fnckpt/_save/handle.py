"""A save as its caller sees it: the :class:`SaveHandle` (wait, poll, stats, and for a failed
save its error, whose ``outcome`` is decided here), :class:`SaveStats`, and :func:`wait` for
every pending save of the process.

No failure is lost: a save stays pending (``fnckpt._state.saves``) until its error has been
raised to someone; ``fnckpt.wait()`` raises those nobody has seen, and the exit handler
(registered by the first save) prints them and makes the exit status 1.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading

from .. import _state
from .._errors import CheckpointError, SaveOutcome, SavesFailedError
from .._io import collective as _collective

__all__ = ["SaveStats", "SaveHandle", "wait", "begin"]


@dataclasses.dataclass
class SaveStats:
  """What one save did on this process. Seconds are wall-clock.

  >>> SaveStats().bytes_written
  0
  """

  blocking_s: float = 0.0  # time save() held the caller
  write_s: float = 0.0  # from the first chunk write until all chunks are durable
  commit_s: float = 0.0  # barriers, manifest and commit marker
  total_s: float = 0.0  # from the call until committed
  bytes_written: int = 0  # array bytes this process wrote (chunks and packs)
  chunks_written: int = 0
  bytes_reused: int = 0  # array bytes equal to the base's, not written (save(base=))
  peak_staged_bytes: int = 0  # the most host bytes held for this process's pending saves
  # (as charged to the budget: CHUNK_COST x each chunk in flight)


class SaveHandle:
  """A save in flight. ``wait()`` blocks until the checkpoint is committed and re-raises any
  error (its ``outcome`` says what the failed save left: ``committed``, ``replaced``);
  ``done()`` polls; ``stats`` says what happened.

  >>> import numpy as np, fnckpt, tempfile
  >>> h = fnckpt.save({"x": np.arange(3)}, f"{tempfile.mkdtemp()}/c")
  >>> h.wait().total_s > 0, h.done()
  (True, True)
  """

  def __init__(self, location: str):
    self.location = location
    self.stats = SaveStats()
    self._event = threading.Event()
    self._error: BaseException | None = None
    self._seq = next(_state.saves.order)  # fnckpt.wait() reports failures in the save order
    self.replaced = False  # overwrite=True removed what was at the location
    self.planned: tuple | None = None  # its planned leaf records (a later save's base)
    self._callbacks: list = []

  def add_done_callback(self, fn) -> None:
    """Call ``fn()`` once the save has finished (at once if it has; from the thread that
    finishes it otherwise: ``fn`` must not block)."""
    with _state.saves.lock:
      if not self._event.is_set():
        self._callbacks.append(fn)
        return
    fn()

  def done(self) -> bool:
    """Whether the save has finished (committed or failed); never blocks."""
    return self._event.is_set()

  def wait(self, timeout: float | None = None) -> SaveStats:
    """Block until committed (or ``timeout`` seconds); raise the save's error if it failed."""
    if not self._event.wait(timeout):
      raise TimeoutError(f"The save to {self.location!r} is still running after {timeout}s.")
    with _state.saves.lock:
      _state.saves.pending.discard(self)  # (its error, if any, is seen now)
    if self._error is not None:
      raise self._error
    return self.stats

  def _finish(
    self, error: BaseException | None, committed: bool | None = False, reported: bool = False
  ) -> None:
    """The save ended: ``error`` (None: committed; ``reported``: raised to the caller now).
    Its ``outcome`` is decided here, the one place that knows both what the writer did
    (``committed``: whether this process wrote the commit marker, or cannot tell) and whether
    the save removed an old checkpoint first (``replaced``); a PeerFailedError may carry the
    word of the process that decides (process 0's)."""
    if isinstance(error, CheckpointError):
      known = error.outcome if isinstance(error, _collective.PeerFailedError) else None
      error.outcome = (
        dataclasses.replace(known, replaced=self.replaced)
        if known is not None
        else SaveOutcome(committed, self.replaced)
      )
    self._error = error
    saves = _state.saves
    with saves.lock:
      if error is None or reported:
        saves.pending.discard(self)
      if saves.latest.get(self.location) is self:
        del saves.latest[self.location]
      self._event.set()
      callbacks, self._callbacks = self._callbacks, []
    for fn in callbacks:
      fn()

  def __repr__(self) -> str:
    state = "failed" if self._error else "committed" if self.done() else "pending"
    return f"SaveHandle({self.location!r}, {state})"


def begin(location: str) -> SaveHandle:
  """A new save's handle, registered as pending and as the newest save to ``location``; once
  the save to ``location`` before it has finished (its error, if any, stays for its own handle
  and ``fnckpt.wait()``). The first save registers the exit handler (not the import: it then
  runs before ``jax.distributed``'s, while the coordination service is still up)."""
  handle = SaveHandle(location)
  saves = _state.saves
  with saves.lock:  # register first: a concurrent save to this location waits for us
    if not saves.exit_registered:
      atexit.register(_finish_at_exit)
      saves.exit_registered = True
    earlier = saves.latest.get(location)
    saves.latest[location] = handle
    saves.pending.add(handle)
  if earlier is not None:
    earlier._event.wait()
  return handle


def wait() -> None:
  """Wait for every pending save of this process; raise every failure nobody has seen yet
  (its error, or one listing them all whose ``errors`` are each save's, in order).

  >>> import fnckpt
  >>> fnckpt.wait()  # nothing pending: returns at once
  """
  with _state.saves.lock:
    handles = sorted(_state.saves.pending, key=lambda h: h._seq)
  errors = []
  for h in handles:
    try:
      h.wait()
    except BaseException as e:
      errors.append(e)
  if len(errors) == 1:
    raise errors[0]
  if errors:
    raise SavesFailedError(
      f"{len(errors)} saves failed:\n" + "\n".join(f"  - {str(e).splitlines()[0]}" for e in errors),
      errors=errors,
    ) from errors[0]


def _finish_at_exit() -> None:
  """Saves still running finish before the interpreter exits (their thread is not a daemon,
  so Python joins it before this runs). Failures nobody waited for are printed here and make
  the exit status 1, so a scheduler does not record success."""
  with _state.saves.lock:
    handles = sorted(_state.saves.pending, key=lambda h: h._seq)
  failed = False
  for h in handles:
    try:
      h.wait()
    except BaseException as e:
      failed = True
      print(
        f"fnckpt: at interpreter exit: the save to {h.location!r} failed and nobody "
        f"waited for it: {e}",
        file=sys.stderr,
      )
  if failed:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
