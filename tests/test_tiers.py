"""Two tiers on real storage: local saves every k steps, durable copies every n (copied from
the committed local checkpoint in the background, COMMIT last); recovery picks the newest step
restorable from either tier; a damaged copy in one tier is read from the other; a wiped local
tier falls back to durable. (Multi-process cases: tests/test_manager_mp.py.)"""

import os
import threading
import shutil
import uuid

import numpy as np
import pytest

import fnckpt
from fnckpt._io import paths as _paths
from fnckpt._manager import tiers as _tiers
from fnckpt._layout import pieces as _pieces
from fnckpt._errors import DamagedError

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


# --- review findings (issue 13) --------------------------------------------------------------

def _sharded_tree(step):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
  w = jax.device_put(np.arange(512 * 512, dtype=np.float32).reshape(512, 512) + step,
                     NamedSharding(mesh, P("a", "b")))
  return {"w": w, "small": np.arange(30000, dtype=np.float32), "pp": fnckpt.PerProcess(step)}


@pytest.mark.parametrize("lose", ["chunk", "zarr_json", "pack", "pp"])
def test_copy_step_refuses_an_incomplete_local_step(tmp_path, lose, monkeypatch):
  src, dst = str(tmp_path / "fast"), str(tmp_path / "durable")
  if lose in ("chunk", "zarr_json"):  # w in a zarr array of its own (else: pieces in the pack)
    monkeypatch.setattr(_pieces, "PIECE_BYTES", 0)
  fnckpt.save(_sharded_tree(1), os.path.join(src, "1"), pack_bytes=1 << 18).wait()
  files = sorted(os.path.relpath(os.path.join(d, f), os.path.join(src, "1"))
                 for d, _, fs in os.walk(os.path.join(src, "1")) for f in fs)
  pick = {"chunk": lambda f: "/a/" in f and "/c/" in f, "zarr_json": lambda f: f.endswith(
      "/a/0/zarr.json") or ("/a/" in f and f.endswith("zarr.json")),
          "pack": lambda f: "/p/" in f and "/c/" in f, "pp": lambda f: "/pp/" in f}[lose]
  victim = [f for f in files if pick(f)][-1]   # e.g. one shard file of the 4x2 grid
  os.remove(os.path.join(src, "1", victim))
  with pytest.raises(DamagedError, match=rf"The local checkpoint '.*/fast/1' is "
                     rf"incomplete: 1 object\(s\) its manifest names are missing \(e.g. "
                     rf"'{victim}'\); it was not copied and nothing was committed"):
    _tiers.copy_step(src, dst, 1, None, None)
  assert not os.path.exists(os.path.join(dst, "1", "COMMIT"))


def test_a_local_step_damaged_before_its_copy_is_not_committed_durably(tmp_path, monkeypatch):
  from test_health import remove_chunk
  durable, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
  real = _tiers.copy_step

  def lose_a_file_first(src_root, *args, **kw):  # the local disk loses a file after commit
    remove_chunk(os.path.join(src_root, "0"))
    return real(src_root, *args, **kw)

  monkeypatch.setattr(_tiers, "copy_step", lose_a_file_first)
  mgr = fnckpt.CheckpointManager(durable, local_directory=fast)
  with pytest.warns(RuntimeWarning, match="Copying step 0"):
    mgr.save(0, state_of(0))
    with pytest.raises(fnckpt.CheckpointError, match=r"failed: The local checkpoint .* is "
                       r"incomplete.* The local copy of step 0 is gone, damaged or incomplete, "
                       r"so step 0 is restorable from neither tier"):
      mgr.wait()
  assert fnckpt.CheckpointManager(durable).all_steps() == []
  assert not os.path.exists(os.path.join(durable, "0", "COMMIT"))


