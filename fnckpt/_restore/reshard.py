"""The broadcast of a read-once restore: one wave of leaves, read onto their reader shardings,
moved onto the targets' shardings by one jitted identity (XLA's collectives carry the bytes:
ICI/NVLink/IB on accelerators, Gloo over TCP between CPU processes).

Collective and bounded, inside the restore's attempt (:mod:`fnckpt._io.attempt`: barriers
numbered per attempt, failures published for the barrier they stop at): every process enters
a wave through the attempt's next barrier (a process that died or never came is named there,
before any collective can wait on it); a collective that fails (a peer's connection closed)
or does not finish by the deadline ends in a second, short barrier whose absentees are the
lost processes, and every surviving process raises a :class:`CheckpointError` naming them and
the wave's key paths. While waiting in the collective, each process reads the errors published
for the next barrier: a process that failed instead of joining is seen within
``attempt.POLL_S``.

A process that fails before a wave's collective (its reads, the leaves read without broadcast
before the first wave, the previous wave's leaves finished) publishes its error and still
arrives at the wave's barrier (:func:`failed`), so the others learn of it there, before any
collective, and raise at once instead of waiting for the deadline: every process fails the
same wave, with a :class:`DamagedError` on all of them where one found damage (so the
manager's self-healing restore takes the same way on all of them).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax

from .._errors import CheckpointError, DamagedError
from .._io import attempt as _attempt
from .._io import commit as _commit
from .._io import paths as _paths

__all__ = ["start", "reading", "failed", "reshard", "done", "FAILED_WAIT_S"]

FAILED_WAIT_S = 5.0  # after a failed collective: how long the survivors wait for each other
POLL_S = 0.05  # how often a wave's results are checked against the deadline


def _identity(*xs: Any) -> tuple[Any, ...]:
  return xs


def start(location: str) -> None:
  """Before the first wave (nothing to do: the attempt's barriers and errors are its own)."""


def reading(location: str, wave: int) -> None:
  """Publish that this process is reading its parts of ``wave`` (a barrier that times out
  on another process says so about this one)."""
  _commit.report(location, f"broadcast-wave-{wave}: reading")


def done(location: str) -> None:
  """The broadcast is over: the attempt's last barrier is passed; drop this process's
  progress entry."""
  _attempt.close()
  _commit.forget(location)


def failed(location: str, wave: int, error: BaseException, timeout_s: float) -> None:
  """This process could not read its parts of ``wave``: publish ``error`` and arrive at the
  wave's barrier (:meth:`fnckpt._io.attempt.Attempt.fail`), so every other process raises
  there (:func:`reshard`) rather than wait for this one until the deadline. The caller
  raises ``error`` afterwards."""
  _commit.report(location, f"broadcast-wave-{wave}: failed reading")
  _attempt.current().fail(error)


def _explain(location: str, phase: str, where: Sequence[str]) -> _attempt.Explain:
  """The error every process raises where another published a failure of this restore: a
  :class:`DamagedError` where that process found damage (so every process takes the same
  way: the manager reads another copy or an older step on all of them), else a
  :class:`CheckpointError`."""

  def explain(found: _attempt.Failure, when: str) -> CheckpointError:
    who = f"process {found.process}" if found.process >= 0 else "another process (unknown)"
    error = DamagedError if found.damaged else _attempt.PeerFailedError
    return error(
      f"The broadcast restore of {_paths.display(location)!r} failed in {phase} "
      f"({_keys(where)}): {who} could not read its parts ({found.text}). This "
      f"process (process {jax.process_index()}) stops at the same wave. Fix or restore "
      f"another checkpoint (the manager's restore() falls back to an older step on every "
      f"process when the data is damaged). (Learned {when}.)"
    )

  return explain


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
  attempt, explain = _attempt.current(), _explain(location, phase, where)
  attempt.barrier(phase, explain)  # (names who did not come)
  deadline = time.monotonic() + timeout_s
  try:
    out = jax.jit(_identity, out_shardings=tuple(shardings))(*arrays)
    _wait(out, deadline, lambda: attempt.poll(f"in {phase}'s collective", explain))
  except Exception as e:
    if e is attempt.learned:  # (another process failed instead of joining: it said why)
      raise
    raise _failure(location, phase, where, e, timeout_s) from None
  for x in arrays:
    x.delete()
  return list(out)


def _wait(out: Sequence[Any], deadline: float, poll: Callable[[], None]) -> None:
  """Until every result is ready; a TimeoutError at ``deadline`` (a collective waiting on a
  peer that will not come cannot be cancelled, but this process need not wait with it);
  ``poll()`` every ``attempt.POLL_S`` (raises when another process failed instead)."""
  polled = time.monotonic()
  for x in out:
    while not x.is_ready():
      now = time.monotonic()
      if now > deadline:
        raise TimeoutError("the collective did not finish by the deadline")
      if now - polled >= _attempt.POLL_S:
        poll()
        polled = now
      time.sleep(POLL_S)
    x.block_until_ready()  # (raises the collective's error, if any)


def _failure(
  location: str, phase: str, where: Sequence[str], e: BaseException, timeout_s: float
) -> CheckpointError:
  """The error every surviving process raises for a failed wave: who was lost (the
  absentees of a short barrier the survivors all reach), the key paths, the cause."""
  cause = f"{type(e).__name__}: {_paths.error_text(e)}".splitlines()[0][:400]
  try:
    _attempt.current().barrier(f"{phase}-failed", timeout_s=min(timeout_s, FAILED_WAIT_S))
    who = "every process is still there: the failure is not a lost process"
  except CheckpointError as b:
    if b is _attempt.current().learned:  # (one failed outside the collective and said why)
      return b
    who = _lost(str(b))
  _attempt.close()  # every survivor raises here: no further barrier
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
