"""Bad input and damaged checkpoints give one clear fnckpt error that names the key path or
storage path, says what was expected and what was found, and what to do. Strict by default;
partial restore and dtype casting only when asked."""

import os
import re

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt import CheckpointError, NotCommittedError, TreeMismatchError
from fnckpt._format import manifest as _manifest

from tree_utils import assert_trees_all_equal


def _big(n=8192, dtype=np.float32):
  """An array above the inline limit (16 KiB): packed, or in its own zarr3 array with
  pack_bytes=0."""
  return np.arange(n, dtype=dtype)


def _tree():
  return {"params": {"w": _big(), "b": np.ones(3, np.float32)}, "step": 5,
          "rng": jax.random.key(0), "name": "run"}


@pytest.fixture
def ckpt(tmp_path):
  """['params']['w'] packed (the default for a 32 KiB array), the rest inline."""
  tree = _tree()
  path = tmp_path / "ckpt"
  fnckpt.save(tree, path).wait()
  return str(path), tree


@pytest.fixture(params=["array", "pack"])
def damageable(request, tmp_path):
  """The ckpt tree with ['params']['w'] in its own zarr3 array, or in a pack."""
  tree = _tree()
  path = tmp_path / "ckpt"
  fnckpt.save(tree, path, **({"pack_bytes": 0} if request.param == "array" else {})).wait()
  leaf = _leaf_of(str(path))
  assert (leaf.stored is not None, leaf.packed is not None) == (
      request.param == "array", request.param == "pack")
  return str(path), tree


def _loc(path):
  return re.escape(repr(str(path)))


# --- unsupported leaves and keys at save -------------------------------------------------

@pytest.mark.parametrize("leaf, what", [
    (object(), "builtins.object"),
    (lambda: 1, "builtins.function"),
    ({1, 2}, "builtins.set"),
    (np.datetime64("2024-01-01"), "numpy.datetime64"),
    (np.str_("s"), "numpy.str_"),
], ids=["object", "function", "set", "datetime64", "np.str_"])
def test_unsupported_leaf_says_which_where_and_what_to_do(tmp_path, leaf, what):
  with pytest.raises(CheckpointError, match=(
      r"Cannot save this tree:\n  Unsupported leaf at \['opt'\]\[0\]: " + re.escape(what) +
      r"\. fnckpt saves jax\.Array .*register it as a pytree node "
      r"\(jax\.tree_util\.register_dataclass or register_pytree_with_keys\); otherwise "
      r"convert it")):
    fnckpt.save({"opt": [leaf, 1]}, tmp_path / "c")
  assert not os.path.exists(tmp_path / "c")  # nothing written


@pytest.mark.parametrize("array, dtype", [
    (np.array(["a", "b"]), "<U1"), (np.array([object()]), "object"),
    (np.zeros(2, dtype=[("a", "i4")]), r"\[\('a', '<i4'\)\]"),
    (np.zeros(2, "m8[s]"), "timedelta64"), (np.zeros(2, "V4"), r"\|V4"),
])
def test_unsupported_numpy_dtypes(tmp_path, array, dtype):
  with pytest.raises(CheckpointError, match=(
      rf"Unsupported numpy dtype {dtype}.* at \['x'\]: only bool, integer, float16/32/64, "
      r"complex64/128 and ml_dtypes' types \(bfloat16, int4, float8_\*\) are stored\. Convert "
      r"it before saving \(e\.g\. ")):
    fnckpt.save({"x": array}, tmp_path / "c")


def test_every_unsupported_leaf_is_listed_at_once(tmp_path):
  with pytest.raises(CheckpointError) as info:
    fnckpt.save({"a": object(), "b": {"c": {1}}, "ok": 1, "d": np.array(["s"])}, tmp_path / "c")
  text = str(info.value)
  assert text.count("Unsupported") == 3
  for where in ("['a']", "['b']['c']", "['d']"):
    assert where in text