@pytest.mark.parametrize("spell", ["{d}", "{d}/", "file://{d}", "{d}/fast", "{p}"])
def test_a_local_tier_overlapping_the_durable_one_is_refused(tmp_path, spell):
  d = str(tmp_path / "run")
  local = spell.format(d=d, p=str(tmp_path))
  with pytest.raises(fnckpt.CheckpointError, match=r"local_directory '.*' is the durable "
                     r"directory '.*/run' or overlaps it; each durable copy would delete"):
    fnckpt.CheckpointManager(d, local_directory=local)
  with pytest.raises(fnckpt.CheckpointError, match="overlaps it"):
    _tiers.copy_step(local, d, 0, None, None)
  m = f"memory://test_tiers/{uuid.uuid4().hex}"
  with pytest.raises(fnckpt.CheckpointError, match="overlaps it"):
    fnckpt.CheckpointManager(m, local_directory=m + "/fast")
  fnckpt.CheckpointManager(d, local_directory=d + "-fast")        # a sibling is fine


def test_copy_keys_keeps_its_byte_bound():
  src = _paths.open_kvstore(f"memory://test_tiers/{uuid.uuid4().hex}/src")
  dst = _paths.open_kvstore(f"memory://test_tiers/{uuid.uuid4().hex}/dst")
  mib, keys = 1 << 20, [f"k{i:02d}" for i in range(40)]
  for k in keys:
    src.write(k, bytes(mib)).result()
  issued, writes, worst = [], [], [0]

  class Tracked:  # the real kvstores, counting what is read and not yet written
    def __init__(self, kv, on):
      self.kv, self.on = kv, on

    def read(self, key):
      self.on(key)
      return self.kv.read(key)

    def write(self, key, value):
      f = self.kv.write(key, value)
      writes.append((f, len(value)))
      return f

  def on_read(key):
    issued.append(key)
    unwritten = (len(issued) - len(writes)) * mib
    worst[0] = max(worst[0], unwritten + sum(n for f, n in writes if not f.done()))

  copied = _tiers._copy_keys(Tracked(src, on_read), Tracked(dst, None), keys, concurrency=32,
                             max_bytes=4 * mib)
  assert copied == 40 * mib and worst[0] <= 4 * mib
  assert all(bytes(dst.read(k).result().value) == bytes(mib) for k in keys)
  big = _tiers._copy_keys(src, dst, keys[:1], 32, max_bytes=1)   # larger than the bound: alone
  assert big == mib


def test_durable_copies_never_pile_up(tmp_path, monkeypatch):
  import threading
  durable, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
  real, seen, gate = _tiers.copy_step, [], threading.Event()

  def slow_copy(src_root, dst_root, step, *args, **kw):
    names = [t.name.split(":")[0] for t in threading.enumerate()]
    seen.append((len(os.listdir(src_root)), names.count("fnckpt-manager"),
                 names.count("fnckpt-save")))
    gate.wait(timeout=60)  # released once the next save is waiting for this copy
    return real(src_root, dst_root, step, *args, **kw)

  monkeypatch.setattr(_tiers, "copy_step", slow_copy)
  mgr = fnckpt.CheckpointManager(durable, local_directory=fast, save_interval_steps=2,
                                 local_max_to_keep=2)
  releaser = threading.Timer(0.2, gate.set)  # (only ends the first wait early)
  releaser.start()
  for s in range(12):
    mgr.save(s, state_of(s))
  mgr.wait()
  releaser.join()
  assert fnckpt.CheckpointManager(durable).all_steps() == [0, 2, 4, 6, 8, 10]
  # at most one copy running and the next step's waiting; one save writing (its own
  # threads, e.g. for hashing and direct writes, come and go with it)
  assert max(n for n, _, _ in seen) <= 4
  assert max(m for _, m, _ in seen) <= 2 and max(w for _, _, w in seen) <= 1, seen
  assert mgr.schedule.copy_wait_s > 0 and sorted(os.listdir(fast)) == ["10", "11"]


def test_a_committed_durable_step_is_not_replaced_when_the_local_tier_was_wiped(tmp_path):
  mgr, durable, fast = run(tmp_path, steps=range(4))
  mgr.close()
  shutil.rmtree(fast)
  again = fnckpt.CheckpointManager(durable, local_directory=fast, save_interval_steps=3)
  with pytest.raises(fnckpt.CheckpointError, match=rf"Step 3 is already committed in "
                                                   rf"'{durable}'. Pass force=True"):
    again.save(3, state_of(30))
  assert again.restore(3)["step"] == 3
  again.save(3, state_of(30), force=True).wait()
  again.wait()
  assert fnckpt.restore(os.path.join(durable, "3"))["step"] == 30


