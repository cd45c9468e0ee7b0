"""The writer's half of content hashes and incremental saves (``save(base=...)``).

In the background writer thread, never on the caller's path: every save hashes every stored
chunk, packed leaf and pieces run it writes (XXH3-128, :mod:`fnckpt._format.hashes`); a chunk,
packed leaf or run that may reuse its base's data (:mod:`fnckpt._format.refs`) is hashed
*before* writing and not written when it equals the base's. Packed leaves and runs that may
reuse but changed go into this process's pack *segments* (packs laid out by the writer,
``<data>/q/<process>/<k>``). Then :func:`conclude` (collective): every process's
:class:`~fnckpt._format.refs.Report` goes to process 0, which decides which candidate leaves
changed (any process saw a changed chunk), shares that, and builds the manifest; each process
copies the base's chunks it skipped of a leaf that changed elsewhere (so every stored array
stays whole in one directory), and process 0 writes the ``zarr.json`` of those leaves.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import queue
import threading
from typing import Any, Callable

import msgpack
import numpy as np
import tensorstore as ts

from .._errors import CheckpointError
from .._format import hashes as _hashes
from .._format import manifest as _manifest
from .._format import records as _records
from .._format import refs as _refs
from .._io import arrays as _arrays
from .._io import collective as _collective
from .._io import direct as _direct
from .._layout import packing as _packing
from . import buffers as _buffers

__all__ = ["PackLeaf", "Delta", "Plan", "conclude"]


@dataclasses.dataclass
class PackLeaf:
  """A staged candidate packed leaf, or this process's run of a candidate pieced leaf
  (``staged``: an object with ``nbytes`` and ``raw()``); ``expect``: the base's hash, or None
  (this process wrote none of it in the base)."""

  leaf: int
  staged: Any
  cost: int
  expect: bytes | None


@dataclasses.dataclass
class Plan:
  """What concluding a save needs from its plan (see ``fnckpt._save.save``)."""

  records: tuple[_records.Leaf, ...]
  packs: tuple[_records.Pack, ...]
  reusable: _refs.Candidates
  store_specs: dict[int, dict[str, Any]]  # leaf -> its zarr spec (candidates)
  store_dirs: dict[int, str]  # leaf -> its own store dir (candidates)
  kv_spec: dict[str, Any]
  data_dir: str
  build: Callable[[tuple, tuple, tuple], bytes] | None  # process 0: records, packs, bases
  #                                                          (finalized) -> manifest bytes
  check_base: Callable[[], None] | None = None  # raises if the base is gone
  layout: Any = None  # the pieced leaves' writer rule (all of them)
  regions: Any = None  # the pieces regions of this save's own packs


# Threads hashing chunks beside the writer thread (xxhash releases the GIL from 64 KiB).
HASH_THREADS = max(2, min(8, os.cpu_count() or 2))


# Pack chunk files written at once (``_io.direct``: each thread waits for its disk write,
# the GIL released).
FILE_THREADS = 2


class _Workers:
  """``n`` threads running submitted calls in order of submission (each a
  ``concurrent.futures.Future``). Not ``ThreadPoolExecutor``: that refuses new work once the
  interpreter begins to exit, and a save still pending then must finish (fnckpt.wait at exit)."""

  def __init__(self, n: int, name: str):
    self._n, self._name = n, name
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._threads: list[threading.Thread] = []

  def submit(self, fn: Callable, *args: Any) -> concurrent.futures.Future:
    fut: concurrent.futures.Future = concurrent.futures.Future()
    self._queue.put((fut, fn, args))
    if len(self._threads) < self._n:
      t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
      try:
        t.start()
      except RuntimeError:  # Python 3.12.0-3.12.2 start no thread once the main thread has
        if not self._threads:  # returned: the caller (a save finishing at exit) runs them
          self._run(inline=True)
        return fut
      self._threads.append(t)
    return fut

  def _run(self, inline: bool = False) -> None:
    """Run submitted calls until told to stop (``inline``: until the queue is empty)."""
    while True:
      if inline:
        try:
          item = self._queue.get_nowait()
        except queue.Empty:
          return
      else:
        item = self._queue.get()
      if item is None:
        return
      fut, fn, args = item
      del item
      if fut.set_running_or_notify_cancel():
        try:
          result, error = fn(*args), None
        except BaseException as e:  # (handed to whoever waits on it)
          result, error = None, e
        del fn, args  # (a chunk's bytes: not held once its callbacks give its budget back)
        if error is None:
          fut.set_result(result)
        else:
          fut.set_exception(error)
        del result, error
      fut = fn = args = None  # (not held while waiting for the next)

  def shutdown(self) -> None:
    """Finish what was submitted, then stop the threads."""
    self.close()
    for t in self._threads:
      t.join()

  def close(self) -> None:
    """Take no more work: each thread ends once what was submitted is done (not waited for
    here: the submitted futures are)."""
    for _ in self._threads:
      self._queue.put(None)


class _Countdown:
  """Call ``fn`` once after ``n`` calls (from any threads)."""

  _fn: Callable[[], None] | None

  def __init__(self, n: int, fn: Callable[[], None]):
    self._n, self._fn, self._lock = n, fn, threading.Lock()

  def __call__(self) -> None:
    with self._lock:
      self._n -= 1
      fn = self._fn if self._n == 0 else None
      if fn is not None:
        self._fn = None  # (what it holds, e.g. a chunk's buffer, goes with it)
    if fn is not None:
      fn()


class Delta:
  """One save's hashing state in the writer thread."""

  def __init__(
    self,
    kv_spec: dict[str, Any],
    ctx: ts.Context,
    data_dir: str,
    me: int,
    release: Callable[[int], None],
    segment_bytes: int,
    budget: _arrays.ByteBudget | None = None,
  ):
    self.report = _refs.Report()
    self.skipped: list[tuple[int, int, int]] = []  # (leaf, chunk pos, bytes) not written
    self.skipped_bytes = 0
    self.copied_bytes = 0  # (array bytes, as skipped_bytes: of the chunks copied after all)
    self.copied_chunks = 0
    self.budget = budget  # copies of skipped chunks hold it while in flight
    self.written_bytes = 0  # (pack segments: bytes and chunks)
    self.written_chunks = 0
    self.reused_pack_bytes = 0
    self.skipped_chunks = 0
    self._kv_spec, self._ctx, self._dir, self._me = kv_spec, ctx, data_dir, me
    self._release = release
    self._limit = segment_bytes
    self._buffer: list[PackLeaf] = []
    self._hashers: dict[int, Any] = {}
    self._lock = threading.Lock()
    self._executor: _Workers | None = None
    self._ordered: _Workers | None = None
    self._files: _Workers | None = None
    self._closed: _Workers | None = None  # file threads told to end (:meth:`join`)
    self._jobs: list[concurrent.futures.Future] = []
    self._writes: list[ts.Future] = []
    self.check_base: Callable[[], None] | None = None  # set by conclude (process 0)

  @property
  def me(self) -> int:
    """This process's index."""
    return self._me

  # stored chunks ------------------------------------------------------------------------

  def chunk(
    self,
    leaf: int | None,
    pos: int,
    expect: bytes | None,
    nbytes: int,
    cost: int,
    host: np.ndarray,
    write: Callable[[], Any],
    spans: list[tuple[int, int, int]] | None = None,
    reuse: bool = False,
  ) -> None:
    """Write one staged chunk and hash it, on a small thread pool: a candidate's chunk is
    hashed first and written only if it differs from the base's; any other stored chunk is
    written at once and hashed meanwhile. Its budget ``cost`` is given back once it is both
    hashed and durable (or skipped). ``leaf`` None: a pack chunk, written at once while
    its ``spans`` (record, offset, bytes) are hashed in order on one more thread (a leaf's
    bytes may continue in the next chunk); ``reuse``: ``host`` (a pack chunk's buffer from
    ``buffers.take``) goes back to the pool once both are done: nothing reads it after."""
    if leaf is None:

      def after() -> None:
        self._release(cost)
        if reuse:
          _buffers.give(host)

      done = _Countdown(2 if spans else 1, after)
      if spans:  # (first: hashed while the write starts; a write that fails to start never
        #          counts down, so the buffer is not given back while the hashing reads it)
        self._jobs.append(self._in_order().submit(self._hash_spans, host, spans, done))
      self._track(write(), done)
      return
    if expect is None:
      done = _Countdown(2, lambda: self._release(cost))
      self._track(write(), done)
      self._jobs.append(self._pool().submit(self._hash_written, leaf, pos, host, done))
      return
    decide = functools.partial(
      self._decide,
      leaf=leaf,
      pos=pos,
      host=host,
      expect=expect,
      nbytes=nbytes,
      cost=cost,
      write=write,
    )
    self._jobs.append(self._pool().submit(decide))

  def _hash_written(self, leaf: int, pos: int, host: np.ndarray, done: Callable) -> None:
    try:
      h = _hashes.array_digest(host)
      with self._lock:
        self.report.chunks.setdefault(leaf, {})[pos] = h
    finally:
      done()

  def _decide(self, leaf, pos, host, expect, nbytes, cost, write) -> None:
    try:
      h = _hashes.array_digest(host)
    except BaseException:
      self._release(cost)
      raise
    with self._lock:
      self.report.chunks.setdefault(leaf, {})[pos] = h
      same = h == expect
      if same:
        self.skipped.append((leaf, pos, nbytes))
        self.skipped_bytes += nbytes
        self.skipped_chunks += 1
      else:
        self.report.changed.add(leaf)
    if same:
      self._release(cost)
      return
    self._track(write(), lambda: self._release(cost))

  def _track(self, fut: ts.Future, then: Callable[[], None]) -> None:
    """Wait for ``fut`` at the end (``settle``); call ``then`` once it is done."""
    fut.add_done_callback(lambda _f: then())
    with self._lock:
      self._writes.append(fut)

  def _pool(self) -> _Workers:
    if self._executor is None:
      self._executor = _Workers(HASH_THREADS, "fnckpt-hash")
    return self._executor

  def settle(self) -> list[ts.Future]:
    """Wait for every hashing job (raising the first failure); the writes started (those of
    pack chunk files may be in flight: their threads end once they are done)."""
    try:
      for job in self._jobs:
        job.result()
    finally:
      for pool in (self._executor, self._ordered):
        if pool is not None:
          pool.shutdown()
      if self._files is not None:
        self._files.close()
        self._closed = self._files
      self._executor = self._ordered = self._files = None
    with self._lock:
      return list(self._writes)

  def join(self) -> None:
    """Once every write is waited for: the file threads are gone too (a save leaves no
    thread behind it)."""
    closed, self._closed = self._closed, None
    if closed is not None:
      closed.shutdown()

  def started(self) -> list:
    """The writes started so far (those a failed :meth:`settle` did not return)."""
    with self._lock:
      return list(self._writes)

  def write_file(self, path: str, image: Any, buf: np.ndarray) -> concurrent.futures.Future:
    """Write a pack chunk's file assembled in ``buf`` (``_io.direct``): its checksums here,
    then the write on one of :data:`FILE_THREADS` threads; its future."""
    _direct.encode(buf, image)
    if self._files is None:
      self._files = _Workers(FILE_THREADS, "fnckpt-write")
    return self._files.submit(_direct.write_chunk, path, image, buf)

  def _hash_spans(
    self, host: np.ndarray, spans: list[tuple[int, int, int]], done: Callable[[], None]
  ) -> None:
    try:
      for i, offset, n in spans:
        self.hash_piece(i, host[offset : offset + n])
    finally:
      done()

  def _in_order(self) -> _Workers:
    """One thread hashing pack chunks' spans in the order they were written."""
    if self._ordered is None:
      self._ordered = _Workers(1, "fnckpt-hash-pack")
    return self._ordered

  def hash_piece(self, leaf: int, data: np.ndarray) -> None:
    """Bytes of a packed leaf, or of this process's run of a pieced leaf, in a (plan-laid)
    pack, in order."""
    if leaf not in self._hashers:
      self._hashers[leaf] = _hashes.hasher()
    self._hashers[leaf].update(memoryview(data))  # type: ignore[arg-type]  # (numpy's stubs)

  # pack segments ------------------------------------------------------------------------

  def pack_leaf(self, item: PackLeaf) -> list[ts.Future]:
    h = _hashes.digest(memoryview(item.staged.raw()))
    if h == item.expect:
      self.report.maybe[item.leaf] = (h, -1, 0)
      self.reused_pack_bytes += item.staged.nbytes
      self._release(item.cost)
      return []
    self.report.maybe[item.leaf] = (
      h,
      len(self.report.segments),
      sum(b.staged.nbytes for b in self._buffer),
    )
    self._buffer.append(item)
    if sum(b.staged.nbytes for b in self._buffer) >= self._limit:
      return self.flush()
    return []

  def finish(self) -> list[ts.Future]:
    """The queue is done: the last segment, and the hashes of the plan-laid packs' leaves."""
    for i, h in self._hashers.items():
      self.report.packed[i] = h.digest()
    self._hashers = {}
    return self.flush()

  def flush(self) -> list[ts.Future]:
    """Write the buffered changed packed leaves as one pack segment."""
    items, self._buffer = self._buffer, []
    if not items:
      return []
    n = sum(b.staged.nbytes for b in items)
    padded, chunk, inner = _packing.assign([_packing.PackItem(0, n, 0)], 1).sizes[0]
    k = len(self.report.segments)
    d = f"{self._dir}/q/{self._me}/{k}"
    spec = _arrays.pack_spec(self._kv_spec, d, padded, chunk, inner)
    try:
      store = _arrays.open_array(
        {**spec, "store_data_equal_to_fill_value": True}, self._ctx, mode="create"
      ).result()
    except BaseException:
      self._release(sum(b.cost for b in items))
      raise
    self.report.segments.append((d, padded, chunk, inner))
    futures = []
    for start in range(0, padded, chunk):
      end = min(start + chunk, padded)
      futures.append(_arrays.write_chunk(store, ((start, end),), _assemble(items, start, end)))
    self.written_bytes += padded
    self.written_chunks += len(futures)
    cost = sum(b.cost for b in items)
    left = [len(futures)]
    lock = threading.Lock()

    def done(_f: Any) -> None:
      with lock:
        left[0] -= 1
        last = left[0] == 0
      if last:
        self._release(cost)

    for f in futures:
      f.add_done_callback(done)
    return futures