def test_unsupported_dict_keys(tmp_path):
  with pytest.raises(CheckpointError, match=(
      r"Unsupported dict key 1\.5 \(type float\) at \['a'\]\[1\.5\]: checkpoint keys must be "
      r"str or int\. Convert the dict's keys")):
    fnckpt.save({"a": {1.5: 1}}, tmp_path / "c")


def test_keys_no_reader_accepts_are_refused_at_save(tmp_path):
  """A key longer than readers allow, or a path deeper, fails the save (naming the leaf and
  the limit) instead of committing a checkpoint that nothing can open."""
  with pytest.raises(CheckpointError, match=r"4097 characters \(at most 4096\).*Rename"):
    fnckpt.save({"k" * 4097: 1}, tmp_path / "long").wait()
  assert not (tmp_path / "long").exists()
  deep = 1
  for _ in range(257):
    deep = [deep]
  with pytest.raises(CheckpointError, match=r"nested 257 levels deep.*at most 256"):
    fnckpt.save(deep, tmp_path / "deep").wait()
  fnckpt.save({"k" * 4096: 1}, tmp_path / "ok").wait()  # the limit itself is fine
  assert fnckpt.restore(str(tmp_path / "ok")) == {"k" * 4096: 1}


@pytest.mark.parametrize("call", ["save", "restore", "export_safetensors"])
@pytest.mark.parametrize("value", [0, -5, 1.5, "1MB", True])
def test_budget_bytes_must_be_a_positive_int(ckpt, tmp_path, call, value):
  path, tree = ckpt
  run = {"save": lambda: fnckpt.save(tree, tmp_path / "n", budget_bytes=value),
         "restore": lambda: fnckpt.restore(path, budget_bytes=value),
         "export_safetensors": lambda: fnckpt.export_safetensors(
             path, tmp_path / "n.safetensors", select="params", budget_bytes=value)}[call]
  with pytest.raises(CheckpointError, match=rf"{call}\(budget_bytes={re.escape(repr(value))}\): "
                     r"expected an int of at least \d+ \(bytes\), or None for the default"):
    run()
  assert not os.path.exists(tmp_path / "n") and not os.path.exists(tmp_path / "n.safetensors")


def test_export_refuses_a_window_too_small_to_finish(ckpt, tmp_path):
  with pytest.raises(CheckpointError, match=r"budget_bytes=4096\): expected an int of at least "
                     r"65536"):
    fnckpt.export_safetensors(ckpt[0], tmp_path / "n.safetensors", budget_bytes=4096)


def test_a_deleted_or_donated_array(tmp_path):
  x = jnp.ones(10000)
  x.delete()
  with pytest.raises(CheckpointError, match=(
      r"The array at \['params'\]\['x'\] was deleted \(or donated\) before save; save the "
      r"state before the step that donates it")):
    fnckpt.save({"params": {"x": x}}, tmp_path / "c")


def test_metadata_must_be_msgpackable(tmp_path):
  with pytest.raises(CheckpointError, match=(
      r"save\(metadata=\.\.\.\)\['cfg'\]: value of type object cannot be stored as metadata")):
    fnckpt.save({"x": 1}, tmp_path / "c", metadata={"cfg": object()})


# --- the location ------------------------------------------------------------------------

def test_existing_checkpoint_is_refused_unless_overwrite(ckpt):
  path, tree = ckpt
  with pytest.raises(CheckpointError, match=(
      rf"A checkpoint already exists at {_loc(path)}\. Pass overwrite=True to replace it, or "
      r"save to a new path\.")):
    fnckpt.save({"other": 1}, path)
  assert_trees_all_equal(fnckpt.restore(path, tree), tree)  # untouched
  old = _manifest_of(path).data
  # overwrite replaces it entirely: no leaf or file of the old one is left
  fnckpt.save({"other": np.full(9000, 2.0), "big": np.zeros(1 << 20)}, path,
              overwrite=True).wait()
  back = fnckpt.restore(path)
  assert list(back) == ["big", "other"] and back["other"][0] == 2.0
  m = _manifest_of(path)
  assert m.data != old  # new data never lands in the old directory
  assert sorted(os.listdir(path)) == sorted([_manifest.COMMIT, _manifest.MANIFEST, m.data])
  # under it, exactly the arrays and packs the new manifest names (one of each here)
  wanted = {l.stored.dir for l in m.leaves if l.stored} | {p.dir for p in m.packs}
  assert len(wanted) == 2
  assert {os.path.relpath(d, path) for d, _, fs in os.walk(path) if "zarr.json" in fs} == wanted


