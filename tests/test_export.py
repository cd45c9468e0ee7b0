"""export_safetensors and ``fnckpt export``: every output read back by the ``safetensors``
library and compared bitwise with what was saved (single file, shards + index, bf16, fp8,
select/dtype/prefix/rename), refusals with their text, atomic output, bounded memory."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors import TensorSpec, deserialize, safe_open, serialize
from safetensors.numpy import load_file

import fnckpt
from fnckpt._format import records as _records, runs as _runs
from fnckpt._layout import blocks as _blocks
from fnckpt._sources import slices as _slices, source as _source
from fnckpt._export import plan as _export_plan
from test_cli import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_state():
  """What the checkpoint holds, as numpy (the reference for bitwise checks)."""
  rng = np.random.default_rng(0)
  f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  return {
      "params": {
          "dense": {"kernel": f32(1024, 1280),                      # 5 MiB: its own zarr array
                    "bias": f32(1280)},                             # 5 KiB: inline
          "emb": f32(128, 96).astype(ml_dtypes.bfloat16),           # 24 KiB: packed
          "layers": [{"w": f32(64, 80).astype(ml_dtypes.float8_e4m3fn)},
                     {"w": f32(64, 80).astype(ml_dtypes.float8_e5m2)}],
          "scale": np.full((), 0.5, np.float16),  # 0-d
      },
      "ints": {"i8": np.arange(-50, 50, dtype=np.int8), "u8": np.arange(7, dtype=np.uint8),
               "i16": np.arange(9, dtype=np.int16), "u16": np.arange(40, dtype=np.uint16) * 1000,
               "i32": np.arange(5, dtype=np.int32), "u32": np.arange(6, dtype=np.uint32),
               "i64": np.arange(3, dtype=np.int64) - 2**40, "u64": np.full(2, 2**63, np.uint64),
               "mask": np.arange(10) % 3 == 0},
      "f64": rng.standard_normal((3, 4)),
      "c64": (rng.standard_normal(4) + 1j).astype(np.complex64),
      "nothing": np.zeros((0, 3), np.float32),
      "step": 1000, "lr": 0.001, "name": "run-7", "done": False, "epoch": np.int32(3),
      "none": None, "empty": {}, "data": np.random.default_rng(1),
  }


def device_state(host):
  """The same values with the large arrays sharded over 8 devices."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  state = jax.tree.map(lambda x: x, host)
  p = state["params"]
  p["dense"]["kernel"] = jax.device_put(p["dense"]["kernel"],
                                        NamedSharding(mesh, P("data", "model")))
  p["emb"] = jax.device_put(p["emb"], NamedSharding(mesh, P("data", None)))
  p["layers"][0]["w"] = jax.device_put(p["layers"][0]["w"], NamedSharding(mesh, P(None, "model")))
  return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  host = host_state()
  path = str(tmp_path_factory.mktemp("export") / "ckpt")
  fnckpt.save(device_state(host), path).wait()
  kinds = {r.where: ("stored" if r.stored else "packed" if r.packed else
                     "pieces" if r.pieces else "inline")
           for r in fnckpt.metadata(path).leaves if r.is_array}
  assert kinds["['params']['dense']['kernel']"] == "pieces"  # (its 8 shards in the pack)
  assert kinds["['params']['emb']"] == "packed"
  assert kinds["['params']['dense']['bias']"] == "inline"
  return path, host


def arrays(host, select=()):
  """name -> numpy array for every array leaf of ``host`` under ``select``."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))) for k in path]
    if isinstance(leaf, np.ndarray) and keys[:len(select)] == list(select):
      out[".".join(keys[len(select):])] = leaf
  return out


def read_back(path):
  """The library's own parse of a file: name -> (dtype name, shape, raw bytes)."""
  with open(path, "rb") as f:
    return {name: (v["dtype"], tuple(v["shape"]), bytes(v["data"]))
            for name, v in deserialize(f.read())}


def assert_same(got, expected):
  assert sorted(got) == sorted(expected)
  for name, want in expected.items():
    dtype, shape, data = got[name]
    assert dtype == _export_plan.SAFETENSORS_DTYPES[want.dtype.name], name
    assert shape == want.shape, name
    assert data == np.ascontiguousarray(want).tobytes(), name  # little-endian hosts