def test_local_retention_removes_marked_and_leftover_local_steps(tmp_path):
  mgr, durable, fast = run(tmp_path)              # local 6, 7; durable 0, 3, 6
  flip_bytes(os.path.join(fast, "6"))
  with pytest.warns(RuntimeWarning, match="The local copy of step 6 .* is damaged"):
    assert mgr.restore(6)["step"] == 6            # local 6 marked damaged
  os.makedirs(os.path.join(fast, "5", "junk"))    # a crash leftover
  open(os.path.join(fast, "5", "junk", "x"), "w").close()
  for s in range(8, 11):
    mgr.save(s, state_of(s))
  mgr.wait()
  assert sorted(os.listdir(fast)) == ["10", "9", "damaged"]
  assert os.listdir(os.path.join(fast, "damaged")) == []


def test_latest_step_does_not_wait_for_the_durable_copy(tmp_path, monkeypatch):
  import threading
  real, gate = _tiers.copy_step, threading.Event()

  def held_copy(*args, **kw):
    gate.wait(timeout=60)
    return real(*args, **kw)

  monkeypatch.setattr(_tiers, "copy_step", held_copy)
  mgr = fnckpt.CheckpointManager(str(tmp_path / "durable"), local_directory=str(
      tmp_path / "fast"))
  mgr.save(0, state_of(0))
  got = []
  asker = threading.Thread(target=lambda: got.append((mgr.latest_step(), mgr.metrics(0))))
  asker.start()
  asker.join(timeout=30)
  done = not asker.is_alive()
  gate.set()
  mgr.wait()
  assert done and got == [(0, None)]              # answered while the copy was held
  assert fnckpt.CheckpointManager(str(tmp_path / "durable")).all_steps() == [0]


def test_ls_with_local_needs_an_existing_durable_run_directory(tmp_path, capsys):
  from fnckpt import cli
  mgr, durable, fast = run(tmp_path, steps=range(2))
  assert cli.main(["ls", str(tmp_path / "nope"), "--local", fast]) == 1
  assert "holds nothing, not a run directory: with --local, DIR must be the manager's " \
         "durable directory" in capsys.readouterr().err
  assert cli.main(["ls", os.path.join(fast, "1"), "--local", fast]) == 1
  assert "is a single checkpoint, not a run directory" in capsys.readouterr().err
  assert cli.main(["ls", durable, "--local", fast]) == 0


def test_a_wiped_local_tier_does_not_let_an_older_or_durable_step_be_shadowed(tmp_path):
  mgr, durable, fast = run(tmp_path, steps=range(4))
  mgr.close()
  shutil.rmtree(fast)
  again = fnckpt.CheckpointManager(durable, local_directory=fast, save_interval_steps=3)
  with pytest.raises(fnckpt.CheckpointError, match=rf"Step 1 is older than step 3, already in "
                                                   rf"'{durable}'"):
    again.save(1, state_of(1))                    # local-only, but durable holds 3


def test_a_save_failing_after_its_commit_is_recorded_committed(tmp_path, monkeypatch):
  """Issue 34: the local save of step 3 (a durable step) fails after its commit marker is
  written. ``wait()`` still reports the error, and the manager records the step as committed
  (before: as not committed, so it was never copied to the durable tier)."""
  from fnckpt import _state
  real = _state.hooks.on_phase

  def phase(name):
    if name == "committed" and threading.current_thread().name.endswith("/3"):
      raise RuntimeError("simulated failure after the commit")
    real(name)

  monkeypatch.setattr(_state.hooks, "on_phase", phase)
  durable, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
  mgr = fnckpt.CheckpointManager(durable, local_directory=fast, local_save_interval_steps=1,
                                 save_interval_steps=3)
  for s in range(4):
    mgr.save(s, state_of(s))
  with pytest.raises(fnckpt.CheckpointError, match="simulated failure after the commit"):
    mgr.wait()
  assert fnckpt.CheckpointManager(durable).all_steps() == [0, 3]   # copied: committed
  assert mgr.latest_step() == 3 and mgr.restore()["step"] == 3
  mgr.close()
