"""Overlapping saves (``fnckpt._save.pending``): a save started while its base is still being
written refers to that base once it commits; if the base fails it is written in full, never
wrong; a small budget never hangs. Overlap is forced deterministically: the base's writer is
held at its "written" phase (``_state.hooks.on_phase``) until the next save has started.
Every checkpoint is restored and compared bitwise; disk use is counted on disk."""

import os
import threading

import msgpack
import numpy as np
import pytest

import fnckpt
from fnckpt import _state
from fnckpt._save import save as _save

from test_incremental import FROZEN, assert_same, files_under

ADAPTER = 16384   # float32 elements: 64 KiB, packed


def tree(v: int) -> dict:
  """A large frozen leaf (a zarr array), a frozen packed leaf, an adapter that changes every
  step and a "slow" leaf that changes at odd steps only (so an even step shares it with the
  step just before it, not with the one before that)."""
  return {"frozen": FROZEN, "norm": np.linspace(0, 1, 8192, dtype=np.float32),
          "adapter": np.full((ADAPTER,), v, np.float32),
          "slow": np.full((ADAPTER,), (v + 1) // 2, np.float32), "step": v}


def _hold_writers(monkeypatch, fail=()):
  """Hold the writer of each save whose location ends in ``/<name>`` at "written" until
  ``gates[name]`` is set; a name in ``fail`` then fails there. Returns (gates, reached)."""
  gates: dict[str, threading.Event] = {}
  reached: dict[str, threading.Event] = {}

  def hook(phase):
    me = threading.current_thread().name.rsplit("/", 1)[-1]
    if phase == "written" and me in gates:
      reached[me].set()
      gates[me].wait(60)
      if me in fail:
        raise OSError(f"injected failure of the save of {me}")

  def hold(name: str) -> None:
    gates[name], reached[name] = threading.Event(), threading.Event()

  monkeypatch.setattr(_state.hooks, "on_phase", hook)
  return gates, reached, hold


def _bases(path: str) -> list[str]:
  with open(f"{path}/manifest.msgpack", "rb") as f:
    return [b["dir"] for b in msgpack.unpackb(f.read()).get("bases", [])]


def _record_bases(monkeypatch) -> list:
  """The ``base`` each save of a manager was started with."""
  seen, start = [], _save.start

  def spy(*args, **kwargs):
    seen.append(kwargs.get("base"))
    return start(*args, **kwargs)

  monkeypatch.setattr(_save, "start", spy)
  return seen


@pytest.mark.timeout(300)
def test_a_manager_chains_saves_started_while_the_previous_one_writes(tmp_path, monkeypatch):
  root = str(tmp_path / "run")
  gates, reached, hold = _hold_writers(monkeypatch)
  seen = _record_bases(monkeypatch)
  mgr = fnckpt.CheckpointManager(root, incremental=True)
  handles = []
  for v in range(8):
    hold(str(v))
    handles.append(mgr.save(v, tree(v)))
    if v:
      assert not handles[v - 1].done()   # the previous save was in flight all along
      gates[str(v - 1)].set()
  gates["7"].set()
  mgr.wait()
  assert seen == [None] + [f"{root}/{v}" for v in range(7)]
  for v in range(1, 8):
    bases = _bases(f"{root}/{v}")
    assert "0" in bases   # the frozen leaves: written once, by step 0 (references are flat)
    if v % 2 == 0:
      assert str(v - 1) in bases   # "slow": written by the step before, the base
  for v in range(8):
    assert_same(mgr.restore(v), tree(v))
  changed = 7 * ADAPTER * 4 + 4 * ADAPTER * 4
  full = FROZEN.nbytes + 8192 * 4 + 2 * ADAPTER * 4
  assert sum(files_under(root).values()) <= 1.1 * (full + changed)
  mgr.close()


@pytest.mark.timeout(300)
def test_a_failed_base_makes_the_overlapping_save_full(tmp_path, monkeypatch):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  gates, reached, hold = _hold_writers(monkeypatch, fail=("a",))
  hold("a")
  h1 = fnckpt.save(tree(1), a)
  h2 = fnckpt.save(tree(2), b, base=a)   # a is in flight (held at "written")
  assert not h1.done()
  gates["a"].set()
  with pytest.raises(fnckpt.CheckpointError, match="injected failure"):
    h1.wait()
  stats = h2.wait()
  assert stats.bytes_reused == 0 and _bases(b) == []
  assert not os.path.exists(f"{a}/COMMIT")
  assert_same(fnckpt.restore(b), tree(2))
  assert sum(files_under(b).values()) >= FROZEN.nbytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget", [1 << 20, 6 << 20])
def test_a_small_budget_with_overlapping_saves_does_not_hang(tmp_path, monkeypatch, budget):
  root = str(tmp_path / "run")
  gates, reached, hold = _hold_writers(monkeypatch)
  mgr = fnckpt.CheckpointManager(root, incremental=True,
                                 save_options={"budget_bytes": budget, "pack_bytes": 1 << 16})
  for v in range(4):
    hold(str(v))
    mgr.save(v, tree(v))
    if v:
      gates[str(v - 1)].set()
  gates["3"].set()
  mgr.wait()
  for v in range(4):
    assert_same(mgr.restore(v), tree(v))
  mgr.close()


@pytest.mark.timeout(300)
def test_save_with_a_base_in_flight_refers_to_it(tmp_path, monkeypatch):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  gates, reached, hold = _hold_writers(monkeypatch)
  hold("a")
  h1 = fnckpt.save(tree(1), a)
  h2 = fnckpt.save(tree(2), b, base=a)
  assert not h1.done()
  gates["a"].set()
  h1.wait()
  stats = h2.wait()
  assert _bases(b) == ["a"]
  assert stats.bytes_reused >= FROZEN.nbytes
  assert sum(files_under(b).values()) < FROZEN.nbytes // 2
  assert_same(fnckpt.restore(b), tree(2))
  assert_same(fnckpt.restore(a), tree(1))


@pytest.mark.timeout(300)
def test_two_processes_overlapping_manager_saves_chain(tmp_path):
  """Every process sees the same base outcome; process 0 decides reuse; all restore."""
  import json
  import sys
  import helpers_proc as hp
  import mp_manager_worker as mw
  import mp_worker
  worker = os.path.join(hp.HERE, "mp_manager_worker.py")
  root = str(tmp_path / "run")
  cfg = {"mode": "overlap", "root": root, "barrier_s": 60, "port": hp.free_port(),
         "num_processes": 2}
  procs = [hp.start([sys.executable, worker, json.dumps({**cfg, "process_id": i})],
                    hp.child_env()) for i in range(2)]
  for r in hp.finish(procs, timeout=240):
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
    assert r.result["steps"] == [0, 1, 2, 3, 4]
    assert r.result["reused"][0] == 0 and all(n > 0 for n in r.result["reused"][1:])
  for step in range(5):
    got = fnckpt.restore(f"{root}/{step}")
    for name, leaf in mw.OVERLAP_LEAVES.items():
      want = mp_worker.expected(name, leaf["shape"], "float32", 0)
      assert np.asarray(got[name]).tobytes() == want.tobytes(), (step, name)
    assert np.asarray(got["e"]).tobytes() == np.full((4096,), step, np.float32).tobytes()
    if step:
      assert _bases(f"{root}/{step}") == ["0"]   # flat: the frozen data is step 0's


@pytest.mark.timeout(300)
def test_replacing_a_base_in_flight_is_refused(tmp_path, monkeypatch):
  root = str(tmp_path / "run")
  gates, reached, hold = _hold_writers(monkeypatch)
  mgr = fnckpt.CheckpointManager(root, incremental=True)
  mgr.save(0, tree(0))
  mgr.wait()
  hold("1")
  h1 = mgr.save(1, tree(1))
  h2 = mgr.save(2, tree(2))   # refers to step 1, in flight
  try:
    assert not h1.done()
    with pytest.raises(fnckpt.CheckpointError, match="Step 1 of .* cannot be replaced: an "
                       "incremental save in flight refers to its data"):
      mgr.save(1, tree(11), force=True)
  finally:
    gates["1"].set()
  mgr.wait()
  assert "1" in _bases(f"{root}/2")   # "slow" changed at step 1, kept at step 2
  for v in range(3):
    assert_same(mgr.restore(v), tree(v))
  mgr.close()


@pytest.mark.timeout(300)
def test_a_failed_overlapping_save_gives_its_held_bytes_back(tmp_path, monkeypatch):
  """Staging fails after items were held for the base in flight: the save fails, its held
  bytes go back to the budget, and the base commits as usual."""
  from fnckpt._save import staging as _staging
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  two = lambda v: {**tree(v), "frozen2": FROZEN + 1}  # noqa: E731  (two stored leaves)
  gates, reached, hold = _hold_writers(monkeypatch)
  hold("a")
  h1 = fnckpt.save(two(1), a)
  calls, stage = [], _staging.stage_unit

  def failing(*args):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError("injected staging failure")
    return stage(*args)

  monkeypatch.setattr(_staging, "stage_unit", failing)
  with pytest.raises(fnckpt.CheckpointError, match="injected staging failure"):
    fnckpt.save(two(2), b, base=a)
  gates["a"].set()
  h1.wait()
  fnckpt.wait()
  assert _state.saves.budget.held == 0 and _state.saves.budget._spillers == []
  assert_same(fnckpt.restore(a), two(1))
  assert not os.path.exists(f"{b}/COMMIT")
