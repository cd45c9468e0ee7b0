"""Self-healing restore and the automatic save interval of CheckpointManager, on real local
files and memory://: a damaged newest step (flipped bytes, a missing chunk file, a truncated
manifest) is skipped with a warning, marked (not deleted) and not chosen again; restore(step)
of it raises; saving the step again replaces it; keep_durable keeps spare steps;
save_interval_steps="auto" measures, agrees and skips saves while one is writing."""

import glob
import os
import threading
import time
import uuid
import warnings

import msgpack
import numpy as np
import pytest

import fnckpt
from fnckpt._io import paths as _paths
from fnckpt import _state
from fnckpt._manager import health as _health, starts as _starts


def state_of(step, n=5000):
  return {"w": np.arange(n, dtype=np.float32) + step, "step": step, "b": np.full(3, step)}


def data_files(step_dir):
  return sorted(f for f in glob.glob(os.path.join(step_dir, "data-*", "**", "*"),
                                     recursive=True)
                if os.path.isfile(f) and os.path.basename(f) != "zarr.json")


def flip_bytes(step_dir):
  path = data_files(step_dir)[0]
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 3)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0xFF]))


def remove_chunk(step_dir):
  os.remove(data_files(step_dir)[0])


def truncate_manifest(step_dir):
  path = os.path.join(step_dir, "manifest.msgpack")
  os.truncate(path, os.path.getsize(path) // 2)


DAMAGE = {"flipped": (flip_bytes, "checksum mismatch"),
          "missing_chunk": (remove_chunk, "a chunk of its data is missing"),
          "truncated_manifest": (truncate_manifest, "does not match its commit marker")}


def saved_run(root, steps=(1, 2, 3), **kw):
  mgr = fnckpt.CheckpointManager(root, **kw)
  for s in steps:
    mgr.save(s, state_of(s))
  mgr.wait()
  return mgr


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_newest_step_is_skipped_marked_and_not_chosen_again(tmp_path, how):
  root = str(tmp_path / "run")
  damage, text = DAMAGE[how]
  mgr = saved_run(root)
  damage(os.path.join(root, "3"))
  with pytest.warns(RuntimeWarning, match=rf"Step 3 of '{root}' is damaged: .*{text}.*"
                                          r"step 3 is marked damaged \(not deleted"):
    got = mgr.restore()
  assert got["step"] == 2 and np.array_equal(got["w"], state_of(2)["w"])
  assert os.path.isdir(os.path.join(root, "3"))                 # not deleted
  assert os.path.isfile(os.path.join(root, _health.mark_key(3)))
  assert mgr.latest_step() == 2 and mgr.all_steps() == [1, 2]
  with pytest.raises(fnckpt.CheckpointError, match=rf"Step 3 of '{root}' is marked damaged "
                                                   rf"\(.*{text}.*\)\. Restore another step"):
    mgr.restore(3)
  again = fnckpt.CheckpointManager(root)                       # a new job: no second warning
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert again.restore()["step"] == 2
    assert again.restore_or_init(state_of(0))[1] == 2
  # the run goes on from step 2 and saves step 3 again: the new one is valid, the mark lifted
  again.save(3, {**state_of(3), "step": 33}).wait()
  assert again.all_steps() == [1, 2, 3] and again.restore()["step"] == 33
  assert again.restore(3)["step"] == 33


def test_damage_on_memory_storage_and_two_damaged_steps(tmp_path):
  root = f"memory://test_health/{uuid.uuid4().hex}"
  mgr = saved_run(root)
  kv = _paths.open_kvstore(root)
  for step in (2, 3):
    raw = kv.read(f"{step}/manifest.msgpack").result().value
    kv.write(f"{step}/manifest.msgpack", raw[: len(raw) // 2]).result()
  with pytest.warns(RuntimeWarning) as caught:
    state, step = mgr.restore_or_init(state_of(0))
  assert step == 1 and state["step"] == 1
  texts = [str(w.message) for w in caught if "is damaged" in str(w.message)]
  assert [t.split(" of ")[0] for t in texts] == ["Step 3", "Step 2"]
  assert mgr.all_steps() == [1] and sorted(mgr._index.list().damaged) == [2, 3]


def test_every_step_damaged_means_none_to_restore(tmp_path):
  root = str(tmp_path / "run")
  mgr = saved_run(root, steps=(1, 2))
  for step in (1, 2):
    truncate_manifest(os.path.join(root, str(step)))
  with pytest.warns(RuntimeWarning, match="is damaged"):
    with pytest.raises(fnckpt.CheckpointError, match=f"No committed checkpoint in '{root}'"):
      mgr.restore()
  state, step = fnckpt.CheckpointManager(root).restore_or_init(state_of(0))
  assert step is None and state["step"] == 0


def test_explicit_step_and_other_errors_do_not_mark(tmp_path):
  root = str(tmp_path / "run")
  mgr = saved_run(root)
  flip_bytes(os.path.join(root, "3"))
  with pytest.raises(fnckpt.CheckpointError, match=r"Cannot restore \['w'\] from .*: its data "
                                                   r"is corrupt \(crc32c checksum mismatch\)"):
    mgr.restore(3)                       # given explicitly: raised, not marked, not skipped
  assert mgr.all_steps() == [1, 2, 3]
  wrong = {"w": np.zeros(7, np.float32), "step": 0, "b": np.zeros(3, np.int64)}
  with pytest.raises(fnckpt.TreeMismatchError):
    mgr.restore(target=wrong)            # not damage: raised, nothing marked, no fallback
  assert mgr.all_steps() == [1, 2, 3]


def test_keep_durable_keeps_spare_steps(tmp_path):
  root = str(tmp_path / "run")
  mgr = saved_run(root, steps=range(5), max_to_keep=1, keep_durable=3)
  assert mgr.all_steps() == [2, 3, 4]
  truncate_manifest(os.path.join(root, "4"))
  with pytest.warns(RuntimeWarning, match="Step 4 .* is damaged"):
    assert mgr.restore()["step"] == 3
  assert saved_run(str(tmp_path / "all"), steps=range(4), keep_durable=1).all_steps() == [
      0, 1, 2, 3]                        # no retention rule: every step is kept anyway
  with pytest.raises(ValueError, match="keep_durable must be None or an int >= 1, got 0"):
    fnckpt.CheckpointManager(root, max_to_keep=1, keep_durable=0)


# --- save_interval_steps="auto" ---------------------------------------------------------------

def test_auto_interval_needs_an_mtbf_then_measures_restarts(tmp_path):
  root = str(tmp_path / "run")
  for _ in range(2):  # a failed construction records no start, so retrying measures nothing
    with pytest.raises(ValueError, match="needs a mean time between failures: pass mtbf_s="):
      fnckpt.CheckpointManager(root, save_interval_steps="auto")
  assert not os.path.exists(os.path.join(root, _starts.STARTS))
  mgr = fnckpt.CheckpointManager(root, save_interval_steps="auto", mtbf_s=3600.0)  # recorded
  assert (mgr.schedule.mtbf_s, mgr.schedule.mtbf_source) == (3600.0, "given")
  assert os.path.isfile(os.path.join(root, _starts.STARTS))
  mgr = fnckpt.CheckpointManager(root, save_interval_steps="auto")  # a restart: measured
  s = mgr.schedule
  assert s.auto and s.mtbf_source == "restarts" and s.mtbf_s > 0
  assert fnckpt.CheckpointManager(root).all_steps() == []     # the log is not a step
  with pytest.raises(ValueError, match="save_interval_steps must be an int >= 1 or 'auto'"):
    fnckpt.CheckpointManager(root, save_interval_steps="often")


@pytest.mark.parametrize("bad", [[float("nan")], [float("inf")], [0.0], [-1e300],
                                 ["x", True], "future", "not a list"])
def test_implausible_recorded_starts_are_ignored(tmp_path, bad):
  root = str(tmp_path / "run")
  os.makedirs(root)
  now = time.time()
  starts = [now + 10 * 365 * 86400] if bad == "future" else bad
  with open(os.path.join(root, _starts.STARTS), "wb") as f:
    f.write(msgpack.packb({"format": "fnckpt-starts", "starts": starts}))
  with pytest.raises(ValueError, match="needs a mean time between failures"):  # 1 real start
    fnckpt.CheckpointManager(root, save_interval_steps="auto")
  with open(os.path.join(root, _starts.STARTS), "wb") as f:
    f.write(msgpack.packb({"format": "fnckpt-starts", "starts": [now - 1000] + (
        starts if isinstance(starts, list) else [])}))
  s = fnckpt.CheckpointManager(root, save_interval_steps="auto").schedule
  assert s.mtbf_source == "restarts" and 999 <= s.mtbf_s <= 1000 + 600


def test_a_failed_construction_records_no_start(tmp_path):
  root = str(tmp_path / "run")
  fnckpt.CheckpointManager(root, save_interval_steps="auto", mtbf_s=60.0)
  with pytest.raises(fnckpt.CheckpointError, match="overlaps it"):
    fnckpt.CheckpointManager(root, save_interval_steps="auto", local_directory=root)
  with open(os.path.join(root, _starts.STARTS), "rb") as f:
    assert len(msgpack.unpackb(f.read())["starts"]) == 1


def test_auto_interval_skips_saves_while_one_is_writing(tmp_path, monkeypatch):
  root = str(tmp_path / "run")
  release = threading.Event()

  def phase(name):  # hold step 0's save in its background thread until released
    if threading.current_thread().name.endswith("/0") and name == "committing":
      release.wait(60)
  monkeypatch.setattr(_state.hooks, "on_phase", phase)
  mgr = fnckpt.CheckpointManager(root, save_interval_steps="auto", mtbf_s=3600.0)
  assert mgr.should_save(0)
  first = mgr.save(0, state_of(0))
  assert first is not None
  assert mgr.should_save(1) and mgr.save(1, state_of(1)) is None   # skipped: 0 is writing
  release.set()
  mgr.wait()
  s = mgr.schedule
  assert (s.saves, s.skipped) == (1, 1)
  assert s.save_cost_s == pytest.approx(first.stats.total_s)
  assert s.interval_s == pytest.approx(fnckpt.optimal_interval_s(s.save_cost_s, 3600.0))
  assert s.step_time_s is not None and s.expected_lost_s is not None
  # the next due step: the interval agreed at the save of step 1 (cost not measured then: 1)
  assert mgr.should_save(2) and mgr.save(2, state_of(2)) is not None
  mgr.wait()
  assert mgr.schedule.interval_steps == max(1, round(s.interval_s / mgr.schedule.step_time_s))
  assert mgr.all_steps() == [0, 2]
  mgr.close()
