"""The steps of a run directory: which are committed, which are crash leftovers, their metrics.

Layout: ``<run>/<step>/`` (plain decimal, no padding) holds the checkpoint of ``step``; a step
is committed when its commit marker ``<run>/<step>/COMMIT`` exists (docs/concepts/commit.md).
Other names in the run directory are ignored.

What one listing costs, for ``N`` step directories (chunk files are never listed):

- local files: one ``os.scandir`` of the run directory (one entry per step) and one ``stat``
  of each step's marker; a step without a marker costs one more ``scandir`` (of its directory).
- ``memory://``, ``gs://``, ``s3://``: TensorStore's kvstore ``list`` has no delimiter and no
  limit, so the index lists only the key ranges *between* the step directories it already
  knows (``N + 1`` range LISTs, empty in the steady state: one request each) and reads each
  known step's marker (``N`` small reads); a step found in those ranges becomes known. The
  first listing of an index knows nothing, so it lists every key once. A known step without a
  marker has its own key range listed (a leftover, or a step being written elsewhere).

A step marked damaged (``<run>/damaged/<step>``, :mod:`fnckpt._manager.health`) is listed in
``damaged``, not among the committed steps; checking a mark costs two small reads (the mark
and the step's marker), only for steps that have one.

All requests of one listing are in flight together. The known names only say where not to
look; every step is checked on every listing, so nothing goes stale across processes.
"""

from __future__ import annotations

import builtins
import dataclasses
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorstore as ts

from .._errors import CheckpointError
from .._io import paths as _paths
from .._restore import restore as _restore
from . import fork as _fork
from . import health as _health

__all__ = ["MARKER", "Listing", "StepIndex", "as_step", "scan"]

# The commit marker's key in a checkpoint (docs/format.md; the same key that
# fnckpt._io.commit.is_committed reads; tests/test_manager.py checks that a saved step has it).
MARKER = "COMMIT"
HELD = "REFERENCED"  # a deleted step whose data others still refer to (fnckpt._manager.fork)
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")


def as_step(step: Any) -> int:
  """``step`` as an int: a non-negative int, numpy integer or 0-d integer array.

  >>> as_step(np.int64(7))
  7
  """
  if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
    value = int(step)
  elif getattr(step, "shape", None) == () and np.issubdtype(np.asarray(step).dtype, np.integer):
    value = int(np.asarray(step))  # a 0-d array, e.g. state.step
  else:
    value = -1
  if value < 0:
    raise CheckpointError(f"A checkpoint step must be a non-negative int, got {step!r}.")
  return value


@dataclasses.dataclass(frozen=True)
class Listing:
  """One look at a run directory. ``committed``: step -> its marker's stamp (opaque; it
  changes whenever the step is committed again); ``uncommitted``: leftovers, sorted;
  ``damaged``: committed steps marked damaged (step -> the damage), not in ``committed``."""

  committed: dict[int, bytes]
  uncommitted: list[int]
  damaged: dict[int, str] = dataclasses.field(default_factory=dict)
  held: list[int] = dataclasses.field(default_factory=list)  # deleted; data still referred to
  marked: dict[int, bytes] = dataclasses.field(default_factory=dict)  # damaged: their stamps

  @property
  def referrers(self) -> dict[int, bytes]:
    """Committed steps whose references keep data, damaged ones too (a mark is only a memo:
    the data a marked step refers to stays while it is there)."""
    return {**self.committed, **self.marked}

  @property
  def steps(self) -> list[int]:
    return sorted(self.committed)


def _step_of(key: bytes | str) -> int | None:
  if isinstance(key, bytes):
    key = key.decode("utf-8", "surrogateescape")
  name, sep, _ = key.partition("/")
  return int(name) if sep and _STEP_NAME.fullmatch(name) else None


def _range_of(step: int) -> ts.KvStore.KeyRange:
  return ts.KvStore.KeyRange(f"{step}/", f"{step}0")  # '0' follows '/': keys under "<step>/"


def _gaps(steps: set[int]) -> list[ts.KvStore.KeyRange]:
  """The key ranges outside the directories of ``steps`` (an empty max means unbounded).

  >>> [(r.inclusive_min, r.exclusive_max) for r in _gaps({1, 10})]
  [(b'', b'1/'), (b'10', b'10/'), (b'100', b'')]
  """
  out, low = [], ""
  for prefix in sorted(f"{s}/" for s in steps):
    if prefix > low:
      out.append(ts.KvStore.KeyRange(low, prefix))
    low = prefix[:-1] + "0"
  return out + [ts.KvStore.KeyRange(low, "")]


def _has_entries(path: str) -> bool:
  try:
    with os.scandir(path) as it:
      return next(it, None) is not None
  except OSError:  # gone meanwhile
    return False


