"""PURE: how often to checkpoint, from what a save costs and how often the job fails.

:func:`optimal_interval_s` is Daly's higher-order estimate (J. T. Daly, "A higher order
estimate of the optimum checkpoint interval for restart dumps", Future Generation Computer
Systems 22(3), 2006). :class:`Cadence` turns it into a number of steps for
``CheckpointManager(save_interval_steps="auto")`` from measurements the manager feeds it (the
cost of each save, the time of each step); it does no I/O and reads no clock itself.
:func:`mtbf_from_starts` estimates the mean time between failures from the start times the
manager records in the run directory (:mod:`fnckpt._manager.starts`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Sequence, cast

__all__ = ["optimal_interval_s", "mtbf_from_starts", "Cadence", "Schedule"]


def _positive(name: str, value: float) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{name} must be a number of seconds, got {value!r}.")
  value = float(value)
  if not (value > 0 and math.isfinite(value)):
    raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}.")
  return value


def optimal_interval_s(cost_s: float, mtbf_s: float) -> float:
  """The compute time to run between two checkpoints, by Daly's higher-order formula.

  With ``C = cost_s`` (the time one checkpoint costs) and ``M = mtbf_s`` (the mean time
  between failures): for ``C < 2M``,
  ``T = sqrt(2CM) * (1 + sqrt(C/(2M))/3 + (C/(2M))/9) - C``, else ``T = M``. Its first term
  is Young's ``sqrt(2CM)``. ``T`` is the *compute* time between checkpoints, not counting the
  checkpoint itself: one period from the start of a save to the start of the next is
  ``T + C`` when saves stall the job. Daly's own examples are ``T``: ``M`` = 24 h and ``C`` =
  5 min give 116.7 min (Young: 120 min), ``M`` = 15 min and ``C`` = 5 min give 9.1 min.

  >>> round(optimal_interval_s(5 * 60, 24 * 3600) / 60, 1)
  116.7
  >>> round(optimal_interval_s(5 * 60, 15 * 60) / 60, 1)
  9.1
  >>> optimal_interval_s(600, 60)   # C >= 2M: checkpoint every M
  60.0
  """
  c, m = _positive("cost_s", cost_s), _positive("mtbf_s", mtbf_s)
  if c >= 2 * m:
    return m
  x = c / (2 * m)
  return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def mtbf_from_starts(starts: Sequence[float]) -> float | None:
  """The mean time between failures of a run that started at the (Unix) times ``starts``:
  every start after the first is a restart after a failure (or preemption), so it is the
  time from the first start to the last, divided by the restarts. ``None`` before the
  first restart (nothing measured yet).

  >>> mtbf_from_starts([100.0, 1100.0, 3100.0])
  1500.0
  >>> mtbf_from_starts([100.0]) is None
  True
  """
  times = sorted(t for t in map(float, starts) if math.isfinite(t))
  if len(times) < 2 or times[-1] <= times[0]:
    return None
  return (times[-1] - times[0]) / (len(times) - 1)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How often a :class:`fnckpt.CheckpointManager` saves, and what it costs
  (``CheckpointManager.schedule``).

  ``interval_steps``: the interval in use (steps between saves; with ``"auto"`` the one all
  processes agreed on at the last save); ``auto``: whether it is computed; ``interval_s``:
  Daly's ``T`` for the measured cost and ``mtbf_s`` (``None`` until a save has committed, or
  without an MTBF); ``save_cost_s``: the mean cost of this run's recent committed saves, from
  ``save`` being called until committed (the caller's blocked time plus the background write
  and commit: while it lasts, a failure loses this save too); ``mtbf_s`` and
  ``mtbf_source`` (``"given"``, ``"restarts"`` or ``None``); ``step_time_s``: the mean wall
  time of a training step (between calls of ``should_save``/``save``); ``expected_lost_s``:
  the expected work lost per failure, ``P/2 + C`` for the save period
  ``P = interval_steps * step_time_s`` and cost ``C`` (a failure lands anywhere in a period,
  and the newest save is usable only ``C`` after it started); ``saves`` started and
  ``skipped`` (due while the previous save was still writing; ``"auto"`` only);
  ``copy_wait_s``: the seconds ``save`` waited in all for the previous durable copy from the
  local tier to finish before starting a durable save (one process with a local tier:
  back-pressure, so copies never pile up).
  """

  interval_steps: int
  auto: bool
  interval_s: float | None
  save_cost_s: float | None
  mtbf_s: float | None
  mtbf_source: str | None
  step_time_s: float | None
  expected_lost_s: float | None
  saves: int
  skipped: int
  copy_wait_s: float = 0.0


