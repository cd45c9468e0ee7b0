"""The manager's save pipeline: whether a step is saved and to which tiers, the collective
save, and the background work after its commit (the durable copy, retention).

One save of step ``s``: due on the durable interval (:class:`fnckpt._manager.interval.Cadence`, or
``force``, or the preemption step) and/or the local one (:class:`fnckpt._manager.tiers.TierPolicy`);
process 0 checks that it may be saved in both tiers (not older than the newest, not in
flight, not committed unless ``force``; a damaged step is replaced like a leftover) and, with
``"auto"``, whether the previous durable save is still writing (then this one is skipped),
and publishes that for every process (keyed on the durable step). Then :func:`fnckpt.save`
goes to the local tier if there is one, except a durable step with several processes, which
goes to the durable one (as without a local tier). After the commit, in a background thread:
with one process a durable step saved locally is copied to the durable tier
(:meth:`fnckpt._manager.tiers.LocalTier.copy_to_durable`; a later durable save waits for it), the
save's cost is measured, process 0 runs the durable tier's retention and every process its
own local tier's. No cross-process wait covers a copy (copies happen with one process only).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import jax

from .._errors import CheckpointError, DamagedError
from .._io import commit as _commit
from .._io import coordination as _coordination
from .._io import paths as _paths
from .._save import pending as _pending
from .._save import save as _save
from .._save.options import SaveOptions
from . import held as _held
from . import interval as _interval
from . import lineage as _lineage
from . import peers as _peers
from . import steps as _steps
from . import tiers as _tiers
from .claims import StepClaims
from .preemption import Preemption
from .retention_runner import Background, RetentionError, RetentionRunner

__all__ = ["Saver"]


class Saver:
  """Starts a manager's saves and their background work (see the module docstring)."""

  def __init__(
    self,
    index: _steps.StepIndex,
    local: _tiers.LocalTier | None,
    claims: StepClaims,
    cadence: _interval.Cadence,
    preemption: Preemption,
    background: Background,
    retention: RetentionRunner,
    save_options: SaveOptions,
    timeout_s: float,
    incremental: _lineage.Incremental | None = None,
  ):
    self.index, self.local, self.claims, self.cadence = index, local, claims, cadence
    self.incremental = incremental or _lineage.Incremental(False, None)
    self.preemption, self.background, self.retention = preemption, background, retention
    self.save_options, self.timeout_s = save_options, timeout_s
    self.last_saved: int | None = None
    self._warned_tiers = False  # (incremental with local tiers on several processes)
    self._recent: dict[int, Any] = {}  # step -> handle of the latest saves (their bases)

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
    # One attempt from the decision to the save's start: a failure on any process before it
    # (its metadata, its copy of the held shards) fails every process, and none saves.
    with _coordination.operation(self.index.root, "save", self.timeout_s):
      ready = self._decide(
        step, tree, user, force=force, durable=durable, local=local, urgent=urgent
      )
    return None if ready is None else self._start(step, tree, *ready)

  def _decide(
    self,
    step: int,
    tree: Any,
    user: Callable[[], Any],
    force: bool,
    durable: bool,
    local: bool,
    urgent: bool,
  ) -> tuple[_steps.StepIndex, Any, bool, Any, Any] | None:
    """save(): process 0's decision for every process; then the base and held shards of a
    save that goes on (the tier, the metadata, durable, base, staged), else None."""
    metadata = user()

    def decide() -> dict[str, Any]:
      for index in [self.index] + ([self.local.index] if self.local else []):
        _check_may_save(self.claims, index, step, force)  # both tiers: a wiped one hides none
        _lineage.check_replace(
          index,
          self.claims,
          step,  # (do other steps refer to it?)
          self.incremental,
        )
      busy = (
        self.local.pending if self.local is not None and self._copies() else self.claims.saving()
      )
      return self.cadence.decide(busy=bool(busy)) if durable else {}

    # Decided on process 0 for all: every process calls the collective save, or none does.
    # Keyed on the durable location (local path strings may differ between hosts).
    decision = _coordination.from_process_0(
      self.index.path(step), "may-save", decide, self.timeout_s
    )
    if durable:
      self.cadence.apply(step, {**decision, "save": decision["save"] or urgent})
      durable = decision["save"] or urgent  # "auto": skipped while the previous one writes
    if not (durable or local):
      return None
    if durable and self._copies():  # back-pressure: one durable copy pending at a time
      assert self.local is not None
      self.cadence.waited(self.local.wait_copied())
    index = self._where(durable)
    base = self._base(step, index)
    try:
      staged = self._stage_held(step, tree, index)
    except BaseException:
      self.incremental.release(base)
      raise
    return index, metadata, durable, base, staged

  def _copies(self) -> bool:
    """Whether durable steps are saved to the local tier and copied from there: only with
    one process (several processes save durable steps to ``directory`` themselves, each its
    own chunks: a per-host local tier holds only its host's chunks)."""
    return self.local is not None and not _coordination.multi()

  def _where(self, durable: bool) -> _steps.StepIndex:
    """The tier a save goes to: the local one if there is one, except for a durable step
    with several processes (saved to ``directory``, as without tiers)."""
    if self.local is not None and (self._copies() or not durable):
      return self.local.index
    return self.index

  def _base(self, step: int, index: _steps.StepIndex) -> Any:
    inc = self.incremental  # the base: the newest committed step where this save goes
    # (claimed till committed); not with local tiers of several processes (each host's
    # local directory may hold only its own chunks: see fnckpt._manager.tiers)
    base = (
      inc.choose(index, self.claims, step, self.timeout_s)
      if not (self.local and jax.process_count() > 1)
      else None
    )
    if inc.enabled and self.local and jax.process_count() > 1 and not self._warned_tiers:
      self._warned_tiers = True
      warnings.warn(
        "CheckpointManager(incremental=True, local_directory=...) with several processes: "
        "every save is written in full (hashes recorded), because a per-host fast-tier "
        "directory may hold only its host's chunks, so no base there is readable by every "
        "process. Use incremental=True without local_directory to write only what changed.",
        RuntimeWarning,
        stacklevel=5,
      )
    return base

  def _start(
    self,
    step: int,
    tree: Any,
    index: _steps.StepIndex,
    metadata: Any,
    durable: bool,
    base: Any,
    staged: Any,
  ) -> Any:
    inc = self.incremental
    self.claims.claim_save(step)  # retention and deletes leave it alone from here
    try:
      # A local tier's barriers are keyed on the durable step (per-host paths may differ).
      key = None if index is self.index else _paths.join(self.index.path(step), "(local-tier)")
      handle = _save.start(
        tree,
        index.at(step),
        self.save_options,
        metadata=metadata,
        base=index.path(base.step) if base else None,
        barrier_location=key,
        base_state=self._base_state(base),
      )
    except BaseException:
      self.claims.release_save(step)
      inc.release(base)
      raise
    self.claims.set_handle(step, handle)
    self.last_saved = step
    self._recent.pop(step, None)
    self._recent[step] = handle
    self._recent = dict(list(self._recent.items())[-4:])
    if self.local and durable and index is not self.index:
      self.local.begin(step)
    self.background.spawn(
      f"fnckpt-manager:{self.index.display}/{step}",
      self._after_commit,
      step=step,
      handle=handle,
      durable=durable,
      index=index,
      base=base,
      staged=staged,
    )
    return handle

  def _stage_held(self, step: int, tree: Any, index: _steps.StepIndex) -> Any:
    """A local save with several processes: host copies of every shard this process holds
    (replicas included; :mod:`fnckpt._manager.held`), written beside the save once it
    commits, for recovery from peers; its old record of ``step`` deleted first. None when
    not such a save or the tree is not supported."""
    if self.local is None or index is not self.local.index or jax.process_count() == 1:
      return None
    _peers.forget(index.at(step), jax.process_index())
    return _held.stage(tree, jax.process_index())

  def _write_held(self, step: int, index: _steps.StepIndex, staged: Any) -> None:
    """Write the held pieces and record of a committed local save (a failure only warns:
    recovery then reads a complete local copy or the durable tier)."""
    try:
      _peers.write(index.at(step), staged, step, jax.process_index(), jax.process_count())
    except Exception as e:
      warnings.warn(
        f"Could not write what process {jax.process_index()} holds of local step "
        f"{step} in {index.display!r}: {e}. Recovery from peers will not use this "
        "process's copy of it.",
        RuntimeWarning,
        stacklevel=1,
      )

  def _base_state(self, base: Any) -> _pending.BaseState:
    """``start(base_state=)``: the base is committed, or (process 0 chose a step in flight)
    in flight, with this process's handle of that save if it holds one."""
    if base is None or not base.in_flight:
      return _pending.Committed()
    return _pending.InFlight(self._recent.get(base.step))

  def _copy(self, step: int) -> float:
    assert self.local is not None
    try:
      return self.local.copy_to_durable(step)
    except Exception as e:
      error = _copy_error(step, self.local, e)
      warnings.warn(str(error), RuntimeWarning, stacklevel=1)
      raise error from e

  def _after_commit(
    self,
    step: int,
    handle: Any,
    durable: bool,
    index: _steps.StepIndex,
    base: Any = None,
    staged: Any = None,
  ) -> None:
    """Background: wait for the save's commit (the step's claim ends there); copy it to the
    durable tier if it was saved to the local one for that (one process; with the data of
    other steps it refers to); then retention (never while a copy runs: it may be bringing
    referenced data): the durable tier's on process 0, each process's own local tier on every
    process. The base stays claimed until then."""
    try:
      try:
        reported = _wait_committed(handle)
      finally:  # the claim covers the commit, not the copy (pending guards the copy)
        self.claims.release_save(step, handle)
      index.note_committed(step)
      if staged is not None:
        self._write_held(step, index, staged)
        staged = None
      cost = handle.stats.total_s
      if durable and index is not self.index:
        cost += self._copy(step)
        self.index.note_committed(step)
      if durable:
        self.cadence.committed(cost)
      if reported is not None:  # (committed all the same: recorded as such above)
        raise reported
    except BaseException as e:
      self.background.record(e)
      return
    finally:
      self.incremental.release(base)
      if self.local:
        self.local.finish(step)
    if jax.process_index() == 0:  # errors are recorded (and warned about) by Background
      with self.local.copying if self.local else contextlib.nullcontext():
        self.retention.run()
    if self.local:
      self.local.retain(self.claims)


