"""save(): plan -> agree across processes -> stage off the devices (under a host-memory budget,
``staging``) -> background write (``writer``) -> barrier -> manifest -> barrier -> commit
marker. The caller's handle, ``fnckpt.wait()`` and the pending saves are ``handle``'s."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import threading
import time
import warnings
import zlib
from typing import Any, Callable, cast

import jax
import msgpack
import numpy as np
import tensorstore as ts

from .. import _state
from .._errors import CheckpointError
from .._format import hashes as _hashes
from .._format import leaves as _leaves
from .._format import manifest as _manifest
from .._format import perprocess as _perprocess
from .._format import records as _records
from .._format import refs as _refs
from .._format import tree as _tree
from .._io import arrays as _arrays
from .._io import collective as _collective
from .._io import commit as _commit
from .._io import direct as _direct
from .._io import paths as _paths
from .._layout import chunks as _chunks
from .._layout import packing as _packing
from .._layout import pieces as _pieces
from .._sources import source as _source
from .._version import __version__
from . import delta as _delta
from . import pending as _pending
from . import piece_writes as _piece_writes
from .copies import Copies
from .errors import at_leaf as _at
from .errors import wrap
from .handle import SaveHandle, begin
from .options import INLINE_BYTES, SaveOptions
from .staged_leaf import Run, Staged
from .staging import CHUNK_COST
from .staging import charge as _charge
from .staging import leaf_nbytes as _nbytes
from .staging import stage_array as _stage_array
from .staging import stage_pack as _stage_pack
from .staging import start_copies as _start_copies
from .writer import Commit, Writer

__all__ = ["save", "start"]


def default_budget_bytes() -> int:
  """A quarter of the memory available now (at least 256 MiB)."""
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    available = int(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  return max(256 << 20, available // 4)


def _reached(location: str, name: str) -> None:
  """The save passed phase ``name`` ("staging", "staged", "written", "manifest",
  "committing", "committed"): reported for timeouts, and to the test hook."""
  _commit.report(location, name)
  _state.hooks.on_phase(name)


def _process_budget(limit: int) -> _arrays.ByteBudget:
  """One budget per process, shared by overlapping saves; its limit is the latest asked."""
  saves = _state.saves
  with saves.budget_lock:
    if saves.budget is None:
      saves.budget = _arrays.ByteBudget(limit)
    saves.budget.limit = limit
    return saves.budget


@dataclasses.dataclass
class _Array:
  index: int
  rec: _records.Leaf  # with ``stored``
  data: Any  # jax.Array or np.ndarray holding the bytes
  spec: dict[str, Any]
  units: list[_chunks.WriteUnit]


@dataclasses.dataclass
class _Plan:
  """A save as planned: the manifest's leaf records (every one with its storage, but for the
  candidate packed leaves of a save with a base, placed when concluding; hashes are added
  then) and what this process writes. On processes other than 0 an inline leaf's ``inline``
  is ``b""`` (process 0 writes the manifest): their records serve the agreement only."""

  records: tuple[_records.Leaf, ...]
  arrays: list[_Array]  # zarr arrays (this process writes ``units`` of each)
  packed: list[tuple[int, Any]]  # (record index, data) this process packs
  packs: tuple[_records.Pack, ...]  # every process's pack, for the manifest
  my_pack: _records.Pack | None
  data_dir: str
  values: bytes | None = None  # this process's fnckpt.PerProcess values (its pp/ file)
  holders: list[str | None] = dataclasses.field(default_factory=list)  # per record: _holders
  reusable: _refs.Candidates = dataclasses.field(default_factory=_refs.Candidates)
  maybe_packed: list[tuple[int, Any]] = dataclasses.field(default_factory=list)  # mine
  pieces: list[_piece_writes.PackPart] = dataclasses.field(default_factory=list)  # mine
  meshes: tuple[np.ndarray, ...] = ()  # the pieced leaves' meshes and layout (the manifest's)
  layout: _pieces.Layout | None = None
  regions: _pieces.Layout | None = None  # the pieced leaves in the packs' regions
  maybe_runs: list[tuple[int, list[_piece_writes.PackPart]]] = dataclasses.field(
    default_factory=list
  )  # mine, of pieced leaves that may reuse the base's runs


def _holders(data: Any) -> str:
  """Who holds an array leaf: "host" (numpy), "local" (jax, on this process's devices only:
  process 0's value is saved), "all" (replicated on every process), or "some" (sharded, or
  replicated on some processes). Alike on every process but for "local" (on another
  process, an array held by one process is "some"), which the tree agreement then reports."""
  if isinstance(data, np.ndarray):
    return "host"
  if data.is_fully_addressable:
    return "local"
  if data.is_fully_replicated and len(_processes(data.sharding)) == jax.process_count():
    return "all"
  return "some"


@_state.memo(256)
def _processes(sharding: Any) -> frozenset[int]:
  return frozenset(d.process_index for d in sharding.device_set)


@dataclasses.dataclass(frozen=True)
class _Base:
  """An incremental save's base: its manifest and where it and the new checkpoint are."""

  manifest: Any
  loc: _refs.Location
  new_loc: _refs.Location
  source: Any = None  # the opened base (its commit marker as read at the start)
  pending: Any = None  # a base still in flight here (``pending.Pending``): no manifest

  def candidates(self, records, meshes=()) -> _refs.Candidates:
    """The leaves that may reuse the base's data (``refs.candidates``; in flight: by layout).
    ``meshes``: the new save's meshes of pieced leaves."""
    if self.pending is not None:
      return self.pending.candidates(records, meshes)
    return _refs.candidates(records, self.manifest, self.loc, self.new_loc, meshes)

  @property
  def where(self) -> str:
    """The base's location, for messages."""
    return self.source.location if self.source is not None else self.pending.path

  def check(self) -> None:
    """Before the new checkpoint commits: the base is still the committed checkpoint read at
    the start (else the new one would refer to data that may be gone)."""
    src = self.source
    if not _commit.unchanged(src.kv, src.commit):
      raise CheckpointError(
        f"The base {src.location!r} was deleted or replaced while this save was writing; "
        "the new checkpoint would refer to its data, so it is not committed. Save again "
        "(with a committed base, or without base=)."
      )


