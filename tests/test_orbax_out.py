"""fnckpt.export_orbax read by the real orbax-checkpoint (0.12.8, a test-only dependency):
StandardCheckpointer().restore onto another mesh and PartitionSpecs, PyTreeCheckpointer
without a target, CheckpointManager at ROOT/7/default, compared bitwise; the layout compared
file by file with what Orbax's own StandardCheckpointer().save writes for the same tree;
fnckpt.restore reads the export back. What Orbax cannot hold is refused naming key paths;
bad input leaves ``out`` untouched; a checkpoint saved by 2 processes is exported by one;
the window bounds what is held."""

import base64
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
import fnckpt.cli
import helpers_proc as hp
from fnckpt._export import orbax_plan
from fnckpt._format import records

WORKER = os.path.join(hp.HERE, "interop_worker.py")


def state_on(mesh):
  s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
  return {
      "params": {
          "w": jax.device_put(w, s("data", "model")),                             # sharded
          "b": jax.device_put(np.arange(32).astype(jnp.bfloat16), s()),           # replicated
          "e": jax.device_put((np.arange(48 * 8) % 97).astype(jnp.bfloat16).reshape(48, 8),
                              s(None, ("data", "model"))),                        # 2 axes
          "q": jax.device_put((np.arange(16 * 4) % 251 - 125).astype(np.int8).reshape(16, 4),
                              s("model")),
      },
      "layers": [{"k": jax.device_put(np.full((4, 4), i, np.int32), s())} for i in range(3)],
      "host": np.arange(10, dtype=np.int64),
      "f64": np.linspace(0, 1, 7),
      "step": 7,
      "lr": 0.25,
  }


def same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_restored(got, want):
  flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
  assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
  for (p, g), (_, w) in zip(flat_got, flat_want):
    if isinstance(w, (int, float)):
      assert g == w and type(g) is type(w), jax.tree_util.keystr(p)
    else:
      assert same(g, w), jax.tree_util.keystr(p)


def abstract(tree, mesh, specs):
  """ShapeDtypeStructs of ``tree``'s jax arrays on ``mesh`` (``specs`` by key path, else P());
  other leaves as they are (what StandardCheckpointer's restore takes)."""
  def leaf(path, x):
    if not isinstance(x, jax.Array):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
        mesh, specs.get(jax.tree_util.keystr(path), P())))
  return jax.tree_util.tree_map_with_path(leaf, tree)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  root = tmp_path_factory.mktemp("orbax_out")
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  state = state_on(mesh)
  fnckpt.save(state, str(root / "ckpt")).wait()
  r = fnckpt.export_orbax(str(root / "ckpt"), str(root / "out"))
  return root, state, mesh, r


def test_standard_checkpointer_restores_onto_another_mesh_bitwise(exported):
  root, state, _, r = exported
  assert r.out == str(root / "out") and r.arrays == 11
  other = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[::-1])
  specs = {"['params']['w']": P("y", "x"), "['params']['b']": P("x"),
           "['params']['e']": P(("x", "y")), "['params']['q']": P(None, "y")}
  target = abstract(state, other, specs)
  got = ocp.StandardCheckpointer().restore(str(root / "out"), target)
  assert_restored(got, jax.tree.map(np.asarray, state))
  for (p, g), (_, t) in zip(jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(target)):
    if isinstance(t, jax.ShapeDtypeStruct):
      assert g.sharding == t.sharding, jax.tree_util.keystr(p)
  assert isinstance(got["host"], np.ndarray) and isinstance(got["step"], int)


def test_pytree_checkpointer_restores_without_a_target(exported):
  root, state, _, _ = exported
  with pytest.warns(UserWarning, match="Sharding info not provided"):  # (Orbax's own)
    got = ocp.PyTreeCheckpointer().restore(str(root / "out"))
  assert_restored(got, jax.tree.map(np.asarray, state))
  w = got["params"]["w"]  # on the saved mesh axes and PartitionSpec, over jax.devices()
  assert isinstance(w, jax.Array) and w.sharding.spec == P("data", "model")
  assert dict(w.sharding.mesh.shape) == {"data": 2, "model": 4}
  assert got["params"]["e"].sharding.spec == P(None, ("data", "model"))