def _wait_committed(handle: Any) -> CheckpointError | None:
  """Wait for a save; ``None`` once committed, or the error it raised *after* its commit
  (``error.outcome.committed``: the step is committed, the error is still reported); any
  other error is raised (not committed)."""
  try:
    handle.wait()
  except CheckpointError as e:
    if e.outcome is None or e.outcome.committed is not True:
      raise
    return e
  return None


def _copy_error(step: int, local: _tiers.LocalTier, error: BaseException) -> RetentionError:
  """A failed durable copy, as background work that ``wait()`` raises (a
  :class:`RetentionError`); the text says where the step is left, by cause."""
  kept = False
  if not isinstance(error, DamagedError):  # damaged or incomplete: not restorable there
    try:
      kept = step in local.index.list().steps
    except Exception:  # the local tier itself is unreadable
      pass
  where = (
    f"Step {step} is committed on the local tier only; the next durable save is copied "
    f"as usual (or save it again with force=True)."
    if kept
    else f"The local copy of step {step} is gone, damaged or incomplete, so step {step} is "
    "restorable from neither tier (nothing was committed in the durable one; its older "
    "steps are unaffected): save a new step, or this one again with force=True."
  )
  return RetentionError(
    f"Copying step {step} from the local tier {local.index.display!r} to the durable tier "
    f"{local.durable.display!r} failed: {error} {where}"
  )


def _check_may_save(claims: StepClaims, index: _steps.StepIndex, step: int, force: bool) -> None:
  """save(): refuse an older step, one being saved, or one committed already (unless
  ``force``). Run on process 0 for every process (``_coordination.from_process_0``)."""
  if force:
    return
  directory = index.display
  newest = max(claims.saving() | {index.newest_known() or -1})
  if newest > step:
    raise CheckpointError(
      f"Step {step} is older than step {newest}, already in {directory!r}. Steps must "
      "increase; to go back, delete the newer steps (manager.delete(s)) or pass force=True."
    )
  handle = claims.handle(step)
  if handle is not False and (handle is None or not handle.done()):
    raise CheckpointError(
      f"Step {step} is being saved to {directory!r} already; pass force=True to replace it."
    )
  if (
    _commit.is_committed(_paths.open_kvstore(index.at(step))) and step not in index.list().damaged
  ):  # a damaged step is replaced like a leftover
    raise CheckpointError(
      f"Step {step} is already committed in {directory!r}. Pass force=True to replace it, "
      "or save a new step."
    )
