"""Recovery from peers' fast tiers with real ``jax.distributed`` processes (Gloo on CPU,
2 CPU devices each; the children run ``tests/mp_manager_worker.py`` mode ``peers``): a wiped
fast tier is recovered from the replicas another process holds (the newest local step, bitwise,
not the older durable one); without replicas the newest durable step is restored, with a
warning naming the process lacking the step and the step skipped."""

from __future__ import annotations

import json
import os
import sys

import pytest

import helpers_proc as hp

pytestmark = pytest.mark.slow

WORKER = os.path.join(hp.HERE, "mp_manager_worker.py")
BARRIER_S = 20


def run(cfg: dict, n: int) -> list[dict]:
  port = hp.free_port()
  procs = [hp.start([sys.executable, WORKER, json.dumps(
      {**cfg, "port": port, "num_processes": n, "process_id": i})], hp.child_env())
      for i in range(n)]
  runs = hp.finish(procs, timeout=150)
  for r in runs:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  return [r.result for r in runs]


def saved(tmp_path, n: int, spec, groups: int = 2) -> dict:
  cfg = {"mode": "peers", "root": str(tmp_path / "durable"), "spec": spec, "groups": groups,
         "local": [str(tmp_path / f"fast-host{i}") for i in range(n)], "barrier_s": BARRIER_S}
  run({**cfg, "phase": "save"}, n)
  for i in range(n):   # every host holds a record of the local steps it keeps
    assert os.path.exists(os.path.join(cfg["local"][i], "5", "held", f"{i}.json"))
  return cfg


@pytest.mark.parametrize("n", [2, 4])
def test_wiped_fast_tier_is_recovered_from_replicas(tmp_path, n):
  cfg = saved(tmp_path, n, [None, "s"])          # "w" replicated over "r" (2 groups)
  out = run({**cfg, "phase": "recover", "wipe": [1]}, n)
  for r in out:
    assert r["restored"] == 5 and r["latest"] == 5, json.dumps(out)   # not the durable step 4
    assert r["checked"] == 2 + 2 + 1, r
    assert not r["warnings"], r
  # step 5 exists nowhere but in the other processes' fast tiers (durable: 0, 2, 4; process
  # 1's wiped), so process 1's bitwise-equal shards came from them over the interconnect
  assert sorted(os.listdir(cfg["root"]), key=int) == ["0", "2", "4"]
  assert not os.path.exists(os.path.join(cfg["local"][1], "5"))


def test_wiped_fast_tier_without_replicas_falls_back_to_durable(tmp_path):
  cfg = saved(tmp_path, 2, ["r", "s"])           # "w" sharded over both axes: no replicas
  out = run({**cfg, "phase": "recover", "wipe": [1]}, 2)
  for r in out:
    assert r["restored"] == 4 and r["latest"] == 4, r
    assert r["checked"] == 2 + 2 + 1, r
    assert len(r["warnings"]) == 1, r
    msg = r["warnings"][0]
    assert "Step 5" in msg and "process(es) 1 (host" in msg and "step 4" in msg, msg


def after_change(tmp_path, spec) -> tuple[dict, list[dict]]:
  """Issue 34's scenario: 4 processes (2 devices each, mesh (2, 4)) save steps 0-7 with
  per-process fast tiers (durable: 0 and 5; each fast tier keeps 6 and 7); a new job of 2
  processes (4 devices each, the same global mesh) opens managers on the old processes 0 and
  1's fast tiers and restores."""
  cfg = {"mode": "peers", "root": str(tmp_path / "durable"), "spec": spec, "groups": 2,
         "local": [str(tmp_path / f"fast-host{i}") for i in range(4)], "barrier_s": BARRIER_S,
         "steps": 8, "every": 5}
  run({**cfg, "phase": "save"}, 4)
  assert sorted(os.listdir(cfg["root"]), key=int) == ["0", "5"]
  out = run({**cfg, "phase": "recover", "devices": 4, "s": 4, "local": cfg["local"][:2]}, 2)
  return cfg, out


def test_after_a_change_of_process_count_held_pieces_are_resharded(tmp_path):
  """"w" replicated over "r": the old processes 0 and 1 held a whole replica of step 7
  between them, so the new job reads their pieces and reshards them onto its own layout:
  step 7 (in no durable tier), bitwise, with no warning."""
  _, out = after_change(tmp_path, [None, "s"])
  for r in out:
    assert r["restored"] == 7 and r["latest"] == 7, json.dumps(out)
    assert r["checked"] == 4 + 4 + 1, r
    assert not r["warnings"], r


def test_after_a_change_of_process_count_the_fallback_is_never_silent(tmp_path):
  """"w" sharded over both axes: the old processes 0 and 1 held half of step 7's "w"; every
  process restores the durable step 5, bitwise, and warns naming step 7 and why."""
  _, out = after_change(tmp_path, ["r", "s"])
  for r in out:
    assert r["restored"] == 5 and r["checked"] == 4 + 4 + 1, r
    (msg,) = r["warnings"]
    assert msg.startswith("Step 7 is held in the fast tier of some processes but cannot be "
                          "restored from them: it was saved by 4 processes (this job has 2) "
                          "and no process holds piece 4 of leaf ['w'] (of 8)"), msg
    assert "step 7 is skipped and step 5 is restored from the durable tier." in msg, msg


def test_after_a_change_of_device_order_held_pieces_are_resharded(tmp_path):
  """The same 2 processes, each opening the other's fast tier (its records name the other
  process): step 5 is restored from them, bitwise, with no warning."""
  cfg = saved(tmp_path, 2, [None, "s"])
  out = run({**cfg, "phase": "recover", "local": cfg["local"][::-1]}, 2)
  for r in out:
    assert r["restored"] == 5 and r["latest"] == 5, json.dumps(out)
    assert r["checked"] == 2 + 2 + 1 and not r["warnings"], r