# --- dtype names -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(_export_plan.SAFETENSORS_DTYPES))
def test_dtype_names_are_the_librarys(name):
  a = np.zeros((2,), _records.np_dtype(name))
  data = serialize({"x": TensorSpec(dtype=name, shape=[2], data_ptr=a.ctypes.data,
                                    data_len=a.nbytes)})
  n = int.from_bytes(data[:8], "little")
  assert json.loads(data[8:8 + n])["x"]["dtype"] == _export_plan.SAFETENSORS_DTYPES[name]


@pytest.mark.parametrize("name", sorted(_records.DTYPES - set(_export_plan.SAFETENSORS_DTYPES)))
def test_dtypes_left_out_are_ones_the_library_cannot_hold(name):
  with pytest.raises(Exception, match="Unknown dtype"):
    TensorSpec(dtype=name, shape=[2], data_ptr=0, data_len=2)


# --- output read back bitwise ----------------------------------------------------------------

def test_one_file_bitwise(saved, tmp_path):
  path, host = saved
  out = tmp_path / "model.safetensors"
  r = fnckpt.export_safetensors(path, out)
  expected = arrays(host)
  assert_same(read_back(out), expected)
  assert r.tensors == len(expected) and r.files == (str(out),)
  assert r.bytes == sum(a.nbytes for a in expected.values())
  meta = {"format": "pt", "step": "1000", "lr": "0.001", "name": "run-7", "done": "false",
          "epoch": "3"}
  assert dict(r.metadata) == meta
  with safe_open(str(out), framework="np") as f:
    assert f.metadata() == meta
    for name in ("params.emb", "params.dense.kernel", "ints.mask", "c64", "params.scale"):
      got = f.get_tensor(name)  # the library's numpy reader (bf16 through ml_dtypes)
      assert got.dtype == expected[name].dtype and got.tobytes() == expected[name].tobytes()
  assert [s.split(":")[0] for s in r.skipped] == ["['data']", "['empty']", "['none']"]
  # Data starts 8-byte aligned and each tensor at a multiple of its element size.
  raw = out.read_bytes()
  n = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + n])
  assert n % 8 == 0 and raw[8 + n - 1:8 + n] in (b" ", b"}")
  for name, info in header.items():
    if name != "__metadata__":
      assert info["data_offsets"][0] % expected[name].dtype.itemsize == 0, name


def test_shards_and_index(saved, tmp_path):
  path, host = saved
  out = tmp_path / "hf"
  r = fnckpt.export_safetensors(path, out, select="params", max_shard_size="1MB")
  expected = arrays(host, ["params"])
  # Checkpoint order (bias, kernel, emb, ...): the 5 MiB kernel is a shard of its own.
  names = sorted(os.listdir(out))
  n = len(names) - 1
  assert names == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + [
      "model.safetensors.index.json"]
  assert n == 3 and r.files == tuple(str(out / x) for x in names)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert index["metadata"] == {"total_size": sum(a.nbytes for a in expected.values())}
  assert sorted(index["weight_map"]) == sorted(expected)
  got = {}
  for shard in names[:-1]:
    part = read_back(out / shard)
    assert all(index["weight_map"][k] == shard for k in part)
    with safe_open(str(out / shard), framework="np") as f:
      assert sorted(f.keys()) == sorted(part)
      for k in f.keys():
        if "layers" not in k:  # the library's numpy reader has no float8 (0.8.0)
          assert f.get_tensor(k).tobytes() == expected[k].tobytes()
    got.update(part)
  assert_same(got, expected)
  assert list(read_back(out / names[1])) == ["dense.kernel"]


