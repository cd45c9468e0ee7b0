"""Device-to-host copies into host memory fnckpt owns (docs/concepts/async.md).

Two ways to take a device shard off its device, chosen per platform:

- ``"owned"`` (the default off CPU): ``jax.device_put`` of the shard into a host memory of its
  device (``pinned_host``, else ``unpinned_host``), a buffer this save allocates and drops once
  the writer has the bytes. Every copy is started as its chunk is charged to the budget and
  none is waited on in the caller's thread until all are started (:meth:`Copies.wait`); the
  caller's arrays are never converted, so JAX caches no host copy on them (``np.asarray`` of a
  GPU/TPU array keeps its copy in the array's ``_npy_value``, outside any budget).
- ``"asarray"`` (the default on CPU): ``np.asarray`` of the caller's shard. On CPU that is a
  view of the device buffer, which JAX keeps alive and untouched if the caller donates or
  deletes the array: no copy at all (measured faster and smaller: docs/performance.md). On
  an accelerator it is JAX's own copy, cached on the caller's array (the old path, kept for
  ``bench/blocking.py`` to compare).

``fnckpt._state.hooks.staging`` overrides the platform's default (tests and benchmarks force
``"owned"`` on CPU).
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import numpy as np

from .. import _state

__all__ = ["ASARRAY_PLATFORMS", "MODES", "Copies", "Owned", "mode", "host", "to_host"]

MODES = ("owned", "asarray")
# Platforms staged with "asarray" by default: on CPU, views of the device buffers (no copy).
ASARRAY_PLATFORMS = frozenset({"cpu"})


def mode(device: Any) -> str:
  """How shards on ``device`` are staged: ``"owned"`` or ``"asarray"`` (see the module)."""
  forced = _state.hooks.staging
  if forced is not None:
    if forced not in MODES:
      raise ValueError(f"fnckpt._state.hooks.staging is {forced!r}; use one of {MODES} or None "
                       "(the platform's default)")
    return forced
  return "asarray" if device.platform in ASARRAY_PLATFORMS else "owned"


def host(device: Any) -> str | None:
  """The host memory kind owned copies from ``device`` land in (None: it has none)."""
  kinds = {m.kind for m in device.addressable_memories()}
  return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


class Owned:
  """A shard's copy in host memory this save owns (a ``jax.Array`` on a host memory kind),
  possibly still in flight. Calling it gives the bytes as numpy (waiting for the copy) and
  drops the copy's array: the numpy result is a view of it on CPU; where JAX copies once
  more (and caches that on *this* array), the cache goes with it."""

  def __init__(self, array: jax.Array):
    self.array: jax.Array | None = array
    self._host: np.ndarray | None = None

  def __call__(self) -> np.ndarray:
    host = self._host
    if host is None:
      array = self.array
      if array is None:  # another thread converted it meanwhile (it sets _host first)
        return self._host
      host = self._host = np.asarray(array)
      self.array = None
    return host


def to_host(part: Any) -> np.ndarray:
  """A staged part as numpy: an :class:`Owned` copy's bytes, else the part itself."""
  return part() if isinstance(part, Owned) else part


class Copies:
  """One save's owned copies: started by :meth:`get` as staging charges each chunk, waited
  for together by :meth:`wait` before ``save`` returns (only those the writer has not taken
  yet: the list holds weak references, so a written chunk's copy is freed at once)."""

  def __init__(self) -> None:
    self._started: list[weakref.ref] = []
    self._kinds: dict[Any, str | None] = {}   # device -> its host memory kind (None: numpy)

  def _kind(self, device: Any) -> str | None:
    """The memory kind owned copies from ``device`` land in; None: staged as numpy (asked
    once per device and save: thousands of small shards ask again and again)."""
    try:
      return self._kinds[device]
    except KeyError:
      kind = self._kinds[device] = host(device) if mode(device) == "owned" else None
      return kind

  def get(self, shard: jax.Array, local: tuple[slice, ...] | None = None,
          device: Any = None) -> Any:
    """``shard`` (one device's array, on ``device`` when the caller knows it), or its part
    ``local``, held safe from the caller: an :class:`Owned` copy being made, or
    (``"asarray"``) a numpy array."""
    if device is None:
      device = next(iter(shard.devices()))
    kind = self._kind(device)
    if kind is None:
      if device.platform in ASARRAY_PLATFORMS:  # a view: slicing it copies nothing
        view = np.asarray(shard)
        return view if local is None else view[local]
      return np.asarray(shard if local is None else shard[local])
    src = shard if local is None else shard[local]
    try:
      copy = jax.device_put(src, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
    except Exception as e:
      raise RuntimeError(
          f"copying {src.nbytes} bytes from {device} into its {kind} memory failed ({e}); "
          "save with a smaller budget_bytes= so that fewer copies are in flight at once"
      ) from e
    self._started.append(weakref.ref(copy))
    return Owned(copy)

  def wait(self) -> None:
    """Wait until every copy started is on the host (the caller may then reuse its arrays)."""
    live = [a for ref in self._started if (a := ref()) is not None]
    self._started = []
    if live:
      jax.block_until_ready(live)
