"""fnckpt.restore / fnckpt.metadata on checkpoints written in the test by the real
orbax-checkpoint (0.12.8, a test-only dependency): StandardCheckpointer, CheckpointManager with
StandardSave, ocp.v1.save_pytree, PyTreeCheckpointer with and without OCDBT and with zarr v2 and
zarr3 arrays; sharded and replicated leaves, bf16, numpy arrays and scalars; restored onto the
saved mesh and another one, compared bitwise. A 2-process Orbax save (real jax.distributed
processes) is restored on 1 process and on 4. Damaged or unfinished Orbax checkpoints are
CheckpointErrors naming what is wrong."""

import json
import os
import shutil
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
import helpers_proc as hp
import mp_worker

WORKER = os.path.join(hp.HERE, "interop_worker.py")


def state_on(mesh):
  s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 7
  return {
      "params": {
          "w": jax.device_put(w, s("data", "model")),                             # sharded
          "b": jax.device_put(np.arange(32).astype(jnp.bfloat16), s()),           # replicated
          "e": jax.device_put((np.arange(48 * 8) % 97).astype(jnp.bfloat16).reshape(48, 8),
                              s(None, "data")),                                   # bf16, sharded
      },
      "layers": [{"k": jax.device_put(np.full((4, 4), i, np.int32), s())} for i in range(3)],
      "host": np.arange(10, dtype=np.int64),
      "step": 7,
      "lr": 0.25,
  }


def same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_restored(got, want, target=None):
  flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
  assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
  for (p, g), (_, w) in zip(flat_got, flat_want):
    if isinstance(w, (int, float)):
      assert g == w and type(g) is type(w), jax.tree_util.keystr(p)
    else:
      assert same(g, w), jax.tree_util.keystr(p)
  for (p, g), (_, t) in zip(jax.tree.leaves_with_path(got),
                            jax.tree.leaves_with_path(target or {})):
    if isinstance(t, jax.ShapeDtypeStruct):
      assert g.sharding == t.sharding, jax.tree_util.keystr(p)


def target_on(mesh, state, specs):
  """ShapeDtypeStructs of ``state`` on ``mesh`` (P() unless ``specs`` names the key path)."""
  def leaf(path, x):
    if not isinstance(x, jax.Array):
      return x
    spec = specs.get(jax.tree_util.keystr(path), P())
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(leaf, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """One state saved by Orbax in every way the contract lists."""
  root = tmp_path_factory.mktemp("orbax")
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  state = state_on(mesh)
  paths = {}
  ckpt = ocp.StandardCheckpointer()
  paths["standard"] = str(root / "standard")
  ckpt.save(paths["standard"], state)
  ckpt.wait_until_finished()
  for ocdbt in (True, False):
    for zarr3 in (True, False):
      name = f"pytree-ocdbt{int(ocdbt)}-zarr{3 if zarr3 else 2}"
      paths[name] = str(root / name)
      c = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3))
      c.save(paths[name], args=ocp.args.PyTreeSave(state))
  mgr = ocp.CheckpointManager(str(root / "manager"))
  mgr.save(7, args=ocp.args.StandardSave(state))
  mgr.wait_until_finished()
  mgr.close()
  paths["manager-step"] = str(root / "manager" / "7")
  paths["manager-item"] = str(root / "manager" / "7" / "default")
  paths["v1"] = str(root / "v1")
  with warnings.catch_warnings():  # 0.12.8: "Use `save` instead" (the contract names save_pytree)
    warnings.simplefilter("ignore", DeprecationWarning)
    ocp.v1.save_pytree(paths["v1"], state)
  return paths, state, mesh


KINDS = ["standard", "pytree-ocdbt1-zarr3", "pytree-ocdbt1-zarr2", "pytree-ocdbt0-zarr3",
         "pytree-ocdbt0-zarr2", "manager-step", "manager-item", "v1"]


