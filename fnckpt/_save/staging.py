"""Staging off the devices, under the process's host-byte budget: each chunk this process
writes (of a zarr array, or of its pack) is charged to the budget, copied into host memory the
save owns (or held as a view of a CPU buffer: :mod:`.copies`) and queued for the writer
thread, which writes it. ``plan`` is save's plan (``plan.Plan``: its arrays, packed leaves
and pieces)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from .. import _state
from .._format import refs as _refs
from .._io import arrays as _arrays
from .._io import direct as _direct
from .._layout import chunks as _chunks
from .._layout.shard import ShardImage
from . import buffers as _buffers
from . import piece_writes as _piece_writes
from .copies import Copies, buffers
from .copies import mode as _mode
from .errors import at_leaf
from .handle import SaveHandle
from .staged_leaf import Staged
from .writer import Chunk, Writer

__all__ = [
  "CHUNK_COST",
  "stage_array",
  "stage_pack",
  "charge",
  "count_staged",
  "leaf_nbytes",
  "Assemble",
  "stage_unit",
  "start_copies",
  "to_copy",
]

# Host bytes a chunk of n bytes costs, in units of n, from staging until it is durable: the
# staged buffer, which the writer drops once TensorStore has copied it into its transaction,
# then that copy plus the encoded chunk being written (measured: about 2n at the peak).
CHUNK_COST = 2


def stage_array(
  a: Any,
  fut,
  cand: _refs.StoredCand | None,
  writer: Writer,
  budget,
  handle: SaveHandle,
  copies: Copies,
) -> None:
  """Stage the chunks of one zarr array (``a``: the plan's ``Array``) this process writes (each
  hashed by the writer; a candidate's chunk equal to the base's is not written)."""
  shard_data = dict(buffers(a.data)) if isinstance(a.data, jax.Array) and a.units else {}
  itemsize = np.dtype(a.data.dtype).itemsize
  chunks, shape = a.rec.stored.chunks, a.rec.shape
  for unit in a.units:
    n = _chunks.nbytes([b - s for s, b in unit.index], itemsize)
    try:
      host = charge(
        budget,
        CHUNK_COST * n,
        writer,
        lambda: stage_unit(a.data, unit, shard_data.get(unit.device), copies.at(a.rec.path)),
      )
    except BaseException as e:
      raise at_leaf(e, a.rec.path)  # noqa: B904
    pos = _refs.chunk_pos(unit.index, chunks, shape)
    writer.put(
      Chunk(
        store=fut,
        index=unit.index,
        host=host,
        cost=CHUNK_COST * n,
        leaf=a.index,
        pos=pos,
        expect=cand.expect(pos) if cand is not None else None,
        nbytes=n,
      )
    )
    count_staged(handle, budget, n)


def stage_pack(
  plan: Any, kv_spec, ctx, writer: Writer, budget, handle: SaveHandle, copies: Copies
) -> None:
  """This process's pack, chunk by chunk. Each packed leaf is staged as chunks are (views of
  its shards on CPU, copies the save owns on accelerators, a copy of numpy data); the
  writer thread then assembles each chunk's bytes from them, so the caller waits for no copy
  it does not need."""
  pack = plan.my_pack
  spec = _arrays.pack_spec(kv_spec, pack.dir, pack.nbytes, pack.chunk, pack.inner)
  # Writes its zarr.json, then the chunks through it: every inner chunk stored, zeros too
  # (else a zero range, e.g. fresh optimizer moments, is left out and reads as missing).
  fut = _arrays.open_array(spec, ctx, mode="create")
  todo = sorted(
    [
      _piece_writes.PackPart(
        plan.records[i].packed.offset, leaf_nbytes(data), i, functools.partial(Staged.of, data)
      )
      for i, data in plan.packed
    ]
    + plan.pieces,
    key=lambda part: part.offset,
  )
  staged: dict[int, Staged] = {}  # by position in todo
  first = 0  # todo[:first] lie before the current chunk

  def parts(start: int, end: int) -> list[tuple[int, Staged, int, int, int]]:
    out = []
    for k in range(first, len(todo)):
      part = todo[k]
      if part.offset >= end:
        break
      if part.offset + part.nbytes <= start:
        continue
      try:
        leaf = (
          staged[k]
          if k in staged
          else staged.setdefault(k, part.make(copies.at(plan.records[part.leaf].path)))
        )
      except BaseException as e:
        raise at_leaf(e, plan.records[part.leaf].path)  # noqa: B904
      lo, hi = max(part.offset, start), min(part.offset + part.nbytes, end)
      out.append((lo - start, leaf, lo - part.offset, hi - part.offset, part.leaf))
    return out

  root = _direct.local_root(kv_spec)
  for start in range(0, pack.nbytes, pack.chunk):
    end = min(start + pack.chunk, pack.nbytes)
    cost = CHUNK_COST * (end - start)
    got = charge(budget, cost, writer, lambda: parts(start, end))
    writer.put(Chunk(fut, ((start, end),), _assemble(got, start, end, pack, root), cost))
    del got  # (while staging the next chunk) the writer frees them once assembled
    count_staged(handle, budget, end - start)
    while first < len(todo) and todo[first].offset + todo[first].nbytes <= end:
      staged.pop(first, None)  # a part that ends in this chunk is not needed any more
      first += 1


def _assemble(got: list, start: int, end: int, pack: Any, root: str | None) -> Assemble:
  """A pack chunk to assemble: as the file ``_io.direct`` writes under the local ``root``,
  else as the chunk's bytes for TensorStore."""
  if root is None or not ShardImage.fits(end - start, pack.chunk, pack.inner):
    return Assemble(end - start, got)
  return Assemble(
    end - start,
    got,
    image=ShardImage(end - start, pack.chunk, pack.inner),
    path=_direct.chunk_path(root, pack.dir, start // pack.chunk),
  )


def charge(budget: _arrays.ByteBudget, cost: int, writer: Writer, stage) -> Any:
  """Take ``cost`` from the budget (starting the writer when it is full), then stage."""
  if writer.error is not None:
    raise writer.error
  budget.acquire(cost, on_wait=writer.drain)
  try:
    return stage()
  except BaseException:
    budget.release(cost)
    raise


def count_staged(handle: SaveHandle, budget: _arrays.ByteBudget, n: int) -> None:
  """A chunk of ``n`` bytes staged: the handle's stats."""
  handle.stats.peak_staged_bytes = max(handle.stats.peak_staged_bytes, budget.held)
  handle.stats.bytes_written += n
  handle.stats.chunks_written += 1


def leaf_nbytes(data: Any) -> int:
  """The bytes of an array leaf."""
  return _chunks.nbytes(data.shape, np.dtype(data.dtype).itemsize)


@dataclasses.dataclass
class Assemble:
  """A pack chunk's bytes, built by the writer thread: each piece is bytes ``[lo, hi)`` of a
  staged leaf (record ``i``), at ``offset`` in the chunk, zeros elsewhere. Once built,
  ``spans`` lists (record, offset, bytes) of each piece, in order, for hashing. The buffer
  comes from :mod:`.buffers` (``reuse``: the delta gives it back once written and hashed).

  With ``image`` (a local chunk written by ``fnckpt._io.direct`` to ``path``) the buffer is
  the chunk's file: each piece goes to its place among the inner chunks (split where one
  ends), and ``spans`` are offsets in the file."""

  nbytes: int
  pieces: list[tuple[int, Staged, int, int, int]]
  spans: list[tuple[int, int, int]] | None = None
  image: ShardImage | None = None
  path: str | None = None
  reuse = True

  def __call__(self) -> np.ndarray:
    image = self.image
    buf = _buffers.take(self.nbytes if image is None else _direct.aligned_size(image))
    self.spans = []  # (an earlier chunk's bytes in buf: every byte is written)
    for offset, leaf, lo, hi, i in self.pieces:
      places = [(offset, 0, hi - lo)] if image is None else image.place(offset, hi - lo)
      if (
        len(places) == 1
        and hi - lo == leaf.nbytes
        and leaf.gather_into(buf[places[0][0] : places[0][0] + hi - lo])
      ):  # (a sharded leaf, in one place)
        self.spans.append((i, places[0][0], hi - lo))
        continue
      src = leaf.raw()[lo:hi]
      for at, skip, n in places:
        buf[at : at + n] = src[skip : skip + n]
        self.spans.append((i, at, n))
    _buffers.fill_gaps(buf, sorted((offset, n) for _, offset, n in self.spans))
    self.pieces = []
    return buf


def stage_unit(data: Any, unit: _chunks.WriteUnit, shard_data: Any, copies: Copies) -> Any:
  """The unit's bytes, safe from whatever the caller does next (numpy, or a callable the
  writer calls for them: ``copies.Owned``).

  - numpy leaves are copied (the caller may mutate them in place);
  - off CPU (``"owned"``), a copy into host memory this save owns, started now and waited
    for with the others before ``save`` returns (:meth:`Copies.wait`);
  - on CPU (``"asarray"``) ``np.asarray`` is a view that holds the device buffer: donating
    or deleting the array then leaves that buffer alone (JAX allocates anew), so no copy is
    needed.
  """
  local = tuple(slice(a, b) for a, b in unit.local)
  if isinstance(data, np.ndarray):
    return np.array(data[local], copy=True)
  whole = shard_data.shape == tuple(b - a for a, b in unit.local)
  return copies.get(shard_data, None if whole else local)


def start_copies(plan: Any, budget: _arrays.ByteBudget) -> None:
  """Accelerators staged with ``"asarray"`` (forced: the old path): start every
  device-to-host copy of this save at once (when they fit in the budget), so the caller
  waits for about the total transfer time, not a sum of serial round trips. ``"owned"``
  copies start as staging charges them (:class:`Copies`); on CPU views copy nothing."""
  if _state.hooks.staging != "asarray":  # (only then may an accelerator stage so)
    return
  asked: dict[Any, bool] = {}  # per sharding (a device's), whether its shards copy so

  def forced(s: jax.Array) -> bool:
    try:
      return asked[s.sharding]
    except KeyError:
      device = next(iter(s.devices()))
      got = asked[s.sharding] = device.platform != "cpu" and _mode(device) == "asarray"
      return got

  shards = [s for s in to_copy(plan) if forced(s)]
  total = sum(s.nbytes for s in shards)
  if total and CHUNK_COST * total <= budget.limit:
    for s in shards:
      s.copy_to_host_async()


def to_copy(plan: Any) -> list[jax.Array]:
  """The device data this process stages: its shards of stored arrays, its packed leaves,
  (save(base=)) the packed leaves that may reuse the base's, and its pieces."""
  shards = []
  for a in plan.arrays:
    if isinstance(a.data, jax.Array) and a.units:
      writers = {u.device for u in a.units}
      shards += [b for device, b in buffers(a.data) if device in writers]
  for _, data in [*plan.packed, *plan.maybe_packed]:
    if isinstance(data, jax.Array):
      shards += [data.addressable_data(0)] if data.is_fully_replicated else [data]
  shards += [part.shard for part in plan.pieces]
  shards += [part.shard for _, parts in plan.maybe_runs for part in parts]
  return shards