def _local_marks(run: str) -> set[int]:
  """The steps with a damage mark in the local run directory ``run``."""
  try:
    with os.scandir(os.path.join(run, _health.MARK_DIR)) as it:
      keys = [f"{_health.MARK_DIR}/{e.name}" for e in it]
  except OSError:  # gone meanwhile, or not a directory
    return set()
  return {s for s in map(_health.mark_of, keys) if s is not None}


class StepIndex:
  """The step directories under ``root`` (any fnckpt location). One index per run directory
  and storage tier; it holds no state that decides an answer (see the module docstring).

  >>> idx = StepIndex("memory://doc/index")
  >>> kv = _paths.open_kvstore("memory://doc/index")
  >>> _ = kv.write("3/COMMIT", b"").result(); _ = kv.write("5/manifest.msgpack", b"").result()
  >>> idx.list().steps, idx.list().uncommitted
  ([3], [5])
  """

  def __init__(self, root: _paths.Location | str, options: Mapping[str, Any] | None = None):
    self.location = _paths.Location.of(root, options)  # (``options``: for a path)
    self.root = self.location.path
    self.display = self.location.display
    spec = self.location.spec()
    self._local = spec["path"] if spec["driver"] == "file" else None
    self._kv = None if self._local else _paths.open_kvstore(self.location)
    self._lock = threading.Lock()
    self._names: set[int] = set()  # step directories seen (object stores: where not to list)
    self._committed: set[int] = set()  # committed at the last listing (newest_known)
    self._noted: set[int] = set()  # committed by the caller since (note_committed)
    self._metrics: dict[int, tuple[bytes, Any]] = {}  # step -> (marker stamp, metric value)
    self._refs: Any = None

  @property
  def refs(self) -> Any:
    """What the run's steps and forks refer to (:class:`fnckpt._manager.fork.References`)."""
    if self._refs is None:
      self._refs = _fork.References(self.location)
    return self._refs

  def delete_keeping(self, step: int) -> None:
    """Delete ``step``, keeping its data that other steps (damaged ones too) or forks refer
    to (see :meth:`delete`)."""
    self.delete(step, self.refs.kept(self.list(), {step}).get(step, set()))

  def path(self, step: int) -> str:
    return _paths.join(self.root, str(as_step(step)))

  def at(self, step: int) -> _paths.Location:
    """The location of ``step`` (on the run's storage, with its options)."""
    return self.location.join(str(as_step(step)))

  def list(self, in_flight: frozenset[int] | set[int] = frozenset()) -> Listing:
    """The committed steps and leftovers now. ``in_flight``: steps the caller is writing (not
    probed for leftover data while their marker is missing)."""
    try:
      committed, leftovers, marks = self._list_local() if self._local else self._list_kv(in_flight)
      damaged = _health.marks_in_force(self._marks_kv(), sorted(marks & set(committed)))
      held = [s for s in leftovers if self._is_held(s)]
    except Exception as e:  # TensorStore raises ValueError & co.; OSError from local files
      raise _paths.io_error(e, self.root, "listing its steps") from e
    marked = {s: v for s, v in committed.items() if s in damaged}
    committed = {s: v for s, v in committed.items() if s not in damaged}
    with self._lock:
      self._committed = set(committed)
    return Listing(committed, sorted(set(leftovers) - set(held)), damaged, sorted(held), marked)

  def _is_held(self, step: int) -> bool:
    if self._local:
      return os.path.exists(os.path.join(self._local, str(step), HELD))
    assert self._kv is not None
    return self._kv.read(f"{step}/{HELD}").result().state == "value"

  def _marks_kv(self) -> Any:
    if self._kv is None:  # local files: opened only when a mark is there
      self._kv = _paths.open_kvstore(self.location)
    return self._kv

  def _list_local(self) -> tuple[dict[int, bytes], builtins.list[int], set[int]]:
    assert self._local is not None
    committed: dict[int, bytes] = {}
    leftovers: list[int] = []
    try:
      with os.scandir(self._local) as it:
        names = list(it)
    except FileNotFoundError:  # no run yet (a file in the way is an error: NotADirectoryError)
      return committed, leftovers, set()
    entries = [e for e in names if _STEP_NAME.fullmatch(e.name) and e.is_dir()]
    marks = _local_marks(self._local) if any(e.name == _health.MARK_DIR for e in names) else set()
    for entry in entries:
      try:
        st = os.stat(os.path.join(entry.path, MARKER))
      except FileNotFoundError:
        if _has_entries(entry.path):
          leftovers.append(int(entry.name))
        continue
      committed[int(entry.name)] = f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()
    return committed, leftovers, marks

  def _list_kv(
    self, in_flight: frozenset[int] | set[int]
  ) -> tuple[dict[int, bytes], builtins.list[int], set[int]]:
    assert self._kv is not None
    with self._lock:
      known = set(self._names)
    gaps = [
      k.decode("utf-8", "surrogateescape")
      for f in [self._kv.list(range=r) for r in _gaps(known)]
      for k in f.result()
    ]
    found = {s for s in map(_step_of, gaps) if s is not None}
    marks = {s for s in map(_health.mark_of, gaps) if s is not None}
    reads = {s: self._kv.read(f"{s}/{MARKER}") for s in known | found}
    committed, missing = {}, set()
    for step, future in reads.items():
      result = future.result()
      if result.state == "value":
        committed[step] = bytes(result.stamp.generation)
      else:
        missing.add(step)
    probes = {s: self._kv.list(range=_range_of(s)) for s in missing - found - set(in_flight)}
    leftovers = [s for s in missing if s in found or (s in probes and probes[s].result())]
    with self._lock:
      self._names = set(committed) | set(leftovers) | (missing & set(in_flight))
    return committed, leftovers, marks

  def exists(self, step: int) -> bool:
    """Whether anything is stored under ``step`` (committed or not)."""
    if self._local:
      return _has_entries(os.path.join(self._local, str(step)))
    assert self._kv is not None
    try:
      return bool(self._kv.list(range=_range_of(step)).result())
    except Exception as e:
      raise _paths.io_error(e, self.path(step), "listing") from e

  def delete(self, step: int, keep: set[str] | frozenset[str] = frozenset()) -> None:
    """Delete ``step``'s directory, its commit marker first (never seen half deleted), and
    its damage mark; its data directories in ``keep`` (that other steps or forks refer to)
    stay (``REFERENCED``, :func:`fnckpt._manager.fork.delete_step`)."""
    _fork.delete_step(self.location, step, set(keep))
    try:
      mark = _health.mark_key(step)
      self._marks_kv().delete_range(ts.KvStore.KeyRange(mark, mark + "\0")).result()
    except Exception as e:
      raise _paths.io_error(e, _paths.join(self.root, _health.mark_key(step)), "deleting") from e
    self.forget(step)

  def damage_of(self, step: int) -> str | None:
    """The damage ``step`` is marked with (a mark in force), or ``None`` (two small reads)."""
    try:
      return _health.marks_in_force(self._marks_kv(), [step]).get(step)
    except Exception as e:
      raise _paths.io_error(e, self.path(step), "reading its damage mark") from e

  def forget(self, step: int) -> None:
    with self._lock:
      self._committed.discard(step)
      self._noted.discard(step)
      self._metrics.pop(step, None)

  def note_committed(self, step: int) -> None:
    with self._lock:
      self._names.add(step)
      self._noted.add(step)

  def newest_known(self) -> int | None:
    """The newest step committed at the last listing or since (no I/O; a hint for checks)."""
    with self._lock:
      return max(self._committed | self._noted, default=None)

  def user_metadata(self, step: int) -> Any:
    """The ``user_metadata`` of the committed ``step`` (one manifest read)."""
    return _restore.metadata_at(self.at(step)).user_metadata

  def metric_values(self, listing: Listing, name: str) -> dict[int, Any]:
    """``{step: metrics[name]}`` for the committed steps of ``listing`` (``None`` where absent
    or unreadable). A step's manifest is read once per commit: values are kept under the
    stamp of the marker they were read with."""
    out = {}
    for step, stamp in listing.committed.items():
      with self._lock:
        cached = self._metrics.get(step)
      if cached is None or cached[0] != stamp:
        try:
          meta = self.user_metadata(step)
        except CheckpointError:  # deleted or damaged meanwhile: not ranked
          meta = None
        metrics = meta.get("metrics") if isinstance(meta, dict) else None
        cached = (stamp, metrics.get(name) if isinstance(metrics, dict) else None)
        with self._lock:
          self._metrics[step] = cached
      out[step] = cached[1]
    with self._lock:
      for step in set(self._metrics) - set(listing.committed):
        del self._metrics[step]
    return out


def scan(directory: _paths.Location | str) -> tuple[list[int], list[int]]:
  """(committed steps, uncommitted leftover steps) under ``directory``, each sorted.

  >>> kv = _paths.open_kvstore("memory://doc/scan")
  >>> _ = kv.write("7/COMMIT", b"").result(); _ = kv.write("9/manifest.msgpack", b"").result()
  >>> _ = kv.write("notes.txt", b"").result(); _ = kv.write("08/COMMIT", b"").result()
  >>> scan("memory://doc/scan")
  ([7], [9])
  """
  listing = StepIndex(directory).list()
  return listing.steps, listing.uncommitted