def test_checkpoint_manager_restores_a_step_exported_to_root_7_default(exported, tmp_path):
  root, state, mesh, _ = exported
  fnckpt.export_orbax(str(root / "ckpt"), str(tmp_path / "run" / "7" / "default"))
  mgr = ocp.CheckpointManager(str(tmp_path / "run"))
  assert mgr.all_steps() == [7]
  target = abstract(state, mesh, {"['params']['w']": P(None, "data")})
  got = mgr.restore(7, args=ocp.args.StandardRestore(target))
  mgr.close()
  assert_restored(got, jax.tree.map(np.asarray, state))
  assert got["params"]["w"].sharding == target["params"]["w"].sharding


def test_fnckpt_reads_the_export_back_bitwise(exported):
  root, state, mesh, _ = exported
  target = abstract(state, mesh, {"['params']['w']": P("model", "data")})
  got = fnckpt.restore(str(root / "out"), target)
  assert_restored(got, jax.tree.map(np.asarray, state))
  assert got["params"]["w"].sharding == target["params"]["w"].sharding
  meta = fnckpt.metadata(str(root / "out"))
  w = meta.tree["params"]["w"]
  assert (w.sharding.axes, tuple(w.sharding.spec)) == (("data", "model"), ("data", "model"))


def _ocdbt(path):
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
  return {k.decode(): kv.read(k).result().value for k in kv.list().result()}


def test_the_layout_is_what_orbax_writes_for_the_same_tree(exported):
  root, state, _, _ = exported
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(str(root / "by_orbax"), state)
  ckpt.wait_until_finished()
  ours, theirs = root / "out", root / "by_orbax"
  assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
  assert sorted(os.listdir(ours / "ocdbt.process_0")) == ["d", "manifest.ocdbt"]
  read = lambda d, n: json.loads((d / n).read_text())  # noqa: E731
  assert read(ours, "_METADATA") == read(theirs, "_METADATA")
  assert read(ours, "array_metadatas/process_0") == read(theirs, "array_metadatas/process_0")
  mine, orbax = read(ours, "_sharding"), read(theirs, "_sharding")
  assert mine.keys() == orbax.keys()
  for k in mine:
    a, b = json.loads(mine[k]), json.loads(orbax[k])
    assert a == {n: b[n] for n in a}, base64.urlsafe_b64decode(k)  # (no device ids, types)
  assert read(ours, "_CHECKPOINT_METADATA")["item_handlers"] == orbax_plan.HANDLER
  assert (ours / "commit_success.txt").read_text() == f"Checkpoint commit was successful to {ours}"
  a, b = _ocdbt(ours), _ocdbt(theirs)
  assert sorted(a) == sorted(b)  # every zarr array's .zarray and chunk keys
  for k in a:
    if k.endswith(".zarray"):
      assert json.loads(a[k]) == json.loads(b[k]), k


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # (Orbax's, without a target)
def test_keys_strings_numbers_and_empty_containers(tmp_path):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  keys = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P("model")))
  tree = {"key": jax.random.key(0), "keys": keys, "rbg": jax.random.key(2, impl="rbg"),
          "flag": True, "n": None, "e": {}, "l": [], "t": (), "u64": 2**63, "np32": np.float32(2.5),
          "i4": np.arange(4).astype(jnp.int4), "f8": np.arange(4).astype(jnp.float8_e4m3fn)}
  fnckpt.save({**tree, "s": "hello", "c": 1 + 2j}, str(tmp_path / "c")).wait()
  fnckpt.export_orbax(str(tmp_path / "c"), str(tmp_path / "o"))
  by_orbax = ocp.PyTreeCheckpointer().restore(str(tmp_path / "o"))
  ours = fnckpt.restore(str(tmp_path / "o"), {**abstract(tree, mesh, {}), "s": "", "c": 0j})
  for got in (by_orbax, ours):
    assert got["s"] == "hello" and got["c"] == 1 + 2j and got["u64"] == 2**63
    assert got["np32"] == 2.5 and type(got["np32"]) is float  # as Orbax returns its scalars
    assert got["flag"] is True and got["n"] is None
    assert (got["e"], got["l"], got["t"]) == ({}, [], ())
    for k in ("key", "keys", "rbg"):
      assert jax.random.key_impl(got[k]) == jax.random.key_impl(tree[k]), k
      assert same(jax.random.key_data(got[k]), jax.random.key_data(tree[k])), k
    assert same(got["i4"], tree["i4"]) and same(got["f8"], tree["f8"])
  # a single-device array (fnckpt records no device): Orbax puts it on the device with id 0
  assert by_orbax["key"].sharding.device_set == {jax.devices()[0]}
  # StandardCheckpointer restores what its targets may hold (no str, complex, numpy scalars)
  standard = {k: v for k, v in tree.items() if k != "np32"}
  fnckpt.save(standard, str(tmp_path / "c2")).wait()
  fnckpt.export_orbax(str(tmp_path / "c2"), str(tmp_path / "o2"))
  target = abstract(standard, mesh, {"['keys']": P("data")})
  got = ocp.StandardCheckpointer().restore(str(tmp_path / "o2"), target)
  assert got["keys"].sharding == target["keys"].sharding
  assert same(jax.random.key_data(got["keys"]), jax.random.key_data(keys))