def _assemble(items: list[PackLeaf], start: int, end: int) -> np.ndarray:
  buf = np.zeros(end - start, np.uint8)
  offset = 0
  for b in items:
    lo, hi = max(offset, start), min(offset + b.staged.nbytes, end)
    if lo < hi:
      buf[lo - start : hi - start] = b.staged.raw()[lo - offset : hi - offset]
    offset += b.staged.nbytes
  return buf


def conclude(
  session: _collective.Session,
  plan: Plan,
  delta: Delta,
  kv: ts.KvStore,
  ctx: ts.Context,
  location: str,
) -> bytes | None:
  """Once this process's chunks are hashed (collective; its writes may be in flight): share
  the reports, decide, copy skipped chunks of changed leaves, write their zarr.json; process 0
  returns the manifest, and sets ``delta.check_base`` (call it once every write is durable,
  before committing: it raises if the base is gone)."""
  gathered = session.gather("hashed", msgpack.packb(delta.report.to_msgpack(), use_bin_type=True))
  manifest: bytes | None = None
  changed: set[int] = set()
  if gathered is not None:  # process 0
    assert plan.build is not None  # (process 0's)
    reports = [_refs.Report.from_msgpack(_manifest.unpack(g)) for g in gathered]
    changed = _refs.changed_leaves(reports, plan.reusable.stored)
    records, packs, bases = _refs.finalize(
      records=plan.records,
      packs=plan.packs,
      reports=reports,
      reusable=plan.reusable,
      changed=changed,
      location=location,
      layout=plan.layout,
      regions=plan.regions,
    )
    manifest = plan.build(records, packs, bases)
  changed = set(msgpack.unpackb(session.share("changed", msgpack.packb(sorted(changed)))))
  futures = _copy_skipped(plan, delta, kv, ctx, changed)
  if gathered is not None:  # process 0 writes the zarr.json of every stored array
    futures += [
      _arrays.open_array(plan.store_specs[i], ctx, mode="create") for i in sorted(changed)
    ]
  for f in futures:
    f.result()
  delta.check_base = plan.check_base if manifest is not None else None  # (once written)
  return manifest


