"""Atomic visibility under faults: a save killed at any instant, a full disk, a read-only
destination and a deleted chunk never make a partial checkpoint visible, and never touch an
earlier one.

The kills happen in child processes (``mp_worker.py``) at exact instants, through the
``fnckpt._state.hooks.on_phase`` hook (replaced in the child) or, for "midwrite", a wrapper of
``fnckpt._io.arrays.write_chunk`` that kills once two chunks are durable and others are not.
"""

import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

import fnckpt
import helpers_proc as hp
import mp_worker

MESH = [[2, 4], ["x", "y"]]
LEAVES = {
    "a": {"shape": [512, 4096], "spec": ["x", "y"]},                # 8 MiB: its own zarr array
    "b": {"shape": [64, 1024], "dtype": "int32", "spec": "replicated"},  # 256 KiB: packed
    "n": {"shape": [100, 300], "dtype": "float64", "kind": "numpy"},     # 234 KiB: packed
    "s": {"shape": [4], "spec": "replicated"},                       # inline in the manifest
}
# What the save writes (docs/format.md): "a" is over pack_bytes (4 MiB), so it
# is a zarr array in chunks of its shard shape: 8 on the 2x4 mesh (its 1 MiB shards would be
# pieces; these saves turn pieces off, "piece_bytes": 0, so that kills land between chunks). "b" and "n" are over
# inline_bytes, at most pack_bytes and seen whole, so they share this process's pack; it is
# smaller than one inner chunk (1 MiB), so its inner chunk and its chunk are the pack: 1.
LAYOUT = {"a": "stored", "b": "packed", "n": "packed", "s": "inline"}
N_CHUNKS = 8 + 1


def expected_tree(seed):
  tree = {k: mp_worker.expected(k, v["shape"], v.get("dtype", "float32"), seed)
          for k, v in LEAVES.items()}
  tree["step"] = 7 if seed == 0 else 6
  return tree


def assert_bit_exact(got, want):
  assert sorted(got) == sorted(want)
  for k, w in want.items():
    if isinstance(w, np.ndarray):
      g = np.asarray(got[k])
      assert g.dtype == w.dtype and g.shape == w.shape, k
      assert g.tobytes() == w.tobytes(), f"{k} differs"
    else:
      assert got[k] == w


def chunk_files(path):
  """The data files (zarr3 chunks) under a checkpoint directory."""
  out = []
  for root, _, files in os.walk(path):
    rel = os.path.relpath(root, path).split(os.sep)
    if "c" in rel:
      out += [os.path.join(root, f) for f in files if not f.endswith(".__lock")]
  return out


def layout(path):
  """How each array leaf of a committed checkpoint is stored."""
  return {l.path[0][1]: "inline" if l.inline is not None else "packed" if l.packed else "stored"
          for l in fnckpt.metadata(path).leaves if l.is_array}


def assert_not_committed(path):
  with pytest.raises(fnckpt.NotCommittedError) as e:
    fnckpt.restore(path)
  msg = str(e.value)
  assert path in msg and "interrupted save" in msg and "commit marker" in msg
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.metadata(path)
  assert not os.path.exists(os.path.join(path, "COMMIT"))


def listing(root):
  """What the manager lists under ``root``: (committed steps, uncommitted steps)."""
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # it warns about uncommitted leftovers: we know
    mgr = fnckpt.CheckpointManager(str(root))
  return mgr.all_steps(), mgr.uncommitted_steps()


def save_config(tmp_path, phase, action="kill", overwrite=False, same_path=False):
  prev, new = str(tmp_path / "1"), str(tmp_path / "2")  # steps 1 and 2 for the manager
  return prev, (prev if same_path else new), {
      "mode": "save", "devices": 8, "mesh": MESH, "leaves": LEAVES, "prev": prev,
      "path": prev if same_path else new, "overwrite": overwrite, "piece_bytes": 0,
      "fault": {"phase": phase, "action": action}}


