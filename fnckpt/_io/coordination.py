"""What the manager's processes agree on, through the ``jax.distributed`` coordination service.

:func:`from_process_0` is the one pattern: process 0 decides (the newest step to restore, the
outcome of a delete, the background errors only it saw), publishes the answer under one key,
and two barriers bracket the read, so every process returns the same answer (or raises the
same error) and the key is never overwritten before everyone has read it. No counters: the
barrier ids are the location and the name, which the service counts itself. The calls are
collective: with several processes every process makes them, in the same order; with one
process they are plain local calls.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import jax

from .._errors import CheckpointError
from . import commit as _commit
from . import paths as _paths

__all__ = ["from_process_0", "all_gather", "client", "preemption_sync_manager", "multi"]


def multi() -> bool:
  return jax.process_count() > 1


def client() -> Any:
  """The coordination service client (JAX has no public accessor for it)."""
  return _commit._client()


def preemption_sync_manager() -> Any:
  """JAX's preemption sync manager (``None`` when its preemption service is off)."""
  return _commit._state().preemption_sync_manager


def _key(location: str, name: str) -> str:
  digest = hashlib.sha256(_paths.display(location).encode()).hexdigest()[:24]
  return f"fnckpt/manager/{digest}/{name}"


def from_process_0(location: str, name: str, decide: Callable[[], Any], timeout_s: float) -> Any:
  """``decide()`` on process 0 (JSON-able result), returned on every process; an exception
  there is raised on every process (process 0: the original; others: a
  :class:`CheckpointError` with its message). Collective with several processes.

  >>> from_process_0("memory://doc/agree", "latest", lambda: 7, 10.0)  # one process: local
  7
  """
  if not multi():
    return decide()
  kv, key, error = client(), _key(location, name), None
  if jax.process_index() == 0:
    try:
      answer = json.dumps({"ok": decide()})
    except Exception as e:
      error, answer = e, json.dumps({"error": f"{type(e).__name__}: {e}"})
    kv.key_value_set(key, answer, allow_overwrite=True)
  _commit.barrier(location, f"manager-{name}-decided", timeout_s)
  answer = json.loads(kv.blocking_key_value_get(key, max(1, int(timeout_s * 1000))))
  _commit.barrier(location, f"manager-{name}-read", timeout_s)
  if error is not None:
    raise error
  if "error" in answer:
    raise CheckpointError(
      f"On process 0 ({name} of {_paths.display(location)!r}): {answer['error']}"
    )
  return answer["ok"]


def all_gather(location: str, name: str, value: Any, timeout_s: float) -> list[Any]:
  """Every process's ``value`` (JSON-able), in process order, on every process (each posts
  under its own key; two barriers bracket the reads). Collective with several processes.

  >>> all_gather("memory://doc/agree", "outcome", {"ok": True}, 10.0)  # one process
  [{'ok': True}]
  """
  if not multi():
    return [value]
  kv, key = client(), _key(location, name)
  kv.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value), allow_overwrite=True)
  _commit.barrier(location, f"manager-{name}-posted", timeout_s)
  ms = max(1, int(timeout_s * 1000))
  values = [
    json.loads(kv.blocking_key_value_get(f"{key}/{p}", ms)) for p in range(jax.process_count())
  ]
  _commit.barrier(location, f"manager-{name}-gathered", timeout_s)
  return values