@pytest.mark.parametrize("kind", KINDS)
def test_restore_same_and_other_mesh_bitwise(saved, kind):
  paths, state, mesh = saved
  path = paths[kind]
  want = jax.tree.map(np.asarray, state)
  assert_restored(fnckpt.restore(path), want)             # host values, no target
  same_mesh = target_on(mesh, state, {"['params']['w']": P("data", "model"),
                                      "['params']['e']": P(None, "data")})
  assert_restored(fnckpt.restore(path, same_mesh), want, same_mesh)
  other = jax.make_mesh((4, 2), ("x", "y"), devices=jax.devices()[::-1])
  resharded = target_on(other, state, {"['params']['w']": P("y", "x"),
                                       "['params']['b']": P("x"),
                                       "['params']['e']": P(("x", "y"))})
  resharded["host"] = np.zeros(10, np.int64)
  assert_restored(fnckpt.restore(path, resharded), want, resharded)


@pytest.mark.parametrize("kind", ["standard", "pytree-ocdbt0-zarr3", "manager-step", "v1"])
def test_metadata(saved, kind):
  paths, _, _ = saved
  meta = fnckpt.metadata(paths[kind])
  assert meta.format == "orbax"
  w = meta.tree["params"]["w"]
  assert w.shape == (64, 32) and w.dtype == np.float32 and w.stored == "params.w"
  assert w.sharding.spec == P("data", "model") and w.sharding.sizes == (2, 4)
  assert meta.tree["params"]["e"].dtype == jnp.bfloat16
  assert meta.tree["params"]["e"].sharding.spec == P(None, "data")
  assert meta.tree["params"]["b"].sharding.spec == P()
  assert meta.tree["host"].sharding is None and meta.tree["host"].shape == (10,)
  assert meta.tree["step"] == 7 and meta.tree["lr"] == 0.25
  assert meta.location.endswith("default" if kind == "manager-step" else
                                "state" if kind == "v1" else kind)
  # a target built from the metadata restores it (on this mesh, the saved specs)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  got = fnckpt.restore(paths[kind], fnckpt.target_from_metadata(meta, mesh))
  assert got["params"]["w"].sharding.spec == P("data", "model")


