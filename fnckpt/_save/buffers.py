"""Host buffers for the pack chunks a save assembles, reused from one save to the next.

Assembling a pack chunk copies its leaves into one buffer, which TensorStore writes. Into
fresh memory that copy cost 6x more than into memory touched before (the first touch of each
page faults; on the bench machine, 110 ms of CPU for the mixed state's 73 MiB of packs,
against 18 ms). So a buffer goes back to a small pool once its chunk is durable and hashed
(:func:`give`: nothing reads it any more) and the next chunk takes it (:func:`take`). At
most :data:`KEEP_BYTES`, and at most a quarter of the saves' ``budget_bytes``, are kept idle
(a buffer in use is charged to the budget like any chunk); a save that needs more allocates
as before. A taken buffer holds the bytes of an earlier chunk: the assembler
writes every byte of the chunk (its pieces, and zeros between and after them). Buffers
start on a page boundary, so a local chunk's file can be written from it past the page
cache (``fnckpt._io.direct``).
"""

from __future__ import annotations

import numpy as np

from .. import _state
from .._io.direct import ALIGN

__all__ = ["KEEP_BYTES", "ALIGN", "take", "give", "fill_gaps"]

KEEP_BYTES = 128 << 20  # idle bytes kept: two pack chunks of 64 MiB
# (ALIGN: every buffer taken starts on such a boundary, as ``_io.direct``'s writes need.)


def take(nbytes: int) -> np.ndarray:
  """A 1-D ``uint8`` buffer of ``nbytes`` starting on a :data:`ALIGN` boundary (a view of the
  smallest idle buffer that holds them and is at most twice as large, else new); its bytes
  are undefined. Give back its ``.base`` (or it) when done.

  >>> b = take(10); b.nbytes, b.ctypes.data % ALIGN
  (10, 0)
  """
  pool = _state.buffers
  with pool.lock:
    fits = [
      k
      for k, b in enumerate(pool.free)  # (at most twice the bytes: the budget
      if nbytes <= _room(b) <= 2 * nbytes
    ]  # is charged for nbytes only)
    if fits:  # (by position: list.remove would compare arrays with ==)
      buf = pool.free.pop(min(fits, key=lambda k: _room(pool.free[k])))
      pool.kept -= buf.nbytes
      return _aligned(buf, nbytes)
  return _aligned(np.empty(nbytes + ALIGN, np.uint8), nbytes)


def _room(buf: np.ndarray) -> int:
  """The bytes a kept buffer holds from its first :data:`ALIGN` boundary, wherever that is
  (:func:`take` allocates ``ALIGN`` more than it needs: those it asked for)."""
  return buf.nbytes - ALIGN


def _aligned(buf: np.ndarray, nbytes: int) -> np.ndarray:
  start = -buf.ctypes.data % ALIGN
  return buf[start : start + nbytes]


def give(buf: np.ndarray) -> None:
  """``buf`` (from :func:`take`, or its view) is no longer read or written by anyone: keep it
  for a later chunk if the pool has room."""
  base = buf if buf.base is None else buf.base
  if not isinstance(base, np.ndarray) or base.ndim != 1 or base.dtype != np.uint8:
    return
  budget = _state.saves.budget
  keep = KEEP_BYTES if budget is None else min(KEEP_BYTES, budget.limit // 4)
  pool = _state.buffers
  with pool.lock:
    if pool.kept + base.nbytes <= keep and all(b is not base for b in pool.free):
      pool.free.append(base)
      pool.kept += base.nbytes


def fill_gaps(buf: np.ndarray, spans: list[tuple[int, int]]) -> None:
  """Zero the bytes of ``buf`` outside ``spans`` ((offset, length), ascending, disjoint).

  >>> b = np.full(8, 7, np.uint8); fill_gaps(b, [(1, 2), (5, 1)]); b.tolist()
  [0, 7, 7, 0, 0, 7, 0, 0]
  """
  at = 0
  for offset, n in spans:
    if offset > at:
      buf[at:offset] = 0
    at = max(at, offset + n)
  if at < buf.nbytes:
    buf[at:] = 0