def test_select_dtype_prefix_rename(saved, tmp_path):
  path, host = saved
  out = tmp_path / "m.safetensors"
  r = fnckpt.export_safetensors(path, out, select="params", dtype="bfloat16", prefix="model.",
                                rename={"dense": "fc", "layers.1": "last"})
  want = {}
  for name, a in arrays(host, ["params"]).items():
    name = name.replace("dense.", "fc.").replace("layers.1.", "last.")
    want[f"model.{name}"] = a.astype(ml_dtypes.bfloat16)  # every leaf here is floating
  assert_same(read_back(out), want)
  loaded = load_file(str(out))
  assert loaded["model.fc.kernel"].tobytes() == want["model.fc.kernel"].tobytes()
  assert dict(r.metadata) == {"format": "pt"}

  # Integer and bool arrays keep their dtype; a selected leaf is named by its own key.
  out2 = tmp_path / "ints.safetensors"
  fnckpt.export_safetensors(path, out2, select=["ints"], dtype="float8_e4m3fn")
  assert_same(read_back(out2), arrays(host, ["ints"]))
  out_fp8 = tmp_path / "fp8.safetensors"
  fnckpt.export_safetensors(path, out_fp8, select="params.dense", dtype="float8_e5m2")
  assert_same(read_back(out_fp8), {k: a.astype(ml_dtypes.float8_e5m2)
                                   for k, a in arrays(host, ["params", "dense"]).items()})
  out3 = tmp_path / "one.safetensors"
  fnckpt.export_safetensors(path, out3, select="params.layers.0.w", dtype=jnp.float32)
  assert_same(read_back(out3), {"w": host["params"]["layers"][0]["w"].astype(np.float32)})


def test_streaming_stays_within_the_budget(saved, tmp_path):
  path, host = saved
  budget = 256 << 10  # 5 MiB kernel, 24 KiB pack range, small inline arrays
  out = tmp_path / "b.safetensors"
  r = fnckpt.export_safetensors(path, out, select="params.dense", budget_bytes=budget)
  assert 0 < r.peak_read_bytes <= budget
  assert_same(read_back(out), arrays(host, ["params", "dense"]))
  # Windows smaller than one row of inner chunks, or than a packed leaf: pieces cut inside
  # rows, still bounded.
  src = _source.open_source(path)
  leaves = {l.where: l for l in src.manifest.leaves}
  for where, limit, want in [("['params']['dense']['kernel']", 64 << 10,
                              host["params"]["dense"]["kernel"]),
                             ("['params']['emb']", 3000, host["params"]["emb"])]:
    w = _slices.Window(limit)
    got = b"".join(p.data.tobytes() for p in _slices.pieces(src, [leaves[where]], w))
    assert got == want.tobytes()
    assert w.peak <= limit and w.largest <= limit and w.reads > 8
  # A widening cast (here 4 -> 32 bytes an element) is charged too: blocks shrink to match.
  for out in (4, 32):
    w = _slices.Window(64 << 10)
    kernel = leaves["['params']['dense']['kernel']"]
    got = b"".join(p.data.tobytes() for p in _slices.pieces(src, [kernel], w, lambda l: out))
    assert got == host["params"]["dense"]["kernel"].tobytes()
    assert w.peak <= 64 << 10 and w.largest <= 64 << 10, (out, w)


@pytest.mark.slow
def test_peak_rss_is_bounded_by_the_window(tmp_path):
  """A 128 MiB state exported with a 8 MiB window: the process's peak RSS grows by far less
  than the state (measured with VmHWM, reset just before the export)."""
  script = textwrap.dedent(f"""
      import os, sys
      os.environ["JAX_PLATFORMS"] = "cpu"
      import numpy as np, fnckpt
      def hwm():
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) << 10
      path, out = sys.argv[1], sys.argv[2]
      fnckpt.save({{"a": np.ones((8192, 2048), np.float32), "b": np.ones(2**24, np.float16)}},
                  path, budget_bytes=16 << 20).wait()
      fnckpt.export_safetensors(path, out + "/warm.safetensors", select="b", budget_bytes=8 << 20)
      open("/proc/self/clear_refs", "w").write("5")
      base = hwm()
      r = fnckpt.export_safetensors(path, out + "/x.safetensors", budget_bytes=8 << 20)
      print(r.bytes, hwm() - base, r.peak_read_bytes)
  """)
  run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "c"), str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
  assert run.returncode == 0, run.stderr
  total, grew, peak = map(int, run.stdout.split())
  assert total == 96 << 20 and peak <= 8 << 20
  assert grew < 40 << 20, f"peak RSS grew by {grew >> 20} MiB exporting {total >> 20} MiB"
  assert os.path.getsize(tmp_path / "x.safetensors") > total


