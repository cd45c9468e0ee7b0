"""The broadcast of a read-once restore: one wave of leaves, read onto their reader shardings,
moved onto the targets' shardings by one jitted identity (XLA's collectives carry the bytes:
ICI/NVLink/IB on accelerators, Gloo over TCP between CPU processes).

Collective and bounded: every process enters a wave through a barrier of the restore's
deadline (a process that died or never came is named there, before any collective can wait
on it); a collective that fails (a peer's connection closed) or does not finish by the
deadline ends in a second, short barrier whose absentees are the lost processes, and every
surviving process raises a :class:`CheckpointError` naming them and the wave's key paths.

A process that fails before a wave's collective (its reads, the leaves read without
broadcast before the first wave, the previous wave's leaves finished) publishes its error and
still arrives at the wave's barrier (:func:`failed`), so the others learn of it there, before
any collective, and raise at once instead of waiting for the deadline: every process fails
the same wave, with a :class:`DamagedError` on all of them where one found damage (so the
manager's self-healing restore takes the same way on all of them). Barrier ids are the
location's and the wave's, counted by the coordination service: a process that never reaches
a barrier (lost, or unable to publish) leaves the counts apart for later restores of that
location (known limit).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax

from .._errors import CheckpointError, DamagedError
from .._io import commit as _commit
from .._io import paths as _paths

__all__ = ["start", "reading", "failed", "reshard", "done", "FAILED_WAIT_S"]

FAILED_WAIT_S = 5.0  # after a failed collective: how long the survivors wait for each other
POLL_S = 0.05  # how often a wave's results are checked against the deadline
ERRORS = "broadcast-error"  # where a process's read failure is published


def _identity(*xs: Any) -> tuple[Any, ...]:
  return xs


def start(location: str) -> None:
  """Before the first wave: drop the error this process published in an earlier broadcast
  restore of ``location`` (before it arrives at any barrier of this one, so no other process,
  which reads errors only past a barrier, can take it for this restore's)."""
  if jax.process_count() > 1:
    _commit.unpublish(location, ERRORS)


def reading(location: str, wave: int) -> None:
  """Publish that this process is reading its parts of ``wave`` (a barrier that times out
  on another process says so about this one)."""
  _commit.report(location, f"broadcast-wave-{wave}: reading")


def done(location: str) -> None:
  """Drop this process's progress entry (the broadcast is over)."""
  _commit.forget(location)


def failed(location: str, wave: int, error: BaseException, timeout_s: float) -> None:
  """This process could not read its parts of ``wave``: publish ``error`` and arrive at the
  wave's barrier, so every other process raises there (:func:`reshard`) rather than wait for
  this one until the deadline. The caller raises ``error`` afterwards."""
  if jax.process_count() == 1:
    return
  kind = "damaged" if isinstance(error, DamagedError) else "error"
  text = f"{type(error).__name__}: {_paths.error_text(error)}"[:4000]
  if not _commit.publish(location, ERRORS, f"{kind}:{text}"):
    return  # fail closed: unpublished, the others time out at the barrier (naming this one)
  phase = f"broadcast-wave-{wave}"
  _commit.report(location, f"{phase}: failed reading")
  try:
    _commit.barrier(location, phase, timeout_s)
  except CheckpointError:  # the others are gone or late: they time out and say so
    pass


def _raise_published(location: str, phase: str, where: Sequence[str]) -> None:
  """Raise if another process published a failure of this restore (past the wave's barrier
  every process has either published or not): a :class:`DamagedError` where that process
  found damage (so every process takes the same way: the manager reads another copy or an
  older step on all of them), else a :class:`CheckpointError`."""
  found = _read_published(location)
  if not found:
    return
  p, published = found[0]
  kind, _, text = published.partition(":")
  who = f"process {p}" if p >= 0 else "another process (unknown)"
  error = DamagedError if kind == "damaged" else CheckpointError
  raise error(
    f"The broadcast restore of {_paths.display(location)!r} failed in {phase} "
    f"({_keys(where)}): {who} could not read its parts ({text}). This "
    f"process (process {jax.process_index()}) stops at the same wave. Fix or restore "
    f"another checkpoint (the manager's restore() falls back to an older step on every "
    f"process when the data is damaged)."
  )


def _read_published(location: str) -> list[tuple[int, str]]:
  """The others' published failures, read with retries; unreadable reads as a failure
  (fail closed: not knowing is not "no failure")."""
  for attempt in range(3):
    try:
      return _commit.published(location, ERRORS)
    except Exception as e:
      if attempt == 2:
        return [(-1, f"error:the coordination service cannot be read ({type(e).__name__})")]
      time.sleep(0.2)
  return []


def _keys(where: Sequence[str]) -> str:
  return ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")


def reshard(
  arrays: Sequence[jax.Array],
  shardings: Sequence[jax.sharding.Sharding],
  where: Sequence[str],
  location: str,
  wave: int,
  timeout_s: float,
) -> list[jax.Array]:
  """``arrays`` (on their reader shardings) on ``shardings``, each input deleted once moved.
  Collective: every process calls it with the same wave, in the same order. ``where``: the
  key paths (for messages)."""
  phase = f"broadcast-wave-{wave}"
  _commit.report(location, f"{phase}: resharding")
  _commit.barrier(location, phase, timeout_s)  # (names who did not come)
  _raise_published(location, phase, where)
  deadline = time.monotonic() + timeout_s
  try:
    out = jax.jit(_identity, out_shardings=tuple(shardings))(*arrays)
    _wait(out, deadline)
  except Exception as e:
    raise _failure(location, phase, where, e, timeout_s) from None
  for x in arrays:
    x.delete()
  return list(out)


def _wait(out: Sequence[jax.Array], deadline: float) -> None:
  """Until every result is ready; a TimeoutError at ``deadline`` (a collective waiting on a
  peer that will not come cannot be cancelled, but this process need not wait with it)."""
  for x in out:
    while not x.is_ready():  # type: ignore[attr-defined]  # (jax's stubs)
      if time.monotonic() > deadline:
        raise TimeoutError("the collective did not finish by the deadline")
      time.sleep(POLL_S)
    x.block_until_ready()  # (raises the collective's error, if any)


def _failure(
  location: str, phase: str, where: Sequence[str], e: BaseException, timeout_s: float
) -> CheckpointError:
  """The error every surviving process raises for a failed wave: who was lost (the
  absentees of a short barrier the survivors all reach), the key paths, the cause."""
  cause = f"{type(e).__name__}: {_paths.error_text(e)}".splitlines()[0][:400]
  try:
    _commit.barrier(location, f"{phase}-failed", min(timeout_s, FAILED_WAIT_S))
    who = "every process is still there: the failure is not a lost process"
  except CheckpointError as b:
    who = _lost(str(b))
  return CheckpointError(
    f"The broadcast restore of {_paths.display(location)!r} failed in {phase} "
    f"({_keys(where)}) on process {jax.process_index()}: {who}. Restore again once every "
    f"process is up (or pass broadcast=False to read without the interconnect). [{cause}]"
  )


def _lost(barrier_text: str) -> str:
  """The lost processes, from the failed barrier's message (``process(es) 1 did not
  arrive``)."""
  at = barrier_text.find("process(es) ")
  if at < 0:
    return "the processes could not meet again (a process was lost)"
  end = barrier_text.find(" did not arrive", at)
  return barrier_text[at:end] + " did not arrive: lost during the broadcast"
