"""Two tiers on real storage: local saves every k steps, durable copies every n (copied from
the committed local checkpoint in the background, COMMIT last); recovery picks the newest step
restorable from either tier; a damaged copy in one tier is read from the other; a wiped local
tier falls back to durable. (Multi-process cases: tests/test_manager_mp.py.)"""

import os
import shutil
import uuid

import numpy as np
import pytest

import fnckpt
from fnckpt import _paths, _tiers

from test_health import flip_bytes, state_of, truncate_manifest


def run(tmp_path, steps=range(8), **kw):
  durable, fast = kw.pop("durable", str(tmp_path / "durable")), str(tmp_path / "fast")
  kw = {"local_save_interval_steps": 1, "save_interval_steps": 3, **kw}
  mgr = fnckpt.CheckpointManager(durable, local_directory=kw.pop("local", fast), **kw)
  for s in steps:
    mgr.save(s, state_of(s))
  mgr.wait()
  return mgr, durable, fast


def test_local_every_step_durable_every_third(tmp_path):
  mgr, durable, fast = run(tmp_path)
  assert sorted(os.listdir(fast), key=int) == ["6", "7"]        # local_max_to_keep=2
  assert fnckpt.CheckpointManager(durable).all_steps() == [0, 3, 6]  # an ordinary run dir
  assert mgr.all_steps() == [0, 3, 6, 7] and mgr.latest_step() == 7
  assert mgr.restore()["step"] == 7                                # from the fast tier
  mgr.save(8, state_of(8), metrics={"loss": 0.5}).wait()          # local only
  assert mgr.metrics(8) == {"loss": 0.5}
  got = fnckpt.restore(os.path.join(durable, "6"))                 # the copy is a checkpoint
  assert np.array_equal(got["w"], state_of(6)["w"])
  for step in (0, 3, 6):
    assert fnckpt.metadata(os.path.join(durable, str(step))).user_metadata["step"] == step
  mgr.close()


def test_wiped_local_tier_falls_back_to_durable(tmp_path):
  mgr, durable, fast = run(tmp_path)
  mgr.close()
  shutil.rmtree(fast)                                              # a replaced host
  again = fnckpt.CheckpointManager(durable, local_directory=fast, save_interval_steps=3)
  state, step = again.restore_or_init(state_of(0))
  assert step == 6 and state["step"] == 6
  again.save(7, state_of(7)).wait()                                # the run goes on
  assert again.all_steps() == [0, 3, 6, 7]


def test_a_damaged_copy_is_read_from_the_other_tier(tmp_path):
  mgr, durable, fast = run(tmp_path)
  flip_bytes(os.path.join(fast, "6"))
  with pytest.warns(RuntimeWarning, match=rf"The local copy of step 6 in '{fast}' is damaged"
                                          rf".*checksum mismatch.*Reading the durable copy"):
    assert mgr.restore(6)["step"] == 6
  assert mgr.restore(6)["step"] == 6                 # marked: the durable copy, no warning
  truncate_manifest(os.path.join(durable, "3"))
  truncate_manifest(os.path.join(fast, "7"))         # only local: falls back to durable 6
  with pytest.warns(RuntimeWarning, match="Step 7 of .* is damaged"):
    assert mgr.restore()["step"] == 6
  mgr.close()


def test_durable_damage_with_a_good_local_copy_reads_local(tmp_path):
  mgr, durable, fast = run(tmp_path)
  truncate_manifest(os.path.join(durable, "6"))
  assert mgr.restore(6)["step"] == 6                 # local first: fine
  shutil.rmtree(fast)
  with pytest.warns(RuntimeWarning, match="Step 6 of .* is damaged"):
    assert mgr.restore()["step"] == 3


def test_memory_local_tier_and_policy_checks(tmp_path):
  fast = f"memory://test_tiers/{uuid.uuid4().hex}"
  mgr, durable, _ = run(tmp_path, steps=range(5), local=fast, local_save_interval_steps=2,
                        save_interval_steps=4, local_max_to_keep=1)
  assert _paths.list_keys(fast) and mgr.all_steps() == [0, 4]      # 1, 3 were not saved
  assert fnckpt.CheckpointManager(durable).all_steps() == [0, 4]
  assert mgr.restore()["step"] == 4
  with pytest.raises(ValueError, match="local_save_interval_steps must be an int >= 1, got 0"):
    fnckpt.CheckpointManager(durable, local_directory=fast, local_save_interval_steps=0)
  with pytest.raises(ValueError, match="local_max_to_keep must be an int >= 1"):
    fnckpt.CheckpointManager(durable, local_directory=fast, local_max_to_keep=0)


