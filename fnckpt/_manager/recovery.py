"""Which step a manager restores, from which tier, and what to do when a copy is damaged.

:class:`Recovery` answers the manager's reading questions over one or two tiers
(:mod:`fnckpt._manager.tiers`): the steps there are, the newest step every process can restore
(collective: the processes exchange their local steps, process 0 decides with the pure
:func:`fnckpt._manager.tiers.choose`), and restoring a step: from this process's local copy when
it has one, else the durable one; a damaged local copy is marked and the durable copy of the
same step read instead. A step damaged in every copy it has goes to
:mod:`fnckpt._manager.health`'s fallback (warn, mark, try the next older step on every process).
"""

from __future__ import annotations

import warnings
from typing import Any

from .._errors import DamagedError
from .._io import attempt as _attempt
from .._io import coordination as _coordination
from .._io import paths as _paths
from .._restore import restore as _restore
from . import health as _health
from . import held as _held
from . import peers as _peers
from . import peers_regrid as _peers_regrid
from . import tiers as _tiers
from .claims import StepClaims
from .steps import StepIndex

__all__ = ["Recovery"]


class Recovery:
  """The reading side of a manager: ``index`` (durable), ``local`` (a
  :class:`fnckpt._manager.tiers.LocalTier` or ``None``), ``claims`` (steps being saved or read),
  the manager's barrier deadline."""

  def __init__(
    self, index: StepIndex, local: _tiers.LocalTier | None, claims: StepClaims, timeout_s: float
  ):
    self.index, self.local, self.claims, self.timeout_s = index, local, claims, timeout_s

  def steps(self) -> list[int]:
    """The committed steps of both tiers (this process's local view), oldest first."""
    saving = self.claims.saving()
    durable = set(self.index.list(in_flight=saving).steps)
    local = set(self.local.index.list(in_flight=saving).steps) if self.local else set()
    return sorted(durable | local)

  def index_of(self, step: int) -> StepIndex:
    """The tier that holds ``step`` on this process: local if it has it, else durable."""
    if self.local is not None and step in self.local.index.list().steps:
      return self.local.index
    return self.index

  def _local_steps(self) -> list[list[int]]:
    """Every process's local steps (collective), or ``[]`` with no local tier."""
    if self.local is None:
      return []
    mine = self.local.index.list(in_flight=self.claims.saving()).steps
    return _coordination.all_gather(self.index.root, "local-steps", mine, self.timeout_s)

  def _reports(self) -> list[_held.HeldReport]:
    """Every process's :class:`fnckpt._manager.held.HeldReport` (collective), or ``[]``
    with one process or no local tier."""
    if self.local is None or not _coordination.multi():
      return []
    mine = _peers.report(self.local.index, self.claims.saving())
    return [
      _held.HeldReport.from_json(r)
      for r in _coordination.all_gather(self.index.root, "held", mine.as_json(), self.timeout_s)
    ]

  def _choice(
    self,
    local_steps: list[list[int]],
    reports: list[_held.HeldReport],
    layout: str | None,
    target: Any = None,
  ) -> _held.Choice:
    """Process 0's :func:`fnckpt._manager.held.choose`, on every process (collective).
    ``target``: the restore's (None: any; ``False``: one recovery from peers cannot use)."""

    def decide() -> list:
      self.claims.wait_saved()
      durable = self.index.list(in_flight=self.claims.saving()).steps
      common = _tiers.choose(local_steps, [], set()) if local_steps else None
      moved = {s: _moved(reports, s, target) for r in reports for s in r.foreign}
      c = _held.choose(reports, [] if common is None else [common], durable, set(), layout, moved)
      return [c.step, c.source, c.warning]

    return _held.Choice(
      *_coordination.from_process_0(self.index.root, "held-choice", decide, self.timeout_s)
    )

  def _from_peers(self, target: Any, kwargs: dict[str, Any]) -> tuple[Any, int | None] | None:
    """Several processes with fast tiers: when process 0 picks a step only the processes'
    held shards together cover, restore it from them (collective); ``(value, step)``, or
    None to go on as before (a warning when a newer local step is skipped)."""
    reports = self._reports()
    if not reports:
      return None
    layouts = None if kwargs else _held.layouts_of(target)
    layout = _held.digest(layouts) if layouts is not None else "(not from peers)"
    choice = self._choice(
      self._local_steps(), reports, layout, target if layouts is not None else False
    )
    if choice.warning:
      warnings.warn(choice.warning, RuntimeWarning, stacklevel=4)
    if choice.source not in ("peers", "regrid"):
      return None
    assert choice.step is not None and self.local is not None  # (peers: a local tier's step)
    how = _peers.restore if choice.source == "peers" else _peers_regrid.restore
    self.claims.wait_saved(choice.step)
    with self.claims.reading(choice.step):
      value = how(
        self.index.root,
        self.local.index.at(choice.step),
        choice.step,
        reports,
        target,
        self.timeout_s,
      )
    return None if value is None else (value, choice.step)

  def _newest(self, local_steps: list[list[int]], skipped: set[int]) -> int | None:
    self.claims.wait_saved()
    durable = self.index.list(in_flight=self.claims.saving()).steps
    return _tiers.choose(local_steps, durable, skipped)

  def agreed_latest(self) -> int | None:
    """The newest step every process can restore (collective; process 0 decides)."""
    local_steps, reports = self._local_steps(), self._reports()
    if reports:
      return self._choice(local_steps, reports, None).step
    return _coordination.from_process_0(
      self.index.root, "latest", lambda: self._newest(local_steps, set()), self.timeout_s
    )

  def restore_latest(self, target: Any, kwargs: dict[str, Any]) -> tuple[Any, int | None]:
    """``(value, step)`` of the newest step no process finds damaged (collective): from the
    processes' held shards when only they cover it, else as :meth:`restore` reads."""
    peers = self._from_peers(target, kwargs)
    if peers is not None:
      return peers
    local_steps = self._local_steps()
    return _health.restore_newest_valid(
      self.index.root,
      lambda skipped: self._newest(local_steps, skipped),
      lambda step: self.restore(step, target, kwargs),
      self._mark,
      self.timeout_s,
    )

  def _mark(self, step: int, damage: str) -> None:
    for index in (self.index, self.local.index if self.local else None):
      if index is not None:
        _health.mark_step(index.location, step, damage)
        index.forget(step)

  def restore(self, step: int, target: Any, kwargs: dict[str, Any], explicit: bool = False) -> Any:
    """Restore ``step`` on this process: the local copy if it has one (unmarked), else the
    durable one; a damaged local copy is marked, with a warning, and the durable one read."""
    self.claims.wait_saved(step)
    # (a collective restore's attempts keyed on the durable step: per-host local paths differ)
    key = _paths.join(self.index.path(step), "(restore)")
    with self.claims.reading(step), _attempt.keyed(key):  # (retention, delete(): not meanwhile)
      if self.local is not None and step in self.local.index.list().steps:
        try:
          return _restore_at(self.local.index, step, target, kwargs)
        except DamagedError as e:
          if step not in self.index.list().steps:
            raise
          self._local_damaged(step, e)
      if explicit:
        _health.refuse_marked(self.index, step)
      return _restore_at(self.index, step, target, kwargs)

  def _local_damaged(self, step: int, error: DamagedError) -> None:
    assert self.local is not None
    try:
      _health.mark_step(self.local.index.location, step, str(error))
      self.local.index.forget(step)
    except Exception:  # only a memo: the durable copy is read regardless
      pass
    warnings.warn(
      f"The local copy of step {step} in {self.local.index.display!r} is damaged: "
      f"{error} Reading the durable copy in {self.index.display!r} instead; the "
      f"local copy is marked damaged.",
      RuntimeWarning,
      stacklevel=5,
    )


def _moved(reports: list[_held.HeldReport], step: int, target: Any) -> str | None:
  """None when another job's records of ``step`` the processes hold can be restored into
  ``target`` (None: any; False: none can), else why not."""
  if target is False:
    return "the target (or restore()'s arguments) is not one recovery from peers supports"
  plan = _peers_regrid.plan_for(reports, step, target)
  return plan if isinstance(plan, str) else None


def _restore_at(index: StepIndex, step: int, target: Any, kwargs: dict[str, Any]) -> Any:
  return _restore.restore_at(index.at(step), target, _restore.RestoreOptions(**kwargs))
