"""What the manager's processes agree on, through the ``jax.distributed`` coordination service.

:func:`from_process_0` is the one pattern: process 0 decides (the newest step to restore, the
outcome of a delete, the background errors only it saw) and publishes the answer; every
process returns it, or raises: an exception in ``decide()`` is process 0's failure. Each call
is a barrier of an attempt (:mod:`fnckpt._io.attempt`): of the manager call it is in
(:func:`operation`: ``restore``, ``save``, ...), or of its own. Barriers are numbered per
attempt and keys are the attempt's, so a failed call leaves nothing the next one meets, and a
process that fails anywhere in a manager call publishes its error for the next barrier: every
other process raises there, naming it. The calls are collective: with several processes every
process makes them, in the same order; with one process they are plain local calls.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, ContextManager, Iterator

import jax

from . import attempt as _attempt
from . import commit as _commit

__all__ = [
  "from_process_0",
  "all_gather",
  "operation",
  "part",
  "client",
  "preemption_sync_manager",
  "multi",
]


def multi() -> bool:
  return jax.process_count() > 1


def client() -> Any:
  """The coordination service client (JAX has no public accessor for it)."""
  return _commit._client()


def preemption_sync_manager() -> Any:
  """JAX's preemption sync manager (``None`` when its preemption service is off)."""
  return _commit._state().preemption_sync_manager


def operation(location: str, name: str, timeout_s: float) -> ContextManager[Any]:
  """A manager call (``name``: ``restore``, ``save``, ...) at the run ``location`` as one
  attempt: its collective calls (these, and collective restores) are the attempt's numbered
  barriers, then one last (``manager-<name>-done``); an exception leaving the block on any
  process is published for its next barrier, where every other process raises a
  :class:`fnckpt.CheckpointError` naming that process and the error. One process: nothing.

  >>> with operation("memory://doc/op", "latest", 10.0):   # one process: a no-op
  ...   from_process_0("memory://doc/op", "latest", lambda: 7, 10.0)
  7
  """
  if not multi():
    return contextlib.nullcontext()
  return _attempt.collective(
    location,
    "manager",
    timeout_s,
    on=True,
    what=f"CheckpointManager.{name}()",
    done=f"manager-{name}-done",
  )


def part(location: str, name: str, timeout_s: float) -> ContextManager[Any]:
  """A part of the open manager call that a caller goes on after, whatever it raises (the
  manager's try of one step: every process then exchanges its outcome): a segment of the
  call's attempt ending with one barrier (``manager-<name>``), so an exception on any
  process inside it is met by every process at a barrier of the part, never at one after
  it (the part raises there, on every process: a :class:`fnckpt.CheckpointError` naming
  the failing process and its error, a :class:`fnckpt.DamagedError` where it found damage).
  Every process leaves it at the same barrier. One process: nothing."""
  if not multi():
    return contextlib.nullcontext()
  return _attempt.collective(location, "manager", timeout_s, on=True, done=f"manager-{name}")


@contextlib.contextmanager
def _within(location: str, name: str, timeout_s: float) -> Iterator[tuple[Any, bool]]:
  """The open attempt this call is a barrier of, or one of its own (then ``True``: the call
  is its last barrier)."""
  current = _attempt.current()
  if current.multi and not current.closed:
    yield current, False
    return
  what = f"fnckpt's manager ({name})"
  with _attempt.collective(location, "manager", timeout_s, on=True, what=what) as attempt:
    yield attempt, True


def from_process_0(location: str, name: str, decide: Callable[[], Any], timeout_s: float) -> Any:
  """``decide()`` on process 0 (JSON-able result), returned on every process; an exception
  there is raised on every process (process 0: the original; others: a
  :class:`CheckpointError` naming process 0 and the error). Collective with several
  processes.

  >>> from_process_0("memory://doc/agree", "latest", lambda: 7, 10.0)  # one process: local
  7
  """
  if not multi():
    return decide()
  with _within(location, name, timeout_s) as (attempt, last):
    mine = json.dumps(decide()) if jax.process_index() == 0 else None
    return json.loads(attempt.share(f"manager-{name}", mine, last))


def all_gather(location: str, name: str, value: Any, timeout_s: float) -> list[Any]:
  """Every process's ``value`` (JSON-able), in process order, on every process (each posts
  its own, one barrier, then the reads). Collective with several processes.

  >>> all_gather("memory://doc/agree", "outcome", {"ok": True}, 10.0)  # one process
  [{'ok': True}]
  """
  if not multi():
    return [value]
  with _within(location, name, timeout_s) as (attempt, last):
    return [json.loads(v) for v in attempt.gather(f"manager-{name}", json.dumps(value), last)]
