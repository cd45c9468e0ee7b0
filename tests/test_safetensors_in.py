"""fnckpt.restore / fnckpt.metadata on safetensors written by the real `safetensors` library
(numpy API): one file, a sharded directory with model.safetensors.index.json, a directory
without an index; onto sharded targets (bitwise), partial and cast; every header damage is a
CheckpointError naming the file and the tensor; a sharded restore reads only the rows it
needs (bytes counted with TensorStore's own kvstore metrics)."""

import json
import os
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import save_file

import fnckpt

TENSORS = {
    "model.embed.weight": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
    "model.layers.0.attn.kernel": (np.arange(32 * 16) % 251).astype(ml_dtypes.bfloat16)
                                  .reshape(32, 16),
    "model.layers.1.attn.kernel": (np.arange(32 * 16) % 13).astype(ml_dtypes.bfloat16)
                                  .reshape(32, 16),
    "model.layers.0.scale": np.linspace(-1, 1, 16).astype(ml_dtypes.float8_e4m3fn),
    "model.layers.1.scale": np.linspace(-2, 2, 16).astype(ml_dtypes.float8_e5m2),
    "model.norm": np.arange(7, dtype=np.int32),
    "model.flag": np.array([True, False, True]),
    "model.count": np.array(5, dtype=np.int64),
}


def nested(t):
  """The tree fnckpt restores TENSORS as (names split on '.', digits -> list indices)."""
  layer = lambda i: {"attn": {"kernel": t[f"model.layers.{i}.attn.kernel"]},  # noqa: E731
                     "scale": t[f"model.layers.{i}.scale"]}
  return {"model": {"embed": {"weight": t["model.embed.weight"]},
                    "layers": [layer(0), layer(1)], "norm": t["model.norm"],
                    "flag": t["model.flag"], "count": t["model.count"]}}


def same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_tree_equal(got, want):
  flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
  assert [p for p, _ in flat_got] == [p for p, _ in flat_want]
  for (p, g), (_, w) in zip(flat_got, flat_want):
    assert same(g, w), jax.tree_util.keystr(p)


@pytest.fixture
def one_file(tmp_path):
  path = str(tmp_path / "model.safetensors")
  save_file(TENSORS, path, metadata={"format": "np", "note": "test"})
  return path


def sharded_dir(tmp_path, with_index=True):
  d = tmp_path / "sharded"
  d.mkdir()
  names = sorted(TENSORS)
  parts = [names[:3], names[3:]]
  wmap = {}
  for k, part in enumerate(parts):
    f = f"model-{k + 1:05d}-of-00002.safetensors"
    save_file({n: TENSORS[n] for n in part}, str(d / f))
    wmap.update({n: f for n in part})
  if with_index:
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 123}, "weight_map": wmap}))
  return str(d)


def test_one_file_restores_bitwise_without_target_and_metadata(one_file):
  got = fnckpt.restore(one_file)
  assert_tree_equal(got, nested(TENSORS))
  assert got["model"]["embed"]["weight"].flags.writeable
  meta = fnckpt.metadata(one_file)
  assert meta.format == "safetensors" and meta.user_metadata == {"format": "np", "note": "test"}
  k = meta.tree["model"]["layers"][1]["attn"]["kernel"]
  assert k.shape == (32, 16) and k.dtype == jnp.bfloat16 and k.stored == "model.safetensors"
  assert meta.tree["model"]["layers"][0]["scale"].dtype == ml_dtypes.float8_e4m3fn


