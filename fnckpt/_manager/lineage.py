"""The manager's incremental saves (which earlier step a save refers to) and forks.

Kept out of ``manager`` so that the manager only asks two questions: which base for this
save (:meth:`Incremental.choose`) and fork this step (:func:`fork`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from .._errors import CheckpointError
from .._io import commit as _commit
from .._io import coordination as _coordination
from .._io import paths as _paths
from . import fork as _fork

__all__ = ["Incremental", "Base", "fork"]

# How often a save looks for its base when the one it chose was deleted while it looked.
_LOOKS = 3


@dataclasses.dataclass
class Base:
  """The committed step an incremental save refers to; on process 0 it stays claimed for
  reading (so retention and deletes spare it) until the save has committed or failed."""

  step: int
  claim: Any = None
  in_flight: bool = False  # process 0 chose a save still in flight in this manager


class Incremental:
  """``incremental``: each save refers to the newest committed step; ``full_every``: every
  ``full_every``-th save of this manager is a full save (then its first one is full too)."""

  def __init__(self, enabled: bool, full_every: int | None):
    if not isinstance(enabled, bool):
      raise ValueError(f"incremental must be True or False, got {enabled!r}.")
    if full_every is not None and (
      not isinstance(full_every, int) or isinstance(full_every, bool) or full_every < 1
    ):
      raise ValueError(f"full_every must be None or an int >= 1, got {full_every!r}.")
    if full_every is not None and not enabled:
      raise ValueError("full_every needs incremental=True.")
    self.enabled = enabled
    self.full_every = full_every
    self._since_full: int | None = None  # saves since the last full one (None: none yet)
    self._lock = threading.Lock()
    self._bases: collections.Counter[int] = collections.Counter()  # (process 0) in flight

  def in_flight_base(self, step: int) -> bool:
    """(Process 0.) Whether a save in flight refers to ``step``'s data (is based on it)."""
    with self._lock:
      return self._bases[step] > 0

  def choose(self, index: Any, claims: Any, step: int, timeout_s: float) -> Base | None:
    """The base of a save of ``step`` into the :class:`fnckpt._manager.steps.StepIndex` ``index``
    (None: a full save). Collective: process 0 decides (the newest step before ``step``
    that is committed, never one marked damaged, or in flight in this manager: the new save
    then refers to it once it commits, ``fnckpt._save.pending``) and claims it in ``claims``
    for reading (a step in flight too: retention spares it once committed)."""
    if not self.enabled:
      return None
    with self._lock:
      full = self.full_every is not None and (
        self._since_full is None or self._since_full + 1 >= self.full_every
      )
    claimed: list[Any] = []

    def decide() -> list | None:
      if full:
        return None
      for _ in range(_LOOKS):
        older = [s for s in index.list(in_flight=claims.saving()).steps if s < step]
        flying = _flying(index, claims, step)
        if not older and not flying:
          return None
        chosen = max(older[-1:] + flying)
        cm = claims.reading(chosen)
        cm.__enter__()
        if chosen in flying or _commit.is_committed(_paths.open_kvstore(index.at(chosen))):
          claimed.append(cm)
          with self._lock:
            self._bases[chosen] += 1
          return [chosen, chosen in flying]
        # Deleted meanwhile: a newer step committed between the listing and the look at the
        # saves in flight (it was in neither), and retention removed this one. Look again.
        cm.__exit__(None, None, None)
      return None  # (still moving after a few looks: a full save, which is always right)

    chosen = _coordination.from_process_0(index.path(step), "base", decide, timeout_s)
    with self._lock:
      self._since_full = 0 if chosen is None else (self._since_full or 0) + 1
    return (
      None if chosen is None else Base(chosen[0], claimed[0] if claimed else None, bool(chosen[1]))
    )

  def release(self, base: Base | None) -> None:
    if base is not None and base.claim is not None:
      claim, base.claim = base.claim, None
      with self._lock:
        self._bases[base.step] -= 1
        if self._bases[base.step] <= 0:
          del self._bases[base.step]
      claim.__exit__(None, None, None)


def _flying(index: Any, claims: Any, step: int) -> list[int]:
  """(Process 0.) Steps before ``step`` whose save to ``index`` is in flight in this manager."""
  out = []
  for s in claims.saving():
    h = claims.handle(s)
    if (
      s < step
      and h not in (None, False)
      and not h.done()
      and (h.location == _paths.display(index.path(s)))
    ):
      out.append(s)
  return out


def fork(index: Any, step: int, directory: str) -> None:
  """(Process 0.) Fork committed ``step`` of the run of ``index`` (a
  :class:`fnckpt._manager.steps.StepIndex`) into ``directory``."""
  if not _commit.is_committed(_paths.open_kvstore(index.at(step))):
    raise CheckpointError(
      f"Cannot fork step {step} of {index.display!r}: it is not a "
      "committed step of that directory (see manager.all_steps(); a step "
      "of the local tier only is forked once it is durable)."
    )
  target = _paths.Location.of(directory, index.location.options).join(str(step))
  if _paths.list_keys(target):
    raise CheckpointError(
      f"Cannot fork into {_paths.display(directory)!r}: step {step} "
      "exists there already. Fork into a new directory."
    )
  _fork.fork_step(index.location, step, directory)


def check_replace(
  index: Any, claims: Any, step: int, incremental: Incremental | None = None
) -> None:
  """(Process 0.) Refuse to save over ``step`` (``force``, or a deleted step whose data is
  kept) while other steps, forks or (``incremental``) saves in flight refer to its data:
  replacing it would break them. A deleted step whose kept data nothing refers to any more
  is cleared (so that it can be saved)."""
  # (first: a base still in flight may have written no file yet)
  if incremental is not None and incremental.in_flight_base(step):
    raise CheckpointError(
      f"Step {step} of {index.display!r} cannot be replaced: an incremental save in flight "
      "refers to its data (it is that save's base). Wait for it (manager.wait()); then "
      "delete the steps that refer to it first, or save a new step."
    )
  if not index.exists(step):
    return
  listing = index.list(in_flight=claims.saving())
  kept = index.refs.kept(listing, {step}).get(step)
  if kept:
    users = sorted(
      s
      for s, stamp in listing.committed.items()
      if s != step and any(t == step for t, _ in index.refs.of_step(s, stamp))
    )
    who = f"steps {users}" if users else "a fork of this run"
    raise CheckpointError(
      f"Step {step} of {index.display!r} cannot be replaced: {who} refer to its data "
      "(incremental saves or forks). Delete those first, or save a new step."
    )
  if step in listing.held:  # deleted, and nothing refers to its kept data any more
    index.delete(step)