def test_choose_is_the_newest_step_every_process_can_restore():
  assert _tiers.choose([[5, 6], [5, 6]], [4]) == 6
  assert _tiers.choose([[5, 6], [5]], [4]) == 5
  assert _tiers.choose([[5, 6], []], [4]) == 4
  assert _tiers.choose([[], []], []) is None
  assert _tiers.choose([], [2, 4], skipped={4}) == 2


def test_copy_step_refuses_an_uncommitted_source(tmp_path):
  src = str(tmp_path / "src")
  os.makedirs(os.path.join(src, "1"))
  open(os.path.join(src, "1", "manifest.msgpack"), "wb").close()
  with pytest.raises(fnckpt.CheckpointError, match=r"Cannot copy '.*/src/1' to '.*/dst/1': "
                                                   r"it is not committed"):
    _tiers.copy_step(src, str(tmp_path / "dst"), 1, None, None)


def test_ls_shows_both_tiers_and_steps_marked_damaged(tmp_path, capsys):
  from fnckpt import cli
  mgr, durable, fast = run(tmp_path)
  truncate_manifest(os.path.join(durable, "6"))
  shutil.rmtree(os.path.join(fast, "6"))
  truncate_manifest(os.path.join(fast, "7"))
  with pytest.warns(RuntimeWarning, match="is damaged"):
    assert mgr.restore()["step"] == 3
  assert cli.main(["ls", durable, "--local", fast]) == 0
  out = capsys.readouterr().out
  rows = [line.split() for line in out.splitlines()]
  assert rows[0] == ["TIER", "STEP", "STATUS", "DATA", "WRITTEN", "LEAVES", "FILES", "COMMITTED",
                     "METRICS"]
  assert [r[:3] for r in rows[1:5]] == [["durable", "0", "committed"],
                                        ["durable", "3", "committed"],
                                        ["durable", "6", "DAMAGED"], ["local", "7", "DAMAGED"]]
  assert "marked damaged (" in out and "manager.delete(6) removes it" in out
  assert ("2 committed, 0 uncommitted, 1 marked damaged in durable " in out
          and "0 committed, 0 uncommitted, 1 marked damaged in local " in out
          and out.rstrip().endswith("latest: 3"))
  assert cli.main(["ls", durable]) == 0                  # one tier: the old columns
  out = capsys.readouterr().out
  assert out.splitlines()[0].split()[0] == "STEP" and "latest: 3" in out


def test_a_failed_durable_copy_is_raised_by_wait_and_the_local_step_stays(tmp_path):
  durable, fast = tmp_path / "durable", str(tmp_path / "fast")
  durable.mkdir()
  (durable / "3").write_text("a file where the step directory would go")
  mgr = fnckpt.CheckpointManager(str(durable), local_directory=fast, save_interval_steps=3)
  mgr.save(2, state_of(2))
  with pytest.warns(RuntimeWarning, match="Copying step 3 from the local tier"):
    mgr.save(3, state_of(3))
    with pytest.raises(fnckpt.CheckpointError,
                       match=rf"Copying step 3 from the local tier '{fast}' to the durable "
                             rf"tier '{durable}' failed: .* committed on the local tier only"):
      mgr.wait()
  assert mgr.restore(3)["step"] == 3 and mgr.all_steps() == [2, 3]


def test_s3_durable_tier_copy_damage_and_marks(s3_env, tmp_path):
  """On a real S3 server: the durable copies, a flipped byte in an S3 object found after the
  local tier is wiped, the mark written and listed through S3 (object-store listing)."""
  durable, fast = s3_env.unique_url("tiers"), str(tmp_path / "fast")
  opts = dict(s3_env.storage_options)
  run(tmp_path, steps=range(7), durable=durable, local=fast, storage_options=opts)
  assert fnckpt.CheckpointManager(durable, storage_options=opts).all_steps() == [0, 3, 6]
  kv = _paths.open_kvstore(_paths.join(durable, "6"), opts)
  key = next(k for k in _paths.list_keys(_paths.join(durable, "6"), opts) if "/c/" in k)
  raw = bytearray(kv.read(key).result().value)
  raw[len(raw) // 3] ^= 0xFF
  kv.write(key, bytes(raw)).result()
  shutil.rmtree(fast)
  again = fnckpt.CheckpointManager(durable, local_directory=fast, save_interval_steps=3,
                                   storage_options=opts)
  with pytest.warns(RuntimeWarning, match=r"Step 6 of 's3://.*' is damaged: .*checksum"):
    assert again.restore()["step"] == 3
  assert again.all_steps() == [0, 3]
  assert "damaged/6" in _paths.list_keys(durable, opts)
  assert fnckpt.CheckpointManager(durable, storage_options=opts).latest_step() == 3
