"""How a failed save is worded: the error and the phase it failed in. What the save left (its
last sentence) is the error's ``outcome`` (:class:`fnckpt._errors.SaveOutcome`), which the
handle attaches when the save finishes (``handle._finish``)."""

from __future__ import annotations

import re

from .._io import paths as _paths
from .._errors import CheckpointError

__all__ = ["wrap"]


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
      f"Saving to {location!r} failed while {phase}: {type(e).__name__}: {text}.{hint}")