@pytest.mark.parametrize("with_index", [True, False])
def test_sharded_directory_onto_a_sharded_target(tmp_path, with_index):
  d = sharded_dir(tmp_path, with_index)
  path = os.path.join(d, "model.safetensors.index.json") if with_index else d
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  want = nested(TENSORS)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s()), want)
  target["model"]["embed"]["weight"] = jax.ShapeDtypeStruct((64, 32), jnp.float32,
                                                            sharding=s("data", "model"))
  target["model"]["layers"][0]["attn"]["kernel"] = jax.ShapeDtypeStruct(
      (32, 16), jnp.bfloat16, sharding=s("model", "data"))
  target["model"]["layers"][1]["attn"]["kernel"] = jax.ShapeDtypeStruct(
      (32, 16), jnp.bfloat16, sharding=s(None, ("data", "model")))
  target["model"]["layers"][0]["scale"] = jax.ShapeDtypeStruct(
      (16,), ml_dtypes.float8_e4m3fn, sharding=s("model"))
  target["model"]["flag"] = np.zeros(3, bool)  # a host target
  with jax.enable_x64():
    target["model"]["count"] = 0                  # a Python int target takes the 0-d array
    got = fnckpt.restore(path, target)
  assert got["model"]["count"] == 5 and type(got["model"]["count"]) is int
  assert isinstance(got["model"]["flag"], np.ndarray)
  for (p, g), (_, t) in zip(jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(target)):
    if isinstance(t, jax.ShapeDtypeStruct):
      assert g.sharding == t.sharding, jax.tree_util.keystr(p)
  got["model"]["count"] = TENSORS["model.count"]
  assert_tree_equal(jax.tree.map(np.asarray, got), want)
  meta = fnckpt.metadata(path)
  assert meta.tree["model"]["norm"].stored == "model-00002-of-00002.safetensors"
  assert meta.user_metadata == ({"total_size": 123} if with_index else None)


def test_partial_cast_and_strict_matching(one_file):
  target = {"model": {"embed": {"weight": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)}}}
  with pytest.raises(fnckpt.TreeMismatchError, match=r"(?s)7 key path\(s\) in the checkpoint "
                     r"but not in the target.*\['model'\]\['norm'\].*partial=True"):
    fnckpt.restore(one_file, target, cast=True)
  with pytest.raises(fnckpt.TreeMismatchError, match=r"\['model'\]\['embed'\]\['weight'\]: "
                     r"dtype float32 saved, bfloat16 in the target \(pass cast=True"):
    fnckpt.restore(one_file, target, partial=True)
  got = fnckpt.restore(one_file, target, partial=True, cast=True)
  w = got["model"]["embed"]["weight"]
  assert w.dtype == jnp.bfloat16
  assert same(w, TENSORS["model.embed.weight"].astype(ml_dtypes.bfloat16))
  bad = {"model": {"embed": {"weight": jax.ShapeDtypeStruct((32, 64), jnp.float32)}}}
  with pytest.raises(fnckpt.TreeMismatchError, match=r"shape \(64, 32\) saved, \(32, 64\)"):
    fnckpt.restore(one_file, bad, partial=True)
  # a prefix tree of shardings
  mesh = jax.make_mesh((8,), ("x",))
  got = fnckpt.restore(one_file, {"model": {"embed": NamedSharding(mesh, P("x"))}},
                       partial=True)
  assert same(got["model"]["embed"]["weight"], TENSORS["model.embed.weight"])


def bytes_read():
  for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
    return sum(v["value"] for v in m["values"])
  return 0


