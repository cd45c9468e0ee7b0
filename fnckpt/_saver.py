"""The manager's save pipeline: whether a step is saved and to which tiers, the collective
save, and the background work after its commit (the durable copy, retention).

One save of step ``s``: due on the durable interval (:class:`fnckpt._interval.Cadence`, or
``force``, or the preemption step) and/or the local one (:class:`fnckpt._tiers.TierPolicy`);
process 0 checks that it may be saved (not older than the newest, not in flight, not
committed unless ``force``; a damaged step is replaced like a leftover) and, with ``"auto"``,
whether the previous durable save is still writing (then this one is skipped), and publishes
that for every process; then :func:`fnckpt.save` goes to the local tier if there is one, else
to the durable one. After the commit, in a background thread: process 0 copies a durable step
from the local tier (:meth:`fnckpt._tiers.LocalTier.copy_to_durable`), the save's cost is
measured, and process 0 runs retention on both tiers.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Mapping

import jax

from . import _commit, _coordination, _interval, _lineage, _paths, _steps, _tiers
from ._claims import StepClaims
from ._errors import CheckpointError
from ._preemption import Preemption
from ._retention_runner import Background, RetentionError, RetentionRunner

__all__ = ["Saver"]


class Saver:
  """Starts a manager's saves and their background work (see the module docstring)."""

  def __init__(self, index: _steps.StepIndex, local: _tiers.LocalTier | None,
               claims: StepClaims, cadence: _interval.Cadence, preemption: Preemption,
               background: Background, retention: RetentionRunner,
               save_options: Mapping[str, Any], timeout_s: float,
               incremental: _lineage.Incremental | None = None):
    self.index, self.local, self.claims, self.cadence = index, local, claims, cadence
    self.incremental = incremental or _lineage.Incremental(False, None)
    self.preemption, self.background, self.retention = preemption, background, retention
    self.save_options, self.timeout_s = dict(save_options), timeout_s
    self.last_saved: int | None = None

  def due(self, step: int) -> bool:
    """Whether ``step`` is on an interval (durable or local)."""
    return self.cadence.due(step) or (self.local is not None and self.local.policy.local_due(step))

  def save(self, step: int, tree: Any, user: Callable[[], Any], force: bool) -> Any:
    """Save ``step`` (``user()``: its manifest metadata) if it is due; its handle or None."""
    urgent = force or self.preemption.is_save_step(step)
    durable = urgent or self.cadence.due(step)
    local = self.local is not None and self.local.policy.local_due(step)
    if not (durable or local):
      return None
    metadata = user()
    index = self.local.index if self.local else self.index  # where the save goes

    def decide() -> dict[str, Any]:
      _check_may_save(self.claims, index, step, force)
      for written in {index, self.index if durable else index}:  # (references to it?)
        _lineage.check_replace(written, self.claims, step)
      busy = self.local.pending if self.local else self.claims.saving()
      return self.cadence.decide(busy=bool(busy)) if durable else {}

    # Decided on process 0 for all: every process calls the collective save, or none does.
    decision = _coordination.from_process_0(index.path(step), "may-save", decide,
                                            self.timeout_s)
    if durable:
      self.cadence.apply(step, {**decision, "save": decision["save"] or urgent})
      durable = decision["save"] or urgent  # "auto": skipped while the previous one writes
    if not (durable or local):
      return None
    return self._start(step, tree, index, metadata, durable)

  def _start(self, step: int, tree: Any, index: _steps.StepIndex, metadata: Any,
             durable: bool) -> Any:
    from . import _save
    inc = self.incremental  # the base: the newest committed step where this save goes
    # (claimed till committed); not with local tiers of several processes (each host's
    # local directory may hold only its own chunks: see fnckpt._tiers)
    base = (inc.choose(index, self.claims, step, self.timeout_s)
            if not (self.local and jax.process_count() > 1) else None)
    self.claims.claim_save(step)  # retention and deletes leave it alone from here
    try:
      handle = _save.start(tree, index.path(step), overwrite=True, metadata=metadata,
                           storage_options=index.storage_options, **self.save_options,
                           base=index.path(base.step) if base else None,
                           hashes=inc.enabled)
    except BaseException:
      self.claims.release_save(step)
      inc.release(base)
      raise
    self.claims.set_handle(step, handle)
    self.last_saved = step
    if self.local and durable:
      self.local.pending.add(step)
    self.background.spawn(f"fnckpt-manager:{self.index.display}/{step}", self._after_commit,
                          step, handle, durable, base)
    return handle

  def _copy(self, step: int) -> float:
    try:
      return self.local.copy_to_durable(step)
    except Exception as e:
      error = _copy_error(step, self.local, e)
      warnings.warn(str(error), RuntimeWarning, stacklevel=1)
      raise error from e

  def _after_commit(self, step: int, handle: Any, durable: bool, base: Any = None) -> None:
    """Background: wait for the save's commit; (process 0) copy it to the durable tier if
    it was saved to the local one (with the data of other steps it refers to), then apply
    retention (never while a copy runs: it may be bringing referenced data)."""
    try:
      handle.wait()
      cost = handle.stats.total_s
      if self.local and durable and jax.process_index() == 0:
        cost += self._copy(step)
      for index in ([self.local.index] if self.local else []) + ([self.index] * durable):
        index.note_committed(step)
      if durable:
        self.cadence.committed(cost)
    except BaseException as e:
      self.background.record(e)
      return
    finally:
      self.claims.release_save(step, handle)
      self.incremental.release(base)
      if self.local:
        self.local.pending.discard(step)
    if jax.process_index() == 0:  # errors are recorded (and warned about) by Background
      with self.local.copying if self.local else contextlib.nullcontext():
        self.retention.run()
      if self.local:
        self.local.retain(self.claims)


def _copy_error(step: int, local: _tiers.LocalTier, error: BaseException) -> RetentionError:
  """A failed durable copy, as background work of process 0 that every process's ``wait()``
  raises (a :class:`RetentionError`, which :class:`Background` shares)."""
  return RetentionError(
      f"Copying step {step} from the local tier {local.index.display!r} to the durable tier "
      f"{_paths.display(local.durable_root)!r} failed: {error} Step {step} is committed on the "
      "local tier only; the next durable save is copied as usual (or save it again with "
      "force=True).")


def _check_may_save(claims: StepClaims, index: _steps.StepIndex, step: int,
                    force: bool) -> None:
  """save(): refuse an older step, one being saved, or one committed already (unless
  ``force``). Run on process 0 for every process (``_coordination.from_process_0``)."""
  if force:
    return
  directory = index.display
  newest = max(claims.saving() | {index.newest_known() or -1})
  if newest > step:
    raise CheckpointError(
        f"Step {step} is older than step {newest}, already in {directory!r}. Steps must "
        "increase; to go back, delete the newer steps (manager.delete(s)) or pass force=True.")
  handle = claims.handle(step)
  if handle is not False and (handle is None or not handle.done()):
    raise CheckpointError(f"Step {step} is being saved to {directory!r} already; pass "
                          "force=True to replace it.")
  if (_commit.is_committed(_paths.open_kvstore(index.path(step), index.storage_options))
      and step not in index.list().damaged):  # a damaged step is replaced like a leftover
    raise CheckpointError(
        f"Step {step} is already committed in {directory!r}. Pass force=True to replace it, "
        "or save a new step.")
