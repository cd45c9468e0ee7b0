"""How a :class:`fnckpt.CheckpointManager` is put together: the constructor's options checked,
then its parts built in dependency order, the run's start recorded last (:func:`assemble`).

A construction that fails raises before anything is written: every check comes before the
``"auto"`` cadence records this start in ``<directory>/fnckpt-starts``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, cast

from .._io import coordination as _coordination
from .._io import paths as _paths
from .._save import options as _save_options
from . import interval as _interval
from . import lineage as _lineage
from . import retention as _retention
from . import starts as _starts
from . import steps as _steps
from . import tiers as _tiers
from .claims import StepClaims
from .preemption import Preemption
from .recovery import Recovery
from .retention_runner import Background, RetentionRunner
from .saver import Saver

__all__ = ["Parts", "assemble", "options_of"]


@dataclasses.dataclass(frozen=True)
class Parts:
  """A manager's collaborators (see :mod:`fnckpt._manager.manager`), built by :func:`assemble`;
  ``directory`` is the run's location as shown in messages."""

  directory: str
  run: _paths.Location
  save_options: _save_options.SaveOptions
  timeout_s: float
  index: _steps.StepIndex
  claims: StepClaims
  background: Background
  retention: RetentionRunner
  preemption: Preemption
  local: _tiers.LocalTier | None
  cadence: _interval.Cadence
  recovery: Recovery
  saver: Saver


def options_of(arguments: Mapping[str, Any]) -> dict[str, Any]:
  """The constructor's arguments (its ``locals()``) that :func:`assemble` takes as keywords and
  a fork's manager gets: all but ``directory``, ``local_directory`` and ``handle_preemption``."""
  skip = ("self", "directory", "handle_preemption", "local_directory")
  return {k: v for k, v in arguments.items() if k not in skip}


def assemble(
  directory: str,
  local_directory: str | None,
  *,
  max_to_keep: int | None,
  keep_every: int | None,
  best_n: int | None,
  best_metric: str | None,
  best_mode: str,
  save_interval_steps: int | str,
  storage_options: dict[str, Any] | None,
  save_options: Mapping[str, Any] | None,
  mtbf_s: float | None,
  keep_durable: int | None,
  local_save_interval_steps: int,
  local_max_to_keep: int,
  local_storage_options: dict[str, Any] | None,
  incremental: bool,
  full_every: int | None,
) -> Parts:
  """The parts of ``CheckpointManager(directory, ...)`` (its keyword arguments but
  ``handle_preemption``), every option checked first; raises as the constructor does."""
  policy = _policy(max_to_keep, keep_every, best_n, best_mode, keep_durable)
  lineage = _lineage.Incremental(incremental, full_every)
  options = _checked_options(best_n, best_metric, save_interval_steps, save_options)
  shown = _paths.display(directory)
  run = _paths.Location.of(str(directory), storage_options)
  timeout = float(options.barrier_timeout_s)
  index = _steps.StepIndex(run)
  claims = StepClaims()
  background = Background()
  retention = RetentionRunner(index, claims, policy, best_metric)
  preemption = Preemption(shown)
  local = _local_tier(
    local_directory, local_storage_options, local_save_interval_steps, local_max_to_keep, run
  )
  cadence = _cadence(save_interval_steps, mtbf_s, run, timeout)  # the last check; records ("auto")
  recovery = Recovery(index, local, claims, timeout)
  saver = Saver(
    index=index,
    local=local,
    claims=claims,
    cadence=cadence,
    preemption=preemption,
    background=background,
    retention=retention,
    save_options=options,
    timeout_s=timeout,
    incremental=lineage,
  )
  return Parts(
    directory=shown,
    run=run,
    save_options=options,
    timeout_s=timeout,
    index=index,
    claims=claims,
    background=background,
    retention=retention,
    preemption=preemption,
    local=local,
    cadence=cadence,
    recovery=recovery,
    saver=saver,
  )


