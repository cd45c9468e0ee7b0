"""CheckpointManager: one fnckpt checkpoint per training step under a directory.

Layout: ``<directory>/<step>/`` holds the checkpoint of ``step`` (plain decimal, no padding);
a step exists when its commit marker does. The manager composes small parts, each in its own
module:

- :class:`fnckpt._steps.StepIndex`: which steps the directory holds (O(steps) per listing);
- :class:`fnckpt._claims.StepClaims`: which steps this process is saving, deleting, reading;
- :class:`fnckpt._retention_runner.RetentionRunner`: after each commit, on process 0, deletes
  what the pure policy (:mod:`fnckpt._retention`) no longer keeps, sparing claimed steps and
  the newest committed step; its errors wait in a :class:`~fnckpt._retention_runner.Background`;
- :class:`fnckpt._preemption.Preemption`: SIGTERM flag, or JAX's preemption sync point;
- :mod:`fnckpt._coordination`: what processes agree on (process 0 decides and publishes).

A second storage tier (a fast local one beside a durable one) is another ``StepIndex`` and
``RetentionRunner`` (not there yet). Incremental saves and forks live in
:mod:`fnckpt._lineage` (which step a save refers to; forking) and :mod:`fnckpt._fork` (what
data steps and forks refer to, so deletes keep it).

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
import warnings
from typing import Any, Callable, Mapping

import jax
import msgpack
import numpy as np

from . import _commit, _coordination, _fork, _lineage, _paths, _retention, _steps
from ._claims import StepClaims
from ._errors import CheckpointError
from ._preemption import Preemption
from ._retention_runner import Background, RetentionRunner, delete_unclaimed

__all__ = ["CheckpointManager"]

_DEFAULT_BARRIER_TIMEOUT_S = 600.0  # fnckpt.save's default


def _api() -> Any:
  import fnckpt  # the public save/restore; imported late (fnckpt imports this module)
  return fnckpt


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
      this (``force=True`` or a preemption saves any step).
    handle_preemption: install the preemption handler now (:meth:`install_preemption_handler`).
    storage_options: settings for ``gs://``/``s3://`` (see :func:`fnckpt.save`).
    save_options: more keyword arguments for every :func:`fnckpt.save` (``zstd``,
      ``budget_bytes``, ``inline_bytes``, ``barrier_timeout_s``: also the deadline of the
      manager's own barriers).
    incremental: each save refers to the newest committed step (``save(base=...)``): what is
      unchanged is not written again; retention keeps data that kept steps refer to.
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

  def __init__(self, directory: str, *, max_to_keep: int | None = None,
               keep_every: int | None = None, best_n: int | None = None,
               best_metric: str | None = None, best_mode: str = "min",
               save_interval_steps: int = 1, handle_preemption: bool = False,
               storage_options: dict[str, Any] | None = None,
               save_options: Mapping[str, Any] | None = None, incremental: bool = False,
               full_every: int | None = None):
    policy = _retention.Policy(max_to_keep, keep_every, best_n, best_mode)
    self._options = dict(max_to_keep=max_to_keep, keep_every=keep_every, best_n=best_n,
                         best_metric=best_metric, best_mode=best_mode,
                         save_interval_steps=save_interval_steps,
                         storage_options=storage_options, save_options=save_options,
                         incremental=incremental, full_every=full_every)
    self._incremental = _lineage.Incremental(incremental, full_every)
    self._save_options = _checked_options(best_n, best_metric, save_interval_steps,
                                          save_options)
    self.directory = _paths.display(directory)
    self.best_metric = best_metric
    self.save_interval_steps = save_interval_steps
    self._root, self._storage_options = str(directory), storage_options
    self._timeout = float(self._save_options.get("barrier_timeout_s",
                                                 _DEFAULT_BARRIER_TIMEOUT_S))
    self._index = _steps.StepIndex(self._root, storage_options)
    self._claims = StepClaims()
    self._background = Background()
    self._refs = _fork.References(self._root, storage_options)
    self._retention = RetentionRunner(self._index, self._claims, policy, best_metric,
                                      self._refs)
    self._preemption = Preemption(self.directory)
    self._last_saved: int | None = None
    self._closed = False
    leftovers = self._index.list().uncommitted
    if leftovers:
      warnings.warn(
          f"{self.directory!r} holds uncommitted steps {leftovers} (saves interrupted by a "
          "crash). They are ignored; manager.cleanup() removes them, and saving one of these "
          "steps replaces it.", stacklevel=2)
    if handle_preemption:
      self.install_preemption_handler()

  # --- what is there (reads on the calling process only) ------------------------------------

  def path(self, step: int) -> str:
    """The location of ``step``'s checkpoint (for :func:`fnckpt.metadata`, the CLI, ...)."""
    return self._index.path(step)

  def all_steps(self) -> list[int]:
    """The committed steps, oldest first (read from storage; saves in flight are not there)."""
    return self._index.list(in_flight=self._claims.saving()).steps

  def latest_step(self) -> int | None:
    """The newest committed step, or ``None``. Waits for this manager's saves in flight to
    commit first, so every process of a job calling it at the same point of the loop gets the
    same answer (each save commits behind a barrier; retention keeps the newest step)."""
    self._claims.wait_saved()
    steps = self.all_steps()
    return steps[-1] if steps else None

  def uncommitted_steps(self) -> list[int]:
    """Steps holding data but no commit marker (interrupted saves), not counting this
    manager's saves and deletions in flight."""
    busy = self._claims.busy()
    return [s for s in self._index.list(in_flight=busy).uncommitted if s not in busy]

  def metrics(self, step: int) -> dict[str, Any] | None:
    """The metrics saved with ``step`` (``None`` if none were given)."""
    step = _steps.as_step(step)
    self._claims.wait_saved(step)
    meta = self._index.user_metadata(step)
    return meta.get("metrics") if isinstance(meta, dict) else None

  # --- saving -------------------------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """Whether the loop should save ``step``: it is on the save interval, or it is the first
    step boundary after a preemption notice (with several processes: the step JAX's
    preemption sync point names, the same on every process; ask at every step).

    >>> import fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/should_save", save_interval_steps=10)
    >>> [s for s in range(25) if mgr.should_save(s)]
    [0, 10, 20]
    """
    step = _steps.as_step(step)
    return self._preemption.check(step) or step % self.save_interval_steps == 0

  def save(self, step: int, tree: Any, *, metrics: Mapping[str, Any] | None = None,
           metadata: Any = None, force: bool = False) -> Any:
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
    if not (force or self._preemption.is_save_step(step) or step % self.save_interval_steps == 0):
      return None
    user = _user_metadata(step, metrics, metadata)
    # Decided on process 0 for all: every process calls the collective save, or none does.
    _coordination.from_process_0(
        self.path(step), "may-save", lambda: (_check_may_save(
            self._claims, self._index, step, force, self.directory, self._storage_options),
            _lineage.check_replace(self, step)), self._timeout)
    base = self._incremental.choose(self, step)  # (claimed for reading till committed)
    self._claims.claim_save(step)  # retention and deletes leave it alone from here
    try:
      handle = _api().save(tree, self.path(step), overwrite=True, metadata=user,
                           storage_options=self._storage_options, **self._save_options,
                           **({"base": self.path(base.step)} if base else {}))
    except BaseException:
      self._claims.release_save(step)
      self._incremental.release(base)
      raise
    self._claims.set_handle(step, handle)
    self._last_saved = step
    self._background.spawn(f"fnckpt-manager:{self.directory}/{step}", self._after_commit,
                           step, handle, base)
    return handle

  def _after_commit(self, step: int, handle: Any, base: Any = None) -> None:
    """Background: wait for the save's commit, then (process 0) apply retention."""
    try:
      handle.wait()
      self._index.note_committed(step)
    except BaseException as e:
      self._background.record(e)
      return
    finally:
      self._claims.release_save(step, handle)
      self._incremental.release(base)
    if jax.process_index() == 0:
      self._retention.run()  # its errors are recorded (and warned about) by Background

  def wait(self) -> None:
    """Block until every save of this manager has committed and retention has run; raise the
    first error of any of them (once; the others as notes). With several processes, process
    0's retention errors are raised on every process."""
    _raise_first(self._background.settle(self._root, self._timeout))

  # --- deleting (process 0 deletes; collective) ---------------------------------------------

  def delete(self, step: int) -> None:
    """Delete the checkpoint (or uncommitted leftover) of ``step``, its commit marker first
    (so it is never seen half deleted). Waits for this manager's save of it."""
    step = _steps.as_step(step)

    def remove() -> None:
      if not self._index.exists(step):
        raise CheckpointError(f"There is no step {step} in {self.directory!r}.")
      listing = self._index.list()
      self._index.delete(step, self._refs.kept(listing.committed, {step}).get(step, set()))

    self._claims.claim_delete(step)
    try:
      _coordination.from_process_0(self._root, "delete", remove, self._timeout)
    finally:
      self._claims.release_delete([step])
    self._index.forget(step)

  def cleanup(self) -> list[int]:
    """Delete the uncommitted leftovers of interrupted saves; return their steps. This
    manager's saves in flight are spared (another job's are not: do not run it then)."""
    def remove() -> list[int]:
      leftovers = self.uncommitted_steps()
      committed = self._index.list().committed
      deleted, failed = delete_unclaimed(self._index, self._claims, lambda busy: [
          s for s in leftovers if s not in busy], lambda doomed: self._refs.kept(
              committed, doomed))
      if failed:
        raise failed[0][1]
      return deleted

    return _coordination.from_process_0(self._root, "cleanup", remove, self._timeout)

  # --- restoring ----------------------------------------------------------------------------

  def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> Any:
    """Restore ``step`` with :func:`fnckpt.restore`'s ``target`` and keyword arguments
    (``partial``, ``cast``, ``budget_bytes``). Default: the newest committed step, chosen by
    process 0 once this manager's saves and retention have finished (collective then)."""
    if step is None:
      step = self._agreed_latest()
      if step is None:
        leftovers = self.uncommitted_steps()
        extra = f" (only uncommitted leftovers: steps {leftovers})" if leftovers else ""
        raise CheckpointError(f"No committed checkpoint in {self.directory!r}{extra}.")
    step = _steps.as_step(step)
    self._claims.wait_saved(step)
    with self._claims.reading(step):  # retention and delete() leave it alone meanwhile
      return _api().restore(self.path(step), target, storage_options=self._storage_options,
                            **kwargs)

  def fork(self, step: int, directory: str) -> "CheckpointManager":
    """A new run in ``directory`` whose newest step is ``step`` of this run, without copying
    its data: the fork's checkpoint refers to this run's data, and this run records the fork
    (``<run>/forks/``) so its retention and deletes keep that data. Both runs then go their
    own way. Returns a manager of the fork with this manager's options (collective).

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/fork/a")
    >>> _ = mgr.save(0, {"w": np.arange(40000.0)}); mgr.wait()
    >>> child = mgr.fork(0, "memory://doc/fork/b")
    >>> child.all_steps(), float(child.restore()["w"][-1])
    ([0], 39999.0)
    """
    step = _steps.as_step(step)
    self._claims.wait_saved(step)
    with self._claims.reading(step):
      _coordination.from_process_0(
          self._root, "fork", lambda: _lineage.fork(self, step, directory), self._timeout)
    return CheckpointManager(directory, **self._options)

  def _agreed_latest(self) -> int | None:
    self._background.join()
    return _coordination.from_process_0(self._root, "latest", self.latest_step, self._timeout)

  def restore_or_init(self, init: Callable[[], Any] | Any, target: Any = None,
                      **kwargs: Any) -> tuple[Any, int | None]:
    """``(state, step)``: the newest committed step restored, or ``(init(), None)`` when the
    directory has none. ``init`` is a function making the initial state or the state itself.

    ``target`` says where the restored arrays go (see :func:`fnckpt.restore`): by default the
    state itself when ``init`` is a state, else ``jax.eval_shape(init)`` (for a jitted init
    with ``out_shardings`` that carries the shardings). A ``jax.ShapeDtypeStruct`` without a
    sharding in it is an error with several processes and a warning with one."""
    step = self._agreed_latest()
    if target is None and step is not None:
      target = jax.eval_shape(init) if callable(init) else init
    if target is not None:
      _check_placed(target, self.directory)
    if step is None:
      return (init() if callable(init) else init), None
    return self.restore(step, target, **kwargs), step

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
    if self._last_saved != self._preemption.step:
      warnings.warn(
          f"Stopping for preemption at step {step}, but step {self._preemption.step} was not "
          f"saved (call manager.save when manager.should_save(step) is true); the newest "
          f"checkpoint in {self.directory!r} is older.", stacklevel=2)
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

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    # Leaving on an exception: finish this process's own work but meet no other process
    # (they may be anywhere), and never hide the exception that ended the block.
    self._closed = True
    self._background.join()
    for error in self._background.take():
      print(f"fnckpt: while closing {self.directory!r}: {error}", file=sys.stderr)
    self._preemption.uninstall()

  def __repr__(self) -> str:
    return f"CheckpointManager({self.directory!r}, {self._retention.policy})"


