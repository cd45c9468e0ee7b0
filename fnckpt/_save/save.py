"""save() and ``start``: open the base -> plan (``plan``, pure) -> agree across processes ->
check the location -> stage off the devices (under a host-memory budget, ``staging``) ->
background write (``writer``) -> barrier -> manifest -> barrier -> commit marker; a failure
aborts the writer and walks the barriers. The caller's handle, ``fnckpt.wait()`` and the
pending saves are ``handle``'s."""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
import warnings
from typing import Any, Callable, cast

import jax
import tensorstore as ts

from .. import _state
from .._errors import CheckpointError
from .._format import hashes as _hashes
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
from .._layout import packing as _packing
from .._sources import source as _source
from .._version import __version__
from . import agreement as _agreement
from . import delta as _delta
from . import pending as _pending
from . import plan as _plan
from . import plan_cache as _plan_cache
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
  key = _paths.display(barrier_location) if barrier_location else location
  run = _Attempt(handle, location, key, t0)
  try:
    # The session first: from here on any failure is published to the other processes (and
    # every process counts this attempt, so the next one pairs up again).
    run.session = session = _collective.Session(key, options.barrier_timeout_s)
    if metadata is not None:
      _manifest.check_msgpackable(metadata, "save(metadata=...)")
    opened = _paths.resolve(where)
    kv_spec, ctx, kv = opened
    data_dir = f"{_manifest.DATA_PREFIX}{session.nonce}"
    run.phase = "reading the base checkpoint"
    based = _base_of(base, base_state, session, where, kv_spec)
    run.phase = "planning"
    with _state.collector.paused():  # (the caller waits: docs/performance.md)
      plan = (
        _plan.plan(_tree.flatten(tree)[0], kv_spec, data_dir, options, based)  # (per base)
        if based is not None
        else _plan_cache.plan(tree, kv_spec, data_dir, options)
      )
    handle.planned = plan.records  # (a later save's base, while in flight)
    if session.multi:  # (one process: nothing to agree on, no entries made)
      _agreement.agree(session, _entries(plan))
    run.phase = "checking the location"
    _prepare_location(kv, location, options.overwrite, session, handle)
    writer = _start_writer(run, session, options, opened, data_dir, based)
    run.phase = "staging the arrays"
    _reached(key, "staging")
    with _state.collector.paused():
      commit = _stage_all(
        plan, opened, writer=writer, handle=handle, metadata=metadata, based=based
      )
  except BaseException as e:
    err = wrap(e, location, run.phase)
    _abandon(run, err)
    if err is e:
      raise  # (its traceback and cause as they are)
    raise err from e
  writer.close(commit)
  _reached(key, "staged")
  handle.stats.blocking_s = time.perf_counter() - t0
  return handle


@dataclasses.dataclass
class _Attempt:
  """A call of ``start`` as far as it got: the phase it is in (for the error's wording) and
  the session and writer once made (what a failure must abort)."""

  handle: SaveHandle
  location: str
  key: str  # what the barriers are keyed on
  t0: float
  phase: str = "planning"
  session: _collective.Session | None = None
  writer: Writer | None = None


def _start_writer(
  run: _Attempt,
  session: _collective.Session,
  options: SaveOptions,
  opened: _paths.Opened,
  data_dir: str,
  based: _Base | None,
) -> Writer:
  """The process's budget and the background writer (with its ``delta``, and the base in
  flight's items), started. ``run.writer`` as soon as it is made: a failure from then on
  aborts it."""
  kv_spec, ctx, _ = opened
  budget = _process_budget(_arrays.budget_arg(options.budget_bytes, "save", default_budget_bytes()))
  handle, key, t0 = run.handle, run.key, run.t0
  run.writer = writer = Writer(
    run.location,
    session,
    budget,
    lambda p: _reached(key, p),
    lambda err: _done(handle, writer, err, t0),
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
  return writer


def _abandon(run: _Attempt, err: BaseException) -> None:
  """A failed ``start``: abort the writer (it drains what was staged, publishes the error and
  walks the barriers), or without one publish the error and walk the barriers in the
  background; the handle fails with ``err``."""
  if run.writer is not None:
    run.writer.abort(err)
    run.writer.join()
  else:
    if run.session is not None:
      run.session.fail(err)
      _walk_in_background(run.session)
  run.handle._finish(err, committed=False, reported=True)


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
  plan: _plan.Plan,
  opened: _paths.Opened,
  writer: Writer,
  handle: SaveHandle,
  metadata: Any,
  based: _Base | None = None,
) -> Commit:
  """Stage this process's chunks and pack into the writer (to the ``opened`` location), under
  its budget; return what committing needs."""
  kv_spec, ctx, kv = opened
  budget = writer.budget
  is_main = jax.process_index() == 0
  made = (
    {
      a.index: _arrays.open_array(a.spec, ctx, mode="create")
      for a in plan.arrays
      if a.index not in plan.reusable.stored
    }
    if is_main
    else {}
  )  # (candidates: if changed); each also the handle that writes its chunks (one open)
  creating = list(made.values())
  writing = [
    made[a.index] if a.index in made else _arrays.open_array(a.spec, ctx, mode="write")
    for a in plan.arrays
  ]
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
  return _commit_of(plan, opened, writer, creating, metadata, based)


def _commit_of(
  plan: _plan.Plan,
  opened: _paths.Opened,
  writer: Writer,
  creating: list,
  metadata: Any,
  based: _Base | None,
) -> Commit:
  """What committing a staged save needs: the files process 0 creates (``creating``) and
  concluding it (``delta.conclude``: the hashes compared, the manifest written by process 0)."""
  kv_spec, ctx, kv = opened
  is_main = jax.process_index() == 0
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


def _encode(plan: _plan.Plan, metadata: Any, records, packs, bases) -> bytes:
  """The manifest's bytes (in the writer thread, so the collector is not paused here: that
  would pause it for the caller's threads too, while nobody waits for this)."""
  return _manifest.encode(_manifest_record(plan, metadata, records, packs, bases))


def _stage_apart(
  plan: _plan.Plan, writer: Writer, budget, handle: SaveHandle, copies: Copies
) -> None:
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


def _entries(plan: _plan.Plan) -> list[_agreement.Entry]:
  """What this process's plan says the processes must agree on (a reused plan carries it)."""
  if plan.agreement is not None:
    return plan.agreement
  return _agreement.entries(plan.records, plan.holders, plan.data_dir)


def _manifest_record(
  plan: _plan.Plan,
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