def test_a_sharded_restore_reads_each_row_once(tmp_path):
  """A target sharded 8 ways along the first axis reads the tensor's bytes once (plus the
  header); a slice of rows is one byte range, a block of columns one range per row when those
  are at least 64 KiB (else whole rows). (That each process of a job reads only its own rows: test_orbax_in's
  2-process safetensors test.)"""
  big = np.arange(1024 * 256, dtype=np.float32).reshape(1024, 256)  # 1 MiB
  path = str(tmp_path / "m.safetensors")
  save_file({"big": big, "small": np.arange(10, dtype=np.float32)}, path)
  header = 8 + struct.unpack("<Q", open(path, "rb").read(8))[0]
  mesh = jax.make_mesh((8,), ("x",))
  before = bytes_read()
  got = fnckpt.restore(path, {"big": jax.ShapeDtypeStruct(big.shape, big.dtype,
                                                          sharding=NamedSharding(mesh, P("x")))},
                       partial=True)
  used = bytes_read() - before
  assert same(got["big"], big)
  # the 8-byte length, the header, the 1-byte end check, then big's bytes once
  assert big.nbytes <= used <= big.nbytes + header + 8 + 1, (used, big.nbytes, header)
  from fnckpt._sources import detect as _foreign
  opened = _foreign.open_foreign(path, None)
  rec = next(r for r in opened.manifest.leaves if r.path == (("dict", "big"),))
  before = bytes_read()
  rows = opened.reader.slice_reader(rec)(((256, 512), (0, 256))).result()
  assert bytes_read() - before == 256 * 256 * 4  # rows 256..511: one range, nothing else
  assert same(rows, big[256:512]) and rows.flags.writeable
  before = bytes_read()
  block = opened.reader.slice_reader(rec)(((256, 512), (64, 128))).result()
  assert bytes_read() - before == 256 * 256 * 4  # 256-byte pieces of rows: whole rows instead
  assert same(block, big[256:512, 64:128]) and block.flags.writeable
  wide = np.arange(32 * 32768, dtype=np.float32).reshape(32, 32768)   # rows of 128 KiB
  save_file({"wide": wide}, path)
  opened = _foreign.open_foreign(path, None)
  before = bytes_read()
  half = opened.reader.slice_reader(opened.manifest.leaves[0])(((8, 24), (16384, 32768)))
  assert same(half.result(), wide[8:24, 16384:])
  assert bytes_read() - before == 16 * 16384 * 4  # 64 KiB pieces: one range per row


def test_rows_of_a_column_sharded_slice(tmp_path):
  """A slice along the second axis reads its rows (the whole tensor here) and keeps only its
  columns: bitwise, each device's shard its own."""
  x = np.arange(16 * 24, dtype=np.int16).reshape(16, 24)
  path = str(tmp_path / "c.safetensors")
  save_file({"x": x}, path)
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  got = fnckpt.restore(path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=NamedSharding(mesh, P("b", "a")))})
  for shard in got["x"].addressable_shards:
    assert same(shard.data, x[shard.index])
  # 80 x 64 = 5120 runs per slice along the last axis is more than MAX_RUNS (4096): read
  # whole rows of the second axis instead (80 ranges), sliced on the host; a small budget
  y = np.arange(80 * 64 * 16, dtype=np.float32).reshape(80, 64, 16)
  save_file({"y": y}, path)
  mesh = jax.make_mesh((8,), ("x",))
  got = fnckpt.restore(path, {"y": NamedSharding(mesh, P(None, None, "x"))}, budget_bytes=4096)
  for shard in got["y"].addressable_shards:
    assert same(shard.data, y[shard.index])


# --- header damage: every case a CheckpointError naming the file and the tensor ------------

def write_raw(path, header: dict | bytes, data: bytes, length: int | None = None):
  h = header if isinstance(header, bytes) else json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(h) if length is None else length) + h + data)
  return str(path)


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
  return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


