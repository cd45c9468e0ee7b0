"""The run's start log: when managers with ``save_interval_steps="auto"`` started.

``<run>/fnckpt-starts`` is a msgpack map ``{"format": "fnckpt-starts", "starts": [unix times]}``
(the newest 1000), from which :func:`fnckpt._manager.interval.mtbf_from_starts` measures the
run's mean time between failures. A start is recorded only once the manager's constructor checks
have passed (a construction that fails records nothing).

The log is untrusted: an unreadable or undecodable log starts afresh, and only *plausible*
entries are kept (:func:`plausible`): finite times after :data:`FLOOR` and not after now plus
:data:`SLACK_S` (a future entry, e.g. from a skewed clock, is ignored).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import msgpack

from .._io import paths as _paths

__all__ = ["STARTS", "FLOOR", "SLACK_S", "plausible", "read_starts", "write_starts"]

STARTS = "fnckpt-starts"
FLOOR = 1.5e9  # 2017-07-14: no fnckpt run started before
SLACK_S = 3600.0  # clock skew between hosts tolerated for a recorded start
_KEEP = 1000


def plausible(starts: Any, now: float) -> list[float]:
  """PURE: the entries of an untrusted start list that can be real starts, oldest first:
  numbers, finite, in ``[FLOOR, now + SLACK_S]``.

  >>> plausible([float("nan"), float("inf"), 0, -1e300, "x", True, 2e9, 1.7e9], now=1.8e9)
  [1700000000.0]
  """
  if not isinstance(starts, (list, tuple)):
    return []
  out = [
    float(t)
    for t in starts
    if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
  ]
  return sorted(t for t in out if FLOOR <= t <= now + SLACK_S)


def read_starts(root: _paths.Location | str, now: float) -> list[float]:
  """The plausible recorded starts of the run ``root`` (``[]`` when the log is missing,
  unreadable or undecodable)."""
  try:
    kv = _paths.open_kvstore(root)
    got = kv.read(STARTS).result()
    log = msgpack.unpackb(bytes(got.value), raw=False) if got.state == "value" else {}
    return plausible(log.get("starts") if isinstance(log, dict) else None, now)
  except Exception:  # unreadable or undecodable: start afresh
    return []


def write_starts(root: _paths.Location | str, starts: Sequence[float]) -> None:
  """Replace the run's start log with the newest 1000 of ``starts`` (process 0 only)."""
  log = {"format": "fnckpt-starts", "starts": [float(t) for t in starts][-_KEEP:]}
  try:
    _paths.open_kvstore(root).write(STARTS, msgpack.packb(log)).result()
  except Exception as e:
    raise _paths.io_error(
      e, _paths.Location.of(root).join(STARTS).path, "recording this start"
    ) from e
