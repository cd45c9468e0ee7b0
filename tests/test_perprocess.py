"""fnckpt.PerProcess: a value saved once per process and restored on each process from its
own (issue 10.3). One process here, and 2 real jax.distributed processes (saving, then
restoring on 2 and on 1 process)."""

import glob
import hashlib
import json
import os

import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fnckpt
import helpers_proc as hp

PP_WORKER = os.path.join(hp.HERE, "pp_worker.py")


def _tree(seed=0):
  return {"w": jnp.arange(4.0), "loader": fnckpt.PerProcess(
      {"epoch": 3, "pos": np.arange(5) * (seed + 1), "rng": np.random.default_rng(seed),
       "name": "shard-a", "nested": [1, (2.5, None)]}), "solo": fnckpt.PerProcess(7)}


def test_round_trip_with_and_without_target(tmp_path):
  fnckpt.save(_tree(), tmp_path / "c").wait()
  plain = fnckpt.restore(tmp_path / "c")
  assert isinstance(plain["loader"], fnckpt.PerProcess) and plain["solo"].value == 7
  v = plain["loader"].value
  assert v["epoch"] == 3 and v["name"] == "shard-a" and v["nested"] == [1, [2.5, None]]
  np.testing.assert_array_equal(v["pos"], np.arange(5))
  assert v["rng"].random() == np.random.default_rng(0).random()
  # a template of the value: its tree structure (tuples stay tuples)
  template = {"epoch": 0, "pos": np.zeros(5, np.int64), "rng": np.random.default_rng(9),
              "name": "", "nested": [0, (0.0, None)]}
  got = fnckpt.restore(tmp_path / "c", {"w": jnp.zeros(4), "loader": fnckpt.PerProcess(template),
                                        "solo": fnckpt.PerProcess(None)})
  assert got["loader"].value["nested"] == [1, (2.5, None)]
  assert isinstance(fnckpt.metadata(tmp_path / "c").tree["loader"], fnckpt.PerProcess)


def test_stored_in_one_file_per_process_not_in_the_manifest(tmp_path):
  fnckpt.save(_tree(), tmp_path / "c").wait()
  files = glob.glob(str(tmp_path / "c" / "data-*" / "pp" / "*"))
  assert [os.path.basename(f) for f in files] == ["0"]
  with open(tmp_path / "c" / "manifest.msgpack", "rb") as f:
    manifest = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
  recs = [r for r in manifest["leaves"] if r["kind"] == "perprocess"]
  assert [r["path"] for r in recs] == [[["dict", "loader"]], [["dict", "solo"]]]
  assert all(set(r) == {"path", "kind"} for r in recs)


@pytest.mark.parametrize("target, expect", [
    ({"w": jnp.zeros(4), "loader": None, "solo": fnckpt.PerProcess(None)},
     r"\['loader'\]: the checkpoint holds per-process values \(fnckpt.PerProcess\) here; put "
     r"fnckpt.PerProcess\(None\)"),
    ({"w": fnckpt.PerProcess(None), "loader": fnckpt.PerProcess(None),
      "solo": fnckpt.PerProcess(None)},
     r"\['w'\]: the target is fnckpt.PerProcess, the checkpoint holds an array float32\[4\]"),
    ({"w": jnp.zeros(4), "loader": fnckpt.PerProcess({"epoch": 0}),
      "solo": fnckpt.PerProcess(None)},
     r"PerProcess at \['loader'\]: the target's value has another tree structure .*saved "
     r"leaves: \['loader'\]\['epoch'\], \['loader'\]\['name'\].*PerProcess\(None\)"),
])
def test_mismatched_targets_name_the_key_path(tmp_path, target, expect):
  fnckpt.save(_tree(), tmp_path / "c").wait()
  with pytest.raises(fnckpt.CheckpointError, match=expect):
    fnckpt.restore(tmp_path / "c", target)


def test_unsavable_values_are_refused_before_anything_is_written(tmp_path):
  tree = {"a": fnckpt.PerProcess({"bad": object()}),
          "b": fnckpt.PerProcess(fnckpt.PerProcess(1))}
  with pytest.raises(fnckpt.CheckpointError) as e:
    fnckpt.save(tree, tmp_path / "c")
  assert "Unsupported leaf at ['a']['bad']: builtins.object" in str(e.value)
  assert "fnckpt.PerProcess at ['b'] is inside another PerProcess" in str(e.value)
  assert not os.path.exists(tmp_path / "c" / "COMMIT")


@pytest.mark.parametrize("damage, expect", [
    ("delete", r"The per-process values of process 0 \(.*/pp/0\) are missing: the checkpoint "
               r"is damaged"),
    ("garbage", r"The per-process values at '.*/pp/0' are corrupt"),
    ("bitflip", r"The per-process values at '.*/pp/0' are corrupt \(SHA-256 mismatch\)"),
    ("stored", r"The per-process values at '.*/pp/0' are invalid: .*leaf #0 must hold its "
               r"value inline"),
])
def test_damaged_per_process_file_is_a_clear_error(tmp_path, damage, expect):
  fnckpt.save({"x": fnckpt.PerProcess(np.arange(3))}, tmp_path / "c").wait()
  (f,) = glob.glob(str(tmp_path / "c" / "data-*" / "pp" / "0"))
  if damage == "delete":
    os.remove(f)
  elif damage == "garbage":
    with open(f, "wb") as out:
      out.write(b"\xc1\xff\x00garbage")
  elif damage == "bitflip":
    with open(f, "rb") as fin:
      raw = bytearray(fin.read())
    raw[-3] ^= 1  # inside the payload: an array value's byte
    with open(f, "wb") as out:
      out.write(bytes(raw))
  else:  # a consistent file (its digest recomputed) with an invalid record
    with open(f, "rb") as fin:
      outer = msgpack.unpackb(fin.read(), raw=False)
    m = msgpack.unpackb(outer["payload"], raw=False)
    rec = m["leaves"][0]
    del rec["inline"]
    rec["store"] = {"dir": "x", "chunks": [3], "inner": [3], "zstd": None}
    payload = msgpack.packb(m, use_bin_type=True)
    with open(f, "wb") as out:
      out.write(msgpack.packb({"sha256": hashlib.sha256(payload).hexdigest(),
                               "payload": payload}, use_bin_type=True))
  with pytest.raises(fnckpt.CheckpointError, match=expect):
    fnckpt.restore(tmp_path / "c")