def _plan(
  leaves, kv_spec: dict, data_dir: str, options: SaveOptions, base: _Base | None = None
) -> _Plan:
  """Leaf records for the manifest and what this process writes (pure but for jax sharding
  queries). With ``options.pieces``, small shards of sharded arrays go into the packs
  (docs/format.md "Pieces"). A record gets its storage as it is decided (packed ones: once
  the packs are laid out)."""
  inline_bytes, pack_bytes, codecs = options.inline_bytes, options.pack_bytes, options.codecs
  records: list[_records.Leaf] = []
  holders: list[str | None] = []
  arrays, problems, candidates, per_process = [], [], [], []
  inline: list[tuple[int, Any]] = []
  me, nproc = jax.process_index(), jax.process_count()
  pieced = _piece_writes.Planner(_pieces.PIECE_BYTES if options.pieces else 0)
  for path, leaf in leaves:
    i = len(records)
    if isinstance(leaf, _perprocess.PerProcess):
      records.append(_records.Leaf(i, path, "perprocess"))
      holders.append(None)
      per_process.append((path, leaf))
      continue
    try:
      rec, data = _leaves.leaf_record(i, path, leaf)
    except CheckpointError as e:
      problems.append(str(e))
      continue
    records.append(rec)
    holders.append(None if data is None else _holders(data))
    if data is None:
      continue
    if isinstance(data, jax.Array) and data.is_deleted():
      problems.append(
        f"The array at {_tree.keystr(path)} was deleted (or donated) before save; "
        "save the state before the step that donates it."
      )
      continue
    assert rec.shape is not None
    size = _chunks.nbytes(rec.shape, np.dtype(data.dtype).itemsize)
    whole = holders[-1] != "some"  # process 0 has all of it (its own value, if local)
    if size <= inline_bytes and whole:
      inline.append((i, data))
    elif size <= pack_bytes and whole:
      candidates.append(
        (i, data, _packing.PackItem(i, size, None if holders[-1] == "all" and nproc > 1 else 0))
      )
    elif (holders[-1] != "local" or nproc == 1) and (got := pieced.consider(i, rec, data)):
      records[i] = got
    else:
      arrays.append(_zarr_array(i, rec, data, kv_spec, data_dir, codecs))
      records[i] = arrays[-1].rec
      if holders[-1] == "local" and me != 0:
        arrays[-1].units = []  # a non-global array: process 0's value, written by it alone
  values = None
  try:
    values = _perprocess.encode(per_process) if per_process else None
  except CheckpointError as e:
    problems.append(str(e))
  if problems:
    raise CheckpointError("Cannot save this tree:\n  " + "\n  ".join(problems))
  _set_inline(records, inline, me)
  reusable = _candidates(base, records, pieced.meshes)
  maybe = [c for c in candidates if c[0] in reusable.packed]
  owners = _packing.assign([c[2] for c in maybe], nproc).where
  packs, packed = _assign_packs(
    records,
    [c for c in candidates if c[0] not in reusable.packed],
    data_dir,
    nproc,
    me,
    pieced.finish(reusable.pieced),
  )
  mine = [p for p in packs if p.dir == f"{data_dir}/p/{me}"]
  parts = pieced.parts(cast(int, mine[0].pieces), me) if pieced.regions is not None and mine else []
  return _Plan(
    records=tuple(records),
    arrays=arrays,
    packed=packed,
    packs=packs,
    my_pack=mine[0] if mine else None,
    data_dir=data_dir,
    values=values,
    holders=holders,
    reusable=reusable,
    maybe_packed=[(i, d) for i, d, _ in maybe if owners[i][0] == me],
    pieces=parts,
    meshes=tuple(pieced.meshes),
    layout=pieced.layout,
    regions=pieced.regions,
    maybe_runs=pieced.runs(me) if reusable.pieced else [],
  )


