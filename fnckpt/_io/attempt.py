"""One attempt of a collective restore (or a recovery from peers): barriers numbered within the
attempt, failures published for the barrier they stop at, so every failure fails every process.

A save has :class:`fnckpt._io.collective.Session` (its barriers are a fixed list). A restore's
barriers depend on its plan (one per broadcast wave), so here they are *numbered*: the i-th
barrier of attempt k at a location is ``fnckpt/<location hash>/<kind>/<k>/b<i>``, where k is
the k-th such attempt on this process (every process makes the same collective calls in the
same order, so k agrees without a message, as for saves). Nothing is counted by the
coordination service: an attempt that failed anywhere leaves nothing the next one meets.

The rule that makes every failure fail every process at once: a process that fails while the
attempt is open publishes its error under the number of the barrier it has not reached yet
(``e<i>/<process>``) and then arrives at that barrier; every process, past each barrier, looks
for errors published for it and raises (all of them stop at barrier i: none goes further).
Every open attempt starts with barrier 0, the *agreement* (:func:`agree`), reached once each
process has done everything that can fail on it alone before the first collective (opening
the checkpoint, reading its manifest, matching the target, planning the waves): a failure in
any of those is seen by every process there. While a process waits in a collective (a
reshard), it polls the errors of the next barrier every ``POLL_S``: a process that failed
outside the collective (so never joined it) is seen within that, not at the deadline. A
process that cannot publish its error arrives nowhere (fail closed: the others time out at the
barrier, naming it). Past the attempt's last barrier (:func:`close`) a failure waits for no
one and is not published. With one process everything here is a no-op.

Attempts nest: a collective call made inside an open attempt (a collective restore inside a
CheckpointManager call, :func:`fnckpt._io.coordination.operation`) is a *segment* of it: it
numbers its barriers on, in the same sequence, and publishes failures for them there. So a
process that fails in the manager's own code before a restore's agreement is seen there, and a
restore that failed on every process at barrier i leaves every process just past barrier i:
the enclosing call may go on (the manager exchanges the outcome) or fail at its next barrier.

>>> with collective("memory://doc/attempt", "restore", 10.0, on=True) as a:
...   agree(waves=False)
>>> a.multi, a.closed
(False, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from typing import Callable, Iterator, Sequence

import jax

from .. import _state
from .._errors import BarrierTimeoutError, CheckpointError, DamagedError
from . import collective as _collective
from . import commit as _commit
from . import paths as _paths

__all__ = ["Attempt", "Failure", "collective", "keyed", "current", "agree", "close", "POLL_S"]

POLL_S = 0.25  # while in a collective: how often the next barrier's published errors are read
_MAX_ERROR_CHARS = 4000

_current = _state.attempts.current  # (per context: see fnckpt._state)
_keyed = _state.attempts.keyed


class PeerFailedError(_collective.PeerFailedError):
  """Another process failed during the same collective restore (or recovery from peers).
  (Where it found damaged data, the error is a :class:`DamagedError`.)"""


@dataclasses.dataclass(frozen=True)
class Failure:
  """A failure another process published: ``process``, ``damaged`` (it found damaged data:
  every process then raises a :class:`DamagedError`, so a manager heals the same way on all)
  and ``text`` (its error's type and message)."""

  process: int
  damaged: bool
  text: str

  @staticmethod
  def parse(process: int, value: str) -> Failure:
    kind, _, text = value.partition(":")
    return Failure(process, kind == "damaged", text)


Explain = Callable[[Failure, str], CheckpointError]


@dataclasses.dataclass
class _Line:
  """The numbered barriers of one attempt (and of the segments nested in it): ``count``
  entered so far, ``broken``: one failed (a deadline, a lost process), so none follows;
  ``settled``: the failure this process has met its barrier for (see :meth:`Attempt.fail`).
  Keys live under ``fnckpt/<location hash>/<kind>/<attempt>/``."""

  location: str
  kind: str
  attempt: int
  count: int = 0
  broken: bool = False
  settled: BaseException | None = None

  @property
  def base(self) -> str:
    return f"fnckpt/{_commit._key(self.location)}/{self.kind}"


class Attempt:
  """One collective attempt at ``location`` (``kind``: ``"restore"``, ``"peers"``,
  ``"manager"``), or a segment of ``parent`` (numbered on in its line); ``count``: barriers
  entered so far; ``what``: its name in errors. Made by :func:`collective`."""

  def __init__(
    self,
    location: str,
    kind: str,
    timeout_s: float,
    multi: bool = True,
    parent: Attempt | None = None,
    what: str | None = None,
  ):
    self.location, self.kind, self.timeout_s, self.parent = location, kind, timeout_s, parent
    self.what: str = what or (parent.what if parent else f"Collective {kind}")
    self.shown: str = parent.shown if parent else location  # (where, in errors: the outermost's)
    self.multi = multi and jax.process_count() > 1
    self.closed = self.failed = False
    self.learned: BaseException | None = None
    if not self.multi:
      self.line = _Line(location, kind, 0)
      return
    self.client = _commit._client()
    if parent is not None:
      self.line = parent.line
    else:
      base = f"fnckpt/{_commit._key(location)}/{kind}"
      self.line = _Line(location, kind, _collective._next_attempt(base))

  @property
  def count(self) -> int:
    return self.line.count

  @property
  def broken(self) -> bool:
    return self.line.broken

  @property
  def prefix(self) -> str:
    return f"{self.line.base}/{self.line.attempt}"

  def barrier(self, label: str, explain: Explain | None = None, timeout_s: float = 0) -> None:
    """The attempt's next barrier (``label``: its name in messages); past it, raise what
    another process published for it (``explain`` makes the error; default
    :meth:`default_error`). ``timeout_s``: a shorter deadline than the attempt's."""
    if not self.multi or self.closed:
      return
    if self.broken:
      raise BarrierTimeoutError(
        f"{self.what} of {_paths.display(self.shown)!r}: an earlier barrier of this attempt "
        f"failed on process {jax.process_index()} (a deadline, or a lost process), so it "
        f"cannot reach barrier '{label}'. Call it again on every process."
      )
    i = self._arrive(label, timeout_s or self.timeout_s)
    if i == 0 and jax.process_index() == 0:
      self._tidy()
    found = self.failure(i)
    if found is not None:
      self.closed = True  # every process stops at this barrier: none goes further
      error = self._learned((explain or self.default_error)(found, f"at barrier '{label}'"))
      self.line.settled = error  # (met at its barrier: no enclosing segment arrives again)
      raise error

  def gather(self, label: str, value: str, last: bool = False) -> list[str]:
    """Every process's ``value``, in process order, on every process: each posts its own,
    then the attempt's next barrier (``label``), then the reads. One process: ``[value]``.
    ``last``: the attempt's last barrier (it closes there)."""
    if not self.multi:
      return [value]
    key = f"{self.prefix}/g{self.count}"
    self.client.key_value_set(f"{key}/{jax.process_index()}", value, allow_overwrite=True)
    self.barrier(label)
    self.closed = self.closed or last
    ms = max(1, int(self.timeout_s * 1000))
    return [
      self.client.blocking_key_value_get(f"{key}/{p}", ms) for p in range(jax.process_count())
    ]

  def share(self, label: str, value: str | None, last: bool = False) -> str:
    """Process 0's ``value`` (the others pass None), on every process: process 0 posts it,
    then the attempt's next barrier (``label``), then the reads (a failure process 0
    published instead is raised there). ``last``: as :meth:`gather`."""
    if not self.multi:
      assert value is not None
      return value
    key = f"{self.prefix}/s{self.count}"
    if jax.process_index() == 0:
      assert value is not None
      self.client.key_value_set(key, value, allow_overwrite=True)
    self.barrier(label)
    self.closed = self.closed or last
    if value is not None:
      return value
    return self.client.blocking_key_value_get(key, max(1, int(self.timeout_s * 1000)))

  def _arrive(self, label: str, timeout_s: float) -> int:
    i, self.line.count = self.line.count, self.line.count + 1
    try:
      _commit.barrier_id(f"{self.prefix}/b{i}", self.location, label, timeout_s)
    except BaseException:
      self.line.broken = True  # the service failed it for every process: no walking on
      raise
    return i

  def failure(self, index: int | None = None) -> Failure | None:
    """The first failure another process published for barrier ``index`` (default: the next
    one). Unreadable reads as a failure (fail closed: not knowing is not "no failure")."""
    i = self.count if index is None else index
    for attempt in range(3):
      try:
        found = _commit.published(self.line.location, self._errors(i))
        return Failure.parse(*found[0]) if found else None
      except Exception as e:
        if attempt == 2:
          return Failure(-1, False, f"the coordination service cannot be read ({e!r})")
        time.sleep(0.2)
    return None

  def poll(self, when: str, explain: Explain | None = None) -> None:
    """(Waiting in a collective.) Raise if another process published a failure for the next
    barrier: it will not join the collective. The attempt stays open, so this process's
    :meth:`fail` then meets that process at that barrier."""
    if self.multi and not self.closed:
      found = self.failure()
      if found is not None:
        raise self._learned((explain or self.default_error)(found, when))

  def _learned(self, error: CheckpointError) -> CheckpointError:
    """``error``, remembered as another process's failure (:meth:`fail` does not publish
    it as this process's own)."""
    attempt: Attempt | None = self
    while attempt is not None:  # (and of the attempts it is a segment of)
      attempt.learned, attempt = error, attempt.parent
    return error

  def fail(self, error: BaseException) -> None:
    """This process failed: publish ``error`` for the next barrier (unless it is another
    process's failure, already published) and arrive there, once. Nothing past the last
    barrier, after a failed barrier, or when it could not be published (fail closed).

    A failure costs every process of the line exactly one barrier, the one it was published
    for: the process that failed arrives there here; one that learned of it at that barrier
    (:meth:`barrier`) has arrived already; one that learned of it by :meth:`poll` (before
    arriving) arrives there here. Then the failure is *settled* on the line: an enclosing
    segment it leaves neither publishes it nor arrives again. So where a caller catches it
    and goes on in the line (the manager exchanging every process's outcome), every process
    goes on from the same barrier."""
    if not self.multi or self.closed or self.broken or self.failed:
      return
    if error is self.line.settled:
      self.closed = True
      return
    self.failed = True
    if error is not self.learned and not isinstance(error, _collective.PeerFailedError):
      kind = "damaged" if isinstance(error, DamagedError) else "error"
      text = f"{type(error).__name__}: {_paths.error_text(error)}"[:_MAX_ERROR_CHARS]
      if not _commit.publish(self.line.location, self._errors(self.count), f"{kind}:{text}"):
        return
    _commit.report(self.location, f"{self.kind}: failed")
    try:
      self._arrive(f"{self.kind}-failed", self.timeout_s)
      self.line.settled = error
    except CheckpointError:  # the others are gone or late: they time out and say so
      pass
    self.closed = True

  def default_error(self, found: Failure, when: str) -> CheckpointError:
    who = f"process {found.process}" if found.process >= 0 else "another process (unknown)"
    error: type[CheckpointError] = DamagedError if found.damaged else PeerFailedError
    return error(
      f"{self.what} of {_paths.display(self.shown)!r} failed on {who} "
      f"({found.text}); process {jax.process_index()} learned of it {when} and stops too. "
      f"Fix the cause on {who} and call it again on every process (a failed attempt "
      "leaves nothing behind)."
    )

  def _errors(self, index: int) -> str:
    return f"{self.line.kind}/{self.line.attempt}/e{index}"

  def _tidy(self) -> None:
    """(Process 0, past barrier 0.) Every process has finished the previous attempt: drop
    its keys (the errors it published)."""
    if self.line.attempt > 0:
      try:
        self.client.key_value_delete(f"{self.line.base}/{self.line.attempt - 1}")
      except Exception:  # tidiness only
        pass


@contextlib.contextmanager
def collective(
  location: str,
  kind: str,
  timeout_s: float,
  on: bool,
  what: str | None = None,
  done: str | None = None,
) -> Iterator[Attempt]:
  """The current attempt (``on``: this call is collective with several processes) for the
  block: an exception leaving it is published (:meth:`Attempt.fail`) before it is raised.
  Inside an open attempt, a segment of it. ``what``: its name in errors; ``done``: the name
  of a last barrier, when the block ends still open (a failure anywhere in the block then
  always has a barrier every process reaches)."""
  parent = _current.get()
  if on and parent is not None and parent.multi and not parent.closed:
    attempt = Attempt(location, kind, timeout_s, parent=parent, what=what)
  else:
    attempt = Attempt(_keyed.get() or location, kind, timeout_s, multi=on, what=what)
  token = _current.set(attempt)
  try:
    yield attempt
    if done is not None:
      attempt.barrier(done)
  except BaseException as e:
    attempt.fail(e)
    raise
  finally:
    attempt.closed = True
    _current.reset(token)


@contextlib.contextmanager
def keyed(name: str) -> Iterator[None]:
  """Collective calls in the block key their attempts on ``name`` instead of their location
  (a manager's restore of a step: per-host fast-tier paths differ between processes, and one
  process may read its local copy while another reads the durable one)."""
  token = _keyed.set(name)
  try:
    yield
  finally:
    _keyed.reset(token)


def current() -> Attempt:
  """The attempt of the collective call this thread is in (a no-op one outside any)."""
  got = _current.get()
  return got if got is not None else Attempt("", "none", 0.0, multi=False)


def agree(waves: bool, plan: Sequence[tuple[str, str]] | None = None) -> None:
  """Barrier 0 of the current attempt: every process has done what can fail on it alone
  before the first collective. ``waves``: whether barriers follow (else it closes).
  ``plan``: what every process must agree on, ``(key path, description)`` per leaf (e.g.
  the target's shape, dtype and sharding): process 0 publishes it, every other process
  compares it with its own first and, where they differ, fails (so every process raises at
  the agreement, naming the first leaf that differs)."""
  attempt = current()
  deadline = time.monotonic() + attempt.timeout_s
  if plan is not None and attempt.multi and not attempt.closed:
    _same_plan(attempt, [list(e) for e in plan], deadline)
  left = max(0.001, deadline - time.monotonic())  # (one deadline for the wait and barrier 0)
  attempt.barrier(f"{attempt.kind}-agreed", timeout_s=left)
  if not waves:
    attempt.closed = True


def _same_plan(attempt: Attempt, mine: list[list[str]], deadline: float) -> None:
  """Raise :class:`CheckpointError` unless ``mine`` is process 0's plan (its digest first;
  while waiting for it, a failure published for barrier 0 raises)."""
  text = json.dumps(mine, separators=(",", ":"))
  digest = hashlib.sha256(text.encode()).hexdigest()[:32]
  key = f"{attempt.prefix}/plan{attempt.count}"
  if jax.process_index() == 0:
    attempt.client.key_value_set(key, json.dumps([digest, mine]), allow_overwrite=True)
    return
  while True:
    try:
      theirs, plan0 = json.loads(attempt.client.blocking_key_value_get(key, int(POLL_S * 1000)))
      break
    except Exception:  # (not there yet: a failure published meanwhile ends the wait)
      attempt.poll("while waiting for process 0's plan")
      if time.monotonic() > deadline:
        return  # (barrier 0 times out and says so)
  if theirs != digest:
    raise CheckpointError(_difference(attempt, mine, plan0))


def _difference(attempt: Attempt, mine: list[list[str]], theirs: list[list[str]]) -> str:
  p = jax.process_index()
  where = f"{attempt.what} of {_paths.display(attempt.shown)!r}: "
  fix = " Pass the same target (shapes, dtypes, shardings) on every process."
  for a, b in zip(mine, theirs):
    if a != b:
      return (
        f"{where}process {p}'s target differs from process 0's at {a[0]}: {a[1]} on process "
        f"{p}, {b[1]} on process 0." + fix
      )
  return f"{where}process {p}'s target has {len(mine)} leaves and process 0's {len(theirs)}." + fix


def close() -> None:
  """Past the attempt's last barrier: a failure from here on waits for no one."""
  current().closed = True
