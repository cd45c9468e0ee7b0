"""Everything fnckpt keeps per process, in one place.

fnckpt runs inside a training process, so what it keeps between calls is listed here and kept
nowhere else (tests/test_state.py checks every other module: no ``global``, no mutable
module-level value, no ``functools.lru_cache``). Each is created on first use (importing
fnckpt creates no TensorStore context, budget, thread or exit handler: tests/test_api.py),
bounded, and guarded by its own lock. The logic stays with the owners; this module holds the
data:

``saves`` (``_save``)
  the host-byte budget shared by overlapping saves (its limit: the latest asked); the saves
  not yet reported (``fnckpt.wait()`` and the exit handler raise their errors); the newest save
  per location (a new save there waits for it); the order saves started in; whether the exit
  handler is registered (by the first save).
``storage`` (``_io.paths``)
  the parent TensorStore context holding the ``memory://`` store (``memory://`` checkpoints
  live as long as the process: that is what an in-memory checkpoint is).
``sessions`` (``_io.collective``)
  the attempt number per save location. Barrier ids depend on it, so it is alike on every
  process (the same saves in the same order; the least recently used of ``MAX_LOCATIONS``
  locations is dropped alike).
``attempts`` (``_io.attempt``)
  the collective attempt open in this context and the location a manager call keys its
  attempts on: ``contextvars.ContextVar`` s (per thread and asyncio task), set and reset
  around each collective call by their owner.
``plans`` (``_save.plan_cache``, ``_restore``)
  the plans of the latest saves and restores, by the structure they were made for (a training
  loop saves and restores one structure again and again): at most ``MAX_PLANS`` each, the
  least recently used dropped; they hold no arrays.
``pieces`` (``_layout.pieces``)
  the last pieces layout built (a training loop saves one tree again and again).
``reads`` (``_sources.piece_reads``)
  bytes and byte ranges read from packs for pieces (tests read them).
``hooks`` (``_save``)
  ``on_phase(name)``, called as a save passes each phase ("staging", "staged", "written",
  "manifest", "committing", "committed"): a no-op that fault-injection tests replace;
  ``hashing`` (bench/hashing.py's baseline arm only); ``staging`` (the staging mode
  forced by tests and bench/blocking.py, ``_save.copies``); ``direct_writes`` (local pack
  chunks written by ``_io.direct``; tests turn it off to compare with TensorStore's).
``buffers`` (``_save.buffers``)
  host buffers that assembled pack chunks, kept for the next save (at most
  ``_save.buffers.KEEP_BYTES``): touching fresh memory cost more than the copy into it.
``collector`` (``_save``, ``_restore``)
  the cyclic garbage collector paused while a save plans and stages or a restore runs
  (:meth:`_Collector.paused`): how many pauses are open and whether the collector was on when
  the first began.
``memo`` caches (``_layout.chunks``, ``_save``, ``_restore``)
  pure functions memoised across calls, each a bounded LRU keyed by sharding or mesh objects;
  :func:`memos` lists them all.

Not here: a save's own threads (writer, hash pool, abort walker) and a restore's state belong
to that call; a manager's threads, claims and caches to the manager; signal handlers to
``_manager.preemption`` (installed and restored per object); keys in the coordination service
to ``jax.distributed`` (each save tidies its own).

>>> from fnckpt import _state
>>> sorted(vars(_state.saves))
['budget', 'budget_lock', 'exit_registered', 'latest', 'lock', 'order', 'pending']
>>> "fnckpt._layout.chunks._named_info" in _state.memos()
True
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import gc
import itertools
import threading
from typing import Any, Callable

__all__ = [
  "saves",
  "storage",
  "sessions",
  "attempts",
  "plans",
  "pieces",
  "reads",
  "hooks",
  "buffers",
  "collector",
  "memo",
  "memos",
  "MAX_LOCATIONS",
  "MAX_PLANS",
]

# The most save locations whose attempt numbers are remembered (``sessions``).
MAX_LOCATIONS = 4096
# The most plans kept per kind (saves, restores): a loop uses one or two structures.
MAX_PLANS = 8


class _Saves:
  """This process's saves (``_save.handle`` and ``_save.save``)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()  # guards pending and latest
    self.pending: set[Any] = set()  # SaveHandles running, or failed and not reported
    self.latest: dict[str, Any] = {}  # location -> its newest SaveHandle
    self.order = itertools.count()  # fnckpt.wait() reports in the order saves began
    self.budget_lock = threading.Lock()
    self.budget: Any = None  # _io.arrays.ByteBudget, made by the first save
    self.exit_registered = False  # the atexit handler (registered by the first save)


class _Storage:
  """The process-wide TensorStore parent context (``_io.paths.context``)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.root: Any = None  # ts.Context holding the memory:// store


class _Sessions:
  """Save attempts per location (``_io.collective.Session``)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.attempts: collections.OrderedDict[str, int] = collections.OrderedDict()


class _Attempts:
  """The collective attempt open in this context (``_io.attempt.Attempt``) and the location
  its manager call keys attempts on."""

  def __init__(self) -> None:
    self.current: contextvars.ContextVar[Any] = contextvars.ContextVar(
      "fnckpt_attempt", default=None
    )
    self.keyed: contextvars.ContextVar[str | None] = contextvars.ContextVar(
      "fnckpt_keyed", default=None
    )