def _set_inline(records: list[_records.Leaf], inline: list[tuple[int, Any]], me: int) -> None:
  """The inline leaves' bytes into their records (process 0's; the others' stay empty). A
  jax leaf's bytes are staged as larger leaves are (``copies``): every copy started before
  any is waited for, and none left cached on the caller's array (``np.array(x)`` would cache
  its copy there: on CPU too, for a sharded array)."""
  copies = Copies()
  staged = [
    (
      i,
      data
      if isinstance(data, np.ndarray) or me != 0
      else Staged.of(data, copies.at(records[i].path)),
    )
    for i, data in inline
  ]
  copies.wait()
  for i, data in staged:
    raw = (
      b""
      if me != 0
      else _leaves.host_bytes(data)
      if isinstance(data, np.ndarray)
      else data.raw().tobytes()
    )
    records[i] = _records.evolve(records[i], inline=raw)


def _candidates(
  base: _Base | None, records: list[_records.Leaf], meshes: list[np.ndarray]
) -> _refs.Candidates:
  """The leaves that may reuse the base's data; (process 0) one warning for those that cannot
  because their layout differs (``(key path, why)``)."""
  if base is None:
    return _refs.Candidates()
  reusable = base.candidates(records, meshes)
  leaves = reusable.not_compared
  if not leaves or jax.process_index() != 0:
    return reusable
  where, why = leaves[0]
  more = f" (and {len(leaves) - 1} more leaves)" if len(leaves) > 1 else ""
  warnings.warn(
    f"save(base={base.where!r}): {where}{more} cannot reuse the base's data: {why}. Such "
    "leaves are written in full; save with the same settings and shardings as the base to "
    "write only what changed.",
    RuntimeWarning,
    stacklevel=5,
  )
  return reusable


def _assign_packs(
  records: list[_records.Leaf],
  candidates,
  data_dir: str,
  nproc: int,
  me: int,
  regions: dict[int, int],
) -> tuple[tuple[_records.Pack, ...], list]:
  """Every process's pack (for the manifest; each candidate's record in ``records`` replaced
  by one with its ``packed``) and the (record index, data) this process packs. ``regions``:
  each process's pieces bytes."""
  plan = _packing.assign(
    [c[2] for c in candidates],
    nproc,
    extra=regions,
    chunk_bytes=_pieces.PACK_CHUNK_BYTES if regions else _packing.PACK_CHUNK_BYTES,
  )
  packs: list[_records.Pack] = []
  index_of = {}
  for p, (nbytes, chunk, inner) in sorted(plan.sizes.items()):
    index_of[p] = len(packs)
    packs.append(
      _records.Pack(
        f"{data_dir}/p/{p}",
        nbytes,
        chunk,
        inner,
        None,
        *((p, plan.pieces[p]) if regions else (None, None)),
      )
    )
  packed = []
  for i, data, item in candidates:
    p, offset = plan.where[i]
    records[i] = _records.evolve(
      records[i], packed=_records.Packed(index_of[p], offset, item.nbytes)
    )
    if p == me:
      packed.append((i, data))
  return tuple(packs), packed