def _check_may_save(claims: StepClaims, index: _steps.StepIndex, step: int, force: bool,
                    directory: str, storage_options: dict[str, Any] | None) -> None:
  """save(): refuse an older step, one being saved, or one committed already (unless
  ``force``). Run on process 0 for every process (``_coordination.from_process_0``)."""
  if force:
    return
  newest = max(claims.saving() | {index.newest_known() or -1})
  if newest > step:
    raise CheckpointError(
        f"Step {step} is older than step {newest}, already in {directory!r}. Steps must "
        "increase; to go back, delete the newer steps (manager.delete(s)) or pass force=True.")
  handle = claims.handle(step)
  if handle is not False and (handle is None or not handle.done()):
    raise CheckpointError(f"Step {step} is being saved to {directory!r} already; pass "
                          "force=True to replace it.")
  if _commit.is_committed(_paths.open_kvstore(index.path(step), storage_options)):
    raise CheckpointError(
        f"Step {step} is already committed in {directory!r}. Pass force=True to replace it, "
        "or save a new step.")


def _checked_options(best_n: int | None, best_metric: str | None, save_interval_steps: int,
                     save_options: Mapping[str, Any] | None) -> dict[str, Any]:
  """The constructor's checks (the retention policy checks its own arguments)."""
  if best_n and not isinstance(best_metric, str):
    raise ValueError("best_n needs best_metric: the name of a metric passed to "
                     "save(..., metrics={name: value}).")
  if (not isinstance(save_interval_steps, int) or isinstance(save_interval_steps, bool)
      or save_interval_steps < 1):
    raise ValueError(f"save_interval_steps must be an int >= 1, got {save_interval_steps!r}.")
  options = dict(save_options or {})
  for bad in ("overwrite", "metadata", "storage_options"):
    if bad in options:
      raise ValueError(f"save_options may not set {bad!r}; the manager decides it.")
  return options


