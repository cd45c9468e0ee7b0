"""save(): plan -> stage off the devices (under a host-memory budget) -> background write ->
barrier -> manifest -> barrier -> commit marker. The handle; waiting for pending saves."""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import re
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from . import _commit, _layout, _leaves, _manifest, _paths, _store, _tree
from ._errors import CheckpointError

__all__ = ["save", "wait", "SaveHandle", "SaveStats"]

# Arrays of at most this many bytes are stored inside the manifest (no files of their own).
INLINE_BYTES = 16 << 10

# Host bytes a chunk of n bytes costs, in units of n, from staging until it is durable: the
# staged buffer (on CPU a view that keeps the device buffer alive even if the caller donates
# it), which the writer thread drops once TensorStore has copied it into its transaction,
# then that copy plus the encoded chunk being written (measured: about 2n at the peak of a
# chunk's write). The budget charges this, so that RSS, not just staging, stays under it.
CHUNK_COST = 2


def default_budget_bytes() -> int:
  """A quarter of the memory available now (at least 256 MiB)."""
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    available = int(info["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  return max(256 << 20, available // 4)


def _phase(name: str) -> None:
  """Called as a save passes each phase ("staging", "staged", "written", "manifest",
  "committing", "committed"). A no-op; fault-injection tests replace it in a child process
  to stop or kill the save at an exact instant."""
  del name


def _reached(location: str, name: str) -> None:
  """A save on this process reached phase ``name``: tell the other processes (for barrier
  timeout messages), then call the test hook."""
  _commit.report(location, name)
  _phase(name)


_budget_lock = threading.Lock()
_budget: _store.ByteBudget | None = None
_pending: set["SaveHandle"] = set()
_pending_lock = threading.Lock()


def _process_budget(limit: int) -> _store.ByteBudget:
  """One budget per process, shared by overlapping saves; its limit is the latest asked."""
  global _budget
  with _budget_lock:
    if _budget is None:
      _budget = _store.ByteBudget(limit)
    _budget.limit = limit
    return _budget


@dataclasses.dataclass
class SaveStats:
  """What one save did on this process. Seconds are wall-clock."""
  blocking_s: float = 0.0      # time save() held the caller
  write_s: float = 0.0         # from the first chunk write until all chunks are durable
  commit_s: float = 0.0        # barriers, manifest and commit marker
  total_s: float = 0.0         # from the call until committed
  bytes_written: int = 0       # array bytes this process wrote (chunks and inline values)
  chunks_written: int = 0
  peak_staged_bytes: int = 0   # the most host bytes held for this process's pending saves
                               # (as charged to the budget: CHUNK_COST x each chunk in flight)


class SaveHandle:
  """A save in flight. ``wait()`` blocks until the checkpoint is committed and re-raises any
  error; ``done()`` polls; ``stats`` says what happened."""

  def __init__(self, location: str):
    self.location = location
    self.stats = SaveStats()
    self._event = threading.Event()
    self._error: BaseException | None = None
    self._writer_error: BaseException | None = None   # set by the writer thread
    self._aborted = False                             # staging failed: commit nothing
    # The writer starts once staging is done, or earlier when the budget is full: writing
    # while the caller is still blocked would only compete with its copies.
    self._drain = threading.Event()
    self._thread: threading.Thread | None = None

  def done(self) -> bool:
    """Whether the save has finished (committed or failed); never blocks."""
    return self._event.is_set()

  def wait(self, timeout: float | None = None) -> SaveStats:
    """Block until committed (or ``timeout`` seconds); raise the save's error if it failed."""
    if not self._event.wait(timeout):
      raise TimeoutError(f"The save to {self.location!r} is still running after {timeout}s.")
    with _pending_lock:  # a failed save stays pending until its error has been raised once
      _pending.discard(self)
    if self._error is not None:
      raise self._error
    return self.stats

  def __repr__(self) -> str:
    state = "failed" if self._error else "committed" if self.done() else "pending"
    return f"SaveHandle({self.location!r}, {state})"


def wait() -> None:
  """Wait for every pending save of this process; raise the first error (also of saves
  that failed earlier in the background and whose error nobody has seen yet).

  >>> import fnckpt
  >>> fnckpt.wait()  # nothing pending: returns at once
  """
  with _pending_lock:
    handles = list(_pending)
  errors = []
  for h in handles:
    try:
      h.wait()
    except BaseException as e:  # collect all, raise the first
      errors.append(e)
  if errors:
    raise errors[0]


@atexit.register
def _finish_at_exit() -> None:
  """Saves still running finish before the interpreter exits (their thread is not a daemon,
  so Python joins it before running this); failures nobody waited for are reported here."""
  with _pending_lock:
    handles = list(_pending)
  for h in handles:
    try:
      h.wait()
    except BaseException as e:
      print(f"fnckpt: at interpreter exit: the save to {h.location!r} failed and was not "
            f"committed: {e}", file=sys.stderr)


@dataclasses.dataclass
class _Array:
  rec: dict[str, Any]
  data: Any                      # jax.Array or np.ndarray holding the bytes
  spec: dict[str, Any]
  units: list[_layout.WriteUnit]


def _plan(leaves, kv_spec: dict, inline_bytes: int, zstd: int | None):
  """Leaf records for the manifest and the arrays this process writes (pure but for jax
  sharding queries)."""
  records, arrays, problems = [], [], []
  is_main = jax.process_index() == 0
  for i, (path, leaf) in enumerate(leaves):
    try:
      rec, data = _leaves.encode_leaf(path, leaf)
    except CheckpointError as e:
      problems.append(str(e))
      continue
    records.append(rec)
    if data is None:
      continue
    if isinstance(data, jax.Array) and data.is_deleted():
      problems.append(f"The array at {_tree.keystr(path)} was deleted (or donated) before save; "
                      "save the state before the step that donates it.")
      continue
    dtype = np.dtype(data.dtype)
    shape = tuple(data.shape)
    size = _layout.nbytes(shape, dtype.itemsize)
    visible = isinstance(data, np.ndarray) or data.is_fully_addressable or data.is_fully_replicated
    if size <= inline_bytes and visible:
      value = b""
      if is_main:
        host = data if isinstance(data, np.ndarray) else _leaves.host_value(data)
        value = _leaves.to_little_endian(np.ascontiguousarray(host)).tobytes()
      rec["inline"] = value
      continue
    if isinstance(data, np.ndarray):
      shards = {"host": tuple((0, n) for n in shape)}
      local = ["host"] if is_main else []
      shard_shape, replicas = shape, 1
    else:
      shards = {d: _layout.normalize_index(idx, shape)
                for d, idx in data.sharding.devices_indices_map(shape).items()}
      local = data.sharding.addressable_devices
      shard_shape = data.sharding.shard_shape(shape)
      replicas = _layout.replica_count(shards)
    chunks = _layout.chunk_shape(shard_shape, replicas, dtype.itemsize)
    inner = _layout.inner_chunk_shape(chunks, dtype.itemsize)
    rec["store"] = _store.store_record(f"{_manifest.DATA_DIR}/{i}", chunks, inner, zstd)
    units = _layout.write_plan(shards, local, chunks) if size else []
    arrays.append(_Array(rec, data, _store.zarr_spec(kv_spec, rec["store"], rec["dtype"], shape),
                         units))
  if problems:
    raise CheckpointError("Cannot save this tree:\n  " + "\n  ".join(problems))
  return records, arrays


def _stage(data: Any, unit: _layout.WriteUnit, shard_data: Any) -> np.ndarray:
  """The unit's bytes on the host, safe from whatever the caller does next.

  - numpy leaves are copied (the caller may mutate them in place);
  - on an accelerator ``np.asarray`` *is* the device-to-host copy, into a new buffer;
  - on CPU ``np.asarray`` is a view that holds the device buffer: donating or deleting the
    array then leaves that buffer alone (JAX allocates anew), so no copy is needed and the
    caller is blocked for nothing but bookkeeping.
  """
  local = tuple(slice(a, b) for a, b in unit.local)
  if isinstance(data, np.ndarray):
    return np.array(data[local], copy=True)
  whole = shard_data.shape == tuple(b - a for a, b in unit.local)
  if next(iter(shard_data.devices())).platform == "cpu":
    view = np.asarray(shard_data)
    return view if whole else view[local]
  return np.asarray(shard_data if whole else shard_data[local])


_END = object()


def save(tree: Any, path: str, *, overwrite: bool = False, metadata: Any = None,
         budget_bytes: int | None = None, inline_bytes: int = INLINE_BYTES,
         zstd: int | None = None, barrier_timeout_s: float = _commit.DEFAULT_BARRIER_TIMEOUT_S,
         storage_options: dict[str, Any] | None = None) -> SaveHandle:
  """Save a pytree to ``path``; return once its arrays are copied off the devices.

  Writing and committing continue in the background: ``handle.wait()`` (or
  :func:`fnckpt.wait`) blocks until the checkpoint is committed and raises any error. Once
  ``save`` returns, the caller may delete, donate or overwrite the arrays it passed. With
  several processes (``jax.distributed``), every process calls ``save`` with its part of the
  same global tree; each writes only the chunks it owns.

  Args:
    tree: any pytree of jax/numpy arrays, scalars, strings, PRNG keys, ... (see README).
    path: a local path, ``file://``, ``memory://``, ``gs://`` or ``s3://`` location.
    overwrite: replace an existing checkpoint (or interrupted save) at ``path``.
    metadata: small msgpack-able user data stored in the manifest.
    budget_bytes: host bytes this process may hold for pending saves before ``save`` waits
      for the writes to drain (default: a quarter of available memory).
    inline_bytes: arrays up to this size go inside the manifest instead of their own files.
    zstd: compress chunks with zstd at this level (default: no compression).
    barrier_timeout_s: deadline of each cross-process barrier.
    storage_options: settings for ``gs://``/``s3://`` (endpoint, region, concurrency, ...).

  >>> import jax.numpy as jnp, fnckpt, tempfile
  >>> d = tempfile.mkdtemp()
  >>> h = fnckpt.save({"w": jnp.ones((4, 4)), "step": 1}, f"{d}/ckpt")
  >>> _ = h.wait()
  >>> fnckpt.restore(f"{d}/ckpt")["step"]
  1
  """
  t0 = time.perf_counter()
  location = _paths.display(path)
  if metadata is not None:
    _manifest.check_msgpackable(metadata, "save(metadata=...)")
  kv_spec, ctx, kv = _paths.resolve(path, storage_options)
  leaves, _ = _tree.flatten(tree)
  records, arrays = _plan(leaves, kv_spec, inline_bytes, zstd)
  with _pending_lock:  # an earlier save to this location still writing: let it finish first
    earlier = [h for h in _pending if h.location == location and not h.done()]
  for h in earlier:
    h._event.wait()  # its error (if any) stays for its own handle / fnckpt.wait()
  try:
    _prepare_location(kv, location, overwrite, barrier_timeout_s)
  except Exception as e:  # TensorStore I/O errors, e.g. a file where the directory should be
    raise _wrap(e, location, "checking the location") from e

  handle = SaveHandle(location)
  budget = _process_budget(budget_bytes or default_budget_bytes())
  is_main = jax.process_index() == 0
  # process 0 writes the zarr.json of every array, concurrently with the data.
  creating = [_store.open_array(a.spec, ctx, mode="create") for a in arrays] if is_main else []
  opened = [_store.open_array(a.spec, ctx, mode="write") for a in arrays]
  manifest = _manifest_dict(records, metadata)
  # Staging (here) copies chunks off the devices; the writer thread hands them to TensorStore
  # as they arrive and then commits. The budget is released as each chunk becomes durable.
  chunks: queue.SimpleQueue = queue.SimpleQueue()
  handle._thread = threading.Thread(
      target=_finish, name=f"fnckpt-save:{location}",
      args=(handle, kv, creating, chunks, manifest, barrier_timeout_s, t0, budget))
  with _pending_lock:
    _pending.add(handle)
  handle._thread.start()
  _reached(location, "staging")
  where = "staging the arrays"
  try:
    for a, fut in zip(arrays, opened):
      where = f"staging {_tree.keystr(a.rec['path'])}"
      store = fut.result()
      shard_data = ({s.device: s.data for s in a.data.addressable_shards}
                    if isinstance(a.data, jax.Array) and a.units else {})
      itemsize = np.dtype(a.data.dtype).itemsize
      for unit in a.units:
        if handle._writer_error is not None:
          raise handle._writer_error
        n = _layout.nbytes([b - s for s, b in unit.index], itemsize)
        cost = CHUNK_COST * n
        # The budget is full: start the writer (it frees budget as chunks become durable).
        budget.acquire(cost, on_wait=handle._drain.set)
        try:
          host = _stage(a.data, unit, shard_data.get(unit.device))
        except BaseException:
          budget.release(cost)
          raise
        chunks.put((store, unit.index, host, cost))
        handle.stats.peak_staged_bytes = max(handle.stats.peak_staged_bytes, budget.held)
        handle.stats.bytes_written += n
        handle.stats.chunks_written += 1
  except BaseException as e:
    handle._aborted = True
    chunks.put(_END)
    handle._drain.set()
    handle._event.wait()  # the writer drains what was staged, commits nothing
    raise _wrap(e, location, where) from e
  chunks.put(_END)
  handle._drain.set()
  _reached(location, "staged")
  handle.stats.blocking_s = time.perf_counter() - t0
  return handle


def _manifest_dict(records, metadata) -> dict[str, Any]:
  from importlib import metadata as importlib_metadata
  from . import __version__
  try:
    ts_version = importlib_metadata.version("tensorstore")
  except importlib_metadata.PackageNotFoundError:
    ts_version = "unknown"
  return {"format": _manifest.FORMAT_NAME, "version": _manifest.FORMAT_VERSION,
          "created": time.time(), "process_count": jax.process_count(),
          "versions": {"fnckpt": __version__, "jax": jax.__version__,
                       "tensorstore": ts_version},
          "metadata": metadata, "leaves": records}


def _prepare_location(kv: ts.KvStore, location: str, overwrite: bool, timeout_s: float) -> None:
  """Refuse to clobber a checkpoint unless asked; when asked, hide it (marker first) and clear
  it before any new byte lands."""
  committed = _commit.is_committed(kv)
  keys = [k.decode("utf-8", "replace") for k in kv.list().result()]
  ours = (_manifest.COMMIT, _manifest.MANIFEST)
  foreign = [k for k in keys if k not in ours and not k.startswith(_manifest.DATA_DIR + "/")]
  if foreign:
    raise CheckpointError(
        f"{location!r} holds files that are not part of an fnckpt checkpoint (e.g. "
        f"{sorted(foreign)[0]!r}); fnckpt will not write there, even with overwrite=True, so "
        "that nothing of yours is deleted. Save to a new or empty path.")
  leftovers = committed or bool(keys)
  if leftovers and not overwrite:
    what = "A checkpoint" if committed else "An interrupted save (uncommitted data)"
    raise CheckpointError(
        f"{what} already exists at {location!r}. Pass overwrite=True to replace it, or save "
        "to a new path.")
  # Every process must have looked before any of them writes (or deletes): else a fast
  # process 0 creating files makes a slow one see "an interrupted save" and give up.
  _commit.barrier(location, "checked", timeout_s)
  if leftovers and jax.process_index() == 0:
    _paths.clear(kv, first=(_manifest.COMMIT,))
  if overwrite:
    _commit.barrier(location, "cleared", timeout_s)


def _write_chunks(handle: SaveHandle, chunks: queue.SimpleQueue, budget) -> list[ts.Future]:
  """Hand staged chunks to TensorStore until the end marker. After a failure, keep draining
  (releasing their budget) so that staging never waits on bytes nobody will free."""
  commits = []
  handle._drain.wait()
  while (item := chunks.get()) is not _END:
    store, index, host, n = item
    if handle._writer_error is not None or handle._aborted:
      budget.release(n)
      continue
    try:
      commit = _store.write_chunk(store, index, host)
    except BaseException as e:
      budget.release(n)
      handle._writer_error = e
      continue
    item = host = None  # TensorStore has its own copy: do not hold ours while waiting
    commit.add_done_callback(lambda _f, n=n: budget.release(n))
    commits.append(commit)
  return commits


def _finish(handle: SaveHandle, kv, creating, chunks, manifest, timeout_s, t0, budget) -> None:
  phase = "writing the arrays"
  try:
    t_write = time.perf_counter()
    commits = _write_chunks(handle, chunks, budget)
    for c in [*creating, *commits]:  # wait for every write, even after a failure
      try:
        c.result()
      except BaseException as e:
        handle._writer_error = handle._writer_error or e
    if handle._aborted:
      return
    if handle._writer_error is not None:
      raise handle._writer_error
    handle.stats.write_s = time.perf_counter() - t_write
    _reached(handle.location, "written")
    t_commit = time.perf_counter()
    manifest_bytes = _manifest.encode(manifest)
    if jax.process_index() == 0:
      phase = "writing the manifest"
      kv.write(_manifest.MANIFEST, manifest_bytes).result()
      _reached(handle.location, "manifest")
    phase = "waiting for every process to finish writing"
    _commit.barrier(handle.location, "written", timeout_s)
    _reached(handle.location, "committing")
    if jax.process_index() == 0:
      phase = "writing the commit marker"
      _commit.write_commit(kv, manifest_bytes)
    phase = "waiting for the commit"
    _commit.barrier(handle.location, "committed", timeout_s)
    handle.stats.commit_s = time.perf_counter() - t_commit
    handle.stats.total_s = time.perf_counter() - t0
    _reached(handle.location, "committed")
  except BaseException as e:
    handle._error = _wrap(e, handle.location, phase)
  finally:
    _commit.forget(handle.location)
    with _pending_lock:
      if handle._error is None:  # a failure stays until reported: wait() or at exit
        _pending.discard(handle)
    handle._event.set()


def _wrap(e: BaseException, location: str, phase: str) -> BaseException:
  if isinstance(e, CheckpointError):
    return e
  if not isinstance(e, Exception):
    return e
  text = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", _paths.redact(str(e)))  # noise
  hint = _paths.io_hint(e)
  return CheckpointError(
      f"Saving to {location!r} failed while {phase}: {type(e).__name__}: "
      f"{text}.{hint} Nothing was committed; earlier checkpoints are intact.")