# Reads of the base's chunks in flight at most while copying them (each also holds its bytes
# of the save's budget until written).
COPY_WINDOW = 32


def _copy_skipped(
  plan: Plan, delta: Delta, kv: ts.KvStore, ctx: ts.Context, changed: set[int]
) -> list[ts.Future]:
  """The base's chunks this process skipped, of leaves that changed elsewhere: copied as
  stored (same chunk shape and codecs, so the encoded chunk is the same bytes). Reads go
  out concurrently (at most ``COPY_WINDOW``), each charged to the budget until written."""
  todo = [(i, pos, n) for i, pos, n in delta.skipped if i in changed]
  if not todo:
    return []
  sources: dict[str, ts.KvStore] = {}
  loc = _refs.locate(plan.kv_spec)
  pending: collections.deque = collections.deque()
  out: list[ts.Future] = []
  try:
    for i, pos, n in todo:
      cand, rec = plan.reusable.stored[i], plan.records[i]
      root = _refs.resolve(loc, cand.base.dir, "the base")
      if root not in sources:
        sources[root] = ts.KvStore.open(loc.spec_at(root), context=ctx).result()
      assert rec.stored is not None and rec.shape is not None
      key = _refs.chunk_key(pos, rec.stored.chunks, rec.shape)
      if len(pending) >= COPY_WINDOW:
        out.append(_copy_one(plan, delta, kv, pending.popleft()))
      if not _fits(delta.budget, n):
        while pending:  # our own reads first: their writes give budget back
          out.append(_copy_one(plan, delta, kv, pending.popleft()))
      if delta.budget is not None:
        delta.budget.acquire(n)
      pending.append((i, f"{cand.dir}/{key}", key, n, sources[root].read(f"{cand.dir}/{key}")))
    while pending:
      out.append(_copy_one(plan, delta, kv, pending.popleft()))
  finally:
    for item in pending:  # (after a failure) reads never written: their budget
      if delta.budget is not None:
        delta.budget.release(item[3])
  return out


def _fits(budget: _arrays.ByteBudget | None, n: int) -> bool:
  return budget is None or budget.held == 0 or budget.held + n <= budget.limit


def _copy_one(plan: Plan, delta: Delta, kv: ts.KvStore, item: tuple) -> ts.Future:
  """Write one copied chunk once its read is in; its budget goes back when it is written."""
  i, src_key, key, n, read = item
  budget = delta.budget
  release = (lambda _f=None: budget.release(n)) if budget is not None else (lambda _f=None: None)
  try:
    got = read.result()
    if got.state != "value":
      raise CheckpointError(
        f"The base's chunk {src_key} of leaf {plan.records[i].where} is missing: the base "
        "checkpoint was deleted or damaged during this save. Save again (without base=)."
      )
    fut = kv.write(f"{plan.store_dirs[i]}/{key}", got.value)
  except BaseException:
    release()
    raise
  delta.copied_bytes += n
  delta.copied_chunks += 1
  fut.add_done_callback(release)
  return fut
