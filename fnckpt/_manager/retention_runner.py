"""The manager's background work: after each save commits, retention deletes what the policy
no longer keeps. The policy itself is the pure :mod:`fnckpt._manager.retention`.

Retention runs on process 0 only (deletes are prefix deletes, the commit marker first). Its
errors never propagate from a call another process also makes: they are warned about at once
and kept in :class:`Background` until the manager's ``wait()``/``close()``, which share them
with every process (:mod:`fnckpt._io.coordination`).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import jax

from .._errors import CheckpointError
from .._io import coordination as _coordination
from . import fork as _fork
from . import retention as _retention
from .claims import StepClaims
from .steps import StepIndex

__all__ = [
  "Background",
  "RetentionRunner",
  "RetentionError",
  "delete_unclaimed",
  "delete_referenced",
  "collect_held",
]


class RetentionError(CheckpointError):
  """Retention (on process 0) could not delete a step; the newer checkpoints are committed."""


class Background:
  """Background threads (one per save: wait for its commit, then retention) and the errors
  they hit, each handed out once by :meth:`take`."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []
    self._errors: list[BaseException] = []

  def spawn(self, name: str, fn: Callable[..., None], /, *args: Any, **kwargs: Any) -> None:
    def run() -> None:
      try:
        fn(*args, **kwargs)
      except BaseException as e:  # kept for wait(); nothing may die silently in a thread
        self.record(e)

    thread = threading.Thread(target=run, name=name)  # the interpreter waits for it at exit
    with self._lock:
      self._threads = [t for t in self._threads if t.is_alive()] + [thread]
    thread.start()

  def record(self, error: BaseException) -> None:
    with self._lock:
      self._errors.append(error)

  def join(self) -> None:
    """Wait for every thread, including those started meanwhile."""
    while True:
      with self._lock:
        alive = [t for t in self._threads if t.is_alive() and t is not threading.current_thread()]
      if not alive:
        return
      for t in alive:
        t.join()

  def take(self) -> list[BaseException]:
    with self._lock:
      errors, self._errors = self._errors, []
    return errors

  def settle(self, location: str, timeout_s: float) -> list[BaseException]:
    """Join, then take the errors: this process's, plus (several processes; collective) the
    retention errors process 0 hit, which no other process would see otherwise."""
    self.join()
    errors = self.take()
    shared = _coordination.from_process_0(
      location, "wait", lambda: [str(e) for e in errors if isinstance(e, RetentionError)], timeout_s
    )
    if jax.process_index() != 0:
      errors += [RetentionError(f"On process 0: {text}") for text in shared]
    return errors


def delete_unclaimed(
  index: StepIndex,
  claims: StepClaims,
  choose: Callable[[set[int]], list[int]],
  keep: Callable[[set[int]], dict[int, set[str]]] | None = None,
) -> tuple[list[int], list[tuple[int, BaseException]]]:
  """Claim and delete the steps ``choose(claimed steps)`` names (never a claimed one); return
  (deleted steps, [(step, error)] for those that could not be deleted). ``keep(doomed)``: per
  step, its data directories that the steps left (or forks) refer to, which stay."""
  doomed = claims.claim_unprotected(choose)
  deleted: list[int] = []
  failed: list[tuple[int, BaseException]] = []
  try:
    kept = keep(set(doomed)) if keep is not None and doomed else {}
    for step in doomed:
      try:
        index.delete(step, kept.get(step, set()))
        deleted.append(step)
      except Exception as e:  # TensorStore raises ValueError and others
        failed.append((step, e))
  finally:
    claims.release_delete(doomed)
  return sorted(deleted), failed


def delete_referenced(
  index: StepIndex, claims: StepClaims, choose: Callable[[set[int]], list[int]]
) -> tuple[list[int], list[tuple[int, BaseException]]]:
  """:func:`delete_unclaimed` keeping the data that the steps left (damaged ones too) or
  forks refer to (``REFERENCED``, :mod:`fnckpt._manager.fork`), read from a listing taken once the
  doomed steps are claimed (a step committed after ``choose``'s listing may refer to them);
  then :func:`collect_held`."""
  deleted, failed = delete_unclaimed(
    index,
    claims,
    choose,
    lambda doomed: index.refs.kept(index.list(in_flight=claims.saving()), doomed),
  )
  collect_held(index, claims)
  return deleted, failed


def collect_held(index: StepIndex, claims: StepClaims) -> None:
  """(Process 0, or each process for its local tier.) Drop the data of held (``REFERENCED``)
  steps that nothing refers to any more. The held steps are claimed first (a save of that
  step number waits; claimed ones are left alone), then what is referred to is read from a
  fresh listing (a step committed meanwhile may refer to them)."""
  listing = index.list(in_flight=claims.saving())
  if not listing.held:
    return
  held = claims.claim_unprotected(lambda protect: [s for s in listing.held if s not in protect])
  try:
    if held:
      fresh = index.list(in_flight=claims.saving())
      _fork.collect(
        index.location, [s for s in held if s in fresh.held], index.refs.kept(fresh, set())
      )
  finally:
    claims.release_delete(held)


class RetentionRunner:
  """Applies ``policy`` to the committed steps of ``index``, sparing the steps in ``claims``,
  the newest committed step, and (through the policy) whatever it keeps."""

  def __init__(
    self, index: StepIndex, claims: StepClaims, policy: _retention.Policy, best_metric: str | None
  ):
    self.index = index
    self.claims = claims
    self.policy = policy
    self.best_metric = best_metric

  @property
  def active(self) -> bool:
    return not self.policy.keeps_all

  def run(self) -> None:
    """One retention pass (blocking). Raises :class:`RetentionError` naming every step it
    could not delete; the other doomed steps are deleted regardless. Held steps whose data
    nothing refers to any more are dropped also when the policy keeps every step."""
    if not self.active:
      collect_held(self.index, self.claims)
      return
    listing = self.index.list(in_flight=self.claims.saving())
    metrics = (
      self.index.metric_values(listing, self.best_metric)
      if self.policy.best_n and self.best_metric
      else {}
    )
    _, failed = delete_referenced(
      self.index,
      self.claims,
      lambda protect: _retention.to_delete(listing.steps, self.policy, metrics, protect),
    )
    if failed:
      raise self._error(failed)

  def _error(self, failed: list[tuple[int, BaseException]]) -> RetentionError:
    steps = ", ".join(str(s) for s, _ in failed)
    causes = "; ".join(
      str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}" for _, e in failed
    )
    error = RetentionError(
      f"Retention could not delete step {steps} of {self.index.display!r}: "
      f"{causes.rstrip('.')}. The newer checkpoints are committed. Fix the cause, then call "
      f"manager.delete(step) for step {steps} (or let the next retention pass retry)."
    )
    warnings.warn(str(error), RuntimeWarning, stacklevel=1)
    return error