def test_partial_cast_and_strict_matching(saved):
  paths, state, _ = saved
  path = paths["standard"]
  target = {"params": {"w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)}}
  with pytest.raises(fnckpt.TreeMismatchError, match=r"(?s)in the checkpoint but not in the "
                     r"target:.*\['lr'\].*partial=True"):
    fnckpt.restore(path, target, cast=True)
  with pytest.raises(fnckpt.TreeMismatchError, match=r"\['params'\]\['w'\]: dtype float32 "
                     r"saved, bfloat16 in the target \(pass cast=True"):
    fnckpt.restore(path, target, partial=True)
  got = fnckpt.restore(path, target, partial=True, cast=True)
  assert same(got["params"]["w"], np.asarray(state["params"]["w"]).astype(jnp.bfloat16))
  with pytest.raises(fnckpt.TreeMismatchError, match=r"missing from the checkpoint.*\n.*"
                     r"\['params'\]\['nope'\]"):
    fnckpt.restore(path, {"params": {"nope": jax.ShapeDtypeStruct((1,), jnp.float32)}},
                   partial=True)
  # a prefix tree of shardings; a 0-d array target for a saved scalar
  mesh = jax.make_mesh((8,), ("x",))
  got = fnckpt.restore(path, {"params": NamedSharding(mesh, P("x"))}, partial=True)
  assert got["params"]["w"].sharding.spec == P("x")
  got = fnckpt.restore(path, {"step": jax.ShapeDtypeStruct((), jnp.int32)}, partial=True)
  assert got["step"].dtype == jnp.int32 and int(got["step"]) == 7


def test_strings_and_empty_containers(tmp_path):
  tree = {"name": "run-1", "none": None, "empty": {}, "lst": [], "x": np.arange(3)}
  path = str(tmp_path / "strings")
  ocp.PyTreeCheckpointer().save(path, tree)
  got = fnckpt.restore(path)
  assert got["name"] == "run-1" and got["none"] is None and got["empty"] == {}
  assert got["lst"] == [] and same(got["x"], np.arange(3))


def test_optax_state_into_its_own_classes(tmp_path):
  """Orbax saves attribute names (optax's namedtuples) as dict keys; fnckpt matches by key, so
  an Orbax-saved AdamW state restores into the target's own classes."""
  import optax
  params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
  opt = optax.adamw(1e-3)
  state = {"params": params, "opt": jax.tree.map(lambda x: x + 1, opt.init(params)), "step": 3}
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(str(tmp_path / "o"), state)
  ckpt.wait_until_finished()
  target = jax.eval_shape(lambda: {"params": params, "opt": opt.init(params), "step": 0})
  got = fnckpt.restore(str(tmp_path / "o"), target)
  assert jax.tree.structure(got) == jax.tree.structure(state)
  assert type(got["opt"][0]).__name__ == "ScaleByAdamState" and int(got["opt"][0].count) == 1
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(state)):
    assert same(g, np.asarray(w, dtype=np.asarray(g).dtype))


def copy(src, dst):
  shutil.copytree(src, dst)
  return str(dst)


def test_damaged_or_unfinished_orbax_checkpoints(saved, tmp_path):
  paths, _, _ = saved
  path = copy(paths["pytree-ocdbt0-zarr2"], tmp_path / "c1")
  meta_file = os.path.join(path, "_METADATA")
  good = json.load(open(meta_file))
  open(meta_file, "w").write("{not json")
  with pytest.raises(fnckpt.CheckpointError, match=r"c1' cannot be read: _METADATA is not "
                     r"valid JSON"):
    fnckpt.restore(path)
  bad = json.loads(json.dumps(good))
  entry = bad["tree_metadata"]["('lr',)"]
  entry["key_metadata"][0]["key_type"] = 5
  json.dump(bad, open(meta_file, "w"))
  with pytest.raises(fnckpt.CheckpointError, match=r"_METADATA entry \('lr',\) has a key "
                     r"\{'key': 'lr', 'key_type': 5\}, expected"):
    fnckpt.metadata(path)
  bad = json.loads(json.dumps(good))
  bad["tree_metadata"]["('lr',)"]["key_metadata"][0]["key"] = ".."
  json.dump(bad, open(meta_file, "w"))
  with pytest.raises(fnckpt.CheckpointError, match=r"the parameter name '\.\.' is not a plain "
                     r"relative path"):
    fnckpt.metadata(path)
  json.dump(good, open(meta_file, "w"))
  shutil.rmtree(os.path.join(path, "params.w"))
  with pytest.raises(fnckpt.CheckpointError, match=r"the array of \['params'\]\['w'\] "
                     r"\('params.w'\) cannot be opened \(it is missing\)"):
    fnckpt.restore(path)
  # a chunk file gone: an error naming the leaf, never zeros
  path = copy(paths["pytree-ocdbt0-zarr2"], tmp_path / "c2")
  os.remove(os.path.join(path, "params.w", "0.0"))
  with pytest.raises(fnckpt.CheckpointError, match=r"Cannot restore \['params'\]\['w'\] from "
                     r"the Orbax checkpoint .*c2' \(array 'params.w'\): a chunk of its data is "
                     r"missing"):
    fnckpt.restore(path)
  # Orbax's temporary directory of an unfinished save, and a save with no commit mark
  tmp = copy(paths["standard"], tmp_path / "7.orbax-checkpoint-tmp-1234")
  with pytest.raises(fnckpt.NotCommittedError, match=r"an Orbax save in progress"):
    fnckpt.restore(tmp)
  path = copy(paths["manager-step"], tmp_path / "8")
  os.remove(os.path.join(path, "commit_success.txt"))
  meta = json.load(open(os.path.join(path, "_CHECKPOINT_METADATA")))
  del meta["commit_timestamp_nsecs"]
  json.dump(meta, open(os.path.join(path, "_CHECKPOINT_METADATA"), "w"))
  with pytest.raises(fnckpt.NotCommittedError, match=r"not a finished Orbax checkpoint"):
    fnckpt.restore(path)


def test_a_step_with_several_items_names_them(tmp_path):
  mgr = ocp.CheckpointManager(str(tmp_path / "run"), item_names=("params", "opt"))
  mgr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave({"w": np.ones(2)}),
                                      opt=ocp.args.StandardSave({"m": np.zeros(2)})))
  mgr.wait_until_finished()
  mgr.close()
  step = str(tmp_path / "run" / "1")
  with pytest.raises(fnckpt.CheckpointError, match=r"holds several PyTree items \(opt, "
                     r"params\)\. Restore one of them: e\.g\. fnckpt\.restore\('.*/1/opt'"):
    fnckpt.restore(step)
  assert same(fnckpt.restore(step + "/params")["w"], np.ones(2))