def test_what_orbax_cannot_hold_is_refused_naming_every_key_path(tmp_path):
  tree = {"pp": fnckpt.PerProcess(np.arange(3)), "big": 2**70, "raw": b"xy",
          "gen": np.random.default_rng(0), "u4": np.arange(4).astype(jnp.uint4),
          "a.b": np.ones(2), "a": {"b": np.zeros(2)}, "ok": np.ones(3)}
  fnckpt.save(tree, str(tmp_path / "c")).wait()
  with pytest.raises(fnckpt.CheckpointError) as e:
    fnckpt.export_orbax(str(tmp_path / "c"), str(tmp_path / "o"))
  text = str(e.value)
  assert f"Cannot export the checkpoint at {str(tmp_path / 'c')!r} to Orbax" in text
  for line in ("['pp']: a PerProcess value", "['big']: an int outside int64/uint64",
               "['raw']: a bytes value", "['gen']: a numpy Generator",
               "['u4']: dtype uint4, which Orbax's zarr arrays cannot hold",
               "['a.b']: its Orbax name 'a.b' (key names joined with '.') is also that of "
               "['a']['b']", "save it again"):
    assert line in text, line
  assert "['ok']" not in text
  assert not os.path.exists(tmp_path / "o") and os.listdir(tmp_path) == ["c"]


def test_the_unsupported_dtypes_are_those_tensorstore_zarr_refuses():
  refused = set()
  for name in records.DTYPES:
    spec = {"driver": "zarr", "kvstore": {"driver": "memory"}, "dtype": name,
            "metadata": {"shape": [2], "chunks": [2]}}
    try:
      ts.open(spec, create=True).result()
    except ValueError:
      refused.add(name)
  assert refused == orbax_plan.UNSUPPORTED_DTYPES


def _tree_of(path):
  return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
          for d, _, files in os.walk(path) for f in files}


