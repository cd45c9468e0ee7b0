"""What a restore is asked to do, as one record: :class:`RestoreOptions`, made once where
:func:`fnckpt.restore` (or the manager's ``restore``) is called and checked as it is made.
What is read (a :class:`fnckpt._io.paths.Location`) and into what (the target) are not
options."""

from __future__ import annotations

import dataclasses

from .._io import arrays as _arrays
from .._io import commit as _commit
from .._sources import source as _source

__all__ = ["RestoreOptions"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RestoreOptions:
  """The keyword options of :func:`fnckpt.restore` (see there). Hashable, compared by value.
  ``budget_bytes`` is checked where the reads start (:meth:`budget`), after the checkpoint is
  opened and the target matched: a missing checkpoint or a damaged step is reported first.

  >>> RestoreOptions(partial=True) == RestoreOptions(partial=True, cast=False)
  True
  """

  partial: bool = False
  cast: bool = False
  budget_bytes: int | None = None
  per_process_from: int | None = None
  broadcast: bool | None = None
  barrier_timeout_s: float = _commit.DEFAULT_BARRIER_TIMEOUT_S

  def budget(self) -> int:
    """Bytes of reads in flight (``budget_bytes``, else the default read window)."""
    return _arrays.budget_arg(self.budget_bytes, "restore", _source.READ_WINDOW_BYTES)