# --- several processes ---------------------------------------------------------------------

LEAVES = {
    "a": {"shape": [64, 128], "spec": ["x", "y"]},                 # 8 distinct shards
    "b": {"shape": [128, 64], "dtype": "int32", "spec": ["y"]},     # replicated over x
    "d": {"shape": [8], "spec": "replicated"},
    "f": {"shape": [96, 40], "dtype": "bfloat16", "spec": [None, "x"]},
}


def group(config, n, timeout=180):
  port = hp.free_port()
  procs = [hp.start([sys.executable, WORKER, json.dumps({**config, "port": port,
                                                         "num_processes": n,
                                                         "process_id": i})])
           for i in range(n)]
  results = hp.finish(procs, timeout)
  for r in results:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  return [r.result for r in results]


@pytest.fixture(scope="module")
def two_process_save(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("mp") / "ckpt")
  group({"mode": "orbax_save", "mesh": [[2, 4], ["x", "y"]], "leaves": LEAVES, "path": path}, 2)
  return path


def test_2_process_orbax_save_restored_on_1_process(two_process_save):
  path = two_process_save
  assert os.path.isdir(os.path.join(path, "ocdbt.process_1"))  # both processes wrote
  want = {k: mp_worker.expected(k, l["shape"], l.get("dtype", "float32"))
          for k, l in LEAVES.items()}
  got = fnckpt.restore(path)
  assert got["step"] == 7
  for k in LEAVES:
    assert same(got[k], want[k]), k
  mesh = jax.make_mesh((8,), ("z",))
  target = {k: jax.ShapeDtypeStruct(tuple(l["shape"]), want[k].dtype,
                                    sharding=NamedSharding(mesh, P("z")))
            for k, l in LEAVES.items()}
  got = fnckpt.restore(path, {**target, "step": 0})
  for k in LEAVES:
    mp_worker.check_addressable(k, got[k], want[k])


@pytest.mark.slow
def test_2_process_orbax_save_restored_on_4_processes(two_process_save):
  """mp_worker's restore mode: 4 processes x 2 devices, other PartitionSpecs; every process
  checks its own shards against the expected values."""
  out = group({"mode": "restore", "devices": 2, "mesh": [[4, 2], ["x", "y"]],
               "leaves": LEAVES, "path": two_process_save,
               "target": {"a": ["y", "x"], "b": [None, "x"], "d": ["y"], "f": ["x", "y"]}}, 4)
  assert [r["checked_shards"] for r in out] == [8] * 4


def test_each_process_reads_only_its_rows(tmp_path):
  """2 processes restore one tensor sharded along its rows, from a safetensors file and from
  an Orbax checkpoint (OCDBT, saved with 8 row shards): each reads its own half of the
  tensor's bytes (plus headers and metadata), not the whole."""
  from safetensors.numpy import save_file
  import interop_worker
  shape = (1024, 512)                          # 2 MiB of random float32
  value = interop_worker.rows_value(shape)
  path = str(tmp_path / "m.safetensors")
  save_file({"w": value, "other": np.zeros((256, 1024), np.float32)}, path)
  out = group({"mode": "rows", "path": path, "name": "w", "shape": list(shape)}, 2)
  half = value.nbytes // 2
  for r in out:
    assert r["checked_shards"] == 4
    assert half <= r["bytes_read"] <= half + 4096, r
  mesh = jax.make_mesh((8,), ("x",))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(str(tmp_path / "orbax"), {"w": jax.device_put(value, NamedSharding(mesh, P("x"))),
                                      "other": np.zeros((256, 1024), np.float32)})
  ckpt.wait_until_finished()
  out = group({"mode": "rows", "path": str(tmp_path / "orbax"), "name": "w",
               "shape": list(shape)}, 2)
  stored = sum(os.path.getsize(os.path.join(root, f))  # every file Orbax wrote: chunks
               for root, _, files in os.walk(tmp_path / "orbax") for f in files)  # (zstd) + all
  for r in out:
    assert r["checked_shards"] == 4
    assert 0.4 * stored <= r["bytes_read"] <= 0.6 * stored, (r, stored)