DAMAGE = [
    ("length_too_large", None, rb"its header length is 200000000 bytes, expected 2 to 100000000"),
    ("truncated_header", None, r"it ends inside its 4000-byte header"),
    ("not_json", b"{nope", r"its header is not a JSON map"),
    ("duplicate", b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                  b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
     r"the name 'a' appears twice"),
    ("bad_dtype", {"w.x": entry(dtype="F4")}, r"tensor 'w.x' has dtype 'F4', which fnckpt does "
                                              r"not read \(known: BOOL"),
    ("bad_shape", {"w": entry(shape=(-1,))}, r"tensor 'w' has shape \[-1\], expected a list"),
    ("size_mismatch", {"w": entry(shape=(3,))}, r"tensor 'w': data_offsets \[0, 8\] hold 8 "
                                                r"bytes, its dtype F32 and shape \[3\] need 12"),
    ("overlap", {"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))},
     r"tensor 'b': its bytes \[4, 12\) overlap those of 'a'"),
    ("gap", {"a": entry(offsets=(0, 8)), "b": entry(offsets=(12, 20))},
     r"tensor 'b': its bytes start at 12, after a gap \(the previous tensor ends at 8\)"),
    ("past_the_end", {"a": entry(offsets=(0, 8)), "b": entry(offsets=(8, 16))},
     r"it is truncated: 'b' ends at byte \d+, past the end of the file"),
    ("trailing", {"a": entry()}, r"it has bytes after its last tensor"),
    ("bad_metadata", {"__metadata__": {"a": 1}, "w": entry()},
     r"its '__metadata__' must map strings to strings"),
    ("extra_field", {"w": {**entry(), "x": 1}}, r"tensor 'w' must be a map of exactly"),
]


@pytest.mark.parametrize("case,header,message", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_header_damage_is_a_checkpoint_error(tmp_path, case, header, message):
  path = tmp_path / "bad.safetensors"
  data = b"\0" * 8
  if case == "length_too_large":
    write_raw(path, {"w": entry()}, data, length=200_000_000)
  elif case == "truncated_header":
    write_raw(path, {"w": entry()}, data, length=4000)
  elif case == "past_the_end":
    write_raw(path, header, data)            # b's bytes are not there
  elif case == "trailing":
    write_raw(path, header, data + b"xx")
  else:
    write_raw(path, header, data)
  message = message.decode() if isinstance(message, bytes) else message
  with pytest.raises(fnckpt.CheckpointError, match=message) as info:
    fnckpt.restore(str(path))
  assert "bad.safetensors" in str(info.value)
  with pytest.raises(fnckpt.CheckpointError, match=message):
    fnckpt.metadata(str(path))


def test_short_file_and_names_that_are_not_a_tree(tmp_path):
  short = tmp_path / "short.safetensors"
  short.write_bytes(b"\1\0")
  with pytest.raises(fnckpt.CheckpointError, match=r"short.safetensors.*ends inside its "
                     r"header length"):
    fnckpt.restore(str(short))
  path = write_raw(tmp_path / "tree.safetensors",
                   {"a": entry(offsets=(0, 8)), "a.b": entry(offsets=(8, 16))}, b"\0" * 16)
  with pytest.raises(fnckpt.CheckpointError, match=r"tensor 'a' is also the parent of 'a.b'"):
    fnckpt.restore(path)


def test_index_damage(tmp_path):
  d = sharded_dir(tmp_path)
  index = os.path.join(d, "model.safetensors.index.json")
  good = json.load(open(index))
  cases = [
      ({**good, "weight_map": {**good["weight_map"], "model.extra": good["weight_map"][
          "model.norm"]}}, r"tensor 'model.extra' is mapped to 'model-00002-of-00002."
                           r"safetensors', which does not hold it"),
      ({**good, "weight_map": {**good["weight_map"], "model.norm": "../evil.safetensors"}},
       r"tensor 'model.norm' is mapped to '../evil.safetensors', not a plain file name"),
      ({"weight_map": [1]}, r"its 'weight_map' must map tensor names to file names"),
      ({**good, "weight_map": {k: v for k, v in good["weight_map"].items()
                               if k != "model.norm"}},
       r"tensor 'model.norm' is in 'model-00002-of-00002.safetensors', but the index maps it "
       r"to None"),
  ]
  for content, message in cases:
    with open(index, "w") as f:
      json.dump(content, f)
    with pytest.raises(fnckpt.CheckpointError, match=message):
      fnckpt.restore(index)
  os.remove(os.path.join(d, "model-00001-of-00002.safetensors"))
  with open(index, "w") as f:
    json.dump(good, f)
  with pytest.raises(fnckpt.CheckpointError, match=r"The safetensors index .*index.json' "
                     r"maps tensor '[a-z.]+' to 'model-00001-of-00002.safetensors', but there "
                     r"is no file .*model-00001-of-00002.safetensors'"):
    fnckpt.metadata(index)


def test_same_tensor_in_two_files_and_nothing_there(tmp_path):
  d = tmp_path / "dup"
  d.mkdir()
  save_file({"w": np.zeros(2, np.float32)}, str(d / "a.safetensors"))
  save_file({"w": np.ones(2, np.float32)}, str(d / "b.safetensors"))
  with pytest.raises(fnckpt.CheckpointError, match=r"tensor 'w' is in both 'a.safetensors' "
                     r"and 'b.safetensors'"):
    fnckpt.restore(str(d))
  with pytest.raises(fnckpt.CheckpointError, match=r"No checkpoint at"):
    fnckpt.restore(str(tmp_path / "empty"))


def test_memory_location(one_file):
  """Through TensorStore's kvstore, so other backends work the same (memory:// here)."""
  from fnckpt._io import paths as _paths
  kv = _paths.open_kvstore("memory://st")  # fnckpt's process-wide memory:// store
  kv.write("model.safetensors", open(one_file, "rb").read()).result()
  assert_tree_equal(fnckpt.restore("memory://st/model.safetensors"), nested(TENSORS))
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  got = fnckpt.restore("memory://st/model.safetensors",
                       {"model": {"embed": {"weight": NamedSharding(mesh, P("x"))}}},
                       partial=True)
  assert same(got["model"]["embed"]["weight"], TENSORS["model.embed.weight"])


def test_a_file_changed_after_its_header_was_read(tmp_path):
  """A file truncated between opening and reading: an error naming the tensor, never
  garbage."""
  from fnckpt._sources import detect as _foreign
  path = str(tmp_path / "m.safetensors")
  save_file({"w": np.arange(1000, dtype=np.float32)}, path)
  opened = _foreign.open_foreign(path, None)
  with open(path, "r+b") as f:
    f.truncate(200)
  rec = opened.manifest.leaves[0]
  with pytest.raises(Exception) as info:
    opened.reader.slice_reader(rec)(((0, 1000),)).result()
  err = opened.reader.read_error(rec, info.value)
  assert isinstance(err, fnckpt.CheckpointError) and "'w'" in str(err)
  # slices of some columns, read together in blocks of rows: every one of them an error
  save_file({"x": np.zeros((8192, 256), np.float32)}, path)
  opened = _foreign.open_foreign(path, None)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 4096)
  read = opened.reader.slice_reader(opened.manifest.leaves[0])
  slices = [read(((0, 8192), (i * 32, i * 32 + 32))) for i in range(8)]
  for s in slices[:2]:
    with pytest.raises(fnckpt.CheckpointError, match=r"Tensor 'x' of 'm.safetensors': a byte "
                       r"range of 1048576 bytes could not be read \(nothing came back\); the "
                       r"file changed or is truncated"):
      s.result()


# --- any damage to a header: a CheckpointError or a valid read, nothing else ----------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_SMALL = {"a.0": np.arange(6, dtype=np.float32).reshape(2, 3),
          "a.1": np.arange(4).astype(ml_dtypes.bfloat16), "b": np.array([1, 2], np.uint8)}