def test_per_process_from_must_name_a_saved_process(tmp_path):
  fnckpt.save({"x": fnckpt.PerProcess(1)}, tmp_path / "c").wait()
  assert fnckpt.restore(tmp_path / "c", per_process_from=0)["x"].value == 1
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"per_process_from=1: .* was saved by processes 0\.\.0"):
    fnckpt.restore(tmp_path / "c", per_process_from=1)


def _run(cfg, n, timeout=180, devices=1):
  port = hp.free_port()
  procs = [hp.start([hp.sys.executable, PP_WORKER, json.dumps(
      {**cfg, "num_processes": n, "process_id": i, "port": port, "devices": devices})])
      for i in range(n)]
  results = hp.finish(procs, timeout)
  for r in results:
    assert r.returncode == 0 and r.result is not None, r.describe()
  return [r.result for r in results]


def test_two_processes_each_get_their_own_value_back(tmp_path):
  path = str(tmp_path / "c")
  _run({"mode": "save", "path": path}, 2)
  assert sorted(os.path.basename(f) for f in glob.glob(f"{path}/data-*/pp/*")) == ["0", "1"]
  got = _run({"mode": "restore", "path": path}, 2)
  for me, r in enumerate(got):
    assert r["process"] == me and r["offset"] == 1000 * (me + 1)
    assert r["order"] == (np.arange(4) + me).tolist()
    assert r["draw"] == np.random.default_rng(me).random()
    assert r["w"] == np.arange(6.0).reshape(2, 3).tolist() and r["step"] == 5
  # one process: the count changed, so it must say whose values to take
  (alone,) = _run({"mode": "restore", "path": path}, 1)
  assert "['loader'] holds fnckpt.PerProcess values of 2 processes, but this job has 1" \
      in alone["error"] and "per_process_from" in alone["error"]
  (chosen,) = _run({"mode": "restore", "path": path, "from": 1}, 1)
  assert chosen["offset"] == 2000 and chosen["draw"] == np.random.default_rng(1).random()


def test_processes_restoring_different_leaves_need_no_collective(tmp_path):
  """Restore is per process: process 0 restores one leaf, process 1 another, both onto a
  sharding spanning the two processes (small leaves: placed from this process's slices, not
  by jax.device_put, which would run a cross-process check)."""
  got = _run({"mode": "apart", "path": str(tmp_path / "c")}, 2, devices=2)
  assert [(r["name"], r["ok"], r["shards"]) for r in got] == [("b", True, 2), ("f", True, 2)]


def test_arrays_on_one_process_save_process_0s_value(tmp_path):
  """Non-global jax arrays (each process's own, on its own device) are process 0's in the
  checkpoint, like numpy leaves: a packed one is packed by process 0 (never by whichever
  process the balancer picks), a large one is written by process 0 alone (never by every
  process, the last writer winning)."""
  path = str(tmp_path / "c")
  _run({"mode": "local", "path": path}, 2)
  got = fnckpt.restore(path)
  assert [float(np.abs(s).max()) for s in got["small"]] == [0.0] * 4
  assert not got["big"].any() and got["step"] == 0
  assert [l.packed.pack for l in fnckpt.metadata(path).leaves if l.packed] == [0] * 4


def _valid_values_file():
  from fnckpt._format import perprocess as _perprocess
  return _perprocess.encode([((("dict", "loader"),), fnckpt.PerProcess(
      {"epoch": 3, "pos": np.arange(4), "rng": np.random.default_rng(1), "name": "a",
       "big": 2 ** 70, "key": None, "items": [1.5, (2, "x")]}))])


_json = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) |
                     st.floats(allow_nan=True) | st.text(max_size=8) | st.binary(max_size=8),
                     lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                          c, max_size=4),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_per_process_file_decodes_or_is_a_checkpoint_error(data):
  """Untrusted input: random bytes, and valid files with one field of one record replaced
  (their digest recomputed, so validation itself is exercised): records or CheckpointError,
  never another exception."""
  from fnckpt._format import perprocess as _perprocess
  if data.draw(st.booleans()):
    raw = data.draw(st.binary(max_size=64))
  else:
    outer = msgpack.unpackb(_valid_values_file(), raw=False)
    m = msgpack.unpackb(outer["payload"], raw=False, strict_map_key=False)
    rec = data.draw(st.sampled_from(m["leaves"]))
    field = data.draw(st.sampled_from(sorted(rec) + ["extra"]))
    rec[field] = data.draw(_json)
    payload = msgpack.packb(m, use_bin_type=True)
    raw = msgpack.packb({"sha256": hashlib.sha256(payload).hexdigest(), "payload": payload},
                        use_bin_type=True)
  try:
    leaves = _perprocess.decode(raw, "x/pp/0")
  except fnckpt.CheckpointError as e:
    assert "x/pp/0" in str(e)
    return
  for leaf in leaves:  # what decoded must also rebuild
    _perprocess.value_at(leaves, leaf.path[:1], None, "x/pp/0")
