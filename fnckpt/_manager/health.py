"""Self-healing: damage marks on steps, the run's start log, and restoring the newest valid step.

A step found damaged (a :class:`fnckpt._errors.DamagedError`: checksum mismatch, missing chunk,
unreadable manifest) is *marked*, never deleted: process 0 writes ``<run>/damaged/<step>``, a
msgpack map ``{"format": "fnckpt-damage", "step", "commit_sha256", "damage", "marked"}``. A
mark is in force only while the step's ``COMMIT`` still has the SHA-256 it names, so saving
the step again (which writes a new marker) lifts it without deleting anything first. Listings
(:class:`fnckpt._manager.steps.StepIndex`) leave marked steps out of the committed steps.

Everything read here is untrusted: a mark that does not decode is ignored (it then marks
nothing), never an error that stops a restore. (The run's start log is
:mod:`fnckpt._manager.starts`.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time
import warnings
from typing import Any, Callable

import msgpack

from .._errors import CheckpointError, DamagedError
from .._format import manifest as _manifest
from .._io import coordination as _coordination
from .._io import paths as _paths

__all__ = [
  "MARK_DIR",
  "mark_key",
  "mark_of",
  "mark_step",
  "marks_in_force",
  "refuse_marked",
  "restore_newest_valid",
  "Outcome",
]

# Marks live in a directory of their own, after every step name in any listing order (an
# object store that lists "6/..." before "6.x" cannot hide them from a range listing).
MARK_DIR = "damaged"
_MARK_NAME = re.compile(r"damaged/(0|[1-9][0-9]*)")


def mark_key(step: int) -> str:
  """The key, in the run directory, of ``step``'s damage mark."""
  return f"{MARK_DIR}/{step}"


def mark_of(key: str) -> int | None:
  """The step a run directory key marks damaged, or ``None``.

  >>> mark_of("damaged/12"), mark_of("12"), mark_of("damaged/012")
  (12, None, None)
  """
  found = _MARK_NAME.fullmatch(key)
  return int(found.group(1)) if found else None


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def mark_step(run: _paths.Location | str, step: int, damage: str) -> None:
  """Mark the committed ``step`` of the run ``run`` damaged (its ``COMMIT`` as it is now)."""
  kv = _paths.open_kvstore(run)
  commit = kv.read(f"{step}/{_manifest.COMMIT}").result()
  if commit.state != "value":
    return  # deleted meanwhile: nothing to mark
  mark = {
    "format": "fnckpt-damage",
    "step": step,
    "commit_sha256": _sha(bytes(commit.value)),
    "damage": damage[:2000],
    "marked": time.time(),
  }
  kv.write(mark_key(step), msgpack.packb(mark)).result()


def marks_in_force(kv: Any, steps: list[int]) -> dict[int, str]:
  """``{step: damage}`` for the ``steps`` (each with a mark entry) whose mark matches their
  current ``COMMIT``; all reads in flight together."""
  reads = {s: (kv.read(mark_key(s)), kv.read(f"{s}/{_manifest.COMMIT}")) for s in steps}
  out = {}
  for step, (mark_f, commit_f) in reads.items():
    mark, commit = mark_f.result(), commit_f.result()
    if mark.state != "value" or commit.state != "value":
      continue
    try:
      m = msgpack.unpackb(bytes(mark.value), raw=False)
      ok = (
        isinstance(m, dict)
        and m.get("format") == "fnckpt-damage"
        and m.get("commit_sha256") == _sha(bytes(commit.value))
      )
      damage = m.get("damage") if ok else None
    except Exception:  # an undecodable mark marks nothing
      continue
    if ok:
      out[step] = damage if isinstance(damage, str) else "damaged"
  return out