def test_interrupted_save_is_refused_unless_overwrite(ckpt):
  path, _ = ckpt
  os.remove(os.path.join(path, _manifest.COMMIT))
  with pytest.raises(CheckpointError, match=(
      rf"An interrupted save \(uncommitted data\) already exists at {_loc(path)}\. Pass "
      r"overwrite=True")):
    fnckpt.save({"x": 1}, path)
  fnckpt.save({"x": 1}, path, overwrite=True).wait()
  assert fnckpt.restore(path) == {"x": 1}


def test_no_checkpoint_at_the_path(tmp_path):
  missing = tmp_path / "nope"
  with pytest.raises(CheckpointError, match=(
      rf"No checkpoint at {_loc(missing)} \(no COMMIT marker, no manifest\.msgpack\)\. Check "
      r"the path; a checkpoint directory holds manifest\.msgpack and COMMIT\.")):
    fnckpt.restore(missing)
  with pytest.raises(CheckpointError, match="No checkpoint at"):
    fnckpt.metadata(missing)


def test_nothing_at_the_path_is_its_own_kind_and_names_every_format_tried(tmp_path):
  """An empty directory is none of the formats read: a NoCheckpointError (decided by its type,
  not its text) that says so once."""
  from fnckpt._errors import NoCheckpointError
  (tmp_path / "empty").mkdir()
  for path in (tmp_path / "empty", tmp_path / "nope"):
    with pytest.raises(NoCheckpointError, match=(
        rf"^No checkpoint at {_loc(path)} \(no COMMIT marker, .*\. Nor is it an Orbax "
        r"checkpoint \(_METADATA, _CHECKPOINT_METADATA\) or safetensors \(\*\.safetensors, "
        r"model\.safetensors\.index\.json\)\.$")) as e:
      fnckpt.restore(path)
    assert e.value.outcome is None and str(e.value).count("No checkpoint at") == 1


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
  (tmp_path / "notes.txt").write_text("hello")
  with pytest.raises(CheckpointError, match=rf"No checkpoint at {_loc(tmp_path)}"):
    fnckpt.restore(tmp_path)


