"""Restore's reads and their placement: what each array leaf needs read (the regions), read
through the one reader (``_sources.read``) under the restore budget, and placed on the
target's devices as it lands.

Packed leaves are read first, each whole (a run of them lying one after another in a pack as
one byte range), and placed with their sharding; stored, pieced and foreign leaves as the
distinct slices this process's devices need (``_chunks.plan_read``), each placed on its
devices; inline leaves (no stored bytes: values in the manifest) while the first read is
awaited (the window's ``idle``), else last. A run's leaves are views of the one aligned buffer
it was read into, and inline leaves bound for several CPU devices are copied into shared
aligned blocks (:func:`inline_hosts`): CPU devices adopt each where it lies, no copy per leaf
or device (docs/concepts/saving.md, Placement). A slice's bytes stay charged to the budget until
it is placed: puts go out in batches (slices: one ``jax.device_put`` per device; whole
leaves: one ``jax.make_array_from_callback`` each, :func:`place`), when
256 are waiting, when the next read has not landed yet and an eighth of the budget waits (its
bytes then leave the budget and the next reads go out meanwhile), or when the budget is full
and nothing is in flight (the window's ``drain``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, cast

import jax
import numpy as np

from .._errors import CheckpointError
from .._format import leaves as _leaves
from .._io import arrays as _arrays
from .._layout import chunks as _chunks
from .._sources import read as _read
from .._sources.source import Source

__all__ = [
  "Read",
  "read_arrays",
  "place",
  "place_all",
  "put_grouped",
  "convert",
  "check_fits",
  "inline_hosts",
]

WHOLE = "whole"  # a region's devices: the whole leaf, placed with its sharding
FLUSH_PUTS = 256  # placements batched into one device_put at most
RUN = "run"  # a region's tag: a run of whole packed leaves read as one byte range
RUN_BYTES = 8 << 20  # a run's bytes at most (and an eighth of the budget)


@dataclasses.dataclass
class Read:
  """One array leaf being read: where its slices go and what has arrived (``parts``: device
  -> its slice placed, or None -> the whole host array; ``placed``: the leaf placed whole)."""

  want: Any  # restore's _Want: rec, dtype, host, ...
  shape: tuple[int, ...]
  sharding: jax.sharding.Sharding | None  # None: one host numpy array
  parts: dict[Any, Any] = dataclasses.field(default_factory=dict)
  placed: Any = None
  sliced: bool = False  # a packed leaf read in slices (broadcast)


def read_arrays(src: Source, reads: dict[int, Read], budget: int) -> None:
  """Read every array of ``reads`` (at most ``budget`` bytes held, read or landed and not yet
  placed) and place it: ``placed`` for a leaf placed whole with a sharding, ``parts`` for the
  others. Inline leaves have no stored bytes: their values, from the manifest, are placed
  with the last batch."""
  placer = _Placer(reads)
  window = placer.window = _read.Window(budget, drain=placer.flush, idle=placer.place_inline)
  try:
    for got in _read.read_regions(
      _regions(_read.Opener(src), reads, budget), window, release=False
    ):
      placer.land(got)
    placer.place_inline()
    placer.flush()
  finally:
    window.drain = window.idle = None  # (a cycle through the placer would keep what was
    # read, and the restored arrays, alive until a
    # garbage collection)


def _regions(opener: _read.Opener, reads: dict[int, Read], limit: int) -> Iterator[_read.Region]:
  """Packed leaves whole (first: they share packs, in batches of half the budget; runs of
  leaves lying one after another in a pack read as one range, :func:`_packed_regions`), then
  the slices of stored, pieced and foreign leaves (and of packed ones read in parts:
  ``sliced``). Tags: ``(leaf number, devices)``, devices None for a host target; a run's:
  ``(RUN, [its leaves' tags])``."""
  yield from _packed_regions(opener, reads, limit)
  for i, r in reads.items():
    if (r.want.rec.packed is not None and not r.sliced) or r.want.rec.inline is not None:
      continue
    leaf = opener.leaf(r.want.rec)
    plan: dict[_chunks.Index, Any]
    if r.sharding is None:
      plan = {tuple((0, n) for n in r.shape): None}
    else:
      plan = _chunks.plan_read(r.sharding, r.shape)  # O(local devices), cached
    for index, devices in plan.items():
      yield _read.Region(leaf, index, leaf.cost(index), (i, devices))


def _packed_regions(
  opener: _read.Opener, reads: dict[int, Read], limit: int
) -> Iterator[_read.Region]:
  """The whole packed leaves: one read per run of them in a pack (:func:`_read.pack_runs`,
  at most :data:`RUN_BYTES` or an eighth of the budget), a leaf alone as before. 999 packed
  leaves of the bench's mixed state were 999 TensorStore reads; now 10."""
  packed = [i for i, r in reads.items() if r.want.rec.packed is not None and not r.sliced]
  leaves = [opener.leaf(reads[i].want.rec) for i in packed]
  tags = [(i, None if reads[i].sharding is None else WHOLE) for i in packed]
  for run in _read.pack_runs(leaves, min(RUN_BYTES, limit // 8)):
    if len(run) == 1:
      leaf = leaves[run[0]]
      index = tuple((0, n) for n in leaf.shape)
      yield _read.Region(leaf, index, leaf.cost(index), tags[run[0]])
    else:
      leaf = _read.run_of([leaves[k] for k in run])
      index = ((0, leaf.shape[0]),)
      yield _read.Region(leaf, index, leaf.cost(index), (RUN, [tags[k] for k in run]))


class _Placer:
  """Places landed reads: a host target's array kept, a whole leaf or a slice's device puts
  queued and placed in batches (:meth:`flush`), their bytes released from ``window`` then."""

  def __init__(self, reads: dict[int, Read]):
    self.reads = reads
    self.window: _read.Window | None = None
    self.puts: list[tuple[int, Any, np.ndarray]] = []  # (leaf, device, host slice)
    self.whole: list[tuple[int, np.ndarray]] = []  # (leaf, host array)
    self.held = 0
    self.inline_done = False

  def land(self, got: _read.Landed) -> None:
    """A landed read (one leaf's region, or a run of whole packed leaves) kept or queued."""
    tag = got.region.tag
    assert got.data is not None and self.window is not None  # (read with errors raised)
    if tag[0] is RUN:  # views of one buffer: a host result gets its own copy
      for (i, devices), host in zip(tag[1], got.data):
        self._take(i, devices, np.array(host) if devices is None else host)
    elif not self._take(*tag, got.data):  # type: ignore[call-arg]  # (mypy: *Any, then more)
      self.window.release(got.region.cost)
      return
    self.held += got.region.cost
    if len(self.puts) + len(self.whole) >= FLUSH_PUTS or (
      not got.next_landed and self.held >= self.window.limit // 8
    ):
      self.flush()

  def _take(self, i: int, devices: Any, data: np.ndarray) -> bool:
    """Leaf ``i``'s region: kept (a host target: False) or queued to be placed (True)."""
    r = self.reads[i]
    host = convert(r.want, data)
    if devices is None:
      r.parts[None] = host
      return False
    # ``host`` is ours and nobody writes to it: every device may alias it (on CPU, JAX adopts
    # an aligned host buffer instead of copying it: one buffer for all the replicas; donating
    # such an array makes XLA copy, never write into it).
    if devices is WHOLE:  # (sharded: aligned, its slices are adopted as they are, replicas
      assert r.sharding is not None
      self.whole.append((i, shared_on_cpu(host, r.sharding.device_set)))  # sharing them)
    else:
      host = shared_on_cpu(host, devices)
      self.puts += [(i, d, host) for d in devices]
    return True

  def place_inline(self) -> None:
    """The inline leaves, once: placed while the first read is awaited (``Window.idle``: the
    mixed state's 1,001 inline leaves are placed while its packs are read), else after the
    reads."""
    if self.inline_done:
      return
    self.inline_done = True
    mine = [i for i, r in self.reads.items() if r.want.rec.inline is not None]
    hosts = inline_hosts(
      [self.reads[i].want.rec for i in mine], [self.reads[i].sharding for i in mine]
    )
    for i, host in zip(mine, hosts):
      self.inline(i, host)
    self.flush()

  def inline(self, i: int, host: np.ndarray) -> None:
    """An inline leaf's value: kept for a host target, else queued to be placed whole with
    the last batch (its bytes are the manifest's, charged to no budget, so all inline leaves
    go in one batch: one put per sharding)."""
    r = self.reads[i]
    host = convert(r.want, host)
    if r.sharding is None:
      r.parts[None] = host
    else:
      self.whole.append((i, host))

  def flush(self) -> None:
    """Place everything queued (one batched ``device_put`` of the slices, one of the whole
    leaves) and release its bytes."""
    if self.puts:
      arrays = put_grouped([h for _, _, h in self.puts], [d for _, d, _ in self.puts])
      for (i, d, _), arr in zip(self.puts, arrays):
        self.reads[i].parts[d] = arr
      self.puts.clear()
    if self.whole:
      rs = [self.reads[i] for i, _ in self.whole]
      shardings = [cast(jax.sharding.Sharding, r.sharding) for r in rs]  # (WHOLE: sharded)
      for r, arr in zip(rs, place_all([h for _, h in self.whole], shardings)):
        r.placed = arr
      self.whole.clear()
    assert self.window is not None
    self.window.release(self.held)
    self.held = 0


def convert(w: Any, host: np.ndarray) -> np.ndarray:
  """``host`` in the dtype the target asks for (``w.dtype``; None: as saved), checked to
  fit the devices' dtype (:func:`check_fits`)."""
  if w.dtype is not None and host.dtype != w.dtype:
    host = _leaves.cast(host, w.dtype, w.rec.where)
  if not w.host:
    check_fits(host, w.rec.where)
  return host


# With jax_enable_x64 off, JAX holds 64-bit integers as 32-bit ones on devices, wrapping
# what does not fit (jax.device_put does so without a word): the range that fits.
_X32 = {"i": (-(1 << 31), (1 << 31) - 1), "u": (0, (1 << 32) - 1)}


def check_fits(host: np.ndarray, where: str) -> None:
  """A 64-bit integer array bound for devices while ``jax_enable_x64`` is off holds only
  values its 32-bit form keeps; else a CheckpointError naming the leaf (never wrapped
  values: 2**40 would come back as 0).

  >>> check_fits(np.array([2**31 - 1]), "['step']")
  """
  if (
    host.dtype.kind not in _X32
    or host.dtype.itemsize != 8
    or not host.size
    or jax.config.jax_enable_x64  # type: ignore[attr-defined]  # (jax's stubs)
  ):
    return
  lo, hi = _X32[host.dtype.kind]
  low, high = int(host.min()), int(host.max())
  if low < lo or high > hi:
    raise CheckpointError(
      f"{where}: the checkpoint holds {host.dtype} values from {low} to {high}, beyond "
      f"{host.dtype.name.replace('64', '32')}, and jax_enable_x64 is off, so JAX would "
      "hold them as 32-bit integers and wrap them. Turn x64 on "
      "(jax.config.update('jax_enable_x64', True)) before restoring, or restore this leaf "
      "into a numpy array target."
    )


def inline_hosts(
  recs: list[Any], shardings: list[jax.sharding.Sharding | None]
) -> list[np.ndarray]:
  """Inline leaves' values (fresh copies, bools checked: ``_leaves.inline_array``). Those
  bound for two or more CPU devices are copied out of the manifest into aligned blocks of at
  most :data:`RUN_BYTES` shared by several leaves, each leaf at an aligned offset, which
  every device adopts: one buffer, not one copy per device (the small state's 1,000
  replicated leaves were 8,000 copies), and one allocation per block, not per leaf (the
  mixed state's 1,001 inline leaves: 1,001 allocations of fresh memory -> 2). A leaf placed
  so keeps its block alive while it lives (as a packed leaf keeps its run's)."""
  out: list[Any] = [None] * len(recs)
  shared = []
  for k, (rec, sharding) in enumerate(zip(recs, shardings)):
    if _adopted_on_cpu(sharding):
      shared.append(k)
    else:
      out[k] = _leaves.inline_array(rec)
  for block in _blocks([len(recs[k].inline) for k in shared], RUN_BYTES):
    buf = _arrays.aligned_empty((block[-1][1] + len(recs[shared[block[-1][0]]].inline),), np.uint8)
    for j, offset in block:
      rec = recs[shared[j]]
      n = len(rec.inline)
      view = buf[offset : offset + n]
      view[:] = np.frombuffer(rec.inline, np.uint8)
      out[shared[j]] = _leaves.checked_bools(
        view.view(_leaves.dtype_of(rec.dtype)).reshape(rec.shape), rec
      )
  return out


def _adopted_on_cpu(sharding: jax.sharding.Sharding | None) -> bool:
  """Whether ``sharding`` places on two or more CPU devices (:func:`_cpu_shared`)."""
  return sharding is not None and _cpu_shared(sharding.device_set)


def _cpu_shared(devices: Any) -> bool:
  """Whether ``devices`` are two or more CPU devices, which adopt one aligned host buffer
  instead of each copying it."""
  return len(devices) >= 2 and next(iter(devices)).platform == "cpu"


def _blocks(sizes: list[int], limit: int) -> list[list[tuple[int, int]]]:
  """Consecutive items of ``sizes`` bytes laid out at :data:`_arrays.ALIGN`-aligned offsets in
  blocks of at most ``limit`` bytes (a larger item alone): per block, ``(position, offset)``.

  >>> _blocks([10, 64, 100, 7, 200], 160)
  [[(0, 0), (1, 64)], [(2, 0), (3, 128)], [(4, 0)]]
  """
  blocks: list[list[tuple[int, int]]] = []
  end = 0
  for j, n in enumerate(sizes):
    offset = -(-end // _arrays.ALIGN) * _arrays.ALIGN
    if not blocks or offset + n > limit:
      blocks.append([])
      offset = 0
    blocks[-1].append((j, offset))
    end = offset + n
  return blocks


def shared_on_cpu(host: np.ndarray, devices: Any) -> np.ndarray:
  """``host`` (ours) as CPU devices adopt it without a copy (aligned, :data:`_arrays.ALIGN`)
  when two or more of them take it, whole or in slices: one copy here instead of one per
  device (of each slice whose start stays aligned)."""
  if host.ctypes.data % _arrays.ALIGN == 0 or not _cpu_shared(devices):
    return host
  out = _arrays.aligned_empty(host.shape, host.dtype)
  np.copyto(out, host)
  return out


def place_all(hosts: list[np.ndarray], shardings: list[jax.sharding.Sharding]) -> list[jax.Array]:
  """Whole host arrays placed with their shardings (:func:`place`, one by one)."""
  return [place(h, s) for h, s in zip(hosts, shardings)]


def put_grouped(hosts: list[np.ndarray], places: list[Any]) -> list[jax.Array]:
  """``jax.device_put(hosts, places, may_alias=True)`` (``places``: shardings or devices of
  this process), as one call per distinct place: JAX's per-array work is about a quarter
  less for a list sharing one sharding than for a list of shardings (2,000 small leaves)."""
  groups: dict[Any, list[int]] = {}
  for k, p in enumerate(places):
    groups.setdefault(p, []).append(k)
  out: list[Any] = [None] * len(hosts)
  for p, ks in groups.items():
    for k, arr in zip(ks, jax.device_put([hosts[k] for k in ks], p, may_alias=True)):
      out[k] = arr
  return out


def place(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A whole host array placed with ``sharding``, by ``jax.make_array_from_callback``: from
  this process's slices alone (``jax.device_put`` onto a sharding spanning processes would
  run a cross-process check, a collective, and restore makes none). The slices are views of
  ``host`` (ours, never written: CPU devices adopt the aligned ones, replicas sharing them),
  own copies onto another process's sharding. Cheaper than ``jax.device_put``, even of a
  list sharing one sharding: it skips JAX's per-array abstract value and sharding checks
  (1,000 arrays of 16 KiB onto 8 CPU devices: 24 vs 35 ms replicated, 36 vs 43 ms onto 4
  slices). No ``dtype`` passed where this process holds slices: an int64 array with x64
  off then becomes int32 without a warning, as ``jax.device_put`` did (its values checked
  to fit first: :func:`check_fits`)."""
  if not sharding.is_fully_addressable:
    return jax.make_array_from_callback(
      host.shape,
      sharding,  # dtype: none may be on
      lambda index: np.array(host[index]),  # this process
      dtype=host.dtype,
    )
  if host.ndim == 0:  # (indexing a 0-d array gives a numpy scalar)
    return jax.make_array_from_callback((), sharding, lambda index: host)
  if host.nbytes < _SLICED_BYTES or not _cpu_shared(sharding.device_set):
    return jax.make_array_from_callback(host.shape, sharding, host.__getitem__)
  return jax.make_array_from_callback(host.shape, sharding, _Slices(host))


# Leaves from this size have their slices made once per distinct slice (:class:`_Slices`);
# smaller ones are cheaper copied per device than keyed (the mixed state's 2,000 leaves of
# 4-128 KiB on 8 devices: 16,000 slices).
_SLICED_BYTES = 1 << 20


class _Slices:
  """A host array's slices for CPU devices to adopt: each distinct slice once, as it lies
  when it is contiguous and aligned, else copied once into an aligned block that all its
  replicas share (JAX would copy a strided slice, a column block, once per device)."""

  def __init__(self, host: np.ndarray):
    self.host = host
    self.made: dict[tuple, np.ndarray] = {}

  def __call__(self, index: tuple[slice, ...] | None) -> np.ndarray:
    if index is None:  # (JAX passes slices for an array of rank >= 1)
      return self.host
    key = tuple((s.start, s.stop, s.step) for s in index)
    got = self.made.get(key)
    if got is None:
      view = self.host[index]
      if not (view.flags.c_contiguous and view.ctypes.data % _arrays.ALIGN == 0):
        copy = _arrays.aligned_empty(view.shape, view.dtype)
        np.copyto(copy, view)
        view = copy
      got = self.made[key] = view
    return got