# --- refusals and errors ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def unexportable(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("export") / "bad")
  fnckpt.save({"params": {"w": np.ones((2, 2), np.float32)},
               "q": {"int4": np.arange(4).astype(ml_dtypes.int4),
                     "c128": np.ones(2, np.complex128)},
               "key": jax.random.key(0), "opt": [np.float32(1.0) * np.ones(3, np.float32)]},
              path).wait()
  return path


def test_refused_dtypes_name_every_key_path(unexportable, tmp_path):
  out = tmp_path / "x.safetensors"
  with pytest.raises(fnckpt.CheckpointError) as e:
    fnckpt.export_safetensors(unexportable, out)
  text = str(e.value)
  assert "['q']['int4']: dtype int4, which safetensors cannot hold" in text
  assert "['q']['c128']: dtype complex128, which safetensors cannot hold" in text
  assert "['key']: a PRNG key array (threefry2x32); safetensors holds plain arrays only" in text
  assert "select='params'" in text and "fnckpt export --select params" in text
  assert not out.exists() and os.listdir(tmp_path) == []
  fnckpt.export_safetensors(unexportable, out, select="params")
  assert list(load_file(str(out))) == ["w"]


@pytest.mark.parametrize("kwargs, match", [
    ({"select": "parms"}, r"select='parms' matches no key path .* top-level keys are "
                          r"\['key', 'opt', 'params', 'q'\]"),
    ({"select": "params..w"}, r"select='params..w': expected a key path"),
    ({"select": "params", "dtype": "int8"}, r"dtype='int8': expected a floating dtype "
                                            r"safetensors holds: float16, bfloat16"),
    ({"select": "params", "dtype": "complex64"}, r"dtype='complex64': expected a floating"),
    ({"select": "params", "max_shard_size": "5GB"}, r"applies to a directory output"),
    ({"select": "params.w"}, None),
    ({"select": "params", "rename": {"w": "__metadata__"}},
     r"\['params'\]\['w'\]: its name '__metadata__' is also that of the header"),
    ({"select": "params", "rename": {"": "x"}}, r"every OLD must be a non-empty key prefix"),
])
def test_argument_errors(unexportable, tmp_path, kwargs, match):
  out = tmp_path / "x.safetensors"
  if match is None:
    fnckpt.export_safetensors(unexportable, out, **kwargs)
    assert list(load_file(str(out))) == ["w"]
    return
  with pytest.raises(fnckpt.CheckpointError, match=match):
    fnckpt.export_safetensors(unexportable, out, **kwargs)
  assert os.listdir(tmp_path) == []


def test_name_collisions_are_refused(tmp_path):
  path = str(tmp_path / "c")
  fnckpt.save({"a.b": np.ones(2, np.float32), "a": {"b": np.zeros(2, np.float32)}, "r": {}},
              path).wait()
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"\['a.b'\]: its name 'a.b' is also that of \['a'\]\['b'\]"):
    fnckpt.export_safetensors(path, tmp_path / "x.safetensors")
  with pytest.raises(fnckpt.CheckpointError, match=r"its name is empty .* give prefix="):
    fnckpt.save(np.ones(3, np.float32), str(tmp_path / "root")).wait()
    fnckpt.export_safetensors(str(tmp_path / "root"), tmp_path / "y.safetensors")
  fnckpt.export_safetensors(str(tmp_path / "root"), tmp_path / "y.safetensors", prefix="x")
  assert list(load_file(str(tmp_path / "y.safetensors"))) == ["x"]


