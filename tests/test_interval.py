"""The checkpoint interval: Daly's higher-order formula against his published examples, its
argument checks, and the automatic interval's bookkeeping (pure; no files, no clocks)."""

import math

import pytest

import fnckpt
from fnckpt._manager import interval as _interval


@pytest.mark.parametrize("mtbf_s, cost_s, minutes", [
    (24 * 3600, 5 * 60, 116.7),   # Daly 2006: M = 24 h, C = 5 min -> ~117 min
    (15 * 60, 5 * 60, 9.14),      # M = 15 min, C = 5 min -> ~9.1 min
])
def test_daly_published_examples(mtbf_s, cost_s, minutes):
  t = fnckpt.optimal_interval_s(cost_s, mtbf_s)
  assert t / 60 == pytest.approx(minutes, abs=0.05)


def test_first_term_is_young_and_large_cost_gives_mtbf():
  c, m = 1.0, 1e8   # C << M: the higher-order terms vanish
  young = math.sqrt(2 * c * m)
  assert fnckpt.optimal_interval_s(c, m) == pytest.approx(young - c, rel=1e-3)
  assert fnckpt.optimal_interval_s(200.0, 100.0) == 100.0   # C >= 2M: T = M
  # continuous-ish at the boundary C = 2M (T -> M from below: the bracket is 1+1/3+1/9)
  below = fnckpt.optimal_interval_s(199.999, 100.0)
  assert below == pytest.approx(2 * 100 * (1 + 1 / 3 + 1 / 9) - 200, rel=1e-3)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "5", None, True])
def test_arguments_are_validated(bad):
  with pytest.raises(ValueError, match=r"cost_s must be a (finite )?number of seconds"):
    fnckpt.optimal_interval_s(bad, 100.0)
  with pytest.raises(ValueError, match=r"mtbf_s must be a (finite )?number of seconds"):
    fnckpt.optimal_interval_s(1.0, bad)


def test_mtbf_from_starts():
  assert _interval.mtbf_from_starts([]) is None
  assert _interval.mtbf_from_starts([5.0, 5.0]) is None
  assert _interval.mtbf_from_starts([3000.0, 0.0, 1000.0]) == 1500.0


def test_auto_cadence_schedule():
  cadence = _interval.Cadence(None, mtbf_s=24 * 3600.0, mtbf_source="given")
  first = cadence.schedule()
  assert (first.interval_steps, first.auto, first.interval_s, first.save_cost_s,
          first.expected_lost_s) == (1, True, None, None, None)
  for step in range(0, 101):
    cadence.note_step(step, now=1000.0 + 3.0 * step)       # 3 s per step
  assert cadence.due(0)
  cadence.apply(0, cadence.decide(busy=False))
  assert cadence.schedule().interval_steps == 1               # no cost measured yet
  cadence.committed(300.0)
  assert cadence.decide(busy=False) == {"save": True, "interval": 2334}
  cadence.apply(1, cadence.decide(busy=False))
  s = cadence.schedule()
  assert s.step_time_s == pytest.approx(3.0)
  assert s.interval_s == pytest.approx(fnckpt.optimal_interval_s(300.0, 24 * 3600.0))
  assert s.interval_steps == round(s.interval_s / 3.0) == 2334
  assert s.expected_lost_s == pytest.approx(2334 * 3.0 / 2 + 300.0)
  assert not cadence.due(2334) and cadence.due(2335)
  assert cadence.decide(busy=True)["save"] is False           # the previous save is writing
  cadence.apply(2335, cadence.decide(busy=True))              # skipped: next one an interval on
  assert (cadence.schedule().saves, cadence.schedule().skipped) == (2, 1)
  assert not cadence.due(2335 + 2333) and cadence.due(2335 + 2334)


def test_fixed_cadence_never_skips_and_reports_cost():
  cadence = _interval.Cadence(10)
  assert [s for s in range(25) if cadence.due(s)] == [0, 10, 20]
  assert cadence.decide(busy=True) == {"save": True, "interval": 10}
  for step in range(11):
    cadence.note_step(step, now=2.0 * step)
  cadence.committed(4.0)
  s = cadence.schedule()
  assert (s.auto, s.interval_steps, s.interval_s, s.mtbf_s) == (False, 10, None, None)
  assert s.expected_lost_s == pytest.approx(10 * 2.0 / 2 + 4.0)


def test_auto_needs_an_mtbf():
  with pytest.raises(ValueError, match="needs a mean time between failures: pass mtbf_s="):
    _interval.Cadence(None, None)
  with pytest.raises(ValueError, match="mtbf_s must be a finite number of seconds > 0"):
    _interval.Cadence(None, mtbf_s=0.0, mtbf_source="given")


def test_untrusted_starts_are_filtered_and_copy_waits_are_counted():
  from fnckpt._manager import starts as _starts
  now = 1.8e9
  assert _starts.plausible([float("nan"), float("inf"), 0.0, -1e300, now + 7200, now - 50,
                            "x", True, now - 100], now) == [now - 100, now - 50]
  assert _starts.plausible({"starts": [now]}, now) == []      # not a list: nothing
  assert _interval.mtbf_from_starts([float("nan"), 100.0, 1100.0]) == 1000.0
  cadence = _interval.Cadence(5)
  cadence.waited(1.5)
  cadence.waited(0.5)
  assert cadence.schedule().copy_wait_s == 2.0