def test_bad_input_is_a_checkpoint_error_and_out_is_untouched(exported, tmp_path):
  root, _, _, _ = exported
  ckpt = str(root / "ckpt")
  (tmp_path / "empty").mkdir()
  (tmp_path / "torn").mkdir()
  fnckpt.save({"w": np.ones(3)}, str(tmp_path / "torn" / "c")).wait()
  os.unlink(tmp_path / "torn" / "c" / "COMMIT")  # (fnckpt's commit marker)
  for bad, found in ((tmp_path / "empty", "No checkpoint"), (tmp_path / "nothing", "No "),
                     (tmp_path / "torn" / "c", "no commit marker")):
    with pytest.raises(fnckpt.CheckpointError, match=found):
      fnckpt.export_orbax(str(bad), str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o")
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "notes.txt").write_text("mine")
  before = _tree_of(tmp_path / "busy")
  with pytest.raises(fnckpt.CheckpointError, match="already exists and is not empty. Pass "
                     r"overwrite=True \(CLI: --overwrite\)"):
    fnckpt.export_orbax(ckpt, str(tmp_path / "busy"))
  with pytest.raises(fnckpt.CheckpointError, match="is not an Orbax checkpoint \\(it holds "
                     "'notes.txt'\\); overwrite=True replaces only an Orbax checkpoint"):
    fnckpt.export_orbax(ckpt, str(tmp_path / "busy"), overwrite=True)
  for inside in (ckpt, os.path.join(ckpt, "orbax"), str(root)):  # never over or in it
    with pytest.raises(fnckpt.CheckpointError, match="overlap \\(one is the other or inside "
                       "it\\). Export to a directory outside the checkpoint"):
      fnckpt.export_orbax(ckpt, inside, overwrite=True)
  assert not os.path.exists(os.path.join(ckpt, "orbax"))
  (tmp_path / "file").write_text("x")
  with pytest.raises(fnckpt.CheckpointError, match="is a file or a link, not an Orbax"):
    fnckpt.export_orbax(ckpt, str(tmp_path / "file"), overwrite=True)
  with pytest.raises(fnckpt.CheckpointError, match=r"export_orbax\(budget_bytes=0\)"):
    fnckpt.export_orbax(ckpt, str(tmp_path / "o"), budget_bytes=0)
  assert _tree_of(tmp_path / "busy") == before
  assert os.listdir(tmp_path / "busy") == ["notes.txt"]
  with pytest.raises(fnckpt.CheckpointError, match="writes local files only"):
    fnckpt.export_orbax(ckpt, "gs://bucket/out")
  # an empty directory is filled; an Orbax checkpoint is replaced with overwrite=True
  (tmp_path / "fresh").mkdir()
  fnckpt.export_orbax(ckpt, str(tmp_path / "fresh"))
  fnckpt.save({"x": np.arange(3)}, str(tmp_path / "c2")).wait()
  fnckpt.export_orbax(str(tmp_path / "c2"), str(tmp_path / "fresh"), overwrite=True)
  assert same(ocp.PyTreeCheckpointer().restore(str(tmp_path / "fresh"))["x"], np.arange(3))
  assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_failed_write_leaves_no_trace(exported, tmp_path, monkeypatch):
  root, _, _, _ = exported
  from fnckpt._export import to_orbax
  def fail(*a, **k):
    raise fnckpt.CheckpointError("merge failed (test)")
  monkeypatch.setattr(to_orbax, "_merge", fail)
  with pytest.raises(fnckpt.CheckpointError, match="merge failed"):
    fnckpt.export_orbax(str(root / "ckpt"), str(tmp_path / "o"))
  assert os.listdir(tmp_path) == []