def test_output_is_atomic_and_overwrite_is_explicit(saved, tmp_path):
  path, host = saved
  out = tmp_path / "m.safetensors"
  out.write_bytes(b"old")
  with pytest.raises(fnckpt.CheckpointError, match="already exists. Pass overwrite=True"):
    fnckpt.export_safetensors(path, out, select="ints")
  assert out.read_bytes() == b"old"
  fnckpt.export_safetensors(path, out, select="ints", overwrite=True)
  assert_same(read_back(out), arrays(host, ["ints"]))

  d = tmp_path / "dir"
  d.mkdir()  # an empty directory is fine, with or without a trailing slash
  fnckpt.export_safetensors(path, f"{d}/", select="ints")
  assert len(os.listdir(d)) == 2
  with pytest.raises(fnckpt.CheckpointError, match="already exists"):
    fnckpt.export_safetensors(path, d, select="params")
  fnckpt.export_safetensors(path, d, select="params", max_shard_size=10**6, overwrite=True)
  assert len(os.listdir(d)) == 4 and sorted(os.listdir(tmp_path)) == ["dir", "m.safetensors"]

  with pytest.raises(fnckpt.CheckpointError, match="export writes local files only"):
    fnckpt.export_safetensors(path, "s3://bucket/x.safetensors")


def _records_of(path):
  return _source.open_source(path).manifest


