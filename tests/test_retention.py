"""The retention policy: a pure function of the committed steps (+ metrics). No files."""

import math

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from fnckpt._manager.retention import Policy, keep, to_delete

CASES = [
    # (steps, policy, metrics, protect, kept)
    ([], Policy(max_to_keep=1), None, (), []),
    ([5], Policy(max_to_keep=0), None, (), [5]),                     # newest always kept
    (range(10), Policy(), None, (), list(range(10))),                # no rule: keep all
    (range(10), Policy(max_to_keep=3), None, (), [7, 8, 9]),
    (range(10), Policy(max_to_keep=3), None, (2,), [2, 7, 8, 9]),    # in flight
    (range(10), Policy(max_to_keep=3), None, (42,), [7, 8, 9, 42]),  # protect needs no listing
    (range(0, 100, 10), Policy(keep_every=30), None, (), [0, 30, 60, 90]),
    (range(0, 100, 10), Policy(max_to_keep=2, keep_every=40), None, (), [0, 40, 80, 90]),
    ([1, 2, 3, 4], Policy(best_n=2), {1: 0.3, 2: 0.1, 3: 0.2, 4: 0.9}, (), [2, 3, 4]),
    ([1, 2, 3, 4], Policy(best_n=2, best_mode="max"), {1: 0.3, 2: 0.1, 3: 0.2, 4: 0.9}, (),
     [1, 4]),
    # ties go to the newer step; NaN, missing and non-numbers are never best
    ([1, 2, 3, 4, 5], Policy(best_n=1), {1: 0.5, 2: 0.5, 3: math.nan, 4: "x"}, (), [2, 5]),
    ([1, 2, 3, 4, 5], Policy(best_n=1), {1: True, 2: 0.7}, (), [2, 5]),
    ([10, 20, 30], Policy(max_to_keep=1, best_n=1), {10: 0.0, 20: 1.0, 30: 2.0}, (), [10, 30]),
]


@pytest.mark.parametrize("steps,policy,metrics,protect,kept", CASES)
def test_keep(steps, policy, metrics, protect, kept):
  assert sorted(keep(steps, policy, metrics, protect)) == kept
  assert to_delete(steps, policy, metrics, protect) == [s for s in sorted(set(steps))
                                                        if s not in kept]


@pytest.mark.parametrize("kwargs,match", [
    ({"max_to_keep": -1}, "max_to_keep must be None or an int >= 0"),
    ({"keep_every": 0}, "keep_every must be None or an int >= 1"),
    ({"best_n": 1.5}, "best_n must be None or an int >= 0"),
    ({"max_to_keep": True}, "max_to_keep"),
    ({"best_mode": "best"}, "best_mode must be 'min' or 'max'"),
])
def test_policy_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Policy(**kwargs)


policies = st.builds(Policy,
                     max_to_keep=st.none() | st.integers(0, 6),
                     keep_every=st.none() | st.integers(1, 7),
                     best_n=st.none() | st.integers(0, 4),
                     best_mode=st.sampled_from(["min", "max"]))
step_lists = st.lists(st.integers(0, 60), max_size=25)


@settings(max_examples=300, deadline=None)
@given(steps=step_lists, policy=policies, protect=st.lists(st.integers(0, 70), max_size=3),
       values=st.lists(st.none() | st.floats(allow_nan=True, allow_infinity=False), max_size=25))
def test_invariants(steps, policy, protect, values):
  metrics = dict(zip(sorted(set(steps)), values))
  kept = keep(steps, policy, metrics, protect)
  deleted = to_delete(steps, policy, metrics, protect)
  assert set(deleted) | (kept & set(steps)) == set(steps)      # a partition of the steps
  assert not set(deleted) & kept
  assert set(protect) <= kept                                    # in-flight never deleted
  if steps:
    assert max(steps) in kept                                    # the newest always survives
  if policy.keeps_all:
    assert deleted == []
  if policy.max_to_keep:
    assert set(sorted(set(steps))[-policy.max_to_keep:]) <= kept
  if policy.keep_every:
    assert {s for s in steps if s % policy.keep_every == 0} <= kept
  if not policy.keeps_all:  # nothing is kept without a reason
    reasons = set(protect) | ({max(steps)} if steps else set())
    reasons |= set(sorted(set(steps))[-policy.max_to_keep:]) if policy.max_to_keep else set()
    reasons |= {s for s in steps if policy.keep_every and s % policy.keep_every == 0}
    ranked = sorted((v if policy.best_mode == "min" else -v, -s) for s, v in metrics.items()
                    if v is not None and not math.isnan(v))
    reasons |= {-s for _, s in ranked[:policy.best_n or 0]}
    assert kept == reasons
  # pure: same answer again, and independent of order and duplicates
  assert keep(list(reversed(steps)) + steps, policy, metrics, protect) == kept
