"""The background half of one save: a thread that hands staged chunks to TensorStore as they
arrive, waits until they are durable, then commits (barriers, manifest, commit marker).

All of a save's background state lives here: the queue of staged chunks, the host-memory
budget they hold, the first error, whether staging was aborted, and when to start.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import tensorstore as ts

from .._format import manifest as _manifest
from .._io import arrays as _arrays
from .._io import collective as _collective
from .._io import commit as _commit
from .._io import direct as _direct
from . import buffers as _buffers
from . import delta as _delta
from .errors import wrap

__all__ = ["Writer", "Chunk", "Commit"]


@dataclasses.dataclass
class Chunk:
  """A staged chunk: the opened array (a future), its index, host bytes (or a callable that
  builds them in the writer thread), and budget held."""

  store: ts.Future
  index: Any
  host: Any
  cost: int
  leaf: int | None = None  # a stored array's record index (its chunks are hashed)
  pos: int = 0  # the chunk's position in the grid
  expect: bytes | None = None  # the base's hash of this chunk: equal -> not written
  nbytes: int = 0


@dataclasses.dataclass
class Commit:
  """What committing needs once every chunk is durable."""

  kv: ts.KvStore
  manifest: Callable[[], bytes | None]  # collective (hashes shared); bytes on process 0
  creating: list  # futures of zarr.json writes (process 0)
  write_marker: bool  # process 0
  local: str | None = None  # the directory, when the manifest is written by _io.direct


_END = object()


class Writer:
  """``put`` staged chunks, then ``close()`` (or ``abort(error)``); ``on_done(error)`` is called
  once, from the thread, with the save's error or ``None`` when committed; ``committed`` then
  says whether this process wrote the commit marker (``None``: process 0 may have), which the
  handle makes the error's ``outcome``.

  The thread starts writing once staging is done or when the budget fills (``drain``), so it
  does not compete with the caller's copies; after any failure it keeps draining the queue so
  staging never waits on bytes nobody will free, publishes the error to the other processes
  and arrives at the remaining barriers (so none of them waits for this one)."""

  def __init__(
    self,
    location: str,
    session: _collective.Session,
    budget: _arrays.ByteBudget,
    reached: Callable[[str], None],
    on_done: Callable[[BaseException | None], None],
  ):
    self.location = location
    self.session = session
    self.budget = budget
    self._reached = reached
    self._on_done = on_done
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._drain = threading.Event()
    self._commit: Commit | None = None
    self.error: BaseException | None = None
    self.aborted = False
    self.abort_error: BaseException | None = None
    self.phase = "staging"
    self.committed: bool | None = False  # the marker was written (None: process 0 may have)
    self.write_s = 0.0
    self.commit_s = 0.0
    self.delta: _delta.Delta | None = None  # set before start()
    self.pending: Any = None  # ``pending.Pending``: the base is a save in flight (held items)
    self._stores: list[ts.Future] = []  # packs opened (zarr.json) whose chunks go direct
    self._thread = threading.Thread(target=self._run, name=f"fnckpt-save:{location}")

  def start(self) -> None:
    self._thread.start()

  def join(self) -> None:
    self._thread.join()

  def drain(self) -> None:
    """Start writing now (the budget is full)."""
    self._drain.set()

  def put(self, chunk: Chunk | _delta.PackLeaf) -> None:
    """Queue a staged chunk (its cost already taken from the budget); after a failure, give
    the cost back and raise the failure."""
    if self.error is not None:
      self.budget.release(chunk.cost)
      raise self.error
    self._queue.put(chunk)

  def close(self, commit: Commit) -> None:
    """Staging is done: write what is queued, then commit."""
    self._commit = commit
    self._queue.put(_END)
    self._drain.set()

  def abort(self, error: BaseException) -> None:
    """Staging failed with ``error``: drain what was staged, commit nothing, tell the others."""
    self.aborted = True
    self.abort_error = error
    self._queue.put(_END)
    self._drain.set()

  def nudge(self, marker: Any) -> None:
    """Queue a marker for ``pending`` (from any thread; never blocks)."""
    self._queue.put(marker)

  def _write_all(self) -> list[ts.Future]:
    assert self.delta is not None  # (set before start)
    commits: list[ts.Future] = []
    done = False
    try:
      self._drain.wait()
      while (item := self._next(commits)) is not _END:
        for ready in self.pending.admit(item) if self.pending is not None else (item,):
          self._write_one(ready, commits)
      if self.pending is not None:  # items held for a base in flight: once it is done
        for ready in self.pending.drain(lambda: self.error is not None or self.aborted):
          self._write_one(ready, commits)
      done = True
    finally:  # (after any failure too: every hashing job and file thread ends)
      try:
        commits += self.delta.settle()
        if done and self.error is None and not self.aborted:
          commits += self.delta.finish()
      except BaseException as e:
        self.error = self.error or e
        commits += self.delta.started()  # (waited for all the same: none left writing)
    return commits

  def _write_one(self, item: Any, commits: list) -> None:
    """Write (or hand to the delta) one staged item; after a failure give its budget back."""
    if self.error is not None or self.aborted:
      self.budget.release(item.cost)
      return
    try:
      if isinstance(item, _delta.PackLeaf):
        assert self.delta is not None
        commits += self.delta.pack_leaf(item)
        return
      self._write(item)
    except BaseException as e:
      self.budget.release(item.cost)
      self.error = e

  def _next(self, commits: list) -> Any:
    """The next queued item; before blocking on an empty queue, write the buffered pack
    segment (its leaves hold budget the caller may be waiting for: else a deadlock)."""
    try:
      return self._queue.get_nowait()
    except queue.Empty:
      pass
    if self.error is None and not self.aborted and self.delta is not None:
      try:
        commits += self.delta.flush()
      except BaseException as e:
        self.error = e
    return self._queue.get()

  def _write(self, item: Chunk) -> None:
    """Hand one chunk to the delta: hashed, and written unless equal to the base's."""
    delta = self.delta
    assert delta is not None
    make = item.host
    host = make() if callable(make) else make
    item.host = None  # a pack chunk's staged pieces go once assembled: at most 2x held
    image = getattr(make, "image", None)
    write: Callable[[], Any]  # (a TensorStore future, or a file thread's)
    if image is not None:  # (its zarr.json, being created, is waited for before commit)
      if all(f is not item.store for f in self._stores):
        self._stores.append(item.store)
      write = lambda: delta.write_file(make.path, image, host)  # noqa: E731
    else:
      store = item.store.result()
      write = lambda: _arrays.write_chunk(store, item.index, host)  # noqa: E731
    delta.chunk(
      leaf=item.leaf,
      pos=item.pos,
      expect=item.expect,
      nbytes=item.nbytes,
      cost=item.cost,
      host=host,
      write=write,
      spans=getattr(make, "spans", None),
      reuse=getattr(make, "reuse", False),
    )

  def _run(self) -> None:
    error: BaseException | None = None
    self.phase = "writing the arrays"
    try:
      t0 = time.perf_counter()
      commits = self._write_all()
      try:
        manifest = self._conclude()  # (while the last writes are in flight)
      finally:
        self._wait(commits)
      if self.aborted:
        return
      if self.error is not None:
        raise self.error
      if self.delta is not None and self.delta.check_base is not None:
        self.delta.check_base()  # (process 0, once every write is durable)
      self.write_s = time.perf_counter() - t0
      self._reached("written")
      self._finish(manifest)
    except BaseException as e:
      error = e
    finally:
      if error is not None or self.aborted:
        err = error or self.abort_error or self.error
        if err is not None:
          err = wrap(err, self.location, self.phase)
          self.session.fail(err, self.committed)
        self.session.abort()
        error = err
      self.session.close()
      self._on_done(None if self.aborted else error)

  def _conclude(self) -> bytes | None:
    """Every chunk is hashed: share the hashes and build the manifest (collective; process
    0's bytes), its writes may still be in flight. Not after a failure (raised once every
    write is done)."""
    if self.error is not None or self.aborted or self._commit is None:
      return None
    if self.session.multi:
      self.phase = "sharing the content hashes"
    manifest = self._commit.manifest()
    self.phase = "writing the arrays"
    return manifest

  def _wait(self, commits: list) -> None:
    """Wait for every write (the arrays' zarr.json too), even after a failure; the first
    failure becomes the save's."""
    extra = self._commit.creating if self._commit else []
    for c in [*extra, *self._stores, *commits]:
      try:
        c.result()
      except BaseException as e:
        self.error = self.error or e
    if self.delta is not None:
      self.delta.join()

  def _finish(self, manifest: bytes | None) -> None:
    """Manifest, barrier, commit marker, barrier."""
    t0 = time.perf_counter()
    c = self._commit
    if c is None:  # close() sets it before the end marker; only abort() omits it
      raise RuntimeError("internal: the writer reached commit without close()")
    if manifest is not None:
      self.phase = "writing the manifest"
      _write_manifest(c, manifest)
      self._reached("manifest")
    self.phase = "waiting for every process to finish writing"
    try:
      self.session.barrier("written")
    finally:  # (also when a failure is read right after it: process 0 may not have seen it)
      if self.session.multi and not c.write_marker and "written" in self.session.passed:
        self.committed = None  # every process arrived: process 0 may write the marker now
    self._reached("committing")
    if c.write_marker:
      self.phase = "writing the commit marker"
      assert manifest is not None  # (process 0's)
      _commit.write_commit(c.kv, manifest)
      self.committed = True
    self.phase = "waiting for the commit"
    self.session.barrier("committed")
    self.commit_s = time.perf_counter() - t0
    self._reached("committed")


def _write_manifest(c: Commit, manifest: bytes) -> None:
  """The manifest, durably: through a pool buffer past the page cache (``_io.direct``) for a
  local checkpoint, else through TensorStore."""
  if c.local is None:
    c.kv.write(_manifest.MANIFEST, manifest).result()
    return
  buf = _buffers.take(_direct.aligned_size(len(manifest)))
  try:
    _direct.write_bytes(c.local + _manifest.MANIFEST, manifest, buf)
  finally:
    _buffers.give(buf)