def _zarr_array(
  i: int, rec: _records.Leaf, data, kv_spec, data_dir: str, codecs: _arrays.Codecs
) -> _Array:
  """A large leaf's zarr array (its record with ``stored``) and the chunks this process
  writes: planned from the sharding's structure (O(local devices), cached), ``salt=i``
  spreading replicated leaves' writes over processes."""
  dtype, shape = np.dtype(data.dtype), tuple(data.shape)
  if isinstance(data, np.ndarray):
    whole = tuple((0, n) for n in shape)
    chunks = _chunks.chunk_shape(shape, 1, dtype.itemsize)
    units = [_chunks.WriteUnit(whole, "host", whole)] if jax.process_index() == 0 else []
  else:
    chunks, units = _chunks.plan_write(data.sharding, shape, dtype.itemsize, salt=i)
  inner = _chunks.inner_chunk_shape(chunks, dtype.itemsize)
  stored = _records.Stored(
    f"{data_dir}/a/{i}", tuple(int(c) for c in chunks), tuple(int(c) for c in inner), *codecs
  )
  units = units if _chunks.nbytes(shape, 1) else []
  return _Array(
    i,
    _records.evolve(rec, stored=stored),
    data,
    _arrays.zarr_spec(kv_spec, stored, cast(str, rec.dtype), shape),
    units,
  )


def save(
  tree: Any,
  path: str,
  *,
  overwrite: bool = False,
  metadata: Any = None,
  budget_bytes: int | None = None,
  inline_bytes: int = INLINE_BYTES,
  pack_bytes: int = _packing.PACK_LEAF_BYTES,
  compression: str | None = None,
  zstd: int | None = None,
  barrier_timeout_s: float = _commit.DEFAULT_BARRIER_TIMEOUT_S,
  storage_options: dict[str, Any] | None = None,
  base: str | None = None,
) -> SaveHandle:
  """Save a pytree to ``path``; return once its arrays are copied off the devices.

  Writing and committing continue in the background: ``handle.wait()`` (or
  :func:`fnckpt.wait`) blocks until the checkpoint is committed and raises any error. Once
  ``save`` returns, the caller may delete, donate or overwrite the arrays it passed. With
  several processes (``jax.distributed``), every process calls ``save`` with the same global
  tree; each writes only the chunks it owns. Saves to one location from one process run one
  after another, never mixed.

  Args:
    tree: any pytree of jax/numpy arrays, scalars, strings, PRNG keys, ... (see
      docs/concepts/saving.md).
    path: a local path, ``file://``, ``memory://``, ``gs://`` or ``s3://`` location.
    overwrite: replace an existing checkpoint (or interrupted save) at ``path``.
    metadata: small msgpack-able user data stored in the manifest.
    budget_bytes: host bytes this process may hold for pending saves before ``save`` waits
      for the writes to drain (default: a quarter of available memory).
    inline_bytes: arrays up to this size go inside the manifest instead of their own files.
    pack_bytes: larger arrays up to this size that this process sees whole share one packed
      array per process (fewer, larger files); 0 gives each its own zarr array. Device
      shards of up to 1 MiB of sharded arrays also go into the packs, as *pieces* (format
      spec, "Pieces"), unless ``pack_bytes`` is 0 or the save compresses (packs are not compressed:
      with ``compression=`` such shards are compressed zarr arrays).
    compression: compress the chunks of arrays stored on their own (not inline or packed):
      ``"blosc"`` (lz4 with bit shuffling: 1.2x smaller on Adam-trained state for little CPU,
      docs/performance.md, "Compression"), ``"zstd"`` or ``"zstd:<level>"``; default: none.
    zstd: short for ``compression="zstd:<zstd>"``.
    barrier_timeout_s: deadline of each cross-process barrier.
    storage_options: settings for ``gs://``/``s3://`` (endpoint, region, concurrency, ...).
    base: another committed checkpoint on the same storage (e.g. the previous step): what
      equals the base's data (by content hash: every save records the XXH3-128 of what it
      stores, in the background) is not written again; the new checkpoint refers to the
      base's data instead. The base must outlive it (the manager's retention keeps
      referenced data; see docs/guides/incremental.md). The base may also be a
      save still in flight in this process: this save then refers to it once it commits
      (its writer waits for it, not the caller), or, if it fails, is written in full.

  >>> import jax.numpy as jnp, fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> h = fnckpt.save({"w": jnp.ones((256, 256)), "step": 1}, f"{d}/ckpt")
  >>> _ = h.wait()
  >>> fnckpt.restore(f"{d}/ckpt")["step"]
  1
  >>> s = fnckpt.save({"w": jnp.ones((256, 256)), "step": 2}, f"{d}/next",
  ...                 base=f"{d}/ckpt").wait()
  >>> fnckpt.restore(f"{d}/next")["step"], s.bytes_reused  # "w" is the base's
  (2, 262144)
  """
  where = _paths.Location.of(path, storage_options)
  options = SaveOptions(
    overwrite=overwrite,
    budget_bytes=budget_bytes,
    inline_bytes=inline_bytes,
    pack_bytes=pack_bytes,
    compression=compression,
    zstd=zstd,
    barrier_timeout_s=barrier_timeout_s,
  )
  return start(tree, where, options, metadata=metadata, base=base)