class _Plans:
  """Plans by the structure they were made for, saves' and restores' apart (bounded LRUs)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.saves: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    self.restores: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    # plans reused and made, per kind (tests and bench/call_cost.py read them)
    self.hits = {"saves": 0, "restores": 0}
    self.misses = {"saves": 0, "restores": 0}

  def get(self, kind: str, key: Any) -> Any:
    """The plan of ``kind`` ("saves" or "restores") made for ``key``, or None."""
    table = getattr(self, kind)
    with self.lock:
      got = table.get(key)
      if got is None:
        self.misses[kind] += 1
        return None
      self.hits[kind] += 1
      table.move_to_end(key)
      return got

  def put(self, kind: str, key: Any, plan: Any) -> None:
    """Keep ``plan`` for ``key``, dropping the least recently used beyond ``MAX_PLANS``."""
    table = getattr(self, kind)
    with self.lock:
      table[key] = plan
      table.move_to_end(key)
      while len(table) > MAX_PLANS:
        table.popitem(last=False)

  def clear(self) -> None:
    """Forget every plan, and the counts (tests)."""
    with self.lock:
      self.saves.clear()
      self.restores.clear()
      self.hits = {"saves": 0, "restores": 0}
      self.misses = {"saves": 0, "restores": 0}


class _Slot:
  """One value, read and replaced whole (atomic under the GIL: no lock)."""

  def __init__(self) -> None:
    self.last: Any = None  # (key, layout) of the latest pieces layout


class _PieceReads:
  """Bytes asked of the packs for pieces by every reader of this process (for tests)."""

  def __init__(self) -> None:
    self.bytes_read = 0
    self.ranges = 0


class _Hooks:
  """Test hooks: replace an attribute (``monkeypatch.setattr(_state.hooks, "on_phase", f)``)."""

  def __init__(self) -> None:
    self.on_phase: Callable[[str], None] = _no_op
    # restore's content hash checks on reads of whole hashed units (docs/format.md "Version 3");
    # the bench turns them off to measure what they cost
    self.check_hashes = True
    # how staging takes shards off their devices (``_save.copies``): None, each platform's
    # default; "owned" (copies into host memory the save owns) or "asarray" forces one on
    # every platform (tests and bench/blocking.py force "owned" on CPU)
    self.staging: str | None = None
    # pack chunks of local checkpoints written by fnckpt (``_io.direct``, past the page
    # cache); False: through TensorStore (tests compare the two, byte for byte)
    self.direct_writes = True


class _Buffers:
  """Idle host buffers (1-D ``uint8`` numpy arrays) for pack chunks (``_save.buffers``)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.free: list[Any] = []  # not in use by any save
    self.kept = 0  # their bytes


class _Collector:
  """Pauses of Python's cyclic garbage collector, nested and from any thread.

  A save or restore of thousands of leaves allocates tens of thousands of objects that live
  on (records, arrays, shardings); the collector would scan them, and the whole heap (a JAX
  process holds 100k+ objects) in its oldest generation, several times per call: measured
  10-35% of a 2,000-leaf save or restore, in ``gc.callbacks``. Objects are still freed by
  reference counting while paused; cycles wait for the collector, which runs again as soon
  as the last pause ends (only if it was on when the first began: a caller's
  ``gc.disable()`` is kept)."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.depth = 0  # pauses open
    self.was_enabled = False  # the collector was on when the first began

  @contextlib.contextmanager
  def paused(self):
    """Pause the collector for the block (only in the thread of a caller who waits for it:
    the pause is process-wide). A ``gc.disable()`` by another thread during a pause is undone
    when the last pause ends."""
    with self.lock:
      if self.depth == 0:
        self.was_enabled = gc.isenabled()
        gc.disable()
      self.depth += 1
    try:
      yield
    finally:
      with self.lock:
        self.depth -= 1
        if self.depth == 0 and self.was_enabled:
          gc.enable()


def _no_op(name: str) -> None:
  del name


saves = _Saves()
storage = _Storage()
sessions = _Sessions()
attempts = _Attempts()
plans = _Plans()
pieces = _Slot()
reads = _PieceReads()
hooks = _Hooks()
buffers = _Buffers()
collector = _Collector()
_memos: dict[str, Any] = {}  # qualified name -> the memoised function


def memo(maxsize: int | None) -> Callable[[Callable], Callable]:
  """``functools.lru_cache(maxsize)``, registered for :func:`memos`. For pure functions only
  (keyed by their arguments: shardings, meshes, shapes); ``maxsize`` bounds what is kept
  (``None``: a closed set of keys, e.g. PRNG implementations).

  >>> @memo(4)
  ... def square(x):
  ...   return x * x
  >>> square(3), square.cache_info().currsize
  (9, 1)
  """

  def wrap(fn: Callable) -> Callable:
    cached = functools.lru_cache(maxsize=maxsize)(fn)
    _memos[f"{fn.__module__}.{fn.__qualname__}"] = cached
    return cached

  return wrap


def memos() -> dict[str, Any]:
  """Every memoised function's ``cache_info()``, by qualified name."""
  return {name: fn.cache_info() for name, fn in _memos.items()}
