"""Which steps this process's manager is saving, deleting or reading right now.

Retention and ``delete()`` leave a claimed step alone; a save, delete or read of a step waits
until the conflicting claims on it end. Claims are local to one process: with several
processes only process 0 deletes, and every process makes the same saves and restores.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = ["StepClaims"]


class StepClaims:
  """Per-step claims: saving (with the save's handle once it exists), deleting, reading.

  >>> claims = StepClaims()
  >>> claims.claim_save(3); claims.saving()
  {3}
  >>> claims.release_save(3); claims.saving()
  set()
  """

  def __init__(self) -> None:
    self._cond = threading.Condition()
    self._saving: dict[int, Any] = {}  # step -> SaveHandle (None while staging)
    self._deleting: set[int] = set()
    self._reading: collections.Counter[int] = collections.Counter()

  def saving(self) -> set[int]:
    with self._cond:
      return set(self._saving)

  def busy(self) -> set[int]:
    """The steps being saved or deleted (their directories may look like leftovers)."""
    with self._cond:
      return set(self._saving) | self._deleting

  def handle(self, step: int) -> Any:
    """The handle of ``step``'s save in flight; ``None`` while staging; ``False`` if none."""
    with self._cond:
      return self._saving.get(step, False)

  def claim_save(self, step: int) -> None:
    """Wait until no save or deletion of ``step`` is in flight, then claim it for saving."""
    with self._cond:
      self._cond.wait_for(lambda: step not in self._saving and step not in self._deleting)
      self._saving[step] = None

  def set_handle(self, step: int, handle: Any) -> None:
    with self._cond:
      self._saving[step] = handle

  def release_save(self, step: int, handle: Any = None) -> None:
    with self._cond:
      if self._saving.get(step, False) is handle:
        del self._saving[step]
      self._cond.notify_all()

  def wait_saved(self, step: int | None = None) -> None:
    """Wait until the save of ``step`` (default: every save) is no longer in flight."""
    with self._cond:
      self._cond.wait_for(
        lambda: (step not in self._saving) if step is not None else not self._saving
      )

  @contextlib.contextmanager
  def reading(self, step: int) -> Iterator[None]:
    """Claim ``step`` for reading (after any deletion of it) for the ``with`` block."""
    with self._cond:
      self._cond.wait_for(lambda: step not in self._deleting)
      self._reading[step] += 1
    try:
      yield
    finally:
      with self._cond:
        self._reading[step] -= 1
        if not self._reading[step]:
          del self._reading[step]
        self._cond.notify_all()

  def claim_delete(self, step: int) -> None:
    """Wait until nothing else holds ``step``, then claim it for deletion."""
    with self._cond:
      self._cond.wait_for(
        lambda: (
          step not in self._saving and step not in self._deleting and step not in self._reading
        )
      )
      self._deleting.add(step)

  def claim_unprotected(self, choose: Callable[[set[int]], list[int]]) -> list[int]:
    """Claim for deletion the steps ``choose(protected)`` returns, where ``protected`` are the
    steps claimed now (``choose`` must not return those); in one breath, so no claim slips in."""
    with self._cond:
      protected = set(self._saving) | self._deleting | set(self._reading)
      doomed = [s for s in choose(protected) if s not in protected]
      self._deleting.update(doomed)
      return doomed

  def release_delete(self, steps: list[int] | set[int]) -> None:
    with self._cond:
      self._deleting.difference_update(steps)
      self._cond.notify_all()