def upload(local_dir, url, options):
  """Every file under ``local_dir`` to the directory ``url`` (through TensorStore's kvstore)."""
  from fnckpt._io import paths as _paths
  kv = _paths.open_kvstore(url, options)
  for root, _, files in os.walk(local_dir):
    for f in files:
      full = os.path.join(root, f)
      kv.write(os.path.relpath(full, local_dir), open(full, "rb").read()).result()


def test_orbax_and_safetensors_on_s3(saved, s3_env, tmp_path):
  """The same readers on a real local S3 server (SeaweedFS): an Orbax OCDBT checkpoint (a
  manager step) and a safetensors index with its shards, restored onto sharded targets."""
  from safetensors.numpy import save_file
  paths, state, mesh = saved
  options = s3_env.storage_options
  url = s3_env.unique_url("orbax")
  upload(os.path.dirname(paths["manager-step"]), url, options)
  target = target_on(mesh, state, {"['params']['w']": P("model", "data")})
  got = fnckpt.restore(url + "/7", target, storage_options=options)
  assert_restored(got, jax.tree.map(np.asarray, state), target)
  assert fnckpt.metadata(url + "/7", storage_options=options).format == "orbax"
  d = tmp_path / "st"
  d.mkdir()
  w = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
  save_file({"a.w": w}, str(d / "one.safetensors"))
  save_file({"b": np.ones(3, np.int8)}, str(d / "two.safetensors"))
  (d / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"a.w": "one.safetensors", "b": "two.safetensors"}}))
  url = s3_env.unique_url("st")
  upload(str(d), url, options)
  got = fnckpt.restore(url + "/model.safetensors.index.json",
                       {"a": {"w": NamedSharding(mesh, P("data", "model"))}}, partial=True,
                       storage_options=options)
  assert same(got["a"]["w"], w) and got["a"]["w"].sharding.spec == P("data", "model")
  assert same(fnckpt.restore(url, storage_options=options)["b"], np.ones(3, np.int8))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
    ["", "a", "0", "..", "a/b", "jax.Array", "scalar", "Dict", "key", "key_type"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["key", "key_type", "key_metadata", "value_metadata", "value_type", "x"]), inner,
        max_size=3), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(tree=st.dictionaries(st.text(max_size=4), _JSON, max_size=4),
       use_ocdbt=st.sampled_from([True, False, 1, None]))
def test_any_metadata_json_is_an_error_or_valid_entries(tree, use_ocdbt):
  """_METADATA is untrusted JSON: parsing gives well-formed entries or a CheckpointError."""
  from fnckpt._sources import orbax as _orbax_in
  try:
    entries, options = _orbax_in.parse_metadata(
        {"tree_metadata": tree, "use_ocdbt": use_ocdbt}, "loc")
  except fnckpt.CheckpointError as e:
    assert "'loc'" in str(e)
    return
  assert options["use_ocdbt"] in (True, False)
  for e in entries:
    assert e.path and all(kind in ("seq", "dict") for kind, _ in e.path)
    assert ".." not in e.name.split("/")


# --- review fixes (issue 14 A) --------------------------------------------------------------

def _edit_json(path, fn):
  with open(path) as f:
    value = json.load(f)
  fn(value)
  with open(path, "w") as f:
    json.dump(value, f)


