"""How a failed save is reported: the error, the phase it failed in, and whether the checkpoint
was (or may have been) committed."""

from __future__ import annotations

import re

from .._io import paths as _paths
from .._errors import CheckpointError

__all__ = ["wrap"]


def wrap(e: BaseException, location: str, phase: str,
         committed: bool | None = False) -> BaseException:
  """``e`` (not yet a :class:`CheckpointError`) as one naming the location and the ``phase``
  the save failed in, and saying what was committed: nothing (``committed=False``), the
  checkpoint (``True``: only a last step failed) or maybe (``None``: process 0 may have
  written the marker). CheckpointErrors and BaseExceptions that are not Exceptions pass
  through."""
  if isinstance(e, CheckpointError) or not isinstance(e, Exception):
    return e
  text = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", _paths.redact(str(e)))  # noise
  hint = _paths.io_hint(e)
  if committed:
    after = (" The checkpoint itself is committed (its marker was written); only this "
             "last step failed.")
  elif committed is None:
    after = (" Process 0 may have committed the checkpoint; check with fnckpt.metadata or "
             "`fnckpt ls`.")
  else:
    after = " Nothing was committed; earlier checkpoints are intact."
  return CheckpointError(
      f"Saving to {location!r} failed while {phase}: {type(e).__name__}: {text}.{hint}{after}")