def _local_tier(
  directory: str | None,
  storage_options: dict[str, Any] | None,
  save_interval_steps: int,
  max_to_keep: int,
  durable: _paths.Location,
) -> _tiers.LocalTier | None:
  """The fast local tier beside ``durable`` (``None`` without ``local_directory``); its policy
  and location are checked here."""
  if directory is None:
    return None
  return _tiers.LocalTier(
    _paths.Location.of(str(directory), storage_options),
    _tiers.TierPolicy(save_interval_steps, max_to_keep),
    durable,
  )


def _checked_options(
  best_n: int | None,
  best_metric: str | None,
  save_interval_steps: int | str,
  save_options: Mapping[str, Any] | None,
) -> _save_options.SaveOptions:
  """The constructor's checks (the retention policy checks its own arguments); the options
  of every save (which replaces a leftover of its step: ``overwrite``)."""
  if best_n and not isinstance(best_metric, str):
    raise ValueError(
      "best_n needs best_metric: the name of a metric passed to save(..., metrics={name: value})."
    )
  if save_interval_steps != "auto" and (
    not isinstance(save_interval_steps, int)
    or isinstance(save_interval_steps, bool)
    or save_interval_steps < 1
  ):
    raise ValueError(
      f"save_interval_steps must be an int >= 1 or 'auto', got {save_interval_steps!r}."
    )
  options = dict(save_options or {})
  for bad in ("overwrite", "metadata", "storage_options"):
    if bad in options:
      raise ValueError(f"save_options may not set {bad!r}; the manager decides it.")
  known = {f.name for f in dataclasses.fields(_save_options.SaveOptions) if f.init}
  unknown = sorted(set(options) - known)
  if unknown:
    raise TypeError(
      f"save_options {unknown}: not options of fnckpt.save; it takes "
      f"{sorted(known - {'overwrite'})}."
    )
  return _save_options.SaveOptions(overwrite=True, **options)


def _policy(
  max_to_keep: int | None,
  keep_every: int | None,
  best_n: int | None,
  best_mode: str,
  keep_durable: int | None,
) -> _retention.Policy:
  """The retention policy; ``keep_durable=r`` raises ``max_to_keep`` to at least ``r`` when
  some rule deletes (with no rule every step is kept anyway)."""
  base = _retention.Policy(max_to_keep, keep_every, best_n, best_mode)
  if keep_durable is not None and (
    not isinstance(keep_durable, int) or isinstance(keep_durable, bool) or keep_durable < 1
  ):
    raise ValueError(f"keep_durable must be None or an int >= 1, got {keep_durable!r}.")
  if keep_durable is None or base.keeps_all:
    return base
  return _retention.Policy(max(max_to_keep or 0, keep_durable), keep_every, best_n, best_mode)


def _cadence(
  save_interval_steps: int | str, mtbf_s: float | None, run: _paths.Location, timeout_s: float
) -> _interval.Cadence:
  """When to save. ``"auto"``: the MTBF is ``mtbf_s``, else measured from the run's recorded
  starts (:mod:`fnckpt._manager.starts`); process 0 records this start once that is settled (call
  last in the constructor: a construction that fails records nothing)."""
  if save_interval_steps != "auto":
    return _interval.Cadence(cast(int, save_interval_steps), mtbf_s, "given")
  given = None if mtbf_s is None else _interval.Cadence(None, mtbf_s, "given")  # checks it

  def record() -> list[float]:
    now = time.time()
    starts = _starts.read_starts(run, now) + [now]
    if given is None:
      _interval.Cadence(None, _interval.mtbf_from_starts(starts), "restarts")  # or raise
    _starts.write_starts(run, starts)
    return starts

  starts = _coordination.from_process_0(run.path, "starts", record, timeout_s)
  return given or _interval.Cadence(None, _interval.mtbf_from_starts(starts), "restarts")
