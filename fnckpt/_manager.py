"""CheckpointManager: one fnckpt checkpoint per training step under a directory.

Layout: ``<directory>/<step>/`` holds the checkpoint of ``step`` (plain decimal, no padding);
a step exists when its ``COMMIT`` marker does. Listing is one TensorStore kvstore list of the
directory, so it works on local files, ``memory://``, ``gs://`` and ``s3://`` alike.

Retention is the pure function :func:`fnckpt._retention.to_delete` of the committed steps (and
their metrics). It runs in a background thread after each save has committed, never touches a
step whose save or restore (by this manager) is in flight, and always keeps the newest
committed step; a step it spared for a reader goes at the next retention pass.

Resuming after preemption (single process; the pattern every training loop can copy)::

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

With several processes (``jax.distributed``), JAX's own preemption service handles SIGTERM and
:meth:`CheckpointManager.should_save` asks it for the step at which every process saves.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import warnings
from typing import Any, Callable, Mapping

import jax
import numpy as np

from . import _commit, _manifest, _paths, _retention
from . import _restore as _restore_mod
from . import _save as _save_mod
from ._errors import CheckpointError

__all__ = ["CheckpointManager"]

_STEP_NAME = re.compile(r"0|[1-9][0-9]*")


def _as_step(step: Any) -> int:
  if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
    value = int(step)
  elif getattr(step, "shape", None) == () and np.issubdtype(np.asarray(step).dtype, np.integer):
    value = int(np.asarray(step))  # a 0-d array, e.g. state.step
  else:
    value = -1
  if value < 0:
    raise CheckpointError(f"A checkpoint step must be a non-negative int, got {step!r}.")
  return value


def _plain_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Metrics -> msgpack data: 0-d arrays and numpy scalars become Python numbers."""
  if not isinstance(metrics, Mapping):
    raise CheckpointError(f"metrics must be a dict of name -> value, got {type(metrics).__name__}.")
  out = {}
  for name, value in metrics.items():
    if not isinstance(name, str):
      raise CheckpointError(f"metrics: name {name!r} must be a str.")
    if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0:
      value = np.asarray(value).item()
    out[name] = value
  _manifest.check_msgpackable(out, "save(metrics=...)")
  return out