# Which files a kill at each phase leaves behind: (every chunk durable, manifest written).
PHASES = {
    "staging": (False, False),    # before any chunk is handed to TensorStore
    "midwrite": (False, False),   # 2 chunks durable, the others not
    "staged": (False, False),     # save() returned; the writes are in flight
    "written": (True, False),     # every chunk durable, no manifest yet
    "manifest": (True, True),     # manifest written, no marker
    "committing": (True, True),   # past the last barrier, just before the marker
}


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
def test_sigkill_at_each_phase_leaves_previous_intact(tmp_path, phase):
  prev, new, cfg = save_config(tmp_path, phase)
  r = hp.run_worker(cfg, timeout=120)
  assert r.returncode == -signal.SIGKILL, r.describe()
  assert f"PHASE {phase}" in r.stdout, r.describe()

  assert_bit_exact(fnckpt.restore(prev), expected_tree(seed=1))
  all_chunks, manifest = PHASES[phase]
  files = chunk_files(new)
  if phase == "midwrite":
    assert 2 <= len(files) < N_CHUNKS, files  # really partial data on storage
  if all_chunks:
    assert len(files) == N_CHUNKS, files       # everything but the marker is there
  assert os.path.exists(os.path.join(new, "manifest.msgpack")) == manifest
  # (``*.__lock``: TensorStore's temporary file for a write in progress, never data)
  if any(not f.endswith(".__lock") for _, _, fs in os.walk(new) for f in fs):
    assert_not_committed(new)
    assert listing(tmp_path) == ([1], [2])
  else:  # killed before any file reached storage: simply no checkpoint there
    with pytest.raises(fnckpt.CheckpointError, match="No checkpoint"):
      fnckpt.restore(new)
    assert listing(tmp_path)[0] == [1]


@pytest.mark.slow
def test_sigkill_after_commit_is_a_checkpoint(tmp_path):
  """The control: the same kill just after the marker leaves a complete checkpoint (so the
  tests above would notice a marker written too early)."""
  prev, new, cfg = save_config(tmp_path, "committed")
  r = hp.run_worker(cfg, timeout=120)
  assert r.returncode == -signal.SIGKILL, r.describe()
  assert_bit_exact(fnckpt.restore(new), expected_tree(seed=0))
  assert_bit_exact(fnckpt.restore(prev), expected_tree(seed=1))
  assert listing(tmp_path) == ([1, 2], [])
  assert layout(new) == LAYOUT  # (what N_CHUNKS counts)
  assert len(chunk_files(new)) == N_CHUNKS


@pytest.mark.slow
def test_killed_from_outside_while_hanging_before_commit(tmp_path):
  """SIGKILL sent by another process (as a scheduler would) while the save waits just
  before writing its marker."""
  prev, new, cfg = save_config(tmp_path, "committing", action="hang")
  r = hp.run_and_kill_at(cfg, "PHASE committing", timeout=120)
  assert not r.timed_out and r.returncode == -signal.SIGKILL, r.describe()
  assert len(chunk_files(new)) == N_CHUNKS
  assert_not_committed(new)
  assert_bit_exact(fnckpt.restore(prev), expected_tree(seed=1))


@pytest.mark.slow
def test_kill_while_overwriting_never_shows_a_mix(tmp_path):
  """overwrite=True hides the old checkpoint (marker first) before any new byte lands: a kill
  in the middle leaves an interrupted save, not old and new data under one marker."""
  prev, new, cfg = save_config(tmp_path, "manifest", overwrite=True, same_path=True)
  r = hp.run_worker(cfg, timeout=120)
  assert r.returncode == -signal.SIGKILL, r.describe()
  assert_not_committed(prev)


def _namespace_ok() -> bool:
  if os.geteuid() != 0 or not shutil.which("unshare"):
    return False
  try:
    return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m t /mnt"],
                          capture_output=True, timeout=20).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


needs_namespace = pytest.mark.skipif(
    not _namespace_ok(), reason="needs root and `unshare -m` (private mount namespace)")


@needs_namespace
@pytest.mark.slow
def test_full_disk_gives_a_clear_error_and_no_commit(tmp_path):
  """A 4 MiB tmpfs in a private mount namespace: a 256 KiB checkpoint fits, a 5 MiB one does
  not. The save fails with ENOSPC named, the big one is not a checkpoint, the first is intact
  (the child checks, since the tmpfs vanishes with it)."""
  d = str(tmp_path / "disk")
  os.makedirs(d)
  r = hp.run_worker({"mode": "fill_disk", "path": d, "big_leaves": 5}, timeout=120, prefix=[
      "unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=4m fnckpt-test "{d}" && exec "$@"',
      "sh"])
  out = r.result
  assert r.returncode == 0 and out, r.describe()
  assert out["save"] == "CheckpointError", out
  assert "No space left on device" in out["message"] and d in out["message"], out
  assert "disk is full" in out["message"] and "Nothing was committed" in out["message"]
  assert out["restore_big"] == "NotCommittedError", out
  assert out["ok_intact"] is True
  assert os.listdir(d) == []  # it all happened on the namespace's tmpfs