class Cadence:
  """When a manager saves: a fixed interval (``interval_steps``) or ``None`` for automatic
  (Daly's ``T`` for the measured save cost and ``mtbf_s``, in steps of the measured step
  time). Measurements in, decisions out; no clock, no I/O. Thread-safe (costs arrive from the
  manager's background thread).

  With several processes the interval must be the same everywhere: process 0 calls
  :meth:`decide` at each save and every process :meth:`apply` s its answer.

  >>> cadence = Cadence(None, mtbf_s=3600.0, mtbf_source="given")
  >>> for step in range(4):
  ...   cadence.note_step(step, now=10.0 * step)  # 10 s per step
  >>> cadence.due(0), cadence.due(1)              # nothing measured yet: save when asked
  (True, True)
  >>> cadence.apply(0, cadence.decide(busy=False)); cadence.committed(cost_s=20.0)
  >>> cadence.apply(1, cadence.decide(busy=True))  # (a save due while one is writing)
  >>> s = cadence.schedule(); (s.interval_steps, round(s.interval_s), s.saves, s.skipped)
  (37, 366, 1, 1)
  >>> cadence.due(37), cadence.due(38)            # Daly: T = 366 s for C = 20 s, M = 1 h
  (False, True)
  """

  def __init__(
    self, interval_steps: int | None, mtbf_s: float | None = None, mtbf_source: str | None = None
  ):
    self.auto = interval_steps is None
    self.mtbf_s = None if mtbf_s is None else _positive("mtbf_s", mtbf_s)
    self.mtbf_source = mtbf_source if mtbf_s is not None else None
    if self.auto and self.mtbf_s is None:
      raise ValueError(
        "save_interval_steps='auto' needs a mean time between failures: pass "
        "mtbf_s=<seconds>. Each 'auto' manager that starts records its start in "
        "the run directory; once two are recorded the MTBF is measured from them "
        "and mtbf_s may be left out."
      )
    self._lock = threading.Lock()
    self._interval = 1 if self.auto else int(cast(int, interval_steps))
    self._costs: list[float] = []
    self._first: tuple[int, float] | None = None  # (step, time) of the first step seen
    self._last: tuple[int, float] | None = None
    self._last_save: int | None = None
    self._saves = self._skipped = 0
    self._waited = 0.0

  def note_step(self, step: int, now: float) -> None:
    """The loop is at ``step`` at time ``now`` (monotonic seconds)."""
    with self._lock:
      if self._first is None or step < self._first[0]:
        self._first = (step, now)
      if self._last is None or step > self._last[0]:
        self._last = (step, now)

  def committed(self, cost_s: float) -> None:
    """A save of this manager committed, ``cost_s`` after it was called."""
    with self._lock:
      self._costs = (self._costs + [float(cost_s)])[-16:]  # recent saves only

  def waited(self, seconds: float) -> None:
    """A save waited ``seconds`` for the previous durable copy (back-pressure)."""
    with self._lock:
      self._waited += float(seconds)

  def due(self, step: int) -> bool:
    """Whether ``step`` is on the interval."""
    with self._lock:
      if not self.auto:
        return step % self._interval == 0
      return self._last_save is None or step - self._last_save >= self._interval

  def decide(self, busy: bool) -> dict[str, Any]:
    """(Process 0, at a due save) ``{"save": bool, "interval": steps}``: skip the save while
    the previous one is writing (``busy``; ``"auto"`` only), and the interval from now on."""
    return {"save": not (self.auto and busy), "interval": self._proposal()}

  def apply(self, step: int, decision: dict[str, Any]) -> None:
    """(Every process) adopt process 0's :meth:`decide` for the save due at ``step``."""
    with self._lock:
      if self.auto:
        self._interval = max(1, int(decision["interval"]))
      self._last_save = step
      if decision["save"]:
        self._saves += 1
      else:
        self._skipped += 1

  def _measured(self) -> tuple[float | None, float | None]:
    with self._lock:
      costs, first, last = list(self._costs), self._first, self._last
    step_s = (
      (last[1] - first[1]) / (last[0] - first[0])
      if first and last and last[0] > first[0] and last[1] > first[1]
      else None
    )
    return (sum(costs) / len(costs) if costs else None), step_s

  def _proposal(self) -> int:
    cost, step_s = self._measured()
    if not self.auto or cost is None or step_s is None:
      return self._interval
    assert self.mtbf_s is not None  # ('auto' needs it: __init__)
    return max(1, round(optimal_interval_s(max(cost, 1e-6), self.mtbf_s) / step_s))

  def schedule(self) -> Schedule:
    """What is in use and measured now."""
    cost, step_s = self._measured()
    with self._lock:
      steps, saves, skipped, waited = (self._interval, self._saves, self._skipped, self._waited)
    t = (
      optimal_interval_s(max(cost, 1e-6), self.mtbf_s)
      if cost is not None and self.mtbf_s is not None
      else None
    )
    lost = steps * step_s / 2 + cost if step_s is not None and cost is not None else None
    return Schedule(
      interval_steps=steps,
      auto=self.auto,
      interval_s=t,
      save_cost_s=cost,
      mtbf_s=self.mtbf_s,
      mtbf_source=self.mtbf_source,
      step_time_s=step_s,
      expected_lost_s=lost,
      saves=saves,
      skipped=skipped,
      copy_wait_s=waited,
    )
