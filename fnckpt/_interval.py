"""PURE: how often to checkpoint, from what a save costs and how often the job fails.

:func:`optimal_interval_s` is Daly's higher-order estimate (J. T. Daly, "A higher order
estimate of the optimum checkpoint interval for restart dumps", Future Generation Computer
Systems 22(3), 2006). :class:`AutoInterval` turns it into a number of steps for
``CheckpointManager(save_interval_steps="auto")`` from measurements the manager feeds it (the
cost of each save, the time of each step); it does no I/O and reads no clock itself.
:func:`mtbf_from_starts` estimates the mean time between failures from the start times the
manager records in the run directory (:mod:`fnckpt._health`).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Sequence

__all__ = ["optimal_interval_s", "mtbf_from_starts", "AutoInterval", "Schedule"]


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
  times = sorted(float(t) for t in starts)
  if len(times) < 2 or times[-1] <= times[0]:
    return None
  return (times[-1] - times[0]) / (len(times) - 1)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """What ``save_interval_steps="auto"`` is doing (``CheckpointManager.schedule``).

  ``interval_steps``: the interval in use (steps between saves); ``interval_s``: Daly's ``T``
  for the measured cost (``None`` until a save has committed); ``save_cost_s``: the mean cost
  of this run's committed saves (from ``save`` being called until committed: the caller's
  blocked time plus the background write and commit); ``mtbf_s`` and where it came from
  (``"given"``, ``"restarts"``); ``step_time_s``: the mean wall time of a training step
  (between calls of ``should_save``); ``expected_lost_s``: the expected work lost per failure,
  ``P/2 + C`` for a save period ``P = interval_steps * step_time_s`` (a failure lands
  anywhere in a period; the newest save is usable only ``C`` after it started); ``saves``
  started and ``skipped`` (due while the previous save was still writing).
  """
  interval_steps: int
  interval_s: float | None
  save_cost_s: float | None
  mtbf_s: float
  mtbf_source: str
  step_time_s: float | None
  expected_lost_s: float | None
  saves: int
  skipped: int


class AutoInterval:
  """The state of an automatic save interval: measured save costs and step times in, the
  next step to save out. Thread-safe (costs arrive from the manager's background thread).

  >>> auto = AutoInterval(mtbf_s=3600.0, mtbf_source="given")
  >>> for step in range(4):
  ...   auto.note_step(step, now=10.0 * step)     # 10 s per step
  >>> auto.due(0), auto.due(1)                   # nothing measured: save the first step asked
  (True, True)
  >>> auto.started(0); auto.committed(cost_s=20.0)
  >>> auto.schedule().interval_steps             # Daly: T = 366 s for C = 20 s, M = 1 h
  37
  >>> auto.due(36), auto.due(37)
  (False, True)
  """

  def __init__(self, mtbf_s: float, mtbf_source: str):
    self.mtbf_s = _positive("mtbf_s", mtbf_s)
    self.mtbf_source = mtbf_source
    self._lock = threading.Lock()
    self._costs: list[float] = []
    self._first: tuple[int, float] | None = None   # (step, time) of the first step seen
    self._last: tuple[int, float] | None = None
    self._last_save: int | None = None
    self._saves = self._skipped = 0

  def note_step(self, step: int, now: float) -> None:
    """The loop reached ``step`` at time ``now`` (monotonic seconds)."""
    with self._lock:
      if self._first is None or step < self._first[0]:
        self._first = (step, now)
      self._last = (step, now)

  def started(self, step: int) -> None:
    with self._lock:
      self._saves += 1
      self._last_save = step

  def skipped(self, step: int) -> None:
    """A due save of ``step`` was not started (the previous one was still writing); the
    next one is due an interval later."""
    with self._lock:
      self._skipped += 1
      self._last_save = step

  def committed(self, cost_s: float) -> None:
    with self._lock:
      self._costs = (self._costs + [float(cost_s)])[-16:]  # recent saves only

  def due(self, step: int) -> bool:
    with self._lock:
      last = self._last_save
    return last is None or step - last >= self.schedule().interval_steps

  def schedule(self) -> Schedule:
    with self._lock:
      costs, first, last = list(self._costs), self._first, self._last
      saves, skipped = self._saves, self._skipped
    step_s = ((last[1] - first[1]) / (last[0] - first[0])
              if first and last and last[0] > first[0] and last[1] > first[1] else None)
    cost = sum(costs) / len(costs) if costs else None
    t = optimal_interval_s(max(cost, 1e-6), self.mtbf_s) if cost is not None else None
    steps = max(1, round(t / step_s)) if t is not None and step_s else 1
    lost = steps * step_s / 2 + cost if step_s and cost is not None else None
    return Schedule(steps, t, cost, self.mtbf_s, self.mtbf_source, step_s, lost, saves,
                    skipped)