def _small_file() -> bytes:
  from safetensors.numpy import save
  return save(_SMALL, metadata={"k": "v"})


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_header_damage_is_an_error_or_a_valid_header(data):
  """Flipped, replaced, inserted or removed header bytes, and any cut of the file: parsing
  (and checking the file's length against the header) raises CheckpointError or gives tensors
  that tile the file's data exactly; never another exception."""
  from fnckpt._sources import safetensors as sti
  raw = bytearray(_small_file())
  n = struct.unpack("<Q", raw[:8])[0]
  edit = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "cut"]))
  at = data.draw(st.integers(0, 8 + n - 1))
  if edit == "flip":
    raw[at] ^= 1 << data.draw(st.integers(0, 7))
  elif edit == "set":
    raw[at] = data.draw(st.sampled_from(b'{}[]",:0123456789 .-eE\x00\xff'))
  elif edit == "insert":
    raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
  elif edit == "delete":
    del raw[at]
  else:
    raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
  try:
    length = sti.header_length(bytes(raw[:8]), "f")
    if len(raw) < 8 + length:
      return  # (read_tensors reports it: test_header_damage_is_a_checkpoint_error)
    tensors, _, size = sti.parse_header(bytes(raw[8:8 + length]), "f")
  except fnckpt.CheckpointError:
    return
  assert sum(t.end - t.begin for t in tensors) == size
  for t in tensors:
    assert t.end - t.begin == int(np.prod(t.shape)) * np.dtype(jnp.dtype(t.dtype)).itemsize