def refuse_marked(index: Any, step: int) -> None:
  """Raise if ``step`` of the :class:`fnckpt._manager.steps.StepIndex` ``index`` is marked
  damaged."""
  damage = index.damage_of(step)
  if damage is not None:
    raise CheckpointError(
      f"Step {step} of {index.display!r} is marked damaged ({damage}). Restore another step "
      f"(manager.restore() picks the newest valid one), or inspect it with fnckpt verify "
      f"{index.path(step)}; saving step {step} again replaces it."
    )


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One process's result of trying to restore a step: ``"ok"``, ``"damaged"``, ``"error"``
  (anything else) or ``"peer"`` (it stopped for another process's failure), with the
  error's text."""

  kind: str
  text: str = ""


def _try(
  root: str, restore: Callable[[int], Any], step: int, timeout_s: float
) -> tuple[Any, Outcome, BaseException | None]:
  """``restore(step)`` on this process, as a part of the manager call (collective with
  several processes): a failure on any process in it (even before the restore's own
  agreement) is met by every process at one barrier of the part; a process that learned
  of another's failure there has the outcome ``"peer"`` (that one's says what it was)."""
  part = None
  try:
    with _coordination.part(root, f"tried-{step}", timeout_s) as part:
      value = restore(step)
    return value, Outcome("ok"), None
  except Exception as e:
    if part is not None and e is part.learned:
      return None, Outcome("peer", str(e)), e
    if isinstance(e, DamagedError):
      return None, Outcome("damaged", str(e)), e
    return None, Outcome("error", f"{type(e).__name__}: {e}"), e


def restore_newest_valid(
  root: str,
  choose: Callable[[set[int]], int | None],
  restore: Callable[[int], Any],
  mark: Callable[[int, str], None],
  timeout_s: float,
) -> tuple[Any, int | None]:
  """Restore the newest step that no process finds damaged; ``(value, step)``, or
  ``(None, None)`` when there is no step. Collective with several processes.

  ``choose(skipped)`` is the newest committed step not in ``skipped`` (decided on process 0
  and published); every process tries ``restore(step)`` and all exchange their outcomes. If
  any process found damage, process 0 marks the step (``mark``), every process warns naming
  the step and the damage, and the next older step is tried. Any other error is raised on
  every process. So all processes return the same step or raise.
  """
  skipped: set[int] = set()
  while True:
    step = _coordination.from_process_0(root, "latest", lambda: choose(skipped), timeout_s)
    if step is None:
      return None, None
    value, mine, error = _try(root, restore, step, timeout_s)
    outcomes = [
      Outcome(**o)
      for o in _coordination.all_gather(
        root, f"restore-{step}", dataclasses.asdict(mine), timeout_s
      )
    ]
    damaged = [(p, o.text) for p, o in enumerate(outcomes) if o.kind == "damaged"]
    if damaged:
      _fall_back(root, step, damaged, mark)
      skipped.add(step)
      continue
    failed = [(p, o.text) for p, o in enumerate(outcomes) if o.kind == "error"] + [
      (p, o.text) for p, o in enumerate(outcomes) if o.kind == "peer"
    ]
    if error is not None:
      raise error
    if failed:
      p, text = failed[0]
      raise CheckpointError(
        f"Restoring step {step} of {_paths.display(root)!r} failed on process {p}: {text}"
      )
    return value, step


def _fall_back(
  root: str, step: int, damaged: list[tuple[int, str]], mark: Callable[[int, str], None]
) -> None:
  import jax

  where = (
    ""
    if len(damaged) == 1 and not _coordination.multi()
    else (f" (found by process {', '.join(str(p) for p, _ in damaged)})")
  )
  damage = damaged[0][1]
  note = ""
  if jax.process_index() == 0:
    try:
      mark(step, damage)
    except Exception as e:  # the fallback goes on; the mark is only a memo
      note = f" It could not be marked ({type(e).__name__}: {e}); it will be tried again."
  warnings.warn(
    f"Step {step} of {_paths.display(root)!r} is damaged{where}: {damage} Restoring the "
    f"newest older valid step instead; step {step} is marked damaged (not deleted: "
    f"inspect it with fnckpt verify, remove it with manager.delete({step})).{note}",
    RuntimeWarning,
    stacklevel=4,
  )
