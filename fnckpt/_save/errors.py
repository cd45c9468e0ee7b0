"""How a failed save is worded: the error and the phase it failed in. What the save left (its
last sentence) is the error's ``outcome`` (:class:`fnckpt._errors.SaveOutcome`), which the
handle attaches when the save finishes (``handle._finish``)."""

from __future__ import annotations

import re

from .._errors import CheckpointError
from .._format import tree as _tree
from .._io import paths as _paths

__all__ = ["wrap", "at_leaf"]


def at_leaf(e: BaseException, path) -> BaseException:
  """An error staging the leaf at ``path``, naming it (a CheckpointError passes through).

  >>> print(at_leaf(RuntimeError("out of memory"), [("dict", "w")]))
  Staging ['w'] failed: RuntimeError: out of memory
  """
  if isinstance(e, CheckpointError) or not isinstance(e, Exception):
    return e
  return CheckpointError(f"Staging {_tree.keystr(path)} failed: {type(e).__name__}: {e}")


def wrap(e: BaseException, location: str, phase: str) -> BaseException:
  """``e`` (not yet a :class:`CheckpointError`) as one naming the location and the ``phase``
  the save failed in. CheckpointErrors and BaseExceptions that are not Exceptions pass
  through.

  >>> print(wrap(OSError("disk full"), "/ckpt", "writing the arrays"))
  Saving to '/ckpt' failed while writing the arrays: OSError: disk full.
  """
  if isinstance(e, CheckpointError) or not isinstance(e, Exception):
    return e
  text = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", _paths.redact(str(e)))  # noise
  hint = _paths.io_hint(e)
  return CheckpointError(
    f"Saving to {location!r} failed while {phase}: {type(e).__name__}: {text}.{hint}"
  )