@needs_namespace
@pytest.mark.slow
def test_read_only_destination_gives_a_clear_error(tmp_path):
  """Root ignores file modes, so the directory is bind-mounted read-only in a private mount
  namespace."""
  d = str(tmp_path / "ro")
  os.makedirs(d)
  r = hp.run_worker({"mode": "read_only", "path": d}, timeout=120, prefix=[
      "unshare", "-m", "sh", "-c",
      f'mount --bind "{d}" "{d}" && mount -o remount,bind,ro "{d}" && exec "$@"', "sh"])
  out = r.result
  assert r.returncode == 0 and out, r.describe()
  assert out["save"] == "CheckpointError", out
  assert "Read-only file system" in out["message"] and d in out["message"], out
  assert "save elsewhere" in out["message"] and "credentials" not in out["message"]
  assert os.listdir(d) == []


@pytest.mark.slow
def test_file_size_limit_gives_a_clear_error_and_no_commit(tmp_path):
  """``ulimit -f`` (no privileges needed): writes past the limit fail with EFBIG (Python
  ignores SIGXFSZ, so the process is not killed). Here the parent can look at the files."""
  d = str(tmp_path / "limited")
  os.makedirs(d)
  r = hp.run_worker({"mode": "fill_disk", "path": d, "big_leaves": 2}, timeout=120,
                    prefix=["sh", "-c", 'ulimit -f 1024 && exec "$@"', "sh"])  # <= 1 MiB
  out = r.result
  assert r.returncode == 0 and out, r.describe()
  assert out["save"] == "CheckpointError", out
  assert "File too large" in out["message"] and "ulimit -f" in out["message"], out
  assert out["restore_big"] == "NotCommittedError" and out["ok_intact"] is True
  assert not os.path.exists(os.path.join(d, "big", "COMMIT"))
  assert_not_committed(os.path.join(d, "big"))
  np.testing.assert_array_equal(fnckpt.restore(os.path.join(d, "ok"))["a"],
                                mp_worker.expected("a", (64, 1024)))


# --- missing chunks are errors, never zeros -------------------------------------------------

def _sharded(value, spec=("x", "y")):
  import jax
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  return jax.make_array_from_callback(value.shape, s, lambda idx: value[idx])


@pytest.mark.parametrize("packed", [False, True], ids=["array", "pack"])
@pytest.mark.parametrize("fill", ["values", "zeros"])
def test_deleted_chunk_is_an_error_not_zeros(tmp_path, fill, packed):
  """With ``zeros`` the fill value equals the data: a reader filling missing chunks would
  return the right-looking answer silently; it must still fail. The leaf (32 KiB) is either
  its own zarr array (``pack_bytes=0``: one chunk per shard) or in the pack (one chunk)."""
  value = (np.zeros((64, 128), np.float32) if fill == "zeros"
           else np.arange(64 * 128, dtype=np.float32).reshape(64, 128))
  path = str(tmp_path / "c")
  fnckpt.save({"w": _sharded(value)}, path, **({} if packed else {"pack_bytes": 0})).wait()
  (leaf,) = fnckpt.metadata(path).leaves
  if packed:
    assert leaf.packed is not None and leaf.stored is None
    files = chunk_files(path)
    assert [os.path.relpath(f, path).split(os.sep)[1] for f in files] == ["p"]  # the pack
  else:
    assert leaf.stored is not None and leaf.packed is None
    files = chunk_files(os.path.join(path, leaf.stored.dir))
    assert len(files) == 8  # all-zero chunks are stored too (store_data_equal_to_fill_value)
  np.testing.assert_array_equal(fnckpt.restore(path)["w"], value)
  os.remove(sorted(files)[len(files) // 2])
  with pytest.raises(fnckpt.CheckpointError, match="missing") as e:
    fnckpt.restore(path)
  assert "['w']" in str(e.value) or "w" in str(e.value)
  # also through a resharded, device-placed restore
  import jax
  target = {"w": jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=_sharded(
      value, (None, "x")).sharding)}
  with pytest.raises(fnckpt.CheckpointError, match="missing"):
    fnckpt.restore(path, target)