def start(
  tree: Any,
  where: _paths.Location | str,
  options: SaveOptions | None = None,
  *,
  metadata: Any = None,
  base: str | None = None,
  barrier_location: str | None = None,
  base_state: _pending.BaseState = _pending.LookUp(),
) -> SaveHandle:
  """:func:`save` of ``tree`` to ``where`` as ``options`` ask (their defaults: None), with
  ``metadata`` and ``base`` (a path on the same storage, with the same options);
  ``barrier_location`` (the manager's local tier): the name the processes' barriers are keyed
  on instead of the path, for per-host paths that differ between processes. ``base_state``:
  whether ``base`` is a save in flight (:data:`fnckpt._save.pending.BaseState`; by default
  this process's saves say, process 0's word)."""
  t0 = time.perf_counter()
  where = _paths.Location.of(where)
  options = options if options is not None else SaveOptions()
  location = where.display
  handle = begin(location)  # (once the save before it to this location has finished)
  writer: Writer | None
  session, writer, phase = None, None, "planning"
  key = _paths.display(barrier_location) if barrier_location else location
  try:
    # The session first: from here on any failure is published to the other processes (and
    # every process counts this attempt, so the next one pairs up again).
    session = _collective.Session(key, options.barrier_timeout_s)
    if metadata is not None:
      _manifest.check_msgpackable(metadata, "save(metadata=...)")
    opened = _paths.resolve(where)
    kv_spec, ctx, kv = opened
    data_dir = f"{_manifest.DATA_PREFIX}{session.nonce}"
    phase = "reading the base checkpoint"
    based = _base_of(base, base_state, session, where, kv_spec)
    phase = "planning"
    with _state.collector.paused():  # (the caller waits: docs/performance.md)
      plan = _plan(_tree.flatten(tree)[0], kv_spec, data_dir, options, based)
    handle.planned = plan.records  # (a later save's base, while in flight)
    _agree(session, plan.records, plan.holders)
    phase = "checking the location"
    _prepare_location(kv, location, options.overwrite, session, handle)
    budget = _process_budget(
      _arrays.budget_arg(options.budget_bytes, "save", default_budget_bytes())
    )
    writer = Writer(
      location,
      session,
      budget,
      lambda p: _reached(key, p),
      lambda err: _done(handle, cast(Writer, writer), err, t0),
    )
    writer.delta = _delta.Delta(
      kv_spec,
      ctx,
      data_dir,
      jax.process_index(),
      budget.release,
      min(_packing.PACK_CHUNK_BYTES, max(budget.limit // 4, 1)),
      budget=budget,
    )
    _attach_pending(based, writer)
    writer.start()
    phase = "staging the arrays"
    _reached(key, "staging")
    with _state.collector.paused():
      commit = _stage_all(
        plan, opened, writer=writer, budget=budget, handle=handle, metadata=metadata, based=based
      )
  except BaseException as e:
    err = wrap(e, location, phase)
    if writer is not None:
      writer.abort(err)  # drains what was staged, publishes the error, walks the barriers
      writer.join()
    else:
      if session is not None:
        session.fail(err)
        _walk_in_background(session)
    handle._finish(err, committed=False, reported=True)
    if err is e:
      raise  # (its traceback and cause as they are)
    raise err from e
  writer.close(commit)
  _reached(key, "staged")
  handle.stats.blocking_s = time.perf_counter() - t0
  return handle


def _attach_pending(based: _Base | None, writer: Writer) -> None:
  """A base in flight: its holding of items goes into the writer (before it starts)."""
  if based is not None and based.pending is not None:
    writer.pending = based.pending
    based.pending.attach(
      writer, lambda src: _Base(src.manifest, based.loc, based.new_loc, src).check
    )


def _base_of(
  base: Any, state: _pending.BaseState, session, where: _paths.Location, kv_spec: dict
) -> _Base | None:
  """The base of a save to ``where``: None, a save in flight in this process (``pending``),
  or a committed checkpoint."""
  if base is None:
    return None
  location = where.display
  pending = _pending.open_pending(base, state, session, kv_spec, where, location)
  if pending is not None:
    return _Base(None, pending.loc, pending.new_loc, None, pending)
  return _open_base(base, where, kv_spec)


def _open_base(base: Any, where: _paths.Location, kv_spec: dict) -> _Base:
  """The committed checkpoint ``base`` (on the same storage as the new one, ``where``)."""
  location = where.display
  if not isinstance(base, (str, os.PathLike)):
    raise CheckpointError(
      f"save(base={base!r}): expected the location of a committed "
      "checkpoint (a str), e.g. the previous step's path."
    )
  src = _source.open_source(_paths.Location.of(base, where.options))
  loc, new_loc = _refs.locate(src.kv_spec), _refs.locate(kv_spec)
  if loc.store != new_loc.store or loc.path == new_loc.path:
    raise CheckpointError(
      f"save(base={src.location!r}) to {location!r}: the base must be another checkpoint "
      "on the same storage (same scheme, bucket and options) as the new one. Save without "
      "base=, or pick a base beside the new checkpoint."
    )
  if not _refs.comparable(src.manifest):
    warnings.warn(
      f"save(base={src.location!r}): that checkpoint was written in fnckpt format "
      f"{src.manifest.version}, which records no XXH3-128 content hashes to compare with, so "
      f"this save to {location!r} writes everything (reading the base to compare would cost "
      "about as much as writing it). It records its hashes: the next save with it as base "
      "writes only what changed.",
      RuntimeWarning,
      stacklevel=5,
    )
  return _Base(src.manifest, loc, new_loc, src)


def _walk_in_background(session: _collective.Session) -> None:
  """A save that failed before its writer started still arrives at its remaining barriers."""

  def walk() -> None:
    session.abort()
    session.close()

  if session.multi:
    threading.Thread(target=walk, name="fnckpt-abort").start()


def _done(handle: SaveHandle, writer: Writer, error: BaseException | None, t0: float) -> None:
  if writer.aborted:
    return  # save() raises the staging error itself
  handle.stats.write_s, handle.stats.commit_s = writer.write_s, writer.commit_s
  d = writer.delta
  assert d is not None  # (set before the writer starts)
  handle.stats.bytes_reused = d.skipped_bytes - d.copied_bytes + d.reused_pack_bytes
  handle.stats.bytes_written += d.written_bytes + d.copied_bytes - d.skipped_bytes
  handle.stats.chunks_written += d.copied_chunks - d.skipped_chunks + d.written_chunks
  handle.stats.total_s = time.perf_counter() - t0
  handle._finish(error, writer.committed)


def _stage_all(
  plan: _Plan,
  opened: _paths.Opened,
  writer: Writer,
  budget,
  handle: SaveHandle,
  metadata: Any,
  based: _Base | None = None,
) -> Commit:
  """Stage this process's chunks and pack into the writer (to the ``opened`` location);
  return what committing needs."""
  kv_spec, ctx, kv = opened
  is_main = jax.process_index() == 0
  creating = (
    [
      _arrays.open_array(a.spec, ctx, mode="create")
      for a in plan.arrays
      if a.index not in plan.reusable.stored
    ]
    if is_main
    else []
  )  # (candidates: if changed)
  writing = [_arrays.open_array(a.spec, ctx, mode="write") for a in plan.arrays]
  _start_copies(plan, budget)
  copies = Copies()
  for a, fut in zip(plan.arrays, writing):
    _stage_array(
      a,
      fut,
      cand=plan.reusable.stored.get(a.index),
      writer=writer,
      budget=budget,
      handle=handle,
      copies=copies,
    )
  if plan.my_pack is not None:
    _stage_pack(plan, kv_spec, ctx, writer=writer, budget=budget, handle=handle, copies=copies)
  _stage_apart(plan, writer, budget, handle, copies)
  copies.wait()  # (every copy started above, waited for together)
  if plan.values is not None:
    creating.append(
      kv.write(_perprocess.values_key(plan.data_dir, jax.process_index()), plan.values)
    )
  maybe_stored = [a for a in plan.arrays if a.index in plan.reusable.stored]
  delta_plan = _delta.Plan(
    records=plan.records,
    packs=plan.packs,
    reusable=plan.reusable,
    store_specs={a.index: a.spec for a in maybe_stored},
    store_dirs={a.index: cast(_records.Stored, a.rec.stored).dir for a in maybe_stored},
    kv_spec=kv_spec,
    data_dir=plan.data_dir,
    build=(lambda records, packs, bases: _encode(plan, metadata, records, packs, bases))
    if is_main
    else None,
    check_base=based.check if based is not None else None,
    layout=plan.layout,
    regions=plan.regions,
  )
  pend = based.pending if based is not None else None
  return Commit(
    kv,
    lambda: _delta.conclude(
      writer.session,
      pend.complete(delta_plan) if pend is not None else delta_plan,
      cast(_delta.Delta, writer.delta),
      kv,
      ctx,
      writer.location,
    ),
    creating,
    is_main,
    _direct.local_root(kv_spec),
  )


def _encode(plan: _Plan, metadata: Any, records, packs, bases) -> bytes:
  """The manifest's bytes (in the writer thread, so the collector is not paused here: that
  would pause it for the caller's threads too, while nobody waits for this)."""
  return _manifest.encode(_manifest_record(plan, metadata, records, packs, bases))


def _stage_apart(plan: _Plan, writer: Writer, budget, handle: SaveHandle, copies: Copies) -> None:
  """The items that may equal the base's, each staged whole for the writer to hash and
  compare: packed leaves, and this process's runs of pieced leaves (their bytes count as
  written once written: ``_done``)."""
  me = jax.process_index()
  items: list[tuple[int, int, Callable[..., Staged | Run], bytes | None]] = [
    (
      i,
      _nbytes(data),
      lambda i=i, data=data: Staged.of(data, copies.at(plan.records[i].path)),
      plan.reusable.packed[i].hash,
    )
    for i, data in plan.maybe_packed
  ]
  for i, parts in plan.maybe_runs:
    run = plan.reusable.pieced[i].runs.get(me)
    items.append(
      (
        i,
        sum(p.nbytes for p in parts),
        lambda i=i, parts=parts: Run([p.make(copies.at(plan.records[i].path)) for p in parts]),
        run.hash if run is not None else None,
      )
    )
  for i, n, make, expect in items:
    try:
      staged = _charge(budget, CHUNK_COST * n, writer, make)
    except BaseException as e:
      raise _at(e, plan.records[i].path)  # noqa: B904
    handle.stats.peak_staged_bytes = max(handle.stats.peak_staged_bytes, budget.held)
    writer.put(_delta.PackLeaf(i, staged, CHUNK_COST * n, expect))


def _skeleton(rec: _records.Leaf) -> bytes:
  """What every process must agree on for one leaf: the record without its values."""
  keep = _records.encode(rec)
  for k in ("value", "pack", "subtype"):
    keep.pop(k, None)
  if "inline" in keep:
    keep["inline"] = True
  return msgpack.packb(keep, use_bin_type=True)


def _agree(
  session: _collective.Session, records: tuple[_records.Leaf, ...], holders: list[str | None]
) -> None:
  """Every process saves the same tree (key paths, kinds, shapes, dtypes, shardings, what is
  inline): compare each leaf's digest with process 0's; a difference fails every process,
  naming the first differing key path (save() publishes the error; the others raise it at the
  'agreed' barrier)."""
  if not session.multi:
    return
  mine = [
    (
      r.where,
      hashlib.sha256(_skeleton(r) + str(h).encode()).hexdigest()[:16],
      _brief(r) + (f" ({_HELD[h]})" if h else ""),
    )
    for r, h in zip(records, holders)
  ]
  shared = session.share("tree", zlib.compress(msgpack.packb(mine), 1))
  theirs = [tuple(x) for x in msgpack.unpackb(zlib.decompress(shared), use_list=False)]
  if [m[:2] for m in mine] != [t[:2] for t in theirs]:
    raise CheckpointError(_disagreement(session.location, mine, theirs))
  session.barrier("agreed")


_HELD = {
  "host": "numpy",
  "local": "on this process only",
  "all": "on every process",
  "some": "on some processes",
}


def _brief(rec: _records.Leaf) -> str:
  """A leaf as a disagreement shows it, e.g. ``jax float32[64, 128] P('x', None) on mesh
  {'x': 2, 'y': 4}``."""
  parts = [rec.source or rec.kind] + ([rec.type] if rec.type is not None else [])
  if rec.dtype is not None:
    parts.append(f"{rec.dtype}{list(rec.shape)}" if rec.shape is not None else rec.dtype)
  sharding = rec.sharding
  if sharding is not None and sharding.type == "named":
    spec = ", ".join(repr(e) for e in sharding.spec)
    parts.append(f"P({spec}) on mesh {dict(zip(sharding.axes, sharding.sizes))}")
  elif sharding is not None:
    parts.append(f"{sharding.type} sharding")
  return " ".join(map(str, parts))


def _disagreement(location: str, mine, theirs) -> str:
  """The first difference between this process's leaves and process 0's, each a (key path,
  digest, brief)."""
  me = jax.process_index()
  first = next(
    (i for i, (a, b) in enumerate(zip(mine, theirs)) if a[:2] != b[:2]), min(len(mine), len(theirs))
  )
  a = mine[first] if first < len(mine) else None
  b = theirs[first] if first < len(theirs) else None
  if a is not None and b is not None and a[0] == b[0]:
    what = (
      f"the leaf at {a[0]} is {a[2]} on process {me} but {b[2]} on process 0"
      if a[2] != b[2]
      else f"the leaf at {a[0]} ({a[2]}) is stored differently on "
      f"process {me} than on process 0 (what is inline, or the chunk layout)"
    )
  elif b is not None and b[0] not in {m[0] for m in mine}:
    what = f"process 0 has a leaf at {b[0]} ({b[2]}) that process {me} lacks" + (
      f" (it has {a[0]} there)" if a is not None else ""
    )
  elif a is not None and a[0] not in {t[0] for t in theirs}:
    what = f"process {me} has a leaf at {a[0]} ({a[2]}) that process 0 lacks" + (
      f" (it has {b[0]} there)" if b is not None else ""
    )
  else:
    what = (
      f"leaf #{first} is {a[0] if a else '<none>'} on process {me} but "
      f"{b[0] if b else '<none>'} on process 0 (the same keys in another order)"
    )
  return (
    f"Saving to {location!r}: processes {me} and 0 passed different trees: {what}. "
    "Every process must pass the same tree structure, shapes, dtypes and shardings to "
    "save (values of non-global leaves may differ; process 0's are kept; wrap "
    "per-process values in fnckpt.PerProcess). Nothing was written."
  )


def _manifest_record(
  plan: _Plan,
  metadata,
  records: tuple[_records.Leaf, ...],
  packs: tuple[_records.Pack, ...],
  bases: tuple[_records.Base, ...],
) -> _records.Manifest:
  """The manifest of a save: its final leaf records, packs and bases (``_refs.finalize``)."""
  return _records.Manifest(
    version=_manifest.FORMAT_VERSION,
    created=time.time(),
    process_count=jax.process_count(),
    versions={"fnckpt": __version__, "jax": jax.__version__, "tensorstore": _tensorstore_version()},
    metadata=metadata,
    leaves=records,
    data=plan.data_dir,
    packs=packs,
    bases=bases,
    fork=None,
    meshes=plan.meshes,
    layout=plan.layout,
    hash=_hashes.ALG,
  )


@_state.memo(1)
def _tensorstore_version() -> str:
  """The installed TensorStore's version (read once: 5 ms of package metadata per save)."""
  from importlib import metadata as importlib_metadata

  try:
    return importlib_metadata.version("tensorstore")
  except importlib_metadata.PackageNotFoundError:
    return "unknown"


def _is_ours(key: str) -> bool:
  """Keys a checkpoint (of format 1 or 2) consists of."""
  if key in (_manifest.COMMIT, _manifest.MANIFEST) or key.startswith(_manifest.DATA_DIR + "/"):
    return True
  return re.match(_manifest.DATA_PREFIX + r"[0-9a-f]{32}/", key) is not None


def _prepare_location(
  kv: ts.KvStore, location: str, overwrite: bool, session: _collective.Session, handle: SaveHandle
) -> None:
  """Refuse to clobber a checkpoint unless asked; when asked, hide it (marker first) and clear
  it before any new byte lands (new data goes to this save's own directory anyway)."""
  # an I/O error here is wrapped by save(): "Saving to ... failed while checking the location"
  committed = _commit.is_committed(kv)
  keys = [k.decode("utf-8", "replace") for k in kv.list().result()]
  foreign = [k for k in keys if not _is_ours(k)]
  if foreign:
    raise CheckpointError(
      f"{location!r} holds files that are not part of an fnckpt checkpoint (e.g. "
      f"{sorted(foreign)[0]!r}); fnckpt will not write there, even with overwrite=True, so "
      "that nothing of yours is deleted. Save to a new or empty path."
    )
  leftovers = committed or bool(keys)
  if leftovers and not overwrite:
    what = "A checkpoint" if committed else "An interrupted save (uncommitted data)"
    raise CheckpointError(
      f"{what} already exists at {location!r}. Pass overwrite=True to replace it, or save "
      "to a new path."
    )
  # Every process must have looked before any of them writes (or deletes): else a fast
  # process 0 creating files makes a slow one see "an interrupted save" and give up.
  session.barrier("checked")
  handle.replaced = leftovers  # (every process: an error from here on must say so)
  if leftovers and jax.process_index() == 0:
    _paths.clear(kv, first=(_manifest.COMMIT,))
  session.barrier("cleared")
