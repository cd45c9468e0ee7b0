"""The errors fnckpt raises. Every message names a key path or a storage location and says what
to do about it."""

from __future__ import annotations

__all__ = ["CheckpointError", "TreeMismatchError", "NotCommittedError", "BarrierTimeoutError"]


class CheckpointError(Exception):
  """Base class: anything wrong with a checkpoint, its location or the arguments given."""


class TreeMismatchError(CheckpointError, ValueError):
  """The restore target does not match the saved tree (lists every differing key path)."""


class NotCommittedError(CheckpointError):
  """The location holds an interrupted save (no commit marker): it is not a checkpoint."""


class BarrierTimeoutError(CheckpointError, TimeoutError):
  """Some processes did not reach a save/restore barrier before its deadline."""
