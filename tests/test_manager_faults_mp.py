"""A failure on one process between a CheckpointManager's collective calls fails every process
at once, and the next call works (issue 34), with real processes (``jax.distributed`` on
127.0.0.1; the children run ``tests/manager_faults_worker.py``, each with a fast tier). The
barrier deadlines are fnckpt's default 600 s: the processes are stopped at 90 s, and each
test checks that the others raised within 30 s of the failure (a hang guard, not a timing
figure)."""

from __future__ import annotations

import json
import os
import random
import sys

import helpers_proc as hp
import pytest

pytestmark = pytest.mark.slow

WORKER = os.path.join(hp.HERE, "manager_faults_worker.py")
HANG_GUARD_S = 30


def group(cfg: dict, n: int, timeout: float = 90) -> list[list[dict]]:
  port = hp.free_port()
  procs = [hp.start([sys.executable, WORKER, json.dumps(
      {"mode": "tries", **cfg, "port": port, "num_processes": n, "process_id": i})])
           for i in range(n)]
  results = hp.finish(procs, timeout)
  for r in results:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  return [r.result["tries"] for r in sorted(results, key=lambda r: r.result["process"])]


def assert_failed_together(tries: list[dict], failing: int, cause: str) -> None:
  """The failing process raised its own error; every other raised a CheckpointError naming it
  and ``cause``, within the hang guard of the failure."""
  failed_at = tries[failing]["failed_at"]
  for p, t in enumerate(tries):
    assert "error" in t, (p, t)
    if p != failing:
      assert t["checkpoint_error"], (p, t)
      assert f"process {failing}" in t["message"] and cause in t["message"], (p, t)
      assert t["raised_at"] - failed_at < HANG_GUARD_S, (p, t, failed_at)


@pytest.mark.parametrize("n,how", [(2, "listing"), (4, "internal")])
def test_a_failure_inside_restore_on_one_process_fails_all_then_every_call_works(
    tmp_path, n, how):
  """Process 1 fails inside manager.restore() after the manager's first collective call
  (its fast tier's listing, or the manager's own code): before, the others waited at the
  next call's barrier for its 600 s deadline. Now every other process raises a
  CheckpointError naming process 1 and the cause; then restore, latest_step, a save and
  restore_or_init work on every process."""
  cause = "Permission denied (injected)" if how == "listing" else "injected internal failure"
  tries = group({"root": str(tmp_path / "run"), "tries": [
      {"op": "restore", "fail": {"process": 1, "how": how}}, {"op": "restore"},
      {"op": "latest"}, {"op": "save", "step": 3}, {"op": "restore_or_init"}]}, n)
  assert_failed_together([t[0] for t in tries], 1, cause)
  for t in tries:
    assert [g.get("ok") for g in t[1:]] == [2, 2, 3, 3], t
    assert t[1]["checked"] == t[4]["checked"] > 0, t


def test_10_mixed_manager_calls_with_failures_on_random_processes(tmp_path):
  """10 manager calls from 2 processes, never synchronized between calls: restores,
  restore_or_init, latest_step and saves, some failing on a random process in a random way
  (seeded). Every failed call fails on every process naming the failing one; every correct
  call after it works."""
  rng = random.Random(34)
  causes = {"listing": "Permission denied (injected)", "internal": "injected internal failure",
            "stage": "injected stage failure"}
  plan, step = [], 2
  for _ in range(10):
    t: dict = {"op": rng.choice(["restore", "restore_or_init", "latest", "save"])}
    failing = rng.random() < 0.5
    if t["op"] == "save":
      step += 1 if failing or rng.random() < 0.5 else 2  # odd: the fast tiers (held shards)
      t["step"] = step + (step % 2 == 0 and failing)
      step = t["step"]
    if failing:
      how = "stage" if t["op"] == "save" else rng.choice(["listing", "internal"])
      t["fail"] = {"process": rng.randrange(2), "how": how}
    plan.append(t)
  assert sum("fail" in t for t in plan) >= 3 and {t["op"] for t in plan} >= {"save", "restore"}
  tries = group({"root": str(tmp_path / "run"), "tries": plan}, 2)
  newest = 2
  for i, t in enumerate(plan):
    got = [tries[p][i] for p in (0, 1)]
    if "fail" in t:
      assert_failed_together(got, t["fail"]["process"], causes[t["fail"]["how"]])
      continue
    if t["op"] == "save":
      newest = t["step"]
    assert [g.get("ok") for g in got] == [newest] * 2, (i, t, got)


@pytest.mark.parametrize("failing,how", [(1, "wait_saved"), (1, "restore_listing"),
                                         (0, "wait_saved"), (1, "after_restore")])
def test_a_failure_around_a_broadcast_restore_fails_all_then_every_call_works(
    tmp_path, failing, how):
  """One process fails inside the manager's restore of the chosen step, after process 0's
  choice and before the broadcast restore's agreement (its wait for the step's save, its fast
  tier's listing), or after that restore's last barrier. Before, in the first case the others
  were at that agreement, the same numbered barrier as the failing process's exchange of
  outcomes, passed it with it, and waited for the 600 s deadline. Now every other process
  raises a CheckpointError naming the failing process and the cause within the hang guard
  (process 0 failing: process 1 learns of it while waiting for its plan); then broadcast
  restores, restore_or_init and latest_step work on every process."""
  cause = {"wait_saved": "injected wait_saved failure",
           "restore_listing": "Permission denied (injected)",
           "after_restore": "injected failure after the restore"}[how]
  bcast = {"broadcast": True}
  tries = group({"root": str(tmp_path / "run"), "tries": [
      {"op": "restore", "kwargs": bcast, "fail": {"process": failing, "how": how}},
      {"op": "restore", "kwargs": bcast}, {"op": "restore_or_init", "kwargs": bcast},
      {"op": "latest"}]}, 2, timeout=75)
  assert_failed_together([t[0] for t in tries], failing, cause)
  for t in tries:
    assert [g.get("ok") for g in t[1:]] == [2, 2, 2], t
    assert t[1]["checked"] == t[2]["checked"] > 0, t