def scan(directory: str, storage_options: dict[str, Any] | None = None
         ) -> tuple[list[int], list[int]]:
  """(committed steps, uncommitted leftover steps) under ``directory``, each sorted; one list.
  Step directories are named by the plain decimal step; other names are ignored.

  >>> from fnckpt import _paths
  >>> kv = _paths.open_kvstore("memory://doc/scan")
  >>> _ = kv.write("7/COMMIT", b"").result(); _ = kv.write("9/manifest.msgpack", b"").result()
  >>> _ = kv.write("notes.txt", b"").result(); _ = kv.write("08/COMMIT", b"").result()
  >>> scan("memory://doc/scan")
  ([7], [9])
  """
  names: dict[int, bool] = {}
  for key in _paths.list_keys(directory, storage_options):
    name, sep, rest = key.partition("/")
    if not sep or not _STEP_NAME.fullmatch(name):
      continue
    step = int(name)
    names[step] = names.get(step, False) or rest == _manifest.COMMIT
  committed = sorted(s for s, c in names.items() if c)
  return committed, sorted(s for s, c in names.items() if not c)


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
    handle_preemption: install the SIGTERM handler now (see
      :meth:`install_preemption_handler`).
    storage_options: settings for ``gs://``/``s3://`` (see :func:`fnckpt.save`).
    save_options: more keyword arguments for every :func:`fnckpt.save` (``zstd``,
      ``budget_bytes``, ``inline_bytes``, ``barrier_timeout_s``).

  With no retention rule every step is kept. The newest committed step and steps being saved
  are never deleted. Uncommitted leftovers of crashed saves are ignored, reported (a warning
  here and :meth:`uncommitted_steps`) and removed only by :meth:`cleanup` or by a new save to
  the same step.

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
               save_options: Mapping[str, Any] | None = None):
    self.directory = _paths.display(directory)
    self._root = str(directory)
    self._policy = _retention.Policy(max_to_keep, keep_every, best_n, best_mode)
    if best_n and not isinstance(best_metric, str):
      raise ValueError("best_n needs best_metric: the name of a metric passed to "
                       "save(..., metrics={name: value}).")
    if (not isinstance(save_interval_steps, int) or isinstance(save_interval_steps, bool)
        or save_interval_steps < 1):
      raise ValueError(f"save_interval_steps must be an int >= 1, got {save_interval_steps!r}.")
    self.best_metric = best_metric
    self.save_interval_steps = save_interval_steps
    self._storage_options = storage_options
    self._save_options = dict(save_options or {})
    for bad in ("overwrite", "metadata", "storage_options"):
      if bad in self._save_options:
        raise ValueError(f"save_options may not set {bad!r}; the manager decides it.")

    self._lock = threading.Condition()
    self._pending: dict[int, Any] = {}      # step -> SaveHandle (None while staging)
    self._deleting: set[int] = set()
    self._reading: dict[int, int] = {}      # step -> restores of this manager reading it
    self._threads: list[threading.Thread] = []
    self._errors: list[BaseException] = []
    self._metric_cache: dict[int, Any] = {}
    self._last_saved: int | None = None
    self._preempt_flag = threading.Event()
    self._preempt_step: int | None = None
    self._previous_handlers: dict[int, Any] = {}
    self._multi_process_preemption = False
    self._closed = False

    committed, leftovers = scan(self._root, storage_options)
    self._known: set[int] = set(committed)
    if leftovers:
      warnings.warn(
          f"{self.directory!r} holds uncommitted steps {leftovers} (saves interrupted by a "
          "crash). They are ignored; manager.cleanup() removes them, and saving one of these "
          "steps replaces it.", stacklevel=2)
    if handle_preemption:
      self.install_preemption_handler()

  # --- where things are ---------------------------------------------------------------------

  def path(self, step: int) -> str:
    """The location of ``step``'s checkpoint (for :func:`fnckpt.metadata`, the CLI, ...).

    >>> import fnckpt
    >>> fnckpt.CheckpointManager("/tmp/run").path(7)
    '/tmp/run/7'
    """
    return _paths.join(self._root, str(_as_step(step)))

  def all_steps(self) -> list[int]:
    """The committed steps, oldest first (read from storage; saves in flight are not there).

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/all_steps")
    >>> _ = mgr.save(3, {"x": np.zeros(2)}); mgr.wait()
    >>> mgr.all_steps()
    [3]
    """
    return scan(self._root, self._storage_options)[0]

  def latest_step(self) -> int | None:
    """The newest committed step, or ``None`` if there is none.

    >>> import fnckpt
    >>> print(fnckpt.CheckpointManager("memory://doc/latest_empty").latest_step())
    None
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def uncommitted_steps(self) -> list[int]:
    """Steps whose directory holds data but no commit marker (interrupted saves), not counting
    this manager's saves in flight.

    >>> import fnckpt
    >>> fnckpt.CheckpointManager("memory://doc/uncommitted").uncommitted_steps()
    []
    """
    leftovers = scan(self._root, self._storage_options)[1]
    with self._lock:
      return [s for s in leftovers if s not in self._pending and s not in self._deleting]

  def metrics(self, step: int) -> dict[str, Any] | None:
    """The metrics saved with ``step`` (``None`` if none were given).

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/metrics")
    >>> _ = mgr.save(1, {"x": np.zeros(2)}, metrics={"loss": 0.5}); mgr.wait()
    >>> mgr.metrics(1)
    {'loss': 0.5}
    """
    step = _as_step(step)
    self._wait_step(step)
    kv = _paths.open_kvstore(self.path(step), self._storage_options)
    manifest, _ = _commit.read_header(kv, _paths.display(self.path(step)))
    meta = manifest.get("metadata")
    return meta.get("metrics") if isinstance(meta, dict) else None

  # --- saving -------------------------------------------------------------------------------

  def should_save(self, step: int) -> bool:
    """Whether the loop should save ``step``: it is on the save interval, or it is the first
    step boundary after a preemption notice (then :meth:`reached_preemption` will be true).

    >>> import fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/should_save", save_interval_steps=10)
    >>> [s for s in range(25) if mgr.should_save(s)]
    [0, 10, 20]
    """
    step = _as_step(step)
    return self._check_preemption(step) or step % self.save_interval_steps == 0

  def save(self, step: int, tree: Any, *, metrics: Mapping[str, Any] | None = None,
           metadata: Any = None, force: bool = False) -> _save_mod.SaveHandle | None:
    """Save ``tree`` as ``step``; return once its arrays are off the devices.

    Skipped (returns ``None``) when ``step`` is not on ``save_interval_steps``, unless
    ``force`` or a preemption is pending. The write and commit go on in the background; after
    the commit, retention deletes the steps the policy no longer keeps. Raises if ``step`` is
    already committed or older than the newest step, unless ``force`` (a committed step is
    then replaced). An uncommitted leftover at ``step`` is replaced. An error of an earlier
    save of this manager is raised here.

    Args:
      step: the training step (a non-negative int); names the directory ``<directory>/<step>``.
      tree: the pytree to save (see :func:`fnckpt.save`).
      metrics: small ``{name: number}`` stored with the step (ranked by ``best_n``).
      metadata: more msgpack-able user data stored with the step.
      force: save off the interval, replace a committed step, or save an older step.

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/save", save_interval_steps=2)
    >>> mgr.save(1, {"x": np.zeros(2)}) is None
    True
    >>> _ = mgr.save(2, {"x": np.zeros(2)}, metrics={"loss": 1.0}).wait()
    >>> mgr.all_steps()
    [2]
    """
    self._check_open()
    self._raise_errors()
    step = _as_step(step)
    preempting = self._check_preemption(step)
    if not force and not preempting and step % self.save_interval_steps:
      return None
    manifest_meta: dict[str, Any] = {"step": step}
    if metrics is not None:
      manifest_meta["metrics"] = _plain_metrics(metrics)
    if metadata is not None:
      _manifest.check_msgpackable(metadata, "save(metadata=...)")
      manifest_meta["user"] = metadata
    path = self.path(step)

    with self._lock:
      newer = [s for s in self._known | set(self._pending) if s > step]
      if newer and not force:
        raise CheckpointError(
            f"Step {step} is older than step {max(newer)}, already in {self.directory!r}. Steps "
            "must increase; to go back, delete the newer steps (manager.delete(s)) or pass "
            "force=True.")
      in_flight = self._pending.get(step, False)
      if in_flight is not False and not force and (in_flight is None or not in_flight.done()):
        raise CheckpointError(
            f"Step {step} is being saved to {self.directory!r} already; pass force=True to "
            "replace it.")
    self._wait_step(step, claim=True)  # now protected from retention and other deletions
    try:
      kv = _paths.open_kvstore(path, self._storage_options)
      if _commit.is_committed(kv) and not force:
        raise CheckpointError(
            f"Step {step} is already committed in {self.directory!r}. Pass force=True to "
            "replace it, or save a new step.")
      handle = _save_mod.save(tree, path, overwrite=True, metadata=manifest_meta,
                              storage_options=self._storage_options, **self._save_options)
    except BaseException:
      with self._lock:
        self._pending.pop(step, None)
        self._lock.notify_all()
      raise
    metric = self._metric_of(manifest_meta)
    thread = threading.Thread(target=self._after_commit, args=(step, handle, metric),
                              name=f"fnckpt-manager:{self.directory}/{step}")
    with self._lock:
      self._pending[step] = handle
      self._known.add(step)
      self._last_saved = step
      self._threads = [t for t in self._threads if t.is_alive()] + [thread]
    thread.start()
    return handle

  def _metric_of(self, manifest_meta: Any) -> Any:
    if not self.best_metric or not isinstance(manifest_meta, dict):
      return None
    metrics = manifest_meta.get("metrics")
    return metrics.get(self.best_metric) if isinstance(metrics, dict) else None

  def _after_commit(self, step: int, handle: Any, metric: Any) -> None:
    """Background: wait for the save's commit, then apply retention."""
    try:
      handle.wait()
    except BaseException as e:
      with self._lock:
        self._errors.append(e)
        self._known.discard(step)
        if self._pending.get(step) is handle:
          del self._pending[step]
        self._lock.notify_all()
      return
    with self._lock:
      self._metric_cache[step] = metric
      if self._pending.get(step) is handle:
        del self._pending[step]
      self._lock.notify_all()
    try:
      self._apply_retention()
    except BaseException as e:
      with self._lock:
        self._errors.append(e)

  def _apply_retention(self) -> None:
    if jax.process_index() != 0 or self._policy.keeps_all:
      return
    committed, _ = scan(self._root, self._storage_options)
    metrics = self._metrics_for(committed) if self._policy.best_n else {}
    with self._lock:
      doomed = _retention.to_delete(committed, self._policy, metrics,
                                    protect=set(self._pending) | self._deleting |
                                    set(self._reading))
      self._deleting.update(doomed)
    try:
      for step in doomed:
        try:
          self._delete_now(step)
        except Exception as e:  # TensorStore raises ValueError and others
          raise CheckpointError(
              f"Retention could not delete step {step} of {self.directory!r} ({type(e).__name__}: "
              f"{e}). The newer checkpoints are committed; delete it by hand or fix the "
              "permissions.") from e
    finally:
      with self._lock:
        self._deleting.difference_update(doomed)
        self._lock.notify_all()

  def _metrics_for(self, steps: list[int]) -> dict[int, Any]:
    with self._lock:
      missing = [s for s in steps if s not in self._metric_cache]
    found = {}
    for step in missing:  # steps saved before this manager started: read their manifests once
      try:
        kv = _paths.open_kvstore(self.path(step), self._storage_options)
        manifest, _ = _commit.read_header(kv, _paths.display(self.path(step)))
        found[step] = self._metric_of(manifest.get("metadata"))
      except CheckpointError:
        found[step] = None
    with self._lock:
      self._metric_cache.update(found)
      return {s: self._metric_cache.get(s) for s in steps}

  def _delete_now(self, step: int) -> None:
    _paths.delete_prefix(self.path(step), self._storage_options, first=(_manifest.COMMIT,))
    with self._lock:
      self._known.discard(step)
      self._metric_cache.pop(step, None)

  def _wait_step(self, step: int, claim: bool = False) -> None:
    """Wait until no save and no deletion of ``step`` is in flight; with ``claim``, mark it
    as being saved in the same breath (so retention cannot pick it in between)."""
    with self._lock:
      handle = self._pending.get(step)
    if handle is not None:
      try:
        handle.wait()
      except BaseException:
        pass  # the background thread reports it
    with self._lock:
      self._lock.wait_for(lambda: step not in self._deleting and step not in self._pending)
      if claim:
        self._pending[step] = None

  def _join(self) -> None:
    while True:
      with self._lock:
        threads = [t for t in self._threads if t.is_alive()]
      if not threads:
        return
      for t in threads:
        t.join()

  def wait(self) -> None:
    """Block until every save of this manager has committed and retention has run; raise the
    first error of any of them (once).

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/wait")
    >>> _ = mgr.save(0, {"x": np.zeros(2)})
    >>> mgr.wait(); mgr.latest_step()
    0
    """
    self._join()
    self._raise_errors()

  def _raise_errors(self) -> None:
    with self._lock:
      errors, self._errors = self._errors, []
    if errors:
      raise errors[0]

  # --- deleting -----------------------------------------------------------------------------

  def delete(self, step: int) -> None:
    """Delete the committed checkpoint (or uncommitted leftover) of ``step`` (its commit marker
    first, so it is never seen half deleted). With several processes, process 0 deletes.

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/delete")
    >>> _ = mgr.save(0, {"x": np.zeros(2)}); _ = mgr.save(1, {"x": np.ones(2)}); mgr.wait()
    >>> mgr.delete(1); mgr.all_steps()
    [0]
    """
    step = _as_step(step)
    self._wait_step(step)
    with self._lock:
      if step in self._pending:
        raise CheckpointError(f"Step {step} of {self.directory!r} is being saved; wait first.")
      self._lock.wait_for(lambda: step not in self._reading)  # restores of it finish first
      self._deleting.add(step)
    try:
      if not _paths.list_keys(self.path(step), self._storage_options):
        raise CheckpointError(f"There is no step {step} in {self.directory!r}.")
      if jax.process_index() == 0:
        self._delete_now(step)
      else:
        with self._lock:
          self._known.discard(step)
    finally:
      with self._lock:
        self._deleting.discard(step)
        self._lock.notify_all()

  def cleanup(self) -> list[int]:
    """Delete the uncommitted leftovers of interrupted saves; return their steps. Saves in
    flight of this manager are not touched (do not run it while another process or manager
    writes to the same directory).

    >>> import fnckpt
    >>> fnckpt.CheckpointManager("memory://doc/cleanup").cleanup()
    []
    """
    leftovers = self.uncommitted_steps()
    if jax.process_index() == 0:
      for step in leftovers:
        with self._lock:
          if step in self._pending:
            continue
          self._deleting.add(step)
        try:
          _paths.delete_prefix(self.path(step), self._storage_options)
        finally:
          with self._lock:
            self._deleting.discard(step)
            self._lock.notify_all()
    return leftovers

  # --- restoring ----------------------------------------------------------------------------

  def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> Any:
    """Restore ``step`` (default: the newest committed step) with :func:`fnckpt.restore`'s
    ``target`` and keyword arguments (``partial``, ``cast``, ``budget_bytes``).

    >>> import numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/restore")
    >>> _ = mgr.save(5, {"x": np.arange(3)}); mgr.wait()
    >>> mgr.restore()["x"]
    array([0, 1, 2])
    """
    if step is None:
      self._join()
      for _ in range(3):  # a newer commit may retire the latest step before we claim it
        step = self.latest_step()
        if step is None:
          leftovers = self.uncommitted_steps()
          extra = f" (only uncommitted leftovers: steps {leftovers})" if leftovers else ""
          raise CheckpointError(f"No committed checkpoint in {self.directory!r}{extra}.")
        self._claim_read(step)
        if _commit.is_committed(_paths.open_kvstore(self.path(step), self._storage_options)):
          break
        self._release_read(step)
      else:
        raise CheckpointError(f"The latest step of {self.directory!r} keeps changing; retry.")
    else:
      step = _as_step(step)
      self._wait_step(step)
      self._claim_read(step)
    try:
      return _restore_mod.restore(self.path(step), target,
                                  storage_options=self._storage_options, **kwargs)
    finally:
      self._release_read(step)

  def _claim_read(self, step: int) -> None:
    """Mark ``step`` as being read: retention and delete() leave it alone until released."""
    with self._lock:
      self._lock.wait_for(lambda: step not in self._deleting)
      self._reading[step] = self._reading.get(step, 0) + 1

  def _release_read(self, step: int) -> None:
    with self._lock:
      self._reading[step] -= 1
      if not self._reading[step]:
        del self._reading[step]
      self._lock.notify_all()

  def restore_or_init(self, init: Callable[[], Any] | Any, target: Any = None,
                      **kwargs: Any) -> tuple[Any, int | None]:
    """``(state, step)``: the newest committed step restored, or ``(init(), None)`` when the
    directory has none. ``init`` is a function making the initial state or the state itself.

    ``target`` says where the restored arrays go (see :func:`fnckpt.restore`): by default the
    state itself when ``init`` is a state, else ``jax.eval_shape(init)`` (for a jitted init
    with ``out_shardings`` that carries the shardings; Python scalars in its output must then
    be given by an explicit ``target``).

    >>> import jax.numpy as jnp, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/restore_or_init")
    >>> state, step = mgr.restore_or_init(lambda: {"w": jnp.zeros(2)})
    >>> print(step)
    None
    >>> _ = mgr.save(9, {"w": state["w"] + 1}).wait()
    >>> state, step = mgr.restore_or_init(lambda: {"w": jnp.zeros(2)})
    >>> step, state["w"]
    (9, Array([1., 1.], dtype=float32))
    """
    self._join()
    step = self.latest_step()
    if step is None:
      return (init() if callable(init) else init), None
    if target is None:
      target = jax.eval_shape(init) if callable(init) else init
    return self.restore(step, target, **kwargs), step

  # --- preemption ---------------------------------------------------------------------------

  def install_preemption_handler(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
    """Make ``signals`` (default SIGTERM) only set a flag, so the loop saves at its next step
    boundary: :meth:`should_save` is then true, and :meth:`reached_preemption` returns true
    once that save has committed. Call from the main thread. :meth:`close` restores the
    previous handlers. With several processes JAX's preemption service (started by
    ``jax.distributed.initialize``) already catches SIGTERM, so nothing is installed.

    >>> import os, signal, numpy as np, fnckpt
    >>> mgr = fnckpt.CheckpointManager("memory://doc/preempt", save_interval_steps=100)
    >>> mgr.install_preemption_handler()
    >>> os.kill(os.getpid(), signal.SIGTERM)   # what the scheduler does
    >>> for step in range(1, 1000):
    ...   if mgr.should_save(step):
    ...     _ = mgr.save(step, {"step": step})
    ...   if mgr.reached_preemption(step):
    ...     break
    >>> step, mgr.all_steps()
    (1, [1])
    >>> mgr.close()
    """
    if jax.process_count() > 1:
      self._multi_process_preemption = True
      return
    if threading.current_thread() is not threading.main_thread():
      raise CheckpointError("install_preemption_handler() must be called from the main thread "
                            "(Python installs signal handlers there only).")
    for sig in signals:
      if sig not in self._previous_handlers:
        self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

  def _on_signal(self, signum: int, frame: Any) -> None:
    del frame
    if not self._preempt_flag.is_set():
      print(f"fnckpt: received {signal.Signals(signum).name}; saving {self.directory} at the "
            "next step boundary.", file=sys.stderr, flush=True)
    self._preempt_flag.set()

  def _check_preemption(self, step: int) -> bool:
    """True when ``step`` is the step to save for a preemption (fixed at the first check after
    the notice)."""
    if self._preempt_step is None:
      if self._multi_process_preemption:
        from jax.experimental import multihost_utils
        if multihost_utils.reached_preemption_sync_point(step):
          self._preempt_step = step
      elif self._preempt_flag.is_set():
        self._preempt_step = step
    return self._preempt_step == step

  @property
  def preemption_requested(self) -> bool:
    """Whether a preemption notice has arrived (the handler's flag).

    >>> import fnckpt
    >>> fnckpt.CheckpointManager("memory://doc/requested").preemption_requested
    False
    """
    return self._preempt_flag.is_set() or self._preempt_step is not None

  def reached_preemption(self, step: int) -> bool:
    """True when the loop should stop at ``step`` because of a preemption notice; before
    returning True it waits until every save of this manager has committed, so the process
    may exit right after. Call it after the (maybe) save of each step; see
    :meth:`install_preemption_handler` for the loop.

    >>> import fnckpt
    >>> fnckpt.CheckpointManager("memory://doc/reached").reached_preemption(0)
    False
    """
    step = _as_step(step)
    if self._preempt_step is None or step < self._preempt_step:
      return False
    if self._last_saved != self._preempt_step:
      warnings.warn(
          f"Stopping for preemption at step {step}, but step {self._preempt_step} was not saved "
          f"(call manager.save when manager.should_save(step) is true); the newest checkpoint "
          f"in {self.directory!r} is older.", stacklevel=2)
    self.wait()
    return True

  # --- lifetime -----------------------------------------------------------------------------

  def close(self) -> None:
    """Wait for pending saves (raising their errors) and restore the signal handlers.

    >>> import fnckpt
    >>> fnckpt.CheckpointManager("memory://doc/close").close()
    """
    if self._closed:
      return
    self._closed = True
    try:
      self.wait()
    finally:
      for sig, previous in self._previous_handlers.items():
        if threading.current_thread() is threading.main_thread():
          signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
      self._previous_handlers.clear()

  def _check_open(self) -> None:
    if self._closed:
      raise CheckpointError(f"The CheckpointManager of {self.directory!r} is closed.")

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    try:
      self.close()
    except BaseException as e:  # do not hide the exception that ended the block
      print(f"fnckpt: while closing {self.directory!r}: {e}", file=sys.stderr)

  def __repr__(self) -> str:
    return f"CheckpointManager({self.directory!r}, {self._policy})"