def test_streams_in_a_bounded_window(tmp_path):
  """An 8 MiB sharded leaf (pieces), a 1 MiB one in a pack and a 4 MiB zarr3 one through a
  256 KiB window: chunks of at most a sixteenth of it (a shard's C-order blocks; a packed
  leaf's C-order ranges), the window never exceeded, Orbax reads them bitwise."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  big = np.random.default_rng(0).standard_normal((2048, 1024), dtype=np.float32)
  tree = {"big": jax.device_put(big, NamedSharding(mesh, P("data", "model"))),
          "packed": np.arange(1 << 18, dtype=np.float32), "odd": np.arange(7 * 75_000.0)}
  fnckpt.save(tree, str(tmp_path / "c")).wait()
  budget = 256 << 10
  r = fnckpt.export_orbax(str(tmp_path / "c"), str(tmp_path / "o"), budget_bytes=budget)
  assert r.bytes == sum(x.nbytes for x in tree.values())
  assert 0 < r.peak_read_bytes <= budget
  metas = json.loads((tmp_path / "o" / "array_metadatas" / "process_0").read_text())
  (big_meta,) = [m["array_metadata"] for m in metas["array_metadatas"]]
  assert big_meta["write_shape"] == [1024, 256] and big_meta["chunk_shape"] == [16, 256]
  zarr = {k: json.loads(v) for k, v in _ocdbt(tmp_path / "o").items() if k.endswith(".zarray")}
  assert zarr["packed/.zarray"]["chunks"] == [4096]
  assert zarr["odd/.zarray"]["chunks"] == [1875]
  target = abstract(tree, mesh, {"['big']": P("model")})
  got = ocp.StandardCheckpointer().restore(str(tmp_path / "o"), target)
  assert_restored(got, jax.tree.map(np.asarray, tree))


def test_chunk_shapes():
  assert orbax_plan.chunk_shape((512, 256), 4, 16 << 10) == (16, 256)
  assert orbax_plan.chunk_shape((7, 75_000), 8, 1 << 20) == (1, 75_000)
  assert orbax_plan.chunk_shape((525_000,), 8, 16 << 10) == (1875,)  # a divisor near the most
  assert orbax_plan.chunk_shape((1_000_003,), 4, 4096) == (1024,)    # a prime: the most
  assert orbax_plan.chunk_shape((0, 3), 4, 4) == (1, 1)


def test_cli_exports_to_orbax(exported, tmp_path, capsys):
  root, state, _, _ = exported
  out = str(tmp_path / "o")
  assert fnckpt.cli.main(["export", "--format", "orbax", str(root / "ckpt"), out]) == 0
  assert "wrote an Orbax checkpoint of 11 array(s)" in capsys.readouterr().out
  assert_restored(fnckpt.restore(out), jax.tree.map(np.asarray, state))
  assert fnckpt.cli.main(["export", "--format", "orbax", "--select", "params",
                          str(root / "ckpt"), str(tmp_path / "o2")]) == 2
  assert "--select applies to --format safetensors" in capsys.readouterr().err
  assert fnckpt.cli.main(["export", "--format", "orbax", str(root / "ckpt"), out]) == 2
  assert "already exists and is not empty" in capsys.readouterr().err
  assert fnckpt.cli.main(["export", "--format", "orbax", "--overwrite", str(root / "ckpt"),
                          out]) == 0


LEAVES = {
    "a": {"shape": [64, 128], "spec": ["x", "y"]},
    "b": {"shape": [128, 64], "dtype": "int32", "spec": ["y"]},
    "f": {"shape": [96, 40], "dtype": "bfloat16", "spec": [None, "x"]},
}


def test_a_checkpoint_saved_by_2_processes_is_exported_by_one(tmp_path):
  """Each of 2 jax.distributed processes saves its shards; this process exports them all."""
  import mp_worker
  path = str(tmp_path / "ckpt")
  port = hp.free_port()
  procs = [hp.start([sys.executable, WORKER, json.dumps(
      {"mode": "save", "mesh": [[2, 4], ["x", "y"]], "leaves": LEAVES, "path": path,
       "port": port, "num_processes": 2, "process_id": i})]) for i in range(2)]
  for r in hp.finish(procs, 120):
    assert r.returncode == 0 and not r.timed_out and "error" not in r.result, r.describe()
  fnckpt.export_orbax(path, str(tmp_path / "o"))
  mesh = jax.make_mesh((8,), ("z",))
  want = {k: mp_worker.expected(k, l["shape"], l.get("dtype", "float32")) for k, l in LEAVES.items()}
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P("z")))
            for k, v in want.items()}
  got = ocp.StandardCheckpointer().restore(str(tmp_path / "o"), {**target, "step": 0})
  assert got["step"] == 7
  for k in LEAVES:
    assert same(got[k], want[k]), k
    assert got[k].sharding == target[k].sharding
  assert json.loads((tmp_path / "o" / "_sharding").read_text())  # the saved mesh axes


def test_the_export_imports_no_orbax_and_starts_no_backend(exported, tmp_path):
  """In a fresh process (the CLI's case): the export neither imports orbax nor starts a JAX
  backend (a single-device array needs no device name: see orbax_plan._sharding_json)."""
  import subprocess
  root, _, _, _ = exported
  code = ("import sys, fnckpt\n"
          "from jax._src import xla_bridge\n"  # (the test may look; the package may not)
          f"fnckpt.export_orbax({str(root / 'ckpt')!r}, {str(tmp_path / 'o')!r})\n"
          "assert not [m for m in sys.modules if m.split('.')[0] == 'orbax'], 'orbax imported'\n"
          "assert not xla_bridge.backends_are_initialized(), 'a backend was started'\n"
          "print('ok')\n")
  here = os.path.dirname(os.path.dirname(fnckpt.__file__))
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**hp.child_env(), "PYTHONPATH": here}, timeout=120)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
  assert json.loads((tmp_path / "o" / "_METADATA").read_text())["tree_metadata"]