def test_a_file_where_the_checkpoint_should_be(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(CheckpointError, match=(
      rf"Cannot (read a checkpoint at|access) {_loc(f)} \(.*Not a directory")):
    fnckpt.restore(f)


def test_saving_where_a_file_is_says_nothing_was_committed(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(CheckpointError, match=rf"Saving to {_loc(f)} failed while checking the "
                                            r"location: .*Nothing was committed; earlier "
                                            r"checkpoints are intact\."):
    fnckpt.save({"x": 1}, f)
  assert f.read_text() == "x"


def test_an_interrupted_save_is_not_a_checkpoint(ckpt):
  path, _ = ckpt
  os.remove(os.path.join(path, _manifest.COMMIT))
  with pytest.raises(NotCommittedError, match=(
      rf"{_loc(path)} holds an interrupted save: its data is \(partly\) there but it has no "
      rf"commit marker, so it is not a checkpoint\. Restore an earlier step, or delete "
      rf"{_loc(path)} and save again\.")):
    fnckpt.restore(path)
  # data only (the manifest not yet written): the same
  os.remove(os.path.join(path, _manifest.MANIFEST))
  with pytest.raises(NotCommittedError, match="interrupted save"):
    fnckpt.metadata(path)


@pytest.mark.parametrize("location", ["ftp://host/x", "hdfs://x/y"])
def test_unsupported_scheme(location):
  with pytest.raises(CheckpointError, match=(
      rf"Unsupported storage location {re.escape(repr(location))}: the scheme is not one of "
      r"file://, memory://, gs://, s3://")):
    fnckpt.restore(location)


# --- damaged checkpoints -----------------------------------------------------------------

def _rewrite(path, manifest):
  """Write ``manifest`` and a commit marker naming it (a checkpoint as another writer would)."""
  data = _manifest.pack(manifest)
  with open(os.path.join(path, _manifest.MANIFEST), "wb") as f:
    f.write(data)
  with open(os.path.join(path, _manifest.COMMIT), "wb") as f:
    f.write(_manifest.encode_commit(data, 0.0))


def _manifest_of(path):
  """The validated records (``_records.Manifest``)."""
  with open(os.path.join(path, _manifest.MANIFEST), "rb") as f:
    return _manifest.decode(f.read(), path)


def _raw_manifest_of(path):
  """The manifest's msgpack map, to edit as another writer would."""
  with open(os.path.join(path, _manifest.MANIFEST), "rb") as f:
    return msgpack.unpackb(f.read(), raw=False, strict_map_key=False)


def _leaf_of(path, key=("params", "w")):
  return next(l for l in _manifest_of(path).leaves if tuple(k for _, k in l.path) == key)


def test_a_checkpoint_from_a_newer_format_version(ckpt):
  path, tree = ckpt
  manifest = _raw_manifest_of(path)
  manifest["version"] = _manifest.FORMAT_VERSION + 1
  manifest["leaves"].append({"path": [["dict", "new"]], "kind": "array", "future": True})
  _rewrite(path, manifest)
  for call in (lambda: fnckpt.restore(path), lambda: fnckpt.restore(path, tree),
               lambda: fnckpt.metadata(path)):
    with pytest.raises(CheckpointError, match=(
        rf"{_loc(path)} was written in fnckpt format version {_manifest.FORMAT_VERSION + 1}, "
        rf"newer than this fnckpt reads \(up to {_manifest.FORMAT_VERSION}\)\. Upgrade fnckpt")):
      call()


def test_a_corrupt_manifest(ckpt):
  path, _ = ckpt
  data = _manifest.pack([1, 2])  # valid msgpack, not a manifest
  with open(os.path.join(path, _manifest.MANIFEST), "wb") as f:
    f.write(data)
  with open(os.path.join(path, _manifest.COMMIT), "wb") as f:
    f.write(_manifest.encode_commit(data, 0.0))
  with pytest.raises(CheckpointError, match=(
      rf"The manifest of {_loc(path)} is corrupt or not an fnckpt manifest")):
    fnckpt.restore(path)
  data = b"\xc1garbage"
  with open(os.path.join(path, _manifest.MANIFEST), "wb") as f:
    f.write(data)
  with open(os.path.join(path, _manifest.COMMIT), "wb") as f:
    f.write(_manifest.encode_commit(data, 0.0))
  with pytest.raises(CheckpointError, match=(
      rf"The manifest of {_loc(path)} is corrupt \(.*\)\. The checkpoint cannot be read; "
      r"restore an earlier one\.")):
    fnckpt.restore(path)


def test_a_manifest_changed_after_the_commit(ckpt):
  path, _ = ckpt
  with open(os.path.join(path, _manifest.MANIFEST), "r+b") as f:
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0x01
    f.seek(0)
    f.write(data)
  with pytest.raises(CheckpointError, match=(
      rf"The manifest of {_loc(path)} does not match its commit marker \(missing or modified "
      r"after the commit\)\. The checkpoint cannot be trusted; restore an earlier one\.")):
    fnckpt.restore(path)


def test_a_corrupt_commit_marker(ckpt):
  path, _ = ckpt
  with open(os.path.join(path, _manifest.COMMIT), "wb") as f:
    f.write(b"\xc1")
  with pytest.raises(CheckpointError, match=rf"The commit marker of {_loc(path)} is corrupt"):
    fnckpt.restore(path)


def _storage_dir(path, key=("params", "w")):
  """Where a leaf's bytes are: its zarr3 array's directory, or its pack's; and whether packed."""
  leaf = _leaf_of(path, key)
  if leaf.stored is not None:
    return leaf.stored.dir, False
  return _manifest_of(path).packs[leaf.packed.pack].dir, True


def _chunk_file(path, key=("params", "w")):
  d, packed = _storage_dir(path, key)
  root = os.path.join(path, d, "c")
  (chunk,) = [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs]
  return chunk, d, packed


def _from(path, d, packed):
  """The storage a read error names: the leaf's zarr3 array. For a packed leaf, some place in
  the checkpoint (which one: test_a_pack_read_error_names_the_pack_directory)."""
  if packed:
    return re.escape(repr(path + "/"))[:-1] + r"[^']+'"
  return re.escape(repr(path + "/" + d))


def _damage(chunk, where, at=100):
  with open(chunk, "rb") as f:
    data = bytearray(f.read())
  if where == "data":
    data[at] ^= 0x10
  elif where == "index":
    data[-8] ^= 0x10
  elif where == "truncated":
    data = data[: len(data) // 2]
  else:
    data += b"junk"
  with open(chunk, "wb") as f:
    f.write(data)


@pytest.mark.parametrize("where", ["data", "index", "truncated", "appended"])
def test_a_damaged_chunk_is_detected_and_names_the_leaf(damageable, where):
  path, tree = damageable
  chunk, d, packed = _chunk_file(path)
  _damage(chunk, where)
  with pytest.raises(CheckpointError, match=(
      rf"Cannot restore \['params'\]\['w'\] from {_from(path, d, packed)}: its data is "
      r"corrupt .*The checkpoint is damaged; restore an earlier one")):
    fnckpt.restore(path, tree)
  with pytest.raises(CheckpointError, match=r"\['params'\]\['w'\].*corrupt"):
    fnckpt.restore(path)
  # the undamaged leaves are still there for a partial restore
  got = fnckpt.restore(path, {"step": 0, "name": ""}, partial=True)
  assert got == {"step": 5, "name": "run"}


def test_a_damaged_pack_names_the_leaf_it_hits_and_spares_the_others(tmp_path):
  """Two leaves of 1 MiB share a pack of two 1 MiB inner chunks (one checksum each): a flipped
  byte damages one leaf, named with a checksum error; the other restores intact."""
  tree = {"a": np.full(1 << 18, 1.0, np.float32), "b": np.full(1 << 18, 2.0, np.float32)}
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  m = _manifest_of(path)
  assert [l.packed.pack for l in m.leaves] == [0, 0] and len(m.packs) == 1
  assert m.packs[0].inner == 1 << 20 and m.packs[0].nbytes == 2 << 20
  chunk, d, _ = _chunk_file(path, ("a",))
  _damage(chunk, "data", at=12345)
  outcomes = {}
  for key in ("a", "b"):
    try:
      got = fnckpt.restore(path, {key: tree[key]}, partial=True)
    except CheckpointError as e:
      outcomes[key] = str(e)
    else:
      np.testing.assert_array_equal(got[key], tree[key])
  (hit,) = outcomes  # exactly one leaf lies in the damaged inner chunk
  assert re.match(rf"Cannot restore \[{hit!r}\] from {_from(path, d, True)}: its data is "
                  r"corrupt \(crc32c checksum mismatch\)\. The checkpoint is damaged; restore "
                  r"an earlier one", outcomes[hit]), outcomes[hit]
  with pytest.raises(CheckpointError, match=rf"Cannot restore \[{hit!r}\] .*corrupt"):
    fnckpt.restore(path)


def test_a_pack_read_error_names_the_pack_directory(ckpt):
  path, tree = ckpt
  chunk, d, packed = _chunk_file(path)
  assert packed and d.startswith(_manifest_of(path).data + "/p/")
  _damage(chunk, "data")
  with pytest.raises(CheckpointError, match=(
      rf"Cannot restore \['params'\]\['w'\] from {re.escape(repr(path + '/' + d))}: its data "
      r"is corrupt \(crc32c checksum mismatch\)")):
    fnckpt.restore(path, tree)


def test_a_deleted_chunk_is_an_error_never_zeros(damageable):
  path, tree = damageable
  chunk, d, packed = _chunk_file(path)
  os.remove(chunk)
  with pytest.raises(CheckpointError, match=(
      rf"Cannot restore \['params'\]\['w'\] from {_from(path, d, packed)}: a chunk of "
      r"its data is missing\. The checkpoint is damaged")):
    fnckpt.restore(path, tree)


def test_a_deleted_shard_of_a_sharded_array(tmp_path):
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  x = jax.device_put(jnp.arange(64 * 64.0).reshape(64, 64), NamedSharding(mesh, P("a", "b")))
  fnckpt.save({"x": x}, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  (leaf,) = _manifest_of(str(tmp_path / "c")).leaves
  assert leaf.stored.chunks == (32, 16)  # one chunk per device shard
  os.remove(tmp_path / "c" / leaf.stored.dir / "c" / "1" / "2")
  target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)}
  store = re.escape(repr(f"{tmp_path / 'c'}/{leaf.stored.dir}"))
  with pytest.raises(CheckpointError, match=(
      rf"Cannot restore \['x'\] from {store}: a chunk of its data is missing")):
    fnckpt.restore(tmp_path / "c", target)


# --- strict restore: one error listing every problem -------------------------------------

def test_strict_restore_lists_every_problem_at_once(ckpt):
  path, _ = ckpt
  target = {
      "params": {"w": jax.ShapeDtypeStruct((8192,), jnp.bfloat16),   # dtype differs
                 "b": np.zeros(4, np.float32),                      # shape differs
                 "extra": np.zeros(2)},                             # not in the checkpoint
      "step": jnp.zeros(3),                                          # array vs int
      "rng": jax.ShapeDtypeStruct((2,), jax.random.key(0).dtype),   # key shape differs
      # "name" missing from the target: unexpected
  }
  with pytest.raises(TreeMismatchError) as info:
    fnckpt.restore(path, target)
  assert str(info.value) == (
      f"The restore target does not match the checkpoint at {str(path)!r}:\n"
      "  1 key path(s) missing from the checkpoint (in the target only):\n"
      "    ['params']['extra']\n"
      "  1 key path(s) in the checkpoint but not in the target:\n"
      "    ['name']\n"
      "  4 key path(s) shape or dtype differs:\n"
      "    ['params']['b']: shape (3,) saved, (4,) in the target\n"
      "    ['params']['w']: dtype float32 saved, bfloat16 in the target (pass cast=True to "
      "convert)\n"
      "    ['rng']: key shape () saved, (2,) in the target\n"
      "    ['step']: the target is an array, the checkpoint holds an int value\n"
      "fnckpt.metadata(path).tree shows what the checkpoint holds.")
  assert isinstance(info.value, ValueError)  # TreeMismatchError is a ValueError too


@pytest.mark.parametrize("target_leaf, saved, match", [
    (np.zeros(3), "name", r"\['name'\]: the target is an array, the checkpoint holds a str value"),
    (jax.ShapeDtypeStruct((3,), jnp.float32), "name",
     r"\['name'\]: the target is an array, the checkpoint holds a str value"),
    (jax.ShapeDtypeStruct((), jax.random.key(0).dtype), "step",
     r"\['step'\]: the target is a PRNG key array, the checkpoint holds an int value"),
    (jax.ShapeDtypeStruct((2,), jnp.uint32), "rng",
     r"\['rng'\]: the target is an array, the checkpoint holds a PRNG key array uint32\[2\]"),
    ("text", ("params", "w"),
     r"\['params'\]\['w'\]: the target is str, the checkpoint holds an array float32\[8192\]"),
    (None, ("params", "b"), r"the target is NoneType, the checkpoint holds an array"),
])
def test_kind_mismatches_name_both_sides(ckpt, target_leaf, saved, match):
  path, tree = ckpt
  target = jax.tree.map(lambda x: x, tree)
  if isinstance(saved, tuple):
    target[saved[0]][saved[1]] = target_leaf
  else:
    target[saved] = target_leaf
  with pytest.raises(TreeMismatchError, match=match):
    fnckpt.restore(path, target)


@pytest.mark.parametrize("saved, match", [
    ({}, r"\['x'\]: the target is an array, the checkpoint holds an empty dict"),
    (np.float32(1), r"\['x'\]: the target is an array, the checkpoint holds a numpy float32 "
                    r"scalar"),
])
def test_kind_mismatches_name_empty_containers_and_numpy_scalars(tmp_path, saved, match):
  fnckpt.save({"x": saved}, tmp_path / "c").wait()
  with pytest.raises(TreeMismatchError, match=match):
    fnckpt.restore(tmp_path / "c", {"x": np.zeros(3)})


def test_only_unexpected_keys_suggests_partial(ckpt):
  path, _ = ckpt
  with pytest.raises(TreeMismatchError, match=(
      r"4 key path\(s\) in the checkpoint but not in the target:(.|\n)*"
      r"To restore a subset of the checkpoint, pass partial=True\.")):
    fnckpt.restore(path, {"params": {"w": _big()}})


def test_long_lists_are_truncated_with_a_count(tmp_path):
  fnckpt.save({f"k{i:02d}": i for i in range(30)}, tmp_path / "c").wait()
  with pytest.raises(TreeMismatchError, match=(
      r"30 key path\(s\) in the checkpoint but not in the target:(.|\n)*\.\.\. and 10 more")):
    fnckpt.restore(tmp_path / "c", {"other": 1})


def test_partial_restore(ckpt):
  path, tree = ckpt
  got = fnckpt.restore(path, {"params": {"w": _big()}, "step": 0}, partial=True)
  assert_trees_all_equal(got, {"params": {"w": tree["params"]["w"]}, "step": 5})
  # partial never hides a key the checkpoint lacks, or a mismatch
  with pytest.raises(TreeMismatchError, match=(
      r"1 key path\(s\) missing from the checkpoint \(in the target only\):\n    \['nope'\]")):
    fnckpt.restore(path, {"step": 0, "nope": 1}, partial=True)
  with pytest.raises(TreeMismatchError, match=r"\['params'\]\['w'\]: shape \(8192,\) saved"):
    fnckpt.restore(path, {"params": {"w": np.zeros(5, np.float32)}}, partial=True)


def test_cast(ckpt):
  path, tree = ckpt
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  target = jax.tree.map(lambda x: x, tree)
  target["params"] = {
      "w": jax.ShapeDtypeStruct((8192,), jnp.bfloat16, sharding=NamedSharding(mesh, P("b"))),
      "b": np.zeros(3, np.float16)}
  target["step"] = jax.ShapeDtypeStruct((), jnp.float32)
  with pytest.raises(TreeMismatchError, match="pass cast=True to convert"):
    fnckpt.restore(path, target)
  got = fnckpt.restore(path, target, cast=True)
  assert got["params"]["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(got["params"]["w"],
                                tree["params"]["w"].astype(jnp.bfloat16))
  assert got["params"]["b"].dtype == np.float16 and type(got["params"]["b"]) is np.ndarray
  assert got["step"].dtype == jnp.float32 and got["step"] == 5.0


def test_saved_scalars_fill_zero_d_array_targets(ckpt):
  """A Python int saved (flax's TrainState.step before the first jitted step) restores into
  a 0-d array target (jax.eval_shape(init) makes one) when it fits; otherwise a clear error."""
  path, tree = ckpt
  target = jax.tree.map(lambda x: x, tree)
  target["step"] = jax.ShapeDtypeStruct((), jnp.int32)
  got = fnckpt.restore(path, target)
  assert isinstance(got["step"], jax.Array) and got["step"].dtype == jnp.int32
  assert got["step"] == 5
  target["step"] = np.zeros((), np.int64)
  assert type(fnckpt.restore(path, target)["step"]) is np.ndarray
  target["step"] = jax.ShapeDtypeStruct((), jnp.int8)
  assert fnckpt.restore(path, target)["step"] == 5  # 5 fits int8
  target["step"] = jax.ShapeDtypeStruct((), jnp.bool_)
  with pytest.raises(TreeMismatchError, match=(
      r"\['step'\]: an int value 5 saved, a bool array in the target \(pass cast=True")):
    fnckpt.restore(path, target)
  target["step"] = jax.ShapeDtypeStruct((2,), jnp.int32)  # not 0-d: a mismatch
  with pytest.raises(TreeMismatchError, match=(
      r"\['step'\]: the target is an array, the checkpoint holds an int value")):
    fnckpt.restore(path, target)


@pytest.mark.parametrize("overwrite", [False, True])
def test_save_refuses_a_directory_holding_other_files(tmp_path, overwrite):
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"holds files that are not part of an fnckpt checkpoint \(e\.g\. "
                           r"'notes\.txt'\).*even with overwrite=True"):
    fnckpt.save({"w": np.ones(4)}, str(tmp_path), overwrite=overwrite)
  assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("how", ["stored", "packed"])
def test_an_array_that_cannot_be_opened_is_a_read_error_naming_the_leaf(tmp_path, monkeypatch,
                                                                        how):
  """TensorStore refusing to open a leaf's array (a patched open here) is restore's read error
  naming the leaf and its storage, as export words it, not TensorStore's raw error."""
  from fnckpt._io import arrays as _store
  path = str(tmp_path / "c")
  fnckpt.save({"w": np.arange(40000.0)}, path, **({"pack_bytes": 0} if how == "stored" else {})
              ).wait()
  real = _store.open_array

  def open_array(spec, ctx, *, mode):
    if mode == "read":
      raise ValueError("INVALID_ARGUMENT: refused by the test")
    return real(spec, ctx, mode=mode)
  monkeypatch.setattr(_store, "open_array", open_array)
  with pytest.raises(CheckpointError, match=(
      rf"^Cannot restore \['w'\] from {re.escape(repr(path))[:-1]}/data-[^']+': reading failed "
      r"\(ValueError: INVALID_ARGUMENT: refused by the test\)")):
    fnckpt.restore(path)


def test_storage_options_that_are_not_a_mapping_are_refused_by_name(tmp_path):
  for call in (lambda: fnckpt.save({"w": np.arange(3)}, str(tmp_path / "c"), storage_options="x"),
               lambda: fnckpt.metadata(str(tmp_path / "c"), storage_options=5)):
    with pytest.raises(fnckpt.CheckpointError, match=r"storage_options must be a dict of "
                       r"storage settings or None, found (str 'x'|int 5); e\.g\. "
                       r"storage_options=\{'endpoint': "):
      call()
  assert not (tmp_path / "c").exists()


def test_a_location_survives_copy_and_pickle():
  import copy
  import pickle

  from fnckpt._io.paths import Location
  loc = Location.of("s3://bucket/run", {"endpoint": "http://127.0.0.1:9"})
  for twin in (copy.copy(loc), copy.deepcopy(loc), pickle.loads(pickle.dumps(loc))):
    assert twin == loc and hash(twin) == hash(loc) and dict(twin.options) == dict(loc.options)


def test_restore_reports_a_missing_checkpoint_before_a_bad_budget(tmp_path):
  with pytest.raises(fnckpt.CheckpointError, match="No checkpoint at"):
    fnckpt.restore(str(tmp_path / "none"), None, budget_bytes=-1)