def test_a_chunk_or_scalar_larger_than_its_array_is_refused_before_reading(saved, tmp_path):
  """A .zarray / zarr.json whose chunk is 2**20 x 2**20 for a 4 x 8 array (TensorStore would
  allocate it whole: std::bad_alloc aborts the interpreter), and a "scalar" of 2**40
  elements: CheckpointErrors naming the array and the shapes, from metadata and restore."""
  paths, _, _ = saved
  path = copy(paths["pytree-ocdbt0-zarr2"], tmp_path / "z2")
  _edit_json(os.path.join(path, "params.w", ".zarray"),
             lambda z: z.update(chunks=[1 << 20, 1 << 20]))
  for call in (fnckpt.metadata, fnckpt.restore):
    with pytest.raises(fnckpt.CheckpointError, match=r"the array of \['params'\]\['w'\] "
                       r"\('params.w'\) has shape \(64, 32\) and chunk shape \(1048576, "
                       r"1048576\); a chunk must fit in the array along every axis"):
      call(path)
  path = copy(paths["pytree-ocdbt0-zarr3"], tmp_path / "z3")
  def huge_inner(z):
    z["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 20, 1 << 20]
    z["codecs"][0]["configuration"]["chunk_shape"] = [1 << 20, 1 << 20]
  _edit_json(os.path.join(path, "params.w", "zarr.json"), huge_inner)
  with pytest.raises(fnckpt.CheckpointError, match=r"\('params.w'\) has shape \(64, 32\) and "
                     r"chunk shape \(1048576, 1048576\)"):
    fnckpt.restore(path)
  path = copy(paths["pytree-ocdbt0-zarr2"], tmp_path / "s")
  _edit_json(os.path.join(path, "step", ".zarray"),
             lambda z: z.update(shape=[1 << 40], chunks=[1 << 40]))
  for call in (fnckpt.metadata, fnckpt.restore):
    with pytest.raises(fnckpt.CheckpointError, match=r"the scalar at \['step'\] \('step'\) has "
                       r"shape \(1099511627776,\), expected \(\)"):
      call(path)


def test_the_read_budget_charges_whole_chunks(tmp_path):
  """Orbax saved from one device writes the array as one chunk; TensorStore decodes the whole
  chunk for any slice of it: restore charges each slice the chunk-aligned box it overlaps."""
  from fnckpt._sources import source as _source
  value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  path = str(tmp_path / "one")
  c = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
  c.save(path, args=ocp.args.PyTreeSave({"w": value}))
  src = _source.open_any(path, None)
  rec = src.manifest.leaves[0]
  assert rec.stored.chunks == (64, 32)
  assert src.reader.read_bytes(rec, ((0, 8), (0, 32))) == value.nbytes      # a row slice
  assert src.reader.read_bytes(rec, ((0, 64), (4, 8))) == value.nbytes      # a column slice
  assert src.reader.read_bytes(rec, ((0, 0), (0, 32))) == 0
  mesh = jax.make_mesh((8,), ("x",))
  got = fnckpt.restore(path, {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32,
                                                        sharding=NamedSharding(mesh, P("x")))},
                       budget_bytes=4096)   # (each slice alone is charged over the budget)
  assert same(got["w"], value)


def test_sequence_indices_are_plain_decimals():
  from fnckpt._sources import orbax as _orbax_in
  def meta(key):
    return {"tree_metadata": {"x": {"key_metadata": [{"key": key, "key_type": 1}],
                                    "value_metadata": {"value_type": "scalar"}}}}
  assert _orbax_in.parse_metadata(meta("0"), "loc")[0][0].path == (("seq", 0),)
  for key in ("\u0660", "00", "01", "1234567890"):   # Arabic-Indic zero, leading zeros, > 9
    with pytest.raises(fnckpt.CheckpointError, match=r"has the sequence index"):
      _orbax_in.parse_metadata(meta(key), "loc")


def test_metadata_json_limits(tmp_path):
  """_METADATA over 64 MiB, with too many maps, or with a key path of over 64 keys."""
  from fnckpt._sources import orbax as _orbax_in
  assert _orbax_in.MAX_JSON_BYTES == 64 << 20
  with pytest.raises(fnckpt.CheckpointError, match=r"_METADATA holds more than 1048576 JSON "
                     r"maps"):
    _orbax_in.load_json(b"[" + b"{}," * (1 << 20) + b"{}]", "loc", "_METADATA")
  keys = [{"key": "a", "key_type": 2}] * 65
  with pytest.raises(fnckpt.CheckpointError, match=r"has a key path of 65 keys, more than 64"):
    _orbax_in.parse_metadata({"tree_metadata": {"x": {
        "key_metadata": keys, "value_metadata": {"value_type": "scalar"}}}}, "loc")
  path = tmp_path / "big"
  path.mkdir()
  with open(path / "_METADATA", "wb") as f:
    f.truncate((64 << 20) + 1)      # sparse
  (path / "commit_success.txt").write_text("ok")
  with pytest.raises(fnckpt.CheckpointError, match=r"_METADATA: it is larger than 67108864 "
                     r"bytes"):
    fnckpt.metadata(str(path))