def _user_metadata(step: int, metrics: Mapping[str, Any] | None, metadata: Any) -> dict:
  """The manifest's user metadata of a manager save: ``{"step", "metrics", "user"}``."""
  out: dict[str, Any] = {"step": step}
  if metrics is not None:
    if not isinstance(metrics, Mapping):
      raise CheckpointError(f"metrics must be a dict of name -> value, got "
                            f"{type(metrics).__name__}.")
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
      raise CheckpointError(f"save(metrics=...) must be msgpack data (numbers, str, lists, "
                            f"dicts): {e}. Convert the values, e.g. float(loss).") from None
    out["metrics"] = plain
  if metadata is not None:
    out["user"] = metadata  # checked by fnckpt.save
  return out


def _check_placed(target: Any, directory: str) -> None:
  """restore_or_init: a ``ShapeDtypeStruct`` target leaf without a sharding would land on one
  device. An error with several processes, a warning with one."""
  flat = jax.tree_util.tree_flatten_with_path(target)[0]
  unplaced = [jax.tree_util.keystr(path) for path, leaf in flat
              if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None]
  if not unplaced:
    return
  where = ", ".join(unplaced[:5]) + (f" and {len(unplaced) - 5} more" if len(unplaced) > 5
                                     else "")
  fix = ("Add shardings, e.g. target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, "
         "x.dtype, sharding=NamedSharding(mesh, P())), jax.eval_shape(init)) with each array's "
         "PartitionSpec, pass the initialized state, or make init a jax.jit with out_shardings.")
  if jax.process_count() > 1:
    raise CheckpointError(
        f"restore_or_init({directory!r}): the target has no sharding at {where}, so with "
        f"{jax.process_count()} processes these arrays cannot be placed on the job's devices. "
        f"{fix}")
  warnings.warn(
      f"restore_or_init({directory!r}): the target has no sharding at {where}; these arrays "
      f"are restored onto one device ({jax.devices()[0]}). {fix}", stacklevel=3)


def _raise_first(errors: list[BaseException]) -> None:
  """Raise ``errors[0]``, the others attached as notes (nothing is dropped)."""
  if not errors:
    return
  first = errors[0]
  for other in errors[1:]:
    first.add_note(f"also: {type(other).__name__}: {other}")
  raise first
