"""CheckpointManager: one fnckpt checkpoint per training step under a directory.

Layout: ``<directory>/<step>/`` holds the checkpoint of ``step`` (plain decimal, no padding);
a step exists when its commit marker does. The manager composes small parts, each in its own
module:

- :mod:`fnckpt._manager.parts`: the constructor's option checks, then the parts below built in
  order (:func:`~fnckpt._manager.parts.assemble`);
- :class:`fnckpt._manager.steps.StepIndex`: which steps the directory holds (O(steps) per
  listing);
- :class:`fnckpt._manager.claims.StepClaims`: which steps this process is saving, deleting,
  reading;
- :class:`fnckpt._manager.retention_runner.RetentionRunner`: after each commit, on process 0,
  deletes what the pure policy (:mod:`fnckpt._manager.retention`) no longer keeps, sparing
  claimed steps and the newest committed step; its errors wait in a
  :class:`~fnckpt._manager.retention_runner.Background`;
- :class:`fnckpt._manager.preemption.Preemption`: SIGTERM flag, or JAX's preemption sync point;
- :mod:`fnckpt._io.coordination`: what processes agree on (process 0 decides and publishes);
- :class:`fnckpt._manager.interval.Cadence`: when to save (a fixed interval, or ``"auto"``:
  Daly's interval from the measured save cost and the failure rate), and what saving costs;
- :mod:`fnckpt._manager.health`: restoring the newest step no process finds damaged, marking
  damaged steps (never deleting them); :mod:`fnckpt._manager.starts`: the run's start log (the
  measured failure rate);
- :mod:`fnckpt._manager.tiers`: a fast local tier beside the durable one (its policy, its
  ``StepIndex``, the background copy to durable storage, the pure recovery choice);
- :class:`fnckpt._manager.saver.Saver`: whether and where a step is saved, the collective save,
  and the work after its commit; :class:`fnckpt._manager.recovery.Recovery`: which step and copy
  to read;
- :mod:`fnckpt._manager.lineage`: which step an incremental save refers to, forking a step;
  :mod:`fnckpt._manager.fork`: what data steps and forks refer to, so deletes keep it.

Resuming after preemption (the pattern every training loop can copy)::

    mgr = fnckpt.CheckpointManager(run_dir, max_to_keep=3, save_interval_steps=100,
                                   handle_preemption=True)   # SIGTERM now only sets a flag
    state, step = mgr.restore_or_init(init_state, target=abstract_state)
    for step in range(0 if step is None else step + 1, num_steps):
      state = train_step(state)
      if mgr.should_save(step):          # every 100 steps, and at the first boundary after SIGTERM
        mgr.save(step, state)
      if mgr.reached_preemption(step):   # True once that save has committed
        break
    mgr.close()                          # waits for pending saves; now the process may exit

Several processes (``jax.distributed``): every process makes the same manager calls in the same
order. ``save``, ``wait``, ``close``, ``delete``, ``cleanup``, ``reached_preemption``,
``restore_or_init`` and ``restore`` without a step (process 0 chooses the step and publishes it)
are collective; ``all_steps``, ``latest_step``, ``uncommitted_steps``, ``metrics`` and
``restore(step)`` work on the calling process alone.
Errors of background work (retention, on process 0) are never raised from ``save``: they are
warned about on process 0 and raised by ``wait``/``close`` on every process.
"""

from __future__ import annotations

import signal
import sys
import time
import warnings
from typing import Any, Callable, Mapping

import jax
import msgpack
import numpy as np

from .._errors import CheckpointError
from .._io import coordination as _coordination
from . import interval as _interval
from . import lineage as _lineage
from . import parts as _parts
from . import steps as _steps
from .claims import StepClaims
from .retention_runner import collect_held, delete_referenced

__all__ = ["CheckpointManager"]