def test_damaged_files_through_restore(tmp_path):
  """The same kinds of damage through fnckpt.restore on real files: CheckpointError, or a
  read of tensors of the saved shapes (a flipped data byte is read as it is: safetensors has
  no checksums)."""
  raw = _small_file()
  n = struct.unpack("<Q", raw[:8])[0]
  rng = np.random.default_rng(0)
  path = tmp_path / "f.safetensors"
  outcomes = set()
  for i in range(60):
    b = bytearray(raw)
    at = int(rng.integers(0, len(b))) if i % 3 else int(rng.integers(0, 8 + n))
    b[at] ^= 1 << int(rng.integers(0, 8))
    if i % 5 == 0:
      b = b[:int(rng.integers(0, len(b)))]
    path.write_bytes(bytes(b))
    try:
      got = fnckpt.restore(str(path))
    except fnckpt.CheckpointError as e:
      assert "f.safetensors" in str(e)
      outcomes.add("error")
      continue
    outcomes.add("read")
    assert {np.shape(x) for x in jax.tree.leaves(got)} <= {(2, 3), (4,), (2,)}
  assert "error" in outcomes


# --- review fixes (issue 14 A) --------------------------------------------------------------

def test_probes_read_no_file_whole(tmp_path):
  """Looking for an index, _METADATA or _CHECKPOINT_METADATA reads none of their bytes (an
  empty byte range): a 100 MiB (sparse) index is refused by its size, having read ~nothing."""
  d = tmp_path / "m"
  d.mkdir()
  with open(d / "model.safetensors.index.json", "wb") as f:
    f.truncate(100 << 20)
  before = bytes_read()
  with pytest.raises(fnckpt.CheckpointError, match=r"model.safetensors.index.json' is "
                     r"invalid: the index: it is larger than 67108864 bytes"):
    fnckpt.restore(str(d))
  assert bytes_read() - before <= 4096
  os.remove(d / "model.safetensors.index.json")
  (d / "commit_success.txt").write_text("ok")
  for name in ("_METADATA", "_CHECKPOINT_METADATA"):
    with open(d / name, "wb") as f:
      f.truncate(100 << 20)
    before = bytes_read()
    with pytest.raises(fnckpt.CheckpointError, match=r"larger than 67108864 bytes"):
      fnckpt.metadata(str(d))
    assert bytes_read() - before <= 4096, name
    os.remove(d / name)


def test_bool_bytes_must_be_0_or_1(tmp_path):
  path = write_raw(tmp_path / "m.safetensors",
                   {"mask": entry("BOOL", (4,), (0, 4))}, bytes([1, 2, 254, 0]))
  message = (r"Tensor 'mask' of 'm.safetensors' is BOOL but holds a byte other than 0 or 1 "
             r"\(bool bytes must be 0 or 1\)")
  with pytest.raises(fnckpt.CheckpointError, match=message):
    fnckpt.restore(path)
  with pytest.raises(fnckpt.CheckpointError, match=message):
    fnckpt.restore(path, {"mask": jax.ShapeDtypeStruct((4,), jnp.bool_)})
  write_raw(path, {"mask": entry("BOOL", (4,), (0, 4))}, bytes([1, 0, 1, 0]))
  assert fnckpt.restore(path)["mask"].tolist() == [True, False, True, False]


