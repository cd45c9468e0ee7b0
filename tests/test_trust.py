"""One committed checkpoint or a clear error (issue 9): concurrent saves to one location,
restores that overlap an overwrite, hostile manifests, no lost errors, and the smaller
defects found by the same review. Every error text is asserted."""

import os
import shutil
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._format import hashes as _hashes, manifest as _manifest, records as _records
from fnckpt._io import arrays as _store, direct as _direct, paths as _paths
from fnckpt import _state
from fnckpt._errors import DamagedError, SaveOutcome


def tree(v):
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  big = jax.device_put(jnp.full((1024, 2048), v, jnp.float32), NamedSharding(mesh, P("x", "y")))
  return {"a": big, "b": np.full((300, 300), v, np.float32), "c": np.full((4,), v, np.int32)}


def values_of(t):
  return {float(np.asarray(x).reshape(-1)[0]) for x in jax.tree.leaves(t)}


def test_concurrent_saves_to_one_path_never_mix(tmp_path):
  path = str(tmp_path / "c")
  for run in range(10):
    errors = []

    def go(v):
      try:
        fnckpt.save(tree(v), path, overwrite=True).wait()
      except fnckpt.CheckpointError as e:
        errors.append(e)
    threads = [threading.Thread(target=go, args=(float(v),)) for v in (run * 2 + 1, run * 2 + 2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert not errors  # serialized: the second waits for the first, then overwrites it
    assert len(values_of(fnckpt.restore(path))) == 1


def _patch_first_read(monkeypatch, action):
  """Run ``action`` once, when the restore issues its first data read."""
  real = _store.read_slice
  done = []

  def read_slice(*args, **kwargs):
    if not done:
      done.append(1)
      action()
    return real(*args, **kwargs)
  monkeypatch.setattr(_store, "read_slice", read_slice)


@pytest.mark.parametrize("how", ["overwrite", "delete"])
def test_restore_overlapping_an_overwrite_is_old_or_an_error(tmp_path, monkeypatch, how):
  path = str(tmp_path / "c")
  fnckpt.save(tree(1.0), path).wait()
  if how == "overwrite":
    action = lambda: fnckpt.save(tree(2.0), path, overwrite=True).wait()  # noqa: E731
  else:
    action = lambda: fnckpt.CheckpointManager(str(tmp_path)).delete(0) if False else \
        _paths.delete_prefix(path, first=("COMMIT",))
  _patch_first_read(monkeypatch, action)
  try:
    got = fnckpt.restore(path)
  except fnckpt.CheckpointError as e:
    assert "changed while being read" in str(e), str(e)
  else:
    assert values_of(got) == {1.0}   # entirely the old checkpoint


def _rewrite_manifest(path, change):
  with open(os.path.join(path, _manifest.MANIFEST), "rb") as f:
    m = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
  change(m)
  data = _manifest.pack(m)
  with open(os.path.join(path, _manifest.MANIFEST), "wb") as f:
    f.write(data)
  with open(os.path.join(path, _manifest.COMMIT), "wb") as f:
    f.write(_manifest.encode_commit(data, 0.0))


def _leaf(m, key):
  return next(r for r in m["leaves"] if r["path"][-1][1] == key)


@pytest.mark.parametrize("change, message", [
    (lambda m: _leaf(m, "a")["shape"].__setitem__(0, 2 ** 45),
     r"record of \['a'\] is invalid: a chunk is larger|record of \['a'\] is invalid"),
    (lambda m: _leaf(m, "a").__setitem__("store", {"dir": "../other/d/0", "chunks": [512, 512],
                                                   "inner": [512, 512], "zstd": None}),
     r"record of \['a'\] is invalid: exactly one of 'inline', 'store', 'pack', 'pieces'"),
    (lambda m: [_leaf(m, "a").pop("pieces"), _leaf(m, "a")["sharding"].pop("mesh"),
                _leaf(m, "a").__setitem__("store", {"dir": "../other/d/0", "chunks": [512, 512],
                                                    "inner": [512, 512], "zstd": None})],
     r"record of \['a'\] is invalid: 'store'.dir must be a relative path of plain names"),
    (lambda m: _leaf(m, "g")["value"].__setitem__("bit_generator", "seed"),
     r"record of \['g'\] is invalid: a Generator state needs 'bit_generator' in"),
    (lambda m: next(r for r in m["leaves"] if r["path"][0][1] == "l" and r["path"][-1][1] == 1)[
        "path"][-1].__setitem__(1, 20_000_000),
     r"sequence indices must be 0..n-1 without gaps"),
    (lambda m: _leaf(m, "c").__setitem__("dtype", "object"),
     r"record of \['c'\] is invalid: dtype 'object' is not one fnckpt stores"),
    (lambda m: _leaf(m, "c").__setitem__("kind", "pickle"),
     r"record of leaf #\d+ is invalid|unknown leaf kind 'pickle'"),
    (lambda m: _leaf(m, "c").__setitem__("inline", b"\0"),
     r"record of \['c'\] is invalid: 'inline' must hold 16 bytes"),
    (lambda m: m.__setitem__("data", "/etc"),
     r"its 'data' must be a relative path of plain names"),
])
def test_hostile_manifests_are_refused_naming_the_field(tmp_path, change, message):
  path = str(tmp_path / "c")
  t = tree(1.0)
  t["g"] = np.random.default_rng(0)
  t["l"] = [1, 2]
  fnckpt.save(t, path).wait()
  state = np.random.get_state()[1].copy()
  _rewrite_manifest(path, change)
  for call in (fnckpt.metadata, fnckpt.restore):
    with pytest.raises(fnckpt.CheckpointError, match=message):
      call(path)
  np.testing.assert_array_equal(np.random.get_state()[1], state)


def _failing_save(tmp_path, name):
  (tmp_path / name).mkdir()
  (tmp_path / name / "foreign.txt").write_text("x")
  return str(tmp_path / name)


def _fail_at(monkeypatch, phase, error):
  """Make every save fail with ``error`` as it passes ``phase`` (``_state.hooks.on_phase``)."""
  def hook(name):
    if name == phase:
      raise error
  monkeypatch.setattr(_state.hooks, "on_phase", hook)


def _break_writes(monkeypatch):
  """Every chunk write fails (``_store.write_chunk``, and ``_direct.write_chunk``: a local
  pack chunk), as on a failing disk."""
  def broken(*_):
    raise OSError("disk on fire (simulated)")
  monkeypatch.setattr(_store, "write_chunk", broken)
  monkeypatch.setattr(_direct, "write_chunk", broken)


def test_every_background_failure_is_raised_by_wait(tmp_path, monkeypatch):
  _fail_at(monkeypatch, "written", OSError("injected write failure"))
  h1 = fnckpt.save(tree(1.0), str(tmp_path / "one"))
  h2 = fnckpt.save(tree(2.0), str(tmp_path / "two"))
  with pytest.raises(fnckpt.CheckpointError, match=r"2 saves failed:\n  - Saving to .*one.* "
                     r"failed while writing the arrays: OSError: injected write failure") as e:
    fnckpt.wait()
  one, two = e.value.errors   # each save's error, in order, each with what it left
  assert "one" in one.core and "two" in two.core and e.value.__cause__ is one
  assert one.outcome == two.outcome == SaveOutcome(committed=False)
  with pytest.raises(fnckpt.CheckpointError, match="injected write failure") as first:
    h1.wait()   # a handle still raises its own error
  assert first.value is one
  fnckpt.wait()  # reported once: nothing left


def test_a_failure_after_the_marker_says_the_checkpoint_is_committed(tmp_path, monkeypatch):
  _fail_at(monkeypatch, "committed", OSError("injected late failure"))
  h = fnckpt.save(tree(1.0), str(tmp_path / "c"))
  with pytest.raises(fnckpt.CheckpointError, match="The checkpoint itself is committed") as e:
    h.wait()
  assert e.value.outcome == SaveOutcome(committed=True, replaced=False)
  assert "Nothing was committed" not in str(e.value)
  assert values_of(fnckpt.restore(str(tmp_path / "c"))) == {1.0}


def test_unreported_failure_makes_the_exit_status_nonzero(tmp_path):
  code = (
      "import numpy as np, fnckpt\n"
      "from fnckpt import _state\n"
      "def hook(p):\n"
      "  if p == 'written': raise OSError('injected')\n"
      "_state.hooks.on_phase = hook\n"
      f"fnckpt.save({{'x': np.zeros(10000)}}, {str(tmp_path / 'c')!r})\n"
      "print('script done')\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 1, r.stderr
  assert "script done" in r.stdout
  assert "failed and nobody waited for it" in r.stderr and "injected" in r.stderr


def test_prefix_sharding_naming_a_missing_key_path_is_a_mismatch(tmp_path):
  path = str(tmp_path / "c")
  fnckpt.save(tree(1.0), path).wait()
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  with pytest.raises(fnckpt.TreeMismatchError, match=r"missing from the checkpoint.*\n.*\['nope'\]"):
    fnckpt.restore(path, {"a": s, "nope": s})
  with pytest.raises(fnckpt.TreeMismatchError, match=r"\['c'\]: the sharding .* cannot hold an "
                     r"array of shape \(4,\)"):
    fnckpt.restore(path, {"c": NamedSharding(jax.make_mesh((8,), ("x",)), P("x", None))})


def test_longdouble_is_refused_at_save_naming_the_key_path(tmp_path):
  with pytest.raises(fnckpt.CheckpointError, match=r"Unsupported numpy dtype float128 at "
                     r"\['x'\]: .*astype\(np.float64\)"):
    fnckpt.save({"x": np.zeros(3, np.longdouble)}, str(tmp_path / "c"))


def test_cli_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
  path = str(tmp_path / "c")
  t = {f"k{i}": i for i in range(2000)}
  fnckpt.save(t, path).wait()
  r = subprocess.run(f"{sys.executable} -m fnckpt inspect {path} | head -1", shell=True,
                     capture_output=True, text=True, timeout=120,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0 and r.stderr == "", r.stderr
  assert f"fnckpt format {_manifest.FORMAT_VERSION}," in r.stdout and _manifest.FORMAT_VERSION == 3


def test_a_failed_save_gives_back_its_budget_and_the_next_save_runs(tmp_path, monkeypatch):
  """Chunks staged after the writer failed are charged and then refused: their bytes must go
  back to the process's budget, else every later save waits forever for bytes nobody frees."""
  _break_writes(monkeypatch)
  state = {f"l{i}": np.full((256, 1024), i, np.float32) for i in range(6)}  # 1 MiB each
  with pytest.raises(fnckpt.CheckpointError, match="disk on fire"):
    fnckpt.save(state, tmp_path / "a", pack_bytes=0, budget_bytes=3 << 20).wait()
  assert _state.saves.budget.held == 0
  monkeypatch.undo()
  fnckpt.save(state, tmp_path / "b", pack_bytes=0, budget_bytes=3 << 20).wait(timeout=120)
  assert fnckpt.restore(tmp_path / "b")["l5"][0, 0] == 5


def test_a_packed_leaf_larger_than_memory_is_refused_not_allocated(tmp_path):
  """A manifest (with a matching COMMIT) that claims a packed leaf of 2**42 float32 inside a
  huge pack: a CheckpointError naming the leaf, never an allocation that aborts."""
  path = str(tmp_path / "c")
  fnckpt.save({"a": np.ones(8192, np.float32)}, path).wait()

  def lie(m):
    m["packs"][0]["nbytes"] = 2 ** 44
    _leaf(m, "a")["shape"] = [2 ** 42]
  _rewrite_manifest(path, lie)
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"Cannot restore \['a'\] .*more than this machine's memory"):
    fnckpt.restore(path)


def test_a_committed_barrier_timeout_says_the_checkpoint_is_committed(tmp_path, monkeypatch):
  """A failure after the marker was written (here: the last barrier's deadline, as a
  CheckpointError) keeps its type, and its object: the same exception, with its cause, says
  the checkpoint is committed (and nothing else about what was committed)."""
  timeout = fnckpt.BarrierTimeoutError("Barrier 'committed' of the save to 'x' failed.")
  timeout.__cause__ = OSError("the coordination service is gone")
  _fail_at(monkeypatch, "committed", timeout)
  with pytest.raises(fnckpt.BarrierTimeoutError) as e:
    fnckpt.save(tree(1.0), str(tmp_path / "c")).wait()
  assert e.value is timeout and isinstance(e.value.__cause__, OSError)
  assert e.value.outcome.committed is True
  assert str(e.value) == ("Barrier 'committed' of the save to 'x' failed. The checkpoint itself "
                          "is committed (its marker was written); only this last step failed.")
  assert repr(e.value) == "BarrierTimeoutError(\"Barrier 'committed' of the save to 'x' failed.\")"


def test_a_process_past_the_last_data_barrier_cannot_say_nothing_was_committed():
  """A process other than 0 that learns of another's failure right after every process
  arrived at 'written' cannot tell: process 0 may not have seen that failure before writing
  the marker. Its writer says so (committed None: "may have committed")."""
  from fnckpt._io.collective import PeerFailedError
  from fnckpt._save.writer import Commit, Writer

  class Session:   # process 1 of 2; process 2's failure is read after the barrier
    multi, passed = True, []

    def barrier(self, phase):
      self.passed.append(phase)
      raise PeerFailedError("Saving to 'x' failed on process 2: boom.")

  writer = Writer("x", Session(), _store.ByteBudget(1 << 20), lambda p: None, lambda e: None)
  writer._commit = Commit(None, lambda: None, [], write_marker=False)
  with pytest.raises(PeerFailedError):
    writer._finish(None)
  assert writer.committed is None


@pytest.mark.parametrize("outcome, says, never", [
    (SaveOutcome(False), "Nothing was committed; earlier checkpoints are intact.", "removed"),
    (SaveOutcome(False, replaced=True), "Nothing was committed; the checkpoint that was at this "
     "path was removed first (overwrite=True); other checkpoints are intact.", "earlier"),
    (SaveOutcome(True, replaced=True), "The checkpoint itself is committed (its marker was "
     "written); only this last step failed.", "Nothing"),
    (SaveOutcome(None), "Process 0 may have committed the checkpoint; check with "
     "fnckpt.metadata or `fnckpt ls`.", "Nothing"),
])
def test_the_last_sentence_of_a_save_error_is_its_outcome(outcome, says, never):
  """Composed from the fields (never parsed from the text): once, whatever the type."""
  for kind in (fnckpt.CheckpointError, fnckpt.BarrierTimeoutError, fnckpt.TreeMismatchError):
    err = kind("Saving to 'x' failed while writing the arrays: OSError: disk full.")
    assert str(err).endswith("disk full.")
    err.outcome = outcome
    assert str(err).endswith(says) and str(err).count(says) == 1 and never not in str(err)
    assert err.core == "Saving to 'x' failed while writing the arrays: OSError: disk full."


@pytest.mark.parametrize("kwargs, message", [
    ({"pack_bytes": -1}, r"save\(pack_bytes=-1\): expected an int in \[0, 67108864\]"),
    ({"pack_bytes": 1 << 30}, r"save\(pack_bytes=1073741824\): expected an int in \[0, "),
    ({"inline_bytes": "16k"}, r"save\(inline_bytes='16k'\): expected an int in \[0, "),
])
def test_size_options_are_checked(tmp_path, kwargs, message):
  with pytest.raises(fnckpt.CheckpointError, match=message):
    fnckpt.save({"a": np.ones(3)}, tmp_path / "c", **kwargs)
  assert not os.path.exists(tmp_path / "c" / "COMMIT")


def test_a_failed_overwrite_does_not_say_the_old_checkpoint_is_intact(tmp_path, monkeypatch):
  """overwrite=True removes the old checkpoint (marker first) before writing: if the new save
  then fails, its error must say so, not "earlier checkpoints are intact"."""
  state = {"w": np.arange(1 << 16, dtype=np.float32)}
  fnckpt.save(state, tmp_path / "c", pack_bytes=0).wait()
  _break_writes(monkeypatch)
  with pytest.raises(fnckpt.CheckpointError) as e:
    fnckpt.save(state, tmp_path / "c", pack_bytes=0, overwrite=True).wait()
  assert "disk on fire" in str(e.value)
  assert e.value.outcome == SaveOutcome(committed=False, replaced=True)
  assert ("Nothing was committed; the checkpoint that was at this path was removed first "
          "(overwrite=True); other checkpoints are intact.") in str(e.value)
  with pytest.raises(fnckpt.CheckpointError):
    fnckpt.restore(tmp_path / "c")
  with pytest.raises(fnckpt.CheckpointError) as fresh:  # nothing was there: no such words
    fnckpt.save(state, tmp_path / "new", pack_bytes=0).wait()
  assert "Nothing was committed; earlier checkpoints are intact." in str(fresh.value)
  assert fresh.value.outcome == SaveOutcome(committed=False, replaced=False)


def test_a_base_deleted_during_an_overwrite_does_not_say_the_old_checkpoint_is_intact(
    tmp_path, monkeypatch):
  """save(base=A, overwrite=True) where A is deleted while the save writes: the new
  checkpoint is not committed, and the one that was at its path was removed first. The error
  says so once (it said "Earlier checkpoints are intact." here)."""
  state = {"w": np.arange(1 << 16, dtype=np.float32)}
  a, p = str(tmp_path / "a"), str(tmp_path / "p")
  fnckpt.save(state, a).wait()
  fnckpt.save(state, p).wait()

  def delete_the_base(name):
    if name == "staging":
      shutil.rmtree(a)
  monkeypatch.setattr(_state.hooks, "on_phase", delete_the_base)
  with pytest.raises(fnckpt.CheckpointError, match="was deleted or replaced while this save") \
      as e:
    fnckpt.save(state, p, base=a, overwrite=True).wait()
  assert str(e.value).endswith(
      "Save again (with a committed base, or without base=). Nothing was committed; the "
      "checkpoint that was at this path was removed first (overwrite=True); other checkpoints "
      "are intact."), str(e.value)
  assert "intact" not in str(e.value).lower().replace("other checkpoints are intact", "")
  assert e.value.outcome == SaveOutcome(committed=False, replaced=True)
  with pytest.raises(fnckpt.CheckpointError):
    fnckpt.restore(p)


@pytest.mark.parametrize("target", ["host", "whole", "rows", "columns"])
def test_a_stored_bool_array_with_a_byte_other_than_0_and_1_is_corrupt(tmp_path, target):
  """An array of its own (TensorStore decodes bool itself and refuses the byte 2): damage
  naming the leaf and saying its data is corrupt, not that its zarr.json differs."""
  from jax.sharding import Mesh, SingleDeviceSharding
  path, shape = str(tmp_path / "c"), (64, 96)
  fnckpt.save({"mask": np.ones(shape, np.bool_)}, path, inline_bytes=0, pack_bytes=0).wait()
  leaf = fnckpt.metadata(path).tree["mask"]
  spec = _store.zarr_spec({"driver": "file", "path": path + "/"},
                          _records.Stored(leaf.stored, shape, shape, None), "uint8", shape)
  arr = _store.open_array(spec, __import__("tensorstore").Context(), mode="write").result()
  arr[3:4, 7:8].write(np.array([[2]], np.uint8)).result()   # checksummed by TensorStore
  devices = np.asarray(jax.devices()[:6], dtype=object)
  sharding = {"host": None, "whole": SingleDeviceSharding(jax.devices()[0]),
              "rows": NamedSharding(Mesh(devices[:2], ("x",)), P("x")),
              "columns": NamedSharding(Mesh(devices[:3], ("x",)), P(None, "x"))}[target]
  want = None if sharding is None else {
      "mask": jax.ShapeDtypeStruct(shape, np.bool_, sharding=sharding)}
  with pytest.raises(DamagedError, match=r"\['mask'\].*its data is corrupt or truncated"):
    fnckpt.restore(path, want)


@pytest.mark.parametrize("where", ["inline", "packed"])
def test_bool_bytes_other_than_0_and_1_are_damage(tmp_path, capsys, where):
  """A crafted checkpoint (valid checksums and content hashes) whose bool array holds the byte
  2: restore, export and verify call it damage naming the leaf, never return a bool that is
  neither value. (The packed byte changed after the save is first its content hash mismatch;
  the crafted checkpoint then records the leaf's new hash.)"""
  from fnckpt.cli import main
  path = str(tmp_path / "c")
  n = 4 if where == "inline" else 40_000   # 40 KB: over the inline limit, into the pack
  fnckpt.save({"mask": np.ones(n, np.bool_), "w": np.arange(3.0)}, path).wait()
  if where == "inline":
    _rewrite_manifest(path, lambda m: _leaf(m, "mask").__setitem__("inline", b"\1\2\1\1"))
  else:
    with open(os.path.join(path, _manifest.MANIFEST), "rb") as f:
      m = msgpack.unpackb(f.read(), raw=False)
    pk, at = m["packs"][_leaf(m, "mask")["pack"]["index"]], _leaf(m, "mask")["pack"]["offset"]
    pack = _store.open_array(_store.pack_spec({"driver": "file", "path": path + "/"}, pk["dir"],
                                              pk["nbytes"], pk["chunk"], pk["inner"]),
                             __import__("tensorstore").Context(), mode="write").result()
    pack[at + 7:at + 8].write(np.array([2], np.uint8)).result()   # checksummed by TensorStore
    with pytest.raises(DamagedError, match=r"\['mask'\] .*its data does not match its recorded "
                       r"content hash \(xxh3-128\)"):
      fnckpt.restore(path)
    data = _store.open_array(_store.pack_spec({"driver": "file", "path": path + "/"}, pk["dir"],
                                              pk["nbytes"], pk["chunk"], pk["inner"]),
                             __import__("tensorstore").Context(), mode="read").result()[
                                 at:at + n].read().result()
    assert data[7] == 2
    _rewrite_manifest(path, lambda m: _leaf(m, "mask").__setitem__(
        "hash", _hashes.array_digest(data)))
  msg = r"\['mask'\]: a bool array holds a byte other than 0 and 1.*damaged"
  with pytest.raises(fnckpt.CheckpointError, match=msg):
    fnckpt.restore(path)
  with pytest.raises(fnckpt.CheckpointError, match=msg):
    fnckpt.export_safetensors(path, tmp_path / "m.safetensors")
  assert fnckpt.restore(path, {"w": np.zeros(3)}, partial=True)["w"].sum() == 3.0
  assert main(["verify", "-q", path]) == 1
  assert "['mask']: a bool array holds a byte other than 0 and 1" in capsys.readouterr().out
