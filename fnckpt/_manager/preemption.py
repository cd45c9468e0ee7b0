"""Preemption: a SIGTERM becomes "save at the next step boundary, then stop".

One process: a Python signal handler only sets a flag; the first step checked after it is the
step to save. Several processes (``jax.distributed``): JAX's preemption service, started by
``jax.distributed.initialize`` (on by default: config ``jax_enable_preemption_service``),
catches SIGTERM on any process and tells every process; they agree on a sync step (the
furthest step any process had reached, plus one), and
``multihost_utils.reached_preemption_sync_point(step)`` is true at that step on every process.
It must be asked at every step, with steps counting up by one (``should_save`` does).
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

import jax

from .._errors import CheckpointError
from .._io import coordination as _coordination

__all__ = ["Preemption"]

# The coordination-service key JAX's preemption service writes when a process receives the
# notice (tsl's preemption_sync_manager.cc); read only to answer `requested` early.
_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


class Preemption:
  """The preemption state of one manager: the notice, and the step chosen to save."""

  def __init__(self, directory: str):
    self.directory = directory
    self.step: int | None = None  # the step to save; fixed at the first check after notice
    self._flag = threading.Event()
    self._previous: dict[int, Any] = {}
    self._sync_point = False  # several processes: ask JAX's sync point

  def install(self, signals: tuple[int, ...]) -> None:
    """One process: ``signals`` only set a flag. Several: use JAX's preemption service."""
    if jax.process_count() > 1:
      if _coordination.preemption_sync_manager() is None:
        raise CheckpointError(
          "handle_preemption with several processes uses JAX's preemption service, which "
          "is off. Call jax.config.update('jax_enable_preemption_service', True) before "
          "jax.distributed.initialize()."
        )
      self._sync_point = True
      return
    if threading.current_thread() is not threading.main_thread():
      raise CheckpointError(
        "install_preemption_handler() must be called from the main thread "
        "(Python installs signal handlers there only)."
      )
    for sig in signals:
      if sig not in self._previous:
        self._previous[sig] = signal.signal(sig, self._on_signal)

  def _on_signal(self, signum: int, frame: Any) -> None:
    del frame
    if not self._flag.is_set():
      print(
        f"fnckpt: received {signal.Signals(signum).name}; saving {self.directory} at the "
        "next step boundary.",
        file=sys.stderr,
        flush=True,
      )
    self._flag.set()

  def check(self, step: int) -> bool:
    """Whether ``step`` is the step to save for a preemption (asks JAX's sync point with
    several processes: call it at every step)."""
    if self.step is None:
      if self._sync_point:
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(step):
          self.step = step
      elif self._flag.is_set():
        self.step = step
    return self.step == step

  def is_save_step(self, step: int) -> bool:
    """Like :meth:`check`, without asking JAX's sync point (which wants one call per step)."""
    return self.step == step if self._sync_point else self.check(step)

  @property
  def requested(self) -> bool:
    if self._flag.is_set() or self.step is not None:
      return True
    if not self._sync_point:
      return False
    try:
      _coordination.client().key_value_try_get(_NOTICE_KEY)
      return True
    except Exception:  # not found: no notice yet
      return False

  def reached(self, step: int) -> bool:
    return self.step is not None and step >= self.step

  def uninstall(self) -> None:
    """Restore the signal handlers this object replaced (from the main thread)."""
    if threading.current_thread() is threading.main_thread():
      for sig, previous in self._previous.items():
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
      self._previous.clear()
