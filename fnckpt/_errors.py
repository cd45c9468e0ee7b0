"""The errors fnckpt raises. Every message names a key path or a storage location and says what
to do about it.

What an error says about the state it left is a field, never parsed back out of its text: an
error a save raises carries :class:`SaveOutcome` (``error.outcome``: whether its checkpoint was
committed, whether an old checkpoint at its location was replaced), and the message's last
sentence is composed from that field (:meth:`CheckpointError.__str__`).
"""

from __future__ import annotations

import dataclasses

__all__ = [
  "CheckpointError",
  "TreeMismatchError",
  "NotCommittedError",
  "BarrierTimeoutError",
  "DamagedError",
  "NoCheckpointError",
  "SavesFailedError",
  "SaveOutcome",
]


@dataclasses.dataclass(frozen=True)
class SaveOutcome:
  """What a failed save left at its location (``error.outcome`` of every error a save raises).

  ``committed``: ``True`` if its commit marker was written (the checkpoint is committed; only a
  later step failed), ``False`` if not, ``None`` if this process cannot tell (a process other
  than 0, past the barrier after which process 0 writes the marker). ``replaced``: the save
  (``overwrite=True``) had removed the checkpoint that was at its location before it failed.

  >>> SaveOutcome(committed=False).sentence()
  ' Nothing was committed; earlier checkpoints are intact.'
  >>> SaveOutcome(committed=True, replaced=True).sentence()[:40]
  ' The checkpoint itself is committed (its'
  """

  committed: bool | None
  replaced: bool = False

  def sentence(self) -> str:
    """The message's last sentence: what the save left."""
    if self.committed:
      return (
        " The checkpoint itself is committed (its marker was written); only this last step failed."
      )
    if self.committed is None:
      return (
        " Process 0 may have committed the checkpoint; check with fnckpt.metadata or `fnckpt ls`."
      )
    if self.replaced:
      return (
        " Nothing was committed; the checkpoint that was at this path was removed first "
        "(overwrite=True); other checkpoints are intact."
      )
    return " Nothing was committed; earlier checkpoints are intact."


class CheckpointError(Exception):
  """Base class: anything wrong with a checkpoint, its location or the arguments given.

  ``outcome``: on every error a save raises (``save``, ``SaveHandle.wait``, ``fnckpt.wait``),
  what the save left at its location (:class:`SaveOutcome`, e.g. ``e.outcome.committed``);
  ``None`` on the errors of anything else. The message ends with the outcome's sentence.

  >>> e = CheckpointError("Saving to 'x' failed while writing the arrays: OSError: disk full.")
  >>> e.outcome = SaveOutcome(committed=False)
  >>> print(e)
  Saving to 'x' failed ...: OSError: disk full. Nothing was committed; earlier ... intact.
  >>> e.core
  "Saving to 'x' failed while writing the arrays: OSError: disk full."
  """

  outcome: SaveOutcome | None = None  # set on the instance by the save that raises it

  @property
  def core(self) -> str:
    """The message without the outcome's sentence (what the error was given)."""
    return str(self.args[0]) if len(self.args) == 1 else Exception.__str__(self)

  def __str__(self) -> str:
    return self.core + (self.outcome.sentence() if self.outcome is not None else "")


class TreeMismatchError(CheckpointError, ValueError):
  """The restore target does not match the saved tree (lists every differing key path)."""


class NotCommittedError(CheckpointError):
  """The location holds an interrupted save (no commit marker): it is not a checkpoint."""


class NoCheckpointError(CheckpointError):
  """Nothing is at the location: no commit marker, no manifest, no data."""


class BarrierTimeoutError(CheckpointError, TimeoutError):
  """Some processes did not reach a save/restore barrier before its deadline."""


class SavesFailedError(CheckpointError):
  """Several saves failed (``fnckpt.wait()``): ``errors``, each save's, in the order the saves
  began (each with its own ``outcome``); the message lists their first lines."""

  def __init__(self, message: str, errors: tuple[BaseException, ...] | list = ()):
    super().__init__(message)
    self.errors = tuple(errors)


class DamagedError(CheckpointError):
  """The stored checkpoint is damaged: a checksum mismatch, a missing chunk or file, or a
  commit marker, manifest or per-process file that cannot be decoded. (Not raised for a
  newer format, an unreachable server or a tree mismatch: those are not damage.) The
  manager falls back to an older step on this error only."""
