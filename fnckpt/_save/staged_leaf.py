"""A packed leaf (or one device shard of a pieced leaf) staged off the devices: what save's
pack staging holds until the writer thread assembles the pack's chunks from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .. import _state
from .._format import leaves as _leaves
from .._layout import chunks as _chunks
from .copies import Copies, buffers, to_host

__all__ = ["Staged", "Run"]


@dataclasses.dataclass
class Staged:
  """A packed leaf held safe from the caller: its distinct shards (index, host part), each
  a copy into host memory the save owns (``copies.Owned``, made numpy by :meth:`raw`), a
  view of a CPU device buffer (JAX leaves it alone if the caller donates or deletes the
  array), or a copy of numpy data."""

  shape: tuple[int, ...]
  dtype: np.dtype
  parts: list[tuple[tuple[slice, ...], Any]]

  @staticmethod
  def of(data: Any, copies: Copies) -> Staged:
    shape, dtype = tuple(data.shape), np.dtype(data.dtype)
    whole = tuple(slice(0, n) for n in shape)
    if isinstance(data, np.ndarray):
      return Staged(shape, dtype, [(whole, np.array(data, copy=True, order="C"))])
    if data.is_fully_replicated:
      return Staged(shape, dtype, [(whole, copies.get(data.addressable_data(0)))])
    distinct = _distinct_shards(data.sharding, shape)
    # not np.asarray(data): JAX would cache that copy on the caller's array, unbudgeted
    return Staged(
      shape,
      dtype,
      [
        (index, copies.get(a, device=device))
        for device, a in buffers(data)
        if (index := distinct.get(device)) is not None
      ],
    )

  @property
  def nbytes(self) -> int:
    return _chunks.nbytes(self.shape, self.dtype.itemsize)

  def gather_into(self, dst: np.ndarray) -> bool:
    """Copy a leaf of several parts straight into ``dst`` (1-D ``uint8``, :attr:`nbytes`),
    as :meth:`raw` would gather them, without gathering them first (a copy fewer); False
    (nothing written) for one part, or a dtype not stored as it is in memory."""
    if (
      len(self.parts) == 1
      or _leaves.to_little_endian(np.empty(0, self.dtype)).dtype != self.dtype
      or dst.nbytes != self.nbytes
    ):
      return False
    self.parts = [(index, to_host(part)) for index, part in self.parts]
    out = dst.view(self.dtype).reshape(self.shape)
    for index, part in self.parts:
      out[index] = part
    return True

  def raw(self) -> np.ndarray:
    """The leaf's C-order little-endian bytes (1-D ``uint8``); a view when it is one part.
    Owned copies become numpy here, in the writer's threads (waiting for them if needed)."""
    self.parts = [(index, to_host(part)) for index, part in self.parts]
    if len(self.parts) == 1:
      host = self.parts[0][1]
    else:
      host = np.empty(self.shape, self.dtype)
      for index, part in self.parts:
        host[index] = part
    return _leaves.to_little_endian(np.ascontiguousarray(host)).reshape(-1).view(np.uint8)


@_state.memo(_chunks.LEAF_PLAN_CACHE_SIZE)
def _distinct_shards(sharding: Any, shape: tuple[int, ...]) -> dict[Any, tuple[slice, ...]]:
  """This process's devices holding a distinct shard of an array of ``shape`` (the first of
  each replica group, in device order) and the shard's slices (once per sharding and shape:
  the small leaves of a state share a few). Read-only."""
  out, seen = {}, set()
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    index = _chunks.normalize_index(index, shape)
    if index not in seen:
      seen.add(index)
      out[device] = tuple(slice(a, b) for a, b in index)
  return out


@dataclasses.dataclass
class Run:
  """One process's chunks of a pieced leaf, staged, whose bytes are their concatenation (in
  increasing chunk number): a format-3 *run*, hashed and written (or reused) as one item."""

  parts: list[Staged]
  _raw: np.ndarray | None = None

  @property
  def nbytes(self) -> int:
    return sum(p.nbytes for p in self.parts)

  def raw(self) -> np.ndarray:
    """The run's bytes (1-D ``uint8``; built once)."""
    if self._raw is None:
      self._raw = (
        self.parts[0].raw()
        if len(self.parts) == 1
        else np.concatenate([p.raw() for p in self.parts])
      )
    return self._raw