class CheckpointManager:
  """Checkpoints of a training run, one per step, under ``directory`` (any fnckpt location).

  Args:
    directory: a local path, ``file://``, ``memory://``, ``gs://`` or ``s3://`` location.
    max_to_keep: keep the newest ``k`` steps (``None``: this rule is off).
    keep_every: also keep every step divisible by ``m``.
    best_n: also keep the ``n`` steps with the best ``metrics[best_metric]``.
    best_metric: the metric ``best_n`` ranks (passed to :meth:`save` as ``metrics=``).
    best_mode: ``"min"`` (e.g. a loss) or ``"max"`` (e.g. an accuracy).
    save_interval_steps: :meth:`save` and :meth:`should_save` only save steps divisible by
      this (``force=True`` or a preemption saves any step). ``"auto"``: every ``T`` seconds of
      training, ``T`` by :func:`fnckpt.optimal_interval_s` from the measured cost of this
      run's saves and ``mtbf_s``, converted to steps with the measured step time; a save due
      while the previous one is still writing is skipped (:attr:`schedule` counts them).
    mtbf_s: the mean time between failures for ``"auto"``; default: measured from the run's
      restarts (each ``"auto"`` manager records its start in ``<directory>/fnckpt-starts``).
    keep_durable: with a retention rule, also always keep the newest ``r`` valid committed
      steps (redundancy: a damaged newest step leaves older ones to fall back to).
    local_directory: a fast tier (:mod:`fnckpt._manager.tiers`; not ``directory`` nor inside it):
      every ``local_save_interval_steps``-th step is saved there (with one process also the
      durable steps, then copied to ``directory``); each process keeps its newest
      ``local_max_to_keep`` there.
    handle_preemption: install the preemption handler now (:meth:`install_preemption_handler`).
    storage_options: settings for ``gs://``/``s3://`` (see :func:`fnckpt.save`).
    save_options: more keyword arguments for every :func:`fnckpt.save` (``zstd``,
      ``budget_bytes``, ``inline_bytes``, ``barrier_timeout_s``: also the deadline of the
      manager's own barriers).
    incremental: each save refers to the newest committed step (``save(base=...)``) and
      records content hashes: what is unchanged is not written again (docs/guides/incremental.md).
    full_every: with ``incremental``, every ``n``-th save of this manager is a full save.

  With no retention rule every step is kept. The newest committed step and steps being saved
  or restored are never deleted. Uncommitted leftovers of crashed saves are ignored, reported
  (a warning here and :meth:`uncommitted_steps`) and removed only by :meth:`cleanup` or by a
  new save to the same step.

  >>> import numpy as np, fnckpt
  >>> with fnckpt.CheckpointManager("memory://doc/mgr", max_to_keep=2) as mgr:
  ...   for step in range(5):
  ...     _ = mgr.save(step, {"w": np.full(3, step), "step": step})
  ...   mgr.wait()
  ...   print(mgr.all_steps(), mgr.restore()["step"])
  [3, 4] 4
  """

  def __init__(
    self,
    directory: str,
    *,
    max_to_keep: int | None = None,
    keep_every: int | None = None,
    best_n: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    save_interval_steps: int | str = 1,
    handle_preemption: bool = False,
    storage_options: dict[str, Any] | None = None,
    save_options: Mapping[str, Any] | None = None,
    mtbf_s: float | None = None,
    keep_durable: int | None = None,
    local_directory: str | None = None,
    local_save_interval_steps: int = 1,
    local_max_to_keep: int = 2,
    local_storage_options: dict[str, Any] | None = None,
    incremental: bool = False,
    full_every: int | None = None,
  ):
    self._options = _parts.options_of(locals())  # a fork's manager: the same options
    parts = _parts.assemble(directory, local_directory, **self._options)  # checks, builds
    self.directory = parts.directory
    self.best_metric = best_metric
    self.save_interval_steps = save_interval_steps
    self._run, self._root, self._timeout = parts.run, parts.run.path, parts.timeout_s
    self._save_options = parts.save_options
    self._index, self._claims, self._background = parts.index, parts.claims, parts.background
    self._retention, self._preemption = parts.retention, parts.preemption
    self._local, self._cadence = parts.local, parts.cadence
    self._recovery, self._saver = parts.recovery, parts.saver
    self._closed = False
    _warn_leftovers(self._index.list().uncommitted, self.directory)
    if handle_preemption:
      self.install_preemption_handler()

  # --- what is there (reads on the calling process only) ------------------------------------

  def path(self, step: int) -> str:
    """The location of ``step``'s checkpoint (for :func:`fnckpt.metadata`, the CLI, ...)."""
    return self._index.path(step)

  def all_steps(self) -> list[int]:
    """The committed steps (of both tiers, this process's local view), oldest first (read
    from storage; saves in flight and steps marked damaged are not there)."""
    return self._recovery.steps()

  def latest_step(self) -> int | None:
    """The newest committed step, or ``None``. Waits for this manager's saves in flight to
    commit first, so every process of a job calling it at the same point of the loop gets the
    same answer (each save commits behind a barrier; retention keeps the newest step). With
    several processes and a local tier it is collective: the step ``restore()`` picks
    (complete locally everywhere, covered by the processes' held shards, or durable)."""
    return _latest_step(self)

  def uncommitted_steps(self) -> list[int]:
    """Steps holding data but no commit marker (interrupted saves), not counting this
    manager's saves and deletions in flight."""
    busy = self._claims.busy()
    return [s for s in self._index.list(in_flight=busy).uncommitted if s not in busy]

  def metrics(self, step: int) -> dict[str, Any] | None:
    """The metrics saved with ``step`` (``None`` if none were given)."""
    step = _steps.as_step(step)
    self._claims.wait_saved(step)
    meta = self._recovery.index_of(step).user_metadata(step)
    return meta.get("metrics") if isinstance(meta, dict) else None

  # --- saving -------------------------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """Whether the loop should save ``step``: it is on a save interval, or it is the first
    step boundary after a preemption notice (with several processes: the step JAX's
    preemption sync point names, the same on every process; ask at every step).

    >>> import fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/should_save", save_interval_steps=10)
    >>> [s for s in range(25) if mgr.should_save(s)]
    [0, 10, 20]
    """
    step = _steps.as_step(step)
    self._cadence.note_step(step, time.monotonic())
    return self._preemption.check(step) or self._saver.due(step)

  @property
  def schedule(self) -> _interval.Schedule:
    """How often this manager saves and what it costs: the interval in use, the measured save
    cost and step time, the expected work lost per failure, saves and skipped saves (see
    :class:`fnckpt._manager.interval.Schedule`)."""
    return self._cadence.schedule()

  def save(
    self,
    step: int,
    tree: Any,
    *,
    metrics: Mapping[str, Any] | None = None,
    metadata: Any = None,
    force: bool = False,
  ) -> Any:
    """Save ``tree`` as ``step``; return its :class:`fnckpt.SaveHandle` once its arrays are off
    the devices (the write, the commit and then retention go on in the background).

    Skipped (returns ``None``) when ``step`` is not on ``save_interval_steps``, unless ``force``
    or it is the preemption step. Raises if ``step`` is committed or older than the newest
    step, unless ``force`` (which replaces it); an uncommitted leftover at ``step`` is replaced.
    With one process an error of earlier background work is raised here too.

    Args:
      step: the training step (a non-negative int); names the directory ``<directory>/<step>``.
      tree: the pytree to save (see :func:`fnckpt.save`).
      metrics: small ``{name: number}`` stored with the step (ranked by ``best_n``).
      metadata: more msgpack-able user data stored with the step.
      force: save off the interval, replace a committed step, or save an older step.
    """
    self._check_open()
    if not _coordination.multi():  # nobody else is in this call: fail fast
      _raise_first(self._background.take())
    step = _steps.as_step(step)
    self._cadence.note_step(step, time.monotonic())
    return self._saver.save(step, tree, lambda: _user_metadata(step, metrics, metadata), force)

  def wait(self) -> None:
    """Block until every save of this manager has committed and retention has run; raise the
    first error of any of them (once; the others as notes). With several processes, process
    0's retention errors are raised on every process."""
    _raise_first(self._background.settle(self._root, self._timeout))

  # --- deleting (process 0 deletes; collective) ---------------------------------------------

  def delete(self, step: int) -> None:
    """Delete the checkpoint (or uncommitted leftover) of ``step`` in both tiers (the local
    one of process 0), its commit marker first (so it is never seen half deleted) and its
    damage mark; its data that other steps or forks refer to stays until they go. Waits for
    this manager's save of it."""
    _delete(self, _steps.as_step(step))

  def cleanup(self) -> list[int]:
    """Delete the uncommitted leftovers of interrupted saves; return their steps. This
    manager's saves in flight are spared (another job's are not: do not run it then)."""
    return _coordination.from_process_0(
      self._root, "cleanup", lambda: _cleanup(self), self._timeout
    )

  # --- restoring ----------------------------------------------------------------------------

  def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> Any:
    """Restore ``step`` with :func:`fnckpt.restore`'s ``target`` and keyword arguments
    (``partial``, ``cast``, ``budget_bytes``). Default: the newest committed step, chosen by
    process 0 once this manager's saves and retention have finished (collective then); if
    any process finds it damaged (checksum mismatch, missing chunk, unreadable manifest) in
    every tier holding it, every process warns naming the step and the damage, the step is
    marked damaged (not deleted; listings leave it out from then on), and the next older
    step is tried. An explicit ``step`` marked or found damaged in every tier holding it
    raises :class:`fnckpt.CheckpointError`."""
    if step is None:
      self._background.join()
      with _coordination.operation(self._root, "restore", self._timeout):
        value, step = self._recovery.restore_latest(target, kwargs)
      if step is None:
        raise _nothing_committed(self)
      return value
    return self._recovery.restore(_steps.as_step(step), target, kwargs, explicit=True)

  def fork(self, step: int, directory: str) -> CheckpointManager:
    """A new run in ``directory`` whose newest step is this run's durable ``step``, its data
    not copied but referred to (the fork is recorded under ``<run>/forks/``, so retention
    keeps that data); returns its manager, with these options but no local tier (collective).

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/fork/a")
    >>> _ = mgr.save(0, {"w": np.arange(40000.0)}); mgr.wait()
    >>> float(mgr.fork(0, "memory://doc/fork/b").restore()["w"][-1])
    39999.0
    """
    _fork(self, _steps.as_step(step), directory)
    return CheckpointManager(directory, **self._options)

  def restore_or_init(
    self, init: Callable[[], Any] | Any, target: Any = None, **kwargs: Any
  ) -> tuple[Any, int | None]:
    """``(state, step)``: the newest committed step restored, or ``(init(), None)`` when the
    directory has none. ``init`` is a function making the initial state or the state itself.

    ``target`` says where the restored arrays go (see :func:`fnckpt.restore`): by default the
    state itself when ``init`` is a state, else ``jax.eval_shape(init)`` (for a jitted init
    with ``out_shardings`` that carries the shardings). A ``jax.ShapeDtypeStruct`` without a
    sharding in it is an error with several processes and a warning with one."""
    self._background.join()
    with _coordination.operation(self._root, "restore_or_init", self._timeout):
      step = self._recovery.agreed_latest()
      target = _restore_target(init, target, step, self.directory)
      if step is not None:  # the newest valid step (older ones when it is damaged)
        state, step = self._recovery.restore_latest(target, kwargs)
      if step is None:
        return (init() if callable(init) else init), None
      return state, step

  # --- preemption ---------------------------------------------------------------------------

  def install_preemption_handler(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Make ``signals`` (default SIGTERM) only set a flag, so the loop saves at its next step
    boundary (:meth:`should_save`) and stops once that save has committed
    (:meth:`reached_preemption`). Call from the main thread; :meth:`close` restores the
    previous handlers. With several processes nothing is installed: JAX's preemption service
    (started by ``jax.distributed.initialize``) catches SIGTERM and :meth:`should_save` asks
    its sync point."""
    self._preemption.install(signals)

  @property
  def preemption_requested(self) -> bool:
    """Whether a preemption notice has arrived (on any process, with several)."""
    return self._preemption.requested

  def reached_preemption(self, step: int) -> bool:
    """True when the loop should stop at ``step`` for a preemption notice; first waits
    (:meth:`wait`) until every save of this manager has committed, so the process may exit
    right after. Call it after the (maybe) save of each step."""
    step = _steps.as_step(step)
    if not self._preemption.reached(step):
      return False
    _warn_if_unsaved(self, step)
    self.wait()
    return True

  # --- lifetime -----------------------------------------------------------------------------

  def close(self) -> None:
    """Wait for pending saves and retention (raising their errors, see :meth:`wait`) and
    restore the signal handlers."""
    if self._closed:
      return
    self._closed = True
    try:
      self.wait()
    finally:
      self._preemption.uninstall()

  def _check_open(self) -> None:
    if self._closed:
      raise CheckpointError(f"The CheckpointManager of {self.directory!r} is closed.")

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    _abandon(self)

  def __repr__(self) -> str:
    return f"CheckpointManager({self.directory!r}, {self._retention.policy})"


def _latest_step(mgr: CheckpointManager) -> int | None:
  """latest_step(): collective with several processes and a local tier (process 0 decides),
  else this process's listing once its saves have committed."""
  if mgr._local is not None and _coordination.multi():
    mgr._background.join()
    with _coordination.operation(mgr._root, "latest_step", mgr._timeout):
      return mgr._recovery.agreed_latest()
  mgr._claims.wait_saved()
  steps = mgr.all_steps()
  return steps[-1] if steps else None


def _nothing_committed(mgr: CheckpointManager) -> CheckpointError:
  """restore() found no committed step: the error, naming the leftovers if any."""
  leftovers = mgr.uncommitted_steps()
  extra = f" (only uncommitted leftovers: steps {leftovers})" if leftovers else ""
  return CheckpointError(f"No committed checkpoint in {mgr.directory!r}{extra}.")


def _fork(mgr: CheckpointManager, step: int, directory: str) -> None:
  """fork(step), before the new manager: ``step`` held as read while process 0 records the
  fork (collective)."""
  mgr._claims.wait_saved(step)
  with mgr._claims.reading(step):
    _coordination.from_process_0(
      mgr._root, "fork", lambda: _lineage.fork(mgr._index, step, directory), mgr._timeout
    )


def _restore_target(init: Any, target: Any, step: int | None, directory: str) -> Any:
  """restore_or_init's target: by default ``init``'s shapes when there is a step to restore;
  checked for placement (:func:`_check_placed`)."""
  if target is None and step is not None:
    target = jax.eval_shape(init) if callable(init) else init
  if target is not None:
    _check_placed(target, directory)
  return target


def _warn_if_unsaved(mgr: CheckpointManager, step: int) -> None:
  """reached_preemption(step): warn (at its caller) when the preemption step was not saved."""
  if mgr._saver.last_saved != mgr._preemption.step:
    warnings.warn(
      f"Stopping for preemption at step {step}, but step {mgr._preemption.step} was not "
      f"saved (call manager.save when manager.should_save(step) is true); the newest "
      f"checkpoint in {mgr.directory!r} is older.",
      stacklevel=3,
    )


def _abandon(mgr: CheckpointManager) -> None:
  """Leaving the ``with`` block on an exception: finish this process's own work but meet no
  other process (they may be anywhere), and never hide the exception that ended the block."""
  mgr._closed = True
  mgr._background.join()
  for error in mgr._background.take():
    print(f"fnckpt: while closing {mgr.directory!r}: {error}", file=sys.stderr)
  mgr._preemption.uninstall()


def _warn_leftovers(leftovers: list[int], directory: str) -> None:
  if leftovers:
    warnings.warn(
      f"{directory!r} holds uncommitted steps {leftovers} (saves interrupted by a crash). "
      "They are ignored; manager.cleanup() removes them, and saving one of these steps "
      "replaces it.",
      stacklevel=3,
    )


def _delete(mgr: CheckpointManager, step: int) -> None:
  """delete(step): claimed, then process 0 removes it from every tier (collective)."""
  indexes = [mgr._index] + ([mgr._local.index] if mgr._local else [])
  with _coordination.operation(mgr._root, "delete", mgr._timeout):
    mgr._claims.claim_delete(step)
    try:
      _coordination.from_process_0(
        mgr._root,
        "delete",
        lambda: _remove(indexes, step, mgr.directory, mgr._claims),
        mgr._timeout,
      )
    finally:
      mgr._claims.release_delete([step])
  for index in indexes:
    index.forget(step)


def _cleanup(mgr: CheckpointManager) -> list[int]:
  """cleanup(), on process 0: the leftovers, never data that steps or forks refer to."""
  leftovers = mgr.uncommitted_steps()
  deleted, failed = delete_referenced(
    mgr._index, mgr._claims, lambda busy: [s for s in leftovers if s not in busy]
  )
  if failed:
    raise failed[0][1]
  return deleted


def _remove(indexes: list[_steps.StepIndex], step: int, directory: str, claims: StepClaims) -> None:
  """delete(step), on process 0: every tier holding ``step``; then the data of deleted steps
  that only ``step`` referred to goes."""
  there = [index for index in indexes if index.exists(step)]
  if not there:
    raise CheckpointError(f"There is no step {step} in {directory!r}.")
  for index in there:
    index.delete_keeping(step)
    collect_held(index, claims)


def _user_metadata(step: int, metrics: Mapping[str, Any] | None, metadata: Any) -> dict:
  """The manifest's user metadata of a manager save: ``{"step", "metrics", "user"}``."""
  out: dict[str, Any] = {"step": step}
  if metrics is not None:
    if not isinstance(metrics, Mapping):
      raise CheckpointError(
        f"metrics must be a dict of name -> value, got {type(metrics).__name__}."
      )
    plain = {}
    for name, value in metrics.items():
      if not isinstance(name, str):
        raise CheckpointError(f"metrics: name {name!r} must be a str.")
      if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0:
        value = np.asarray(value).item()  # 0-d arrays and numpy scalars: Python numbers
      plain[name] = value
    try:
      msgpack.packb(plain)
    except (TypeError, ValueError, OverflowError) as e:
      raise CheckpointError(
        f"save(metrics=...) must be msgpack data (numbers, str, lists, "
        f"dicts): {e}. Convert the values, e.g. float(loss)."
      ) from None
    out["metrics"] = plain
  if metadata is not None:
    out["user"] = metadata  # checked by fnckpt.save
  return out


def _check_placed(target: Any, directory: str) -> None:
  """restore_or_init: a ``ShapeDtypeStruct`` target leaf without a sharding would land on one
  device. An error with several processes, a warning with one (at restore_or_init's caller,
  through :func:`_restore_target`)."""
  flat = jax.tree_util.tree_flatten_with_path(target)[0]
  unplaced = [
    jax.tree_util.keystr(path)
    for path, leaf in flat
    if isinstance(leaf, jax.ShapeDtypeStruct) and _no_sharding(leaf)
  ]
  if not unplaced:
    return
  where = ", ".join(unplaced[:5]) + (f" and {len(unplaced) - 5} more" if len(unplaced) > 5 else "")
  fix = (
    "Add shardings, e.g. target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, "
    "x.dtype, sharding=NamedSharding(mesh, P())), jax.eval_shape(init)) with each array's "
    "PartitionSpec, pass the initialized state, or make init a jax.jit with out_shardings."
  )
  if jax.process_count() > 1:
    raise CheckpointError(
      f"restore_or_init({directory!r}): the target has no sharding at {where}, so with "
      f"{jax.process_count()} processes these arrays cannot be placed on the job's devices. "
      f"{fix}"
    )
  warnings.warn(
    f"restore_or_init({directory!r}): the target has no sharding at {where}; these arrays "
    f"are restored onto one device ({jax.devices()[0]}). {fix}",
    stacklevel=4,
  )


def _no_sharding(leaf: jax.ShapeDtypeStruct) -> bool:
  try:
    return leaf.sharding is None
  except Exception:  # a PartitionSpec with no mesh in context: restore names it and the fix
    return False


def _raise_first(errors: list[BaseException]) -> None:
  """Raise ``errors[0]``, the others attached as notes (nothing is dropped)."""
  if not errors:
    return
  first = errors[0]
  for other in errors[1:]:
    first.add_note(f"also: {type(other).__name__}: {other}")
  raise first