def test_an_empty_tensor_restored_sharded(tmp_path):
  """(0, 131072) float32 on columns: each slice's 16384 columns are 64 KiB per row, a range
  per row of none (the old reader's IndexError): an empty slice reads nothing."""
  path = write_raw(tmp_path / "e.safetensors", {"e": entry("F32", (0, 131072), (0, 0))}, b"")
  mesh = jax.make_mesh((8,), ("x",))
  for spec in (P(None, "x"), P("x"), P()):
    got = fnckpt.restore(path, {"e": jax.ShapeDtypeStruct((0, 131072), jnp.float32,
                                                          sharding=NamedSharding(mesh, spec))})
    assert got["e"].shape == (0, 131072) and got["e"].sharding.spec == spec


def test_a_column_sharded_tensor_is_read_once_in_bounded_blocks(tmp_path):
  """(8192, 256) float32 sharded on its columns 8 ways: per-row ranges would be 8192 of 128
  bytes, so whole rows are read, in blocks of 1 MiB, each block once for all 8 slices (the
  old reader read the whole tensor per slice: 8x). Each slice is charged its own bytes and
  two blocks; a budget smaller than one slice still restores it exactly."""
  from fnckpt._sources import detect as _foreign, safetensors as _safetensors_in
  x = np.random.default_rng(0).standard_normal((8192, 256)).astype(np.float32)   # 8 MiB
  path = str(tmp_path / "c.safetensors")
  save_file({"x": x}, path)
  mesh = jax.make_mesh((8,), ("x",))
  target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh,
                                                                                P(None, "x")))}
  opened = _foreign.open_foreign(path, None)
  rec = opened.manifest.leaves[0]
  block = _safetensors_in.BLOCK_BYTES
  assert opened.reader.read_bytes(rec, ((0, 8192), (0, 32))) == x.nbytes // 8 + 2 * block
  budget = 8 * (x.nbytes // 8 + 2 * block)    # the 8 slices, 24 MiB (old charge: 8 x 8 MiB)
  before = bytes_read()
  got = fnckpt.restore(path, target, budget_bytes=budget)
  used = bytes_read() - before
  assert x.nbytes <= used <= 1.1 * x.nbytes, used / x.nbytes
  for shard in got["x"].addressable_shards:
    assert same(shard.data, x[shard.index])
  got = fnckpt.restore(path, target, budget_bytes=4096)
  for shard in got["x"].addressable_shards:
    assert same(shard.data, x[shard.index])
  three = np.arange(300 * 40 * 6, dtype=np.int16).reshape(300, 40, 6)   # blocks over axis 0
  save_file({"t": three}, path)
  got = fnckpt.restore(path, {"t": NamedSharding(jax.make_mesh((2, 4), ("a", "b")),
                                                 P(None, "b", "a"))})
  for shard in got["t"].addressable_shards:
    assert same(shard.data, three[shard.index])


def test_header_and_index_limits(tmp_path):
  """Too many tensors (counted before parsing), names of over 64 parts, dims whose bytes
  overflow even when another dim is 0."""
  from fnckpt._sources import safetensors as _safetensors_in
  many = b"{" + b",".join(b'"t%d":{}' % i for i in range(_safetensors_in.MAX_TENSORS + 2)) + b"}"
  with pytest.raises(fnckpt.CheckpointError, match=r"its header holds more than 262144 "
                     r"tensors"):
    _safetensors_in.parse_header(many, "m.safetensors")
  deep = ".".join(["a"] * 65)
  path = write_raw(tmp_path / "d.safetensors", {deep: entry("U8", (0,), (0, 0))}, b"")
  with pytest.raises(fnckpt.CheckpointError, match=r"d.safetensors' is invalid: tensor "
                     r"'a\.a\.a.*' has more than 64 name parts"):
    fnckpt.metadata(path)
  ok = ".".join(["a"] * 64)
  write_raw(path, {ok: entry("U8", (0,), (0, 0))}, b"")
  assert len(fnckpt.metadata(path).leaves[0].path) == 64
  write_raw(path, {"w": entry("U8", (0, 2 ** 62), (0, 0))}, b"")
  with pytest.raises(fnckpt.CheckpointError, match=r"tensor 'w' has shape \[0, "
                     r"4611686018427387904\], expected .* under 2\*\*62 bytes"):
    fnckpt.metadata(path)
  write_raw(path, {"w": entry("F32", (0, 2 ** 61), (0, 0))}, b"")   # 2**63 bytes per row
  with pytest.raises(fnckpt.CheckpointError, match=r"tensor 'w' has shape"):
    fnckpt.metadata(path)


def test_an_index_must_list_every_shard_file(tmp_path):
  d = sharded_dir(tmp_path)
  index = os.path.join(d, "model.safetensors.index.json")
  good = json.load(open(index))
  for content, message in [
      ({"weight_map": {}}, r"The safetensors index .*index.json' is invalid: its 'weight_map' "
                           r"maps 0 tensors"),
      ({"weight_map": {k: v for k, v in good["weight_map"].items()
                       if v == "model-00001-of-00002.safetensors"}},
       r"The safetensors index .*index.json' is invalid: it maps no tensor to "
       r"'model-00002-of-00002.safetensors', one of the 2 files"),
      ({"weight_map": {"model.norm": "../x.safetensors"}}, r"The safetensors index .* is "
                                                           r"invalid: tensor 'model.norm'"),
      ({"weight_map": [1]}, r"The safetensors index .* is invalid: its 'weight_map' must map")]:
    with open(index, "w") as f:
      json.dump(content, f)
    for path in (index, d):
      with pytest.raises(fnckpt.CheckpointError, match=message):
        fnckpt.restore(path)


def test_random_slices_through_the_reader_equal_numpy(monkeypatch):
  """Random tensors (0-4 dims, some empty), random groups of slices queued together, small
  blocks (BLOCK_BYTES patched down so a group reads many): every slice equals numpy's."""
  import random
  from fnckpt._format import records as _records
  from fnckpt._sources import safetensors as S
  rng = random.Random(0)
  kv = ts.KvStore.open("memory://").result()
  for trial in range(400):
    monkeypatch.setattr(S, "BLOCK_BYTES", rng.choice([1, 64, 1000, 1 << 20]))
    shape = tuple(rng.choice([0, *range(1, 10)] + [rng.randint(1, 9)] * 9)
                  for _ in range(rng.randint(0, 4)))
    dtype = rng.choice(["uint8", "float32", "bfloat16", "int16", "bool"])
    x = (np.arange(int(np.prod(shape))) % (2 if dtype == "bool" else 251)).astype(
        _records.np_dtype(dtype)).reshape(shape)
    pad = rng.randint(0, 5)
    kv.write(f"f{trial}", b"z" * (8 + pad) + x.tobytes()).result()
    t = S.Tensor("t", f"f{trial}", dtype, shape, 8 + pad, 8 + pad + x.nbytes)
    reader = S.Reader(kv, "mem", [t])
    rec = _records.Leaf(0, (("dict", "t"),), "array", dtype, shape, "numpy", None)
    read = reader.slice_reader(rec)
    def span(n):   # mostly non-empty
      lo = rng.randint(0, max(0, n - 1))
      return (lo, rng.randint(min(lo + 1, n), n) if rng.random() < 0.9 else lo)
    rows = span(shape[0]) if shape else None
    boxes = []
    for _ in range(rng.randint(1, 6)):
      box = [rows if rows and rng.random() < 0.7 else None] + [None] * (len(shape) - 1)
      boxes.append(tuple(b or span(n) for b, n in zip(box, shape)))
    futs = [read(box) for box in boxes]
    for box, fut in zip(boxes, futs):
      got, want = fut.result(), x[tuple(slice(a, b) for a, b in box)]
      assert got.shape == want.shape and got.dtype == want.dtype, (trial, shape, box)
      assert got.tobytes() == want.tobytes(), (trial, shape, box)
      assert reader.read_bytes(rec, box) >= want.nbytes