def test_damaged_checkpoint_leaves_no_output(saved, tmp_path):
  import shutil
  path, _ = saved
  copy = tmp_path / "ckpt"
  shutil.copytree(path, copy)
  # the kernel is pieces: flip a byte of its first piece (the start of process 0's run of its
  # chunks, recorded in the leaf (format 3); inner chunks in order in the pack's chunk file,
  # each followed by its crc32c)
  m = _records_of(str(copy))
  kernel = next(l for l in m.leaves if l.path[-1] == ("dict", "kernel"))
  assert kernel.pieces is not None
  run = _runs.writer_runs(m, kernel)[0]
  assert run.process == 0
  pack = m.packs[run.pack]
  at = run.lo + 5
  chunk = copy / pack.dir / "c" / str(at // pack.chunk)
  data = bytearray(chunk.read_bytes())
  q = at % pack.chunk
  data[q // pack.inner * (pack.inner + 4) + q % pack.inner] ^= 1
  chunk.write_bytes(bytes(data))
  out = tmp_path / "out"
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"Cannot restore \['params'\]\['dense'\]\['kernel'\] from .*: its "
                           r"data is corrupt \(crc32c checksum mismatch\)"):
    fnckpt.export_safetensors(str(copy), out, select="params")
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# --- the CLI ---------------------------------------------------------------------------------

def test_cli_export(saved, tmp_path):
  path, host = saved
  rc, out, err = cli("export", path, tmp_path / "hf", "--select", "params", "--dtype",
                     "bfloat16", "--prefix", "model", "--rename", "dense=fc",
                     "--max-shard-size", "1MB")
  assert rc == 0, err
  assert re.search(r"wrote 6 tensor\(s\), .* to .*/hf in .* s \(\d+ MB/s\); 3 shard\(s\) and "
                   r"model.safetensors.index.json", out), out
  index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
  assert "model.fc.kernel" in index["weight_map"]

  rc, out, err = cli("export", path, tmp_path / "all.safetensors")
  assert rc == 0, err
  assert "note: skipped ['none']: empty none" in err and "note: skipped ['data']: npgen" in err
  assert '__metadata__: {"done": "false", "epoch": "3", "lr": "0.001"' in out
  assert_same(read_back(tmp_path / "all.safetensors"), arrays(host))



@pytest.mark.parametrize("args, text", [
    ([], "already exists. Pass overwrite=True (CLI: --overwrite)"),
    (["--rename", "nothing"], "--rename 'nothing': expected OLD=NEW"),
    (["--max-shard-size", "lots"], "max_shard_size='lots': expected a number of bytes"),
    (["--select", "params", "--dtype", "int8"], "dtype='int8': expected a floating dtype"),
])
def test_cli_export_errors(saved, tmp_path, capsys, args, text):
  from fnckpt import cli as fcli
  (tmp_path / "m.safetensors").write_bytes(b"")
  out = tmp_path / ("hf" if "--max-shard-size" in args else "m.safetensors")
  assert fcli.main(["export", saved[0], str(out), *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("fnckpt export: error: ") and text in err and err.count("\n") == 1



# --- pure parts ------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 6), max_size=4), itemsize=st.sampled_from([1, 2, 4, 8]),
       limit=st.integers(1, 200), align=st.booleans())
def test_blocks_cover_the_array_in_c_order(shape, itemsize, limit, align):
  limit = max(limit, itemsize)
  inner = tuple(max(1, n // 2) for n in shape) if align else None
  covered = []
  for index in _blocks.blocks(shape, itemsize, limit, inner):
    n = math.prod(b - a for a, b in index)
    assert 0 < n and n * itemsize <= limit
    flat = np.arange(math.prod(shape)).reshape(shape)[tuple(slice(a, b) for a, b in index)]
    covered += flat.reshape(-1).tolist()
  assert covered == list(range(math.prod(shape)))


def test_plan_splits_files_in_order_and_aligns_tensors():
  leaves = [_records.Leaf(i, (("dict", f"t{i}"),), "array", dt, (n,), inline=bytes(n * k))
            for i, (dt, n, k) in enumerate([("int8", 3, 1), ("float32", 5, 4),
                                            ("bfloat16", 2, 2), ("float64", 100, 8)])]
  p = _export_plan.plan(leaves, "c", single=None, max_shard_size=40)
  assert [[t.name for t in f.tensors] for f in p.files] == [["t1", "t2", "t0"], ["t3"]]
  assert [(t.begin, t.end) for t in p.files[0].tensors] == [(0, 20), (20, 24), (24, 27)]
  assert [f.name for f in p.files] == ["model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors"]
  assert all(len(f.header) % 8 == 0 for f in p.files)
  assert json.loads(p.index)["metadata"]["total_size"] == 827 == p.total_bytes


def test_from_s3(s3_env, tmp_path):
  """A checkpoint on S3 (local SeaweedFS) exported with its storage_options."""
  url = s3_env.unique_url("export")
  host = {"w": np.arange(300_000, dtype=np.float32).reshape(600, 500),  # its own zarr array
          "b": np.arange(8, dtype=np.int16)}
  fnckpt.save(host, url, storage_options=s3_env.storage_options, pack_bytes=0).wait()
  out = tmp_path / "s3.safetensors"
  fnckpt.export_safetensors(url, out, storage_options=s3_env.storage_options,
                            budget_bytes=256 << 10)
  assert_same(read_back(out), host)


@settings(max_examples=40, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from(sorted(_export_plan.SAFETENSORS_DTYPES)),
                                st.lists(st.integers(0, 5), max_size=3)), max_size=8),
       max_size=st.integers(1, 200), single=st.booleans())
def test_planned_headers_are_valid_safetensors(specs, max_size, single):
  """Any plan's files, filled with zeros, are parsed by the library with the planned names,
  dtypes and shapes, and the index maps every name to its file."""
  leaves = [_records.Leaf(i, (("dict", "t"), ("seq", i)), "array", dt, tuple(shape),
                          inline=bytes(math.prod(shape) * _records.itemsize(dt)))
            for i, (dt, shape) in enumerate(specs)]
  p = _export_plan.plan(leaves, "c", single="x.safetensors" if single else None,
                        max_shard_size=None if single else max_size)
  found = {}
  for f in p.files:
    data = f.header + bytes(f.size - len(f.header))
    for name, v in deserialize(data):
      found[name] = (v["dtype"], tuple(v["shape"]), len(v["data"]), f.name)
  assert found == {f"t.{l.index}": (_export_plan.SAFETENSORS_DTYPES[l.dtype], l.shape,
                                    l.nbytes, found[f"t.{l.index}"][3]) for l in leaves}
  if not single:
    index = json.loads(p.index)
    assert index["weight_map"] == {k: v[3] for k, v in found.items()}
    assert index["metadata"]["total_size"] == sum(l.nbytes for l in leaves)


def test_a_failed_write_leaves_nothing(saved, tmp_path, monkeypatch):
  """A write that fails midway (a full disk, injected on the third piece): the export raises
  naming the file and the cause, and neither the file nor a temporary one is left."""
  from fnckpt._export import to_safetensors as _export
  path, _ = saved
  real, calls = _export._to_bytes, []

  def failing(data):
    calls.append(1)
    if len(calls) == 3:
      raise OSError(28, "No space left on device")
    return real(data)
  monkeypatch.setattr(_export, "_to_bytes", failing)
  with pytest.raises(fnckpt.CheckpointError, match=r"Cannot write '.*/m.safetensors' "
                     r"\(OSError: \[Errno 28\] No space left on device\)\. Check the free space"):
    fnckpt.export_safetensors(path, tmp_path / "m.safetensors", budget_bytes=64 << 10)
  assert os.listdir(tmp_path) == [] and len(calls) == 3


def test_big_integers_go_into_metadata_as_text(tmp_path):
  """__metadata__ values are strings; a number there makes the file unreadable."""
  from safetensors import safe_open
  fnckpt.save({"w": np.ones((2, 3), np.float32), "big": 2**100}, tmp_path / "c").wait()
  fnckpt.export_safetensors(str(tmp_path / "c"), str(tmp_path / "m.safetensors"))
  with safe_open(str(tmp_path / "m.safetensors"), "np") as f:
    assert f.metadata()["big"] == str(2**100)


def test_overwrite_never_deletes_files_an_export_did_not_write(tmp_path):
  fnckpt.save({"w": np.ones((2, 3), np.float32)}, tmp_path / "run" / "c").wait()
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text("{}")
  with pytest.raises(fnckpt.CheckpointError, match=r"holds files that are not part of a "
                     r"safetensors export \(e.g. 'config.json'\); overwrite=True would delete"):
    fnckpt.export_safetensors(str(tmp_path / "run" / "c"), str(hf), overwrite=True)
  with pytest.raises(fnckpt.CheckpointError, match="not part of a safetensors export"):
    fnckpt.export_safetensors(str(tmp_path / "run" / "c"), str(tmp_path / "run"),
                              overwrite=True)
  assert (hf / "config.json").exists() and (tmp_path / "run" / "c" / "COMMIT").exists()
  out = str(tmp_path / "out")
  fnckpt.export_safetensors(str(tmp_path / "run" / "c"), out)
  fnckpt.export_safetensors(str(tmp_path / "run" / "c"), out, overwrite=True)  # its own: fine
  assert sorted(os.listdir(out)) == ["model-00001-of-00001.safetensors",
                                     "model.safetensors.index.json"]


def test_long_output_names(saved, tmp_path):
  """A name near the file system's 255-byte limit exports (the temporary name stays within
  it); one beyond is refused up front, naming the limit, with nothing left behind."""
  path, _ = saved
  ok = tmp_path / ("m" * 238 + ".safetensors")  # 250 bytes
  fnckpt.export_safetensors(path, ok)
  assert os.listdir(tmp_path) == [ok.name] and ok.stat().st_size > 0
  os.unlink(ok)
  with pytest.raises(fnckpt.CheckpointError, match=r"is 262 bytes long; file systems allow "
                     r"at most 255\. Choose a shorter name"):
    fnckpt.export_safetensors(path, tmp_path / ("m" * 250 + ".safetensors"))
  assert os.listdir(tmp_path) == []


def test_casts_between_narrow_floats_numpy_cannot_do_directly(tmp_path):
  """float8_e8m0fnu <-> other fp8 types have no direct numpy cast: export and restore(cast=True)
  go through float32 (exact for both) instead of failing midway."""
  import ml_dtypes
  path = str(tmp_path / "c")
  x = np.array([0.25, 1.0, 2.0, 4.0], ml_dtypes.float8_e8m0fnu)
  fnckpt.save({"scale": x}, path).wait()
  fnckpt.export_safetensors(path, tmp_path / "m.safetensors", dtype="float8_e4m3fn")
  from safetensors import safe_open
  with safe_open(str(tmp_path / "m.safetensors"), "np") as f:
    assert f.metadata() == {"format": "pt"} and list(f.keys()) == ["scale"]
  raw = open(tmp_path / "m.safetensors", "rb").read()[-4:]
  np.testing.assert_array_equal(np.frombuffer(raw, ml_dtypes.float8_e4m3fn),
                                x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn))
  got = fnckpt.restore(path, {"scale": np.zeros(4, ml_dtypes.float8_e4m3fn)}, cast=True)
  assert got["scale"].dtype == ml_dtypes.float8_e4m3fn
  np.testing.assert_array_equal(got["scale"].astype(np.float32), x.astype(np.float32))
