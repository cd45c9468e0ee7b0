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

import threading
import weakref
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _state
from .errors import at_leaf

__all__ = ["ASARRAY_PLATFORMS", "MODES", "Copies", "Owned", "buffers", "mode", "host", "to_host"]

MODES = ("owned", "asarray")
# Platforms staged with "asarray" by default: on CPU, views of the device buffers (no copy).
ASARRAY_PLATFORMS = frozenset({"cpu"})


def mode(device: Any) -> str:
  """How shards on ``device`` are staged: ``"owned"`` or ``"asarray"`` (see the module)."""
  forced = _state.hooks.staging
  if forced is not None:
    if forced not in MODES:
      raise ValueError(
        f"fnckpt._state.hooks.staging is {forced!r}; use one of {MODES} or None "
        "(the platform's default)"
      )
    return forced
  return "asarray" if device.platform in ASARRAY_PLATFORMS else "owned"


def host(device: Any) -> str | None:
  """The host memory kind owned copies from ``device`` land in (None: it has none)."""
  kinds = {m.kind for m in device.addressable_memories()}
  return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


class Owned:
  """A shard's copy in host memory this save owns (a ``jax.Array`` on a host memory kind),
  possibly not started yet (:meth:`Copies.flush` starts it) or still in flight. Calling it
  gives the bytes as numpy (starting the copy if needed, waiting for it) and drops the copy's
  array: the numpy result is a view of it (pinned and CPU host memory alike: measured on an
  H200, ``bench/blocking.py``'s ``pinned+numpy`` arm)."""

  def __init__(self, copies: Copies):
    self.array: jax.Array | None = None
    self._copies: Copies | None = copies  # None once started (or failed)
    self._host: np.ndarray | None = None
    self.error: BaseException | None = None  # its batch failed: this copy never started

  def __call__(self) -> np.ndarray:
    host = self._host
    if host is None:
      if self._copies is not None:  # not started: start it (and every other one pending)
        self._copies.flush()
      if self.error is not None:
        raise self.error
      array = self.array
      if array is None:  # another thread converted it meanwhile (it sets _host first)
        host = self._host
        if host is None:
          raise RuntimeError("internal: an owned copy with neither bytes nor array")
        return host
      host = self._host = np.asarray(array)
      self.array = None
    return host


def buffers(x: jax.Array) -> list[tuple[Any, jax.Array]]:
  """``(device, one-device array)`` of each of this process's shards of ``x``: from
  ``x._arrays`` where JAX has it, each device read off its array's own sharding (4x faster
  than ``addressable_shards`` on a fresh array: 36 against 150 us for 8 shards, measured in
  bench/call_cost.py's states); else through ``addressable_shards``."""
  try:
    return [(a.sharding._device, a) for a in x._arrays]  # type: ignore[attr-defined]
  except AttributeError:
    return [(s.device, s.data) for s in x.addressable_shards]


def to_host(part: Any) -> np.ndarray:
  """A staged part as numpy: an :class:`Owned` copy's bytes, else the part itself."""
  return part() if isinstance(part, Owned) else part


class _Pending(NamedTuple):
  """A copy asked for and not started yet (:meth:`Copies.flush` starts it)."""

  src: jax.Array
  device: Any
  kind: str  # the host memory kind it lands in
  owned: Owned  # what the writer calls for its bytes
  label: Any  # the key path of its leaf (None: unnamed)


class Copies:
  """One save's owned copies: asked for by :meth:`get` as staging charges each chunk, started
  in as few ``jax.device_put`` calls as the save allows (a call per shard cost ~75 us, 300
  leaves ~22 ms of a save's blocked time): when the writer needs one not started yet (every
  pending one starts with it), at :meth:`wait`, which starts the rest and waits for them all
  together before ``save`` returns, or past ``BATCH`` shards or ``BATCH_BYTES`` (a bound on
  one call's size; the budget bounds what is held). A save that fits its budget and whose
  writer asks for nothing before :meth:`wait` makes one call. The list of started copies
  holds weak references, so a written chunk's copy is freed at once."""

  BATCH, BATCH_BYTES = 4096, 1 << 30

  def __init__(self) -> None:
    self._started: list[weakref.ref] = []
    self._kinds: dict[Any, str | None] = {}  # device -> its host memory kind (None: numpy)
    self._pending: list[_Pending] = []
    self._pending_bytes = 0
    self._lock = threading.Lock()
    self.label: Any = None  # the key path being staged (names it if its copy fails)

  def at(self, label: Any) -> Copies:
    """These copies, naming ``label`` (a leaf's key path) in the error if the next fail."""
    self.label = label
    return self

  def _kind(self, device: Any) -> str | None:
    """The memory kind owned copies from ``device`` land in; None: staged as numpy (asked
    once per device and save: thousands of small shards ask again and again)."""
    try:
      return self._kinds[device]
    except KeyError:
      kind = self._kinds[device] = host(device) if mode(device) == "owned" else None
      return kind

  def get(
    self, shard: jax.Array, local: tuple[slice, ...] | None = None, device: Any = None
  ) -> Any:
    """``shard`` (one device's array, on ``device`` when the caller knows it), or its part
    ``local``, held safe from the caller: an :class:`Owned` copy (started in a batch), or
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
    owned = Owned(self)
    with self._lock:
      self._pending.append(_Pending(src, device, kind, owned, self.label))
      self._pending_bytes += src.nbytes
      full = len(self._pending) >= self.BATCH or self._pending_bytes >= self.BATCH_BYTES
    if full:
      self.flush()
    return owned

  def flush(self) -> None:
    """Start every pending copy (one ``jax.device_put`` for all; if that fails, one by one,
    so the error names the shard and the leaf that failed)."""
    with self._lock:
      pending, self._pending, self._pending_bytes = self._pending, [], 0
      if not pending:
        return
      try:
        arrays = jax.device_put(
          [p.src for p in pending],
          [jax.sharding.SingleDeviceSharding(p.device, memory_kind=p.kind) for p in pending],
        )
      except Exception:
        arrays = _one_by_one(pending)
      for p, array in zip(pending, arrays):
        owned, owned._copies = p.owned, None
        if isinstance(array, BaseException):
          owned.error = array
        else:
          owned.array = array
          self._started.append(weakref.ref(array))
    failed = next((a for a in arrays if isinstance(a, BaseException)), None)
    if failed is not None:
      raise failed

  def wait(self) -> None:
    """Start what is pending, then wait until every copy started is on the host (the
    caller may then reuse its arrays)."""
    self.flush()
    with self._lock:
      started, self._started = self._started, []
    live = [a for ref in started if (a := ref()) is not None]
    if live:
      jax.block_until_ready(live)


def _one_by_one(pending: list[_Pending]) -> list:
  """Each pending copy alone (their batch failed): its array, or the error that names its
  bytes, device and leaf (raised by the copy when used)."""
  out: list = []
  for p in pending:
    try:
      out.append(
        jax.device_put(p.src, jax.sharding.SingleDeviceSharding(p.device, memory_kind=p.kind))
      )
    except Exception as e:
      error: BaseException = RuntimeError(
        f"copying {p.src.nbytes} bytes from {p.device} into its {p.kind} memory failed "
        f"({e}); save with a smaller budget_bytes= so that fewer copies are in flight at once"
      )
      if p.label is not None:
        error = at_leaf(error, p.label)
      error.__cause__ = e
      out.append(error)
  return out
