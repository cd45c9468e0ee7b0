"""The errors fnckpt raises. Every message names a key path or a storage location and says what
to do about it."""

from __future__ import annotations

__all__ = ["CheckpointError", "TreeMismatchError", "NotCommittedError", "BarrierTimeoutError",
           "DamagedError"]


class CheckpointError(Exception):
  """Base class: anything wrong with a checkpoint, its location or the arguments given."""


class TreeMismatchError(CheckpointError, ValueError):
  """The restore target does not match the saved tree (lists every differing key path)."""


class NotCommittedError(CheckpointError):
  """The location holds an interrupted save (no commit marker): it is not a checkpoint."""


class BarrierTimeoutError(CheckpointError, TimeoutError):
  """Some processes did not reach a save/restore barrier before its deadline."""


class DamagedError(CheckpointError):
  """The stored checkpoint is damaged: a checksum mismatch, a missing chunk or file, or a
  commit marker, manifest or per-process file that cannot be decoded. (Not raised for a
  newer format, an unreachable server or a tree mismatch: those are not damage.) The
  manager falls back to an older step on this error only."""
