"""Overlapping saves: a save whose base is a save still in flight in this process.

The caller plans as for a committed base, but takes the candidates *by layout* from the base's
planned leaf records (:func:`by_layout`): same key path, kind, dtype, shape, and for stored
arrays the same chunking and codecs; packed leaves the base packs. Their staged items carry the
expectation :data:`PENDING`. The writer thread (:class:`Pending`, hooked into
``writer.Writer``) holds those items, charged to the process's budget, until the base's handle
is done; then it reads the base's committed manifest (in the writer thread), fills in the real
expectations (``refs.candidates``) and the items go on exactly as with a committed base. If the
base failed (or is gone), every held item is written and its leaf counted as changed: no
reference, no ``bases`` entry. Whenever someone has to wait on the budget while items are held
(the caller staging, another save, the base's own copies), the held items are written at once
as changed ("spilled"), so nobody waits on bytes that wait on a commit.

Which base outcome a process sees is the storage's word (the base's ``COMMIT``, read after its
handle is done), so every process sees the same; process 0 decides reuse in ``conclude`` as
for any save, and ``_Base.check`` still guards the commit.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .. import _state
from .._errors import CheckpointError
from .._format import records as _records
from .._format import refs as _refs
from .._io import paths as _paths
from .._sources import source as _source

if TYPE_CHECKING:
  from .handle import SaveHandle

__all__ = [
  "PENDING",
  "PendingStored",
  "PendingPacked",
  "by_layout",
  "Pending",
  "open_pending",
  "WAKE",
  "BaseState",
  "LookUp",
  "Committed",
  "InFlight",
]

# The expectation of an item whose base is still in flight (never equal to a real hash).
PENDING = b"(pending base)"
WAKE = object()  # a writer queue marker: the base finished, or someone waits on the budget


@dataclasses.dataclass(frozen=True)
class PendingStored:
  """A stored leaf whose in-flight base plans the same layout (``refs.StoredCand``'s calls)."""

  base: Any = None
  dir: Any = None

  def expect(self, pos: int) -> bytes:
    del pos
    return PENDING


@dataclasses.dataclass(frozen=True)
class PendingPacked:
  """A packed leaf whose in-flight base packs it too (``refs.PackCand``'s ``hash``)."""

  hash: bytes = PENDING


class _EveryProcess:
  """``runs.get(process)`` of a :class:`PendingRuns`: pending for every process."""

  def get(self, process: int) -> PendingPacked:
    del process
    return PendingPacked()


@dataclasses.dataclass(frozen=True)
class PendingRuns:
  """A pieced leaf whose in-flight base pieces it alike (``refs.RunCand``'s ``runs``)."""

  runs: Any = dataclasses.field(default_factory=_EveryProcess)


def _base_packs(old: _records.Leaf) -> bool:
  """Whether the base packs ``old`` (planned in its pack, or a candidate it places later)."""
  return old.packed is not None or (
    old.stored is None and old.inline is None and old.pieces is None
  )


def by_layout(records: Sequence[_records.Leaf], base: Sequence[_records.Leaf]) -> _refs.Candidates:
  """Per new planned record, whether the base's planned (or committed) record has the same
  layout: the leaves that may reuse the base's data once it commits. Planned and committed
  records of one save agree on every field compared here (a pieced leaf's mesh processes and
  writers are compared once the base's manifest is read: :meth:`Pending._resolve`)."""
  by_path = {l.path: l for l in base}
  # (placeholders in refs.Candidates' places: each has the fields its stand-in's callers read)
  stored: dict[int, Any] = {}
  packed: dict[int, Any] = {}
  pieced: dict[int, Any] = {}
  for i, rec in enumerate(records):
    old = by_path.get(rec.path)
    if old is None or old.kind != rec.kind or not old.is_array or not rec.is_array:
      continue
    if old.dtype != rec.dtype or old.shape != rec.shape or 0 in (rec.shape or ()):
      continue
    if old.kind == "key" and old.impl != rec.impl:
      continue
    s = rec.stored
    if (
      s is not None
      and old.stored is not None
      and (old.stored.chunks, old.stored.inner, old.stored.zstd, old.stored.blosc)
      == (s.chunks, s.inner, s.zstd, s.blosc)
    ):
      stored[i] = PendingStored()
    elif rec.pieces is not None and old.pieces is not None and _same_pieces(old, rec):
      pieced[i] = PendingRuns()
    elif s is None and rec.inline is None and rec.pieces is None and _base_packs(old):
      packed[i] = PendingPacked()
  return _refs.Candidates(stored, packed, pieced)


def _same_pieces(old: _records.Leaf, rec: _records.Leaf) -> bool:
  assert old.pieces is not None and rec.pieces is not None and rec.shape is not None
  assert old.sharding is not None and rec.sharding is not None  # (pieced: named)
  return old.pieces.chunks == rec.pieces.chunks and _refs.same_split(
    old.sharding, rec.sharding, len(rec.shape)
  )


@dataclasses.dataclass(frozen=True)
class LookUp:
  """Whether the base is a save in flight is not known: this process's saves say, and with
  several processes process 0's view decides (collectively)."""


@dataclasses.dataclass(frozen=True)
class Committed:
  """The base is a committed checkpoint (the manager's process 0 decided)."""


@dataclasses.dataclass(frozen=True)
class InFlight:
  """The base is a save still in flight (the manager's process 0 decided): ``handle``, this
  process's handle of it, or None when this process holds none (its records are then read
  from the base's manifest once committed)."""

  handle: SaveHandle | None = None


BaseState = LookUp | Committed | InFlight
"""What a save knows of its base: ``start(base_state=)``, :func:`open_pending`."""


def open_pending(
  base: Any, state: BaseState, session: Any, kv_spec: dict, where: _paths.Location, location: str
) -> Pending | None:
  """The in-flight base of a new save to ``where``, or None (a committed base: read it as
  usual; a base is on the new save's storage, with its options)."""
  if isinstance(state, Committed) or not isinstance(base, (str, os.PathLike)):
    return None
  if isinstance(state, LookUp):
    with _state.saves.lock:
      h = _state.saves.latest.get(_paths.display(os.fspath(base)))
    mine = h if h is not None and not h.done() and h.planned is not None else None
    flight = session.share("base-in-flight", b"1" if mine is not None else b"0") == b"1"
    if not flight:
      return None
    state = InFlight(mine)
  handle = state.handle
  based = _paths.Location.of(base, where.options)
  base_spec = _paths.resolve(based)[0]
  loc, new_loc = _refs.locate(base_spec), _refs.locate(kv_spec)
  if loc.store != new_loc.store or loc.path == new_loc.path:
    raise CheckpointError(
      f"save(base={_paths.display(os.fspath(base))!r}) to {location!r}: the base must be "
      "another checkpoint on the same storage (same scheme, bucket and options) as the new "
      "one. Save without base=, or pick a base beside the new checkpoint."
    )
  if handle is None or handle.planned is None:  # (no records here: its committed ones)
    handle, planned = None, _source.open_source(based).manifest.leaves
  else:
    planned = handle.planned
  return Pending(handle, based, loc, new_loc, planned)


class Pending:
  """One save's in-flight base, on the writer's side (see the module docstring)."""

  def __init__(
    self,
    handle: Any,
    base: _paths.Location,
    loc: _refs.Location,
    new_loc: _refs.Location,
    planned: Sequence[_records.Leaf],
  ):
    self.handle, self.base, self.path = handle, base, base.path
    self.loc, self.new_loc, self.planned = loc, new_loc, tuple(planned)
    self.planned_reusable = _refs.Candidates()  # by layout (expectations pending)
    self.meshes: tuple = ()  # the new save's meshes of pieced leaves
    self.records: tuple = ()
    self.resolved: tuple | None = None  # (check_base or None, refs.Candidates)
    self._held: list[Any] = []
    self._spill = False
    self._wake = threading.Event()
    self._done = threading.Event()  # the base's save finished
    self._writer: Any = None
    self._check_of: Callable[[Any], Callable[[], None]] | None = None

  def candidates(self, records: Sequence[_records.Leaf], meshes: Sequence = ()) -> _refs.Candidates:
    """The plan's candidates (``plan.plan``): by layout, expectations pending."""
    self.records, self.meshes = tuple(records), tuple(meshes)
    self.planned_reusable = by_layout(records, self.planned)
    self.planned = ()
    return self.planned_reusable

  def attach(self, writer: Any, check_of: Callable[[Any], Callable[[], None]]) -> None:
    """Before the writer starts: ``check_of(source)`` is the committed base's commit guard."""
    self._writer, self._check_of = writer, check_of
    if self.handle is None:
      self._base_done()
    else:
      self.handle.add_done_callback(self._base_done)

  def _base_done(self) -> None:
    """The base's save finished (committed or failed): wake the writer."""
    self._done.set()
    self._signal()

  def _signal(self) -> None:
    """(Any thread, maybe under the budget's lock: only signals.)"""
    self._wake.set()
    self._writer.nudge(WAKE)

  def _spill_now(self) -> None:
    """The budget's spiller: someone is about to wait on it."""
    self._spill = True
    self._signal()

  # the writer thread -----------------------------------------------------------------------

  def admit(self, item: Any) -> tuple:
    """A queue item -> the items to write now: a pending candidate is held until the base is
    done (or someone waits on the budget); :data:`WAKE` releases what may go."""
    if item is WAKE:
      return self._ready()
    if getattr(item, "expect", None) != PENDING:
      return (item,)
    if self.resolved is None and self._done.is_set():
      self._resolve()
    if self.resolved is not None or self._spill or self._writer.budget.waiting:
      self._fill(item)
      return (item,)
    self._held.append(item)
    self._writer.budget.add_spiller(self._spill_now)
    if self._writer.budget.waiting:  # (a waiter that came before the spiller was added)
      self._spill = True
      return self._ready()
    return ()

  def _ready(self) -> tuple:
    """The held items, expectations filled, once the base is done or on spilling."""
    if self.resolved is None and self._done.is_set():
      self._resolve()
    if self.resolved is None and not self._spill:
      return ()
    self._writer.budget.remove_spiller(self._spill_now)
    items, self._held, self._spill = self._held, [], False
    for item in items:
      self._fill(item)
    return tuple(items)

  def drain(self, stop: Callable[[], bool]):
    """(The queue has ended.) Yield the held items as they may go; ``stop()``: the save
    failed, so they are yielded at once (the writer gives their budget back)."""
    try:
      while self._held:
        if stop():
          items, self._held = self._held, []
          yield from items
          return
        ready = self._ready()
        if ready:
          yield from ready
          continue
        self._wake.wait()
        self._wake.clear()
    finally:
      self._writer.budget.remove_spiller(self._spill_now)

  def _fill(self, item: Any) -> None:
    """Set a pending item's expectation: the base's, or None (written; its leaf changed)."""
    reusable = self.resolved[1] if self.resolved is not None else _refs.Candidates()
    if hasattr(item, "pos"):  # a stored chunk
      cand = reusable.stored.get(item.leaf)
      item.expect = cand.expect(item.pos) if cand is not None else None
      if cand is None:
        self._writer.delta.report.changed.add(item.leaf)
    elif item.leaf in self.planned_reusable.pieced:  # a process's run of a pieced leaf
      cand = reusable.pieced.get(item.leaf)
      run = cand.runs.get(self._writer.delta.me) if cand is not None else None
      item.expect = run.hash if run is not None else None
    else:  # a packed leaf: no expectation -> a pack segment
      cand = reusable.packed.get(item.leaf)
      item.expect = cand.hash if cand is not None else None

  def _resolve(self) -> None:
    """The base is done: its committed manifest's candidates (none if it failed or is
    gone), restricted to the planned ones."""
    try:
      src = _source.open_source(self.base)
    except CheckpointError:
      self.resolved = (None, _refs.Candidates())
      return
    got = _refs.candidates(
      self.records, src.manifest, _refs.locate(src.kv_spec), self.new_loc, self.meshes
    )
    want = self.planned_reusable
    assert self._check_of is not None  # (attached before any item)
    self.resolved = (
      self._check_of(src),
      _refs.Candidates(
        {i: c for i, c in got.stored.items() if i in want.stored},
        {i: c for i, c in got.packed.items() if i in want.packed},
        {i: c for i, c in got.pieced.items() if i in want.pieced},
      ),
    )

  def complete(self, plan: Any) -> Any:
    """Before concluding: the delta plan with the real candidates. A base not resolved yet
    (its items all spilled) is waited for here, in the writer thread (nothing is held now),
    so every process concludes on the same outcome."""
    if self.resolved is None:
      self._done.wait()
      self._resolve()
    assert self.resolved is not None
    check, got = self.resolved
    want = self.planned_reusable
    for i in want.stored:
      if i not in got.stored:  # not reusable after all: written whole (process 0 decides)
        self._writer.delta.report.changed.add(i)
    return dataclasses.replace(
      plan,
      reusable=_refs.Candidates(
        {i: got.stored.get(i, c) for i, c in want.stored.items()}, got.packed, got.pieced
      ),
      check_base=check,
    )
