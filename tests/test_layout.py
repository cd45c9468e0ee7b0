"""fnckpt._layout (pure: chunk shapes, write plan, read plan) and the layout it gives on disk:
zarr3 + sharding_indexed + crc32c, one writer per chunk, no reads while saving, small leaves
inline in a versioned msgpack manifest; and the storage locations (local, file://, memory://).
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt import _layout, _manifest

from tree_utils import CountIO, assert_trees_all_equal


def _mesh(shape, names=None, devices=None):
  n = math.prod(shape)
  devices = jax.devices()[:n] if devices is None else devices
  names = names or tuple("abc"[:len(shape)])
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), names)


def _shards(sharding, shape):
  return {d: _layout.normalize_index(idx, shape)
          for d, idx in sharding.devices_indices_map(shape).items()}


# --- pure functions: small cases ---------------------------------------------------------

@pytest.mark.parametrize("index, shape, expected", [
    ((slice(0, 4), slice(None)), (8, 3), ((0, 4), (0, 3))),
    ((slice(None),), (0,), ((0, 0),)),
    ((), (), ()),
    ((slice(2, None),), (5,), ((2, 5),)),
])
def test_normalize_index(index, shape, expected):
  assert _layout.normalize_index(index, shape) == expected


def test_normalize_index_rejects_strides():
  with pytest.raises(ValueError, match="strided"):
    _layout.normalize_index((slice(0, 4, 2),), (4,))


@pytest.mark.parametrize("shard, replicas, itemsize, split, expected", [
    ((4, 8), 1, 4, 1, (4, 8)),                       # not replicated: the shard
    ((1024, 4096), 4, 4, 16 << 20, (256, 4096)),     # large and replicated: one piece each
    ((1024, 4096), 4, 4, 32 << 20, (1024, 4096)),    # replicated but small: whole
    ((6, 8), 4, 1, 1, (2, 8)),                       # 4 replicas, 6 rows: 3 pieces
    ((1, 8), 4, 1, 1, (1, 2)),                       # one row: split the next dimension
    ((7,), 4, 1, 1, (7,)),                           # prime length > replicas: whole
    ((0, 3), 1, 4, 1, (1, 3)),                       # never an empty chunk
    ((), 8, 4, 1, ()),                               # 0-d
])
def test_chunk_shape(shard, replicas, itemsize, split, expected):
  assert _layout.chunk_shape(shard, replicas, itemsize, split) == expected


@pytest.mark.parametrize("chunk, itemsize, target, expected", [
    ((4096, 4096), 4, 4 << 20, (1024, 1024)),  # near-square: halve the largest dimension
    ((8, 8), 4, 1 << 20, (8, 8)),
    ((4, 6), 1, 6, (2, 3)),
    ((4, 6), 1, 5, (2, 1)),
    ((7, 7), 8, 8, (1, 1)),
    ((1, 1 << 20), 4, 1 << 20, (1, 1 << 18)),
    ((), 4, 1, ()),
])
def test_inner_chunk_shape(chunk, itemsize, target, expected):
  assert _layout.inner_chunk_shape(chunk, itemsize, target) == expected


def test_write_plan_one_writer_per_chunk_replicas_share():
  shards = {"d0": ((0, 4),), "d1": ((0, 4),), "d2": ((4, 8),), "d3": ((4, 8),)}
  everyone = _layout.write_plan(shards, shards, (2,))
  assert [(u.index, u.device, u.local) for u in everyone] == [
      (((0, 2),), "d0", ((0, 2),)), (((2, 4),), "d1", ((2, 4),)),
      (((4, 6),), "d2", ((0, 2),)), (((6, 8),), "d3", ((2, 4),))]
  # a "process" with d2 and d3 writes only their chunks
  assert [u.device for u in _layout.write_plan(shards, ["d2", "d3"], (2,))] == ["d2", "d3"]
  assert _layout.write_plan(shards, [], (2,)) == []


def test_write_plan_rejects_shards_off_the_chunk_grid():
  with pytest.raises(ValueError, match="not aligned"):
    _layout.write_plan({"d0": ((0, 3),), "d1": ((3, 6),)}, ["d0", "d1"], (2,))


def test_read_plan_reads_each_distinct_slice_once():
  wanted = {"d0": ((0, 4),), "d1": ((0, 4),), "d2": ((4, 8),), "d3": ((0, 4),)}
  assert _layout.read_plan(wanted) == {((0, 4),): ["d0", "d1", "d3"], ((4, 8),): ["d2"]}
  assert _layout.read_plan({}) == {}


@pytest.mark.parametrize("shards, expected", [
    ({}, 1), ({"a": ((0, 2),)}, 1), ({"a": ((0, 2),), "b": ((0, 2),)}, 2),
    ({"a": ((0, 2),), "b": ((0, 2),), "c": ((2, 4),)}, 1),
])
def test_replica_count(shards, expected):
  assert _layout.replica_count(shards) == expected


@pytest.mark.parametrize("mesh_shape, spec, shape", [
    ((8,), P("a"), (16, 4)),            # fully sharded
    ((2, 4), P("a", "b"), (4, 8)),      # fully sharded, 2-d mesh
    ((2, 4), P("a"), (4, 8)),           # partially replicated
    ((2, 4), P(None, ("a", "b")), (3, 16)),
    ((2, 4), P(), (4, 8)),              # replicated
    ((1,), P(), (5,)),                  # one device
])
def test_read_plan_per_process_covers_exactly_what_its_devices_need(mesh_shape, spec, shape):
  sharding = NamedSharding(_mesh(mesh_shape), spec)
  full = _shards(sharding, shape)
  devices = list(full)
  for group in (devices[: len(devices) // 2 or 1], devices[len(devices) // 2:]):
    wanted = {d: full[d] for d in group}
    plan = _layout.read_plan(wanted)
    assert sorted(len(v) for v in plan.values()) == sorted(
        sum(1 for w in wanted.values() if w == idx) for idx in plan)
    assert set(plan) == set(wanted.values())          # only what the devices need ...
    assert sorted(d.id for ds in plan.values() for d in ds) == sorted(d.id for d in group)
    assert len(plan) == len(set(wanted.values()))     # ... each distinct slice once


# --- pure functions: properties over random meshes, specs and shapes ---------------------

@st.composite
def _sharded_arrays(draw):
  """A mesh of 1, 2, 4 or 8 devices (in a random order), a PartitionSpec over its axes and a
  shape that the spec divides (dimensions may be 0)."""
  n = draw(st.sampled_from([1, 2, 4, 8]))
  ndim_mesh = draw(st.integers(1, 3))
  sizes = [1] * ndim_mesh
  left = n
  for i in range(ndim_mesh - 1):
    sizes[i] = draw(st.sampled_from([d for d in (1, 2, 4, 8) if left % d == 0]))
    left //= sizes[i]
  sizes[-1] = left
  order = draw(st.permutations(range(n)))
  devices = [jax.devices()[i] for i in order]
  mesh = _mesh(tuple(sizes), tuple(f"m{i}" for i in range(ndim_mesh)), devices)
  ndim = draw(st.integers(0, 3))
  unused = list(mesh.axis_names)
  spec = []
  for _ in range(ndim):
    k = draw(st.integers(0, min(2, len(unused))))
    axes = draw(st.permutations(unused))[:k]
    for a in axes:
      unused.remove(a)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  shape = []
  for entry in spec:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    parts = math.prod(mesh.shape[a] for a in axes)
    shape.append(parts * draw(st.integers(0, 3)))
  return NamedSharding(mesh, P(*spec)), tuple(shape)


def _processes(draw, devices):
  """Split devices into 1-4 'processes' (contiguous groups, as jax.distributed would)."""
  k = draw(st.integers(1, min(4, len(devices))))
  cuts = sorted(draw(st.lists(st.integers(1, len(devices) - 1), min_size=k - 1,
                              max_size=k - 1, unique=True))) if len(devices) > 1 else []
  bounds = [0, *cuts, len(devices)]
  return [devices[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(_sharded_arrays(), st.sampled_from([1, 2, 4]), st.integers(1, 64), st.data())
def test_property_write_plan_writes_every_chunk_exactly_once(arr, itemsize, split, data):
  sharding, shape = arr
  shards = _shards(sharding, shape)
  replicas = _layout.replica_count(shards)
  chunk = _layout.chunk_shape(sharding.shard_shape(shape), replicas, itemsize, split)
  assert all(c >= 1 for c in chunk) and len(chunk) == len(shape)
  processes = _processes(data.draw, list(sharding.mesh.devices.flat))
  plans = [_layout.write_plan(shards, group, chunk) for group in processes]
  units = [u for plan in plans for u in plan]

  # every element is written exactly once, across all devices of all processes
  cover = np.zeros(shape, dtype=np.int32)
  for u in units:
    cover[tuple(slice(a, b) for a, b in u.index)] += 1
  assert np.all(cover == 1)
  assert len({u.index for u in units}) == len(units)
  # each unit is one cell of the zarr chunk grid
  for u in units:
    for (a, b), c, n in zip(u.index, chunk, shape):
      assert a % c == 0 and b == min(a + c, n) and b > a
  # ... written by a device of the process that planned it, which holds those elements,
  # and ``local`` points at them inside that device's shard
  for group, plan in zip(processes, plans):
    for u in plan:
      assert u.device in group
      shard = shards[u.device]
      assert all(s <= a and b <= e for (a, b), (s, e) in zip(u.index, shard))
      assert u.local == tuple((a - s, b - s) for (a, b), (s, _) in zip(u.index, shard))
  # how the devices are split into processes does not change the plan
  assert sorted((u.index, u.device.id) for u in units) == sorted(
      (u.index, u.device.id) for u in _layout.write_plan(shards, shards, chunk))
  # replicas share the work: a shard cut into k chunks has min(k, replicas) writers
  by_shard = {}
  for u in units:
    shard = next(s for s in set(shards.values())
                 if all(a <= x and y <= b for (x, y), (a, b) in zip(u.index, s)))
    by_shard.setdefault(shard, set()).add(u.device)
  for shard, writers in by_shard.items():
    holders = [d for d, s in shards.items() if s == shard]
    n_chunks = sum(1 for u in units if u.device in holders)
    assert len(writers) == min(n_chunks, len(holders))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 64), max_size=4), st.integers(1, 8), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 1 << 12))
def test_property_chunk_shape_tiles_the_shard(shard, replicas, itemsize, split):
  chunk = _layout.chunk_shape(shard, replicas, itemsize, split)
  assert len(chunk) == len(shard)
  assert all(c >= 1 for c in chunk)
  assert all(n == 0 or n % c == 0 for n, c in zip(shard, chunk))
  pieces = math.prod(max(n, 1) // c for n, c in zip(shard, chunk))
  assert 1 <= pieces <= replicas
  if replicas == 1 or _layout.nbytes([max(1, n) for n in shard], itemsize) < split:
    assert chunk == tuple(max(1, n) for n in shard)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=4), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 1 << 16))
def test_property_inner_chunks_divide_the_chunk_and_fit_the_target(chunk, itemsize, target):
  inner = _layout.inner_chunk_shape(chunk, itemsize, target)
  assert len(inner) == len(chunk)
  assert all(c % i == 0 for c, i in zip(chunk, inner))
  assert _layout.nbytes(inner, itemsize) <= target or all(i == 1 for i in inner)
  # no more divided than needed: undoing the last division would go over the target
  if inner != tuple(chunk):
    assert any(_layout.nbytes([x * (c // x if j == d else 1) for j, x in enumerate(inner)],
                              itemsize) > target
               for d, c in enumerate(chunk) if c != inner[d])


# --- on disk -----------------------------------------------------------------------------

def _files(root):
  return sorted(os.path.relpath(os.path.join(d, f), root)
                for d, _, fs in os.walk(root) for f in fs)


def _read_manifest(path):
  with open(os.path.join(path, _manifest.MANIFEST), "rb") as f:
    return _manifest.decode(f.read(), path)


def _records(path):
  return {tuple(x for e in r["path"] for x in e): r for r in _read_manifest(path)["leaves"]}


def test_zarr3_sharding_indexed_with_crc32c_for_data_and_index(tmp_path):
  mesh = _mesh((2, 4))
  x = jax.device_put(jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64),
                     NamedSharding(mesh, P("a", "b")))
  fnckpt.save({"w": x}, tmp_path / "c", inline_bytes=0).wait()
  rec = _records(tmp_path / "c")[("dict", "w")]
  with open(tmp_path / "c" / rec["store"]["dir"] / "zarr.json") as f:
    meta = json.load(f)
  assert meta["zarr_format"] == 3 and meta["node_type"] == "array"
  assert meta["shape"] == [32, 64] and meta["data_type"] == "float32"
  assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [16, 16]  # the device shard
  (codec,) = meta["codecs"]
  assert codec["name"] == "sharding_indexed"
  conf = codec["configuration"]
  assert conf["chunk_shape"] == rec["store"]["inner"]
  assert [c["name"] for c in conf["codecs"]] == ["bytes", "crc32c"]
  assert [c["name"] for c in conf["index_codecs"]] == ["bytes", "crc32c"]
  assert conf.get("index_location", "end") == "end"
  # one file per device shard, named by its chunk-grid position
  chunk_files = [f for f in _files(tmp_path / "c" / rec["store"]["dir"]) if f != "zarr.json"]
  assert sorted(chunk_files) == sorted(f"c/{i}/{j}" for i in range(2) for j in range(4))


def test_zstd_is_an_inner_codec_before_crc32c(tmp_path):
  fnckpt.save({"w": np.zeros((64, 64), np.float32)}, tmp_path / "c", zstd=3,
              inline_bytes=0).wait()
  rec = _records(tmp_path / "c")[("dict", "w")]
  with open(tmp_path / "c" / rec["store"]["dir"] / "zarr.json") as f:
    conf = json.load(f)["codecs"][0]["configuration"]
  assert [c["name"] for c in conf["codecs"]] == ["bytes", "zstd", "crc32c"]
  assert rec["store"]["zstd"] == 3
  assert np.array_equal(fnckpt.restore(tmp_path / "c")["w"], np.zeros((64, 64), np.float32))


@pytest.mark.parametrize("spec, n_chunks", [
    (P("a", "b"), 8),   # fully sharded: 8 distinct shards
    (P("a"), 2),        # 4 replicas of each of 2 shards
    (P(None, "b"), 4),  # 2 replicas of each of 4 shards
    (P(), 1),           # replicated, small: one chunk, written once
])
def test_each_chunk_is_written_once_whatever_the_replication(tmp_path, spec, n_chunks):
  x = jax.device_put(jnp.arange(64 * 64, dtype=jnp.int32).reshape(64, 64),
                     NamedSharding(_mesh((2, 4)), spec))
  stats = fnckpt.save({"x": x}, tmp_path / "c", inline_bytes=0).wait()
  assert stats.chunks_written == n_chunks
  assert stats.bytes_written == x.nbytes  # no replica wrote twice
  rec = _records(tmp_path / "c")[("dict", "x")]
  files = [f for f in _files(tmp_path / "c" / rec["store"]["dir"]) if f.startswith("c/")]
  assert len(files) == n_chunks
  assert np.array_equal(fnckpt.restore(tmp_path / "c")["x"], np.asarray(x))


def test_large_replicated_arrays_are_written_in_pieces_one_per_replica(tmp_path):
  n = 4096  # 16 MiB of uint8: at SPLIT_REPLICATED_BYTES
  assert n * n >= _layout.SPLIT_REPLICATED_BYTES
  x = jax.device_put(jnp.arange(n * n, dtype=jnp.uint8).reshape(n, n),
                     NamedSharding(_mesh((8,)), P()))
  stats = fnckpt.save({"x": x}, tmp_path / "c", inline_bytes=0).wait()
  rec = _records(tmp_path / "c")[("dict", "x")]
  assert rec["store"]["chunks"] == [n // 8, n]
  assert stats.chunks_written == 8 and stats.bytes_written == n * n
  shards = _shards(x.sharding, x.shape)
  units = _layout.write_plan(shards, shards, rec["store"]["chunks"])
  assert len({u.device for u in units}) == 8  # every replica writes one piece
  back = fnckpt.restore(tmp_path / "c")["x"]
  assert np.array_equal(back, np.asarray(x))


def test_a_save_reads_no_chunk_only_the_commit_marker_and_zarr_json(tmp_path):
  mesh = _mesh((2, 4))
  tree = {"a": jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("a", "b"))),
          "b": jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("a"))),
          "c": np.ones((1000,), np.int64), "small": jnp.ones(3), "step": 3}
  n_stored = 3  # a, b, c; "small" and "step" go inline
  with CountIO() as io:
    fnckpt.save(tree, tmp_path / "c", inline_bytes=1024).wait()
  # The reads of a save: one of COMMIT (is a checkpoint there?) and, by process 0 creating
  # the arrays, one of each array's zarr.json (open-or-create). None of a chunk: nothing
  # was there to read, so no bytes at all, and no read-modify-write of a chunk.
  assert io["read"] == 1 + n_stored
  assert io["bytes_read"] == 0
  assert io["write"] == 8 + 2 + 1 + n_stored + 2  # chunks, zarr.json files, manifest, COMMIT
  # overwriting reads the old COMMIT (it is a checkpoint), clears it, then reads no chunk
  commit = (tmp_path / "c" / _manifest.COMMIT).read_bytes()
  with CountIO() as io:
    fnckpt.save(tree, tmp_path / "c", overwrite=True, inline_bytes=1024).wait()
  assert io["read"] == 1 + n_stored and io["bytes_read"] == len(commit)
  # all-inline: only COMMIT is read
  with CountIO() as io:
    fnckpt.save({"small": jnp.ones(3), "step": 3}, tmp_path / "d").wait()
  assert io["read"] == 1 and io["bytes_read"] == 0


def test_small_leaves_are_inline_in_the_manifest(tmp_path):
  tree = {"bias": jnp.arange(4.0), "step": 7, "big": np.arange(5000, dtype=np.float32),
          "name": "run", "rng": jax.random.key(1)}
  fnckpt.save(tree, tmp_path / "c").wait()
  recs = _records(tmp_path / "c")
  assert recs[("dict", "bias")]["inline"] == np.arange(4.0, dtype=np.float32).tobytes()
  assert recs[("dict", "step")]["value"] == 7
  assert recs[("dict", "name")]["value"] == "run"
  assert "inline" in recs[("dict", "rng")] and recs[("dict", "rng")]["kind"] == "key"
  assert "inline" not in recs[("dict", "big")]
  stored = {r["store"]["dir"] for r in recs.values() if "store" in r}
  assert stored == {recs[("dict", "big")]["store"]["dir"]}
  assert set(os.listdir(tmp_path / "c" / _manifest.DATA_DIR)) == {
      d.split("/", 1)[1] for d in stored}
  # inline_bytes=0: every array gets its own zarr array
  fnckpt.save(tree, tmp_path / "d", inline_bytes=0).wait()
  recs = _records(tmp_path / "d")
  assert all("store" in r for r in recs.values() if r["kind"] in ("array", "key"))


def test_manifest_is_versioned_and_describes_each_leaf(tmp_path):
  mesh = _mesh((2, 4))
  x = jax.device_put(jnp.zeros((16, 64), jnp.bfloat16), NamedSharding(mesh, P(("b", "a"))))
  fnckpt.save({"p": {"w": x}}, tmp_path / "c", metadata={"run": "r1"}, inline_bytes=0).wait()
  m = _read_manifest(tmp_path / "c")
  assert m["format"] == "fnckpt" and m["version"] == _manifest.FORMAT_VERSION
  assert set(m["versions"]) >= {"fnckpt", "jax", "tensorstore"}
  assert m["versions"]["jax"] == jax.__version__
  assert m["metadata"] == {"run": "r1"} and m["process_count"] == 1
  (rec,) = m["leaves"]
  assert rec["path"] == [["dict", "p"], ["dict", "w"]]
  assert rec["kind"] == "array" and rec["dtype"] == "bfloat16" and rec["shape"] == [16, 64]
  assert rec["sharding"] == {"type": "named", "axes": ["a", "b"], "sizes": [2, 4],
                             "spec": [["b", "a"]]}
  assert rec["store"] == {"dir": "d/0", "chunks": [2, 64], "inner": [2, 64], "zstd": None}
  # the commit marker names this manifest
  with open(tmp_path / "c" / _manifest.COMMIT, "rb") as f:
    commit = _manifest.decode_commit(f.read(), "c")
  with open(tmp_path / "c" / _manifest.MANIFEST, "rb") as f:
    assert commit["manifest_sha256"] == _manifest.digest(f.read())


# --- locations ---------------------------------------------------------------------------

def _tree():
  return {"w": jax.device_put(jnp.arange(64 * 64.0).reshape(64, 64),
                              NamedSharding(_mesh((2, 4)), P("a", "b"))),
          "b": jnp.ones(3), "step": 1}


@pytest.mark.parametrize("form", ["plain", "pathlike", "file-url", "relative", "trailing-slash"])
def test_local_locations(tmp_path, monkeypatch, form):
  target = tmp_path / "ckpt"
  path = {"plain": str(target), "pathlike": target, "file-url": f"file://{target}",
          "relative": "ckpt", "trailing-slash": f"{target}/"}[form]
  monkeypatch.chdir(tmp_path)
  tree = _tree()
  fnckpt.save(tree, path, inline_bytes=0).wait()
  assert os.path.exists(target / _manifest.COMMIT)
  # whichever form wrote it, every form reads it
  for other in (str(target), f"file://{target}"):
    assert_trees_all_equal(fnckpt.restore(other, tree), tree)
  assert fnckpt.metadata(path).location == str(target)


def test_memory_locations_survive_across_save_and_restore(tmp_path):
  tree = _tree()
  path = f"memory://{tmp_path.name}/run/1"
  with CountIO() as io:
    fnckpt.save(tree, path, inline_bytes=0).wait()
  assert io["write"] == 0  # no file written
  assert_trees_all_equal(fnckpt.restore(path, tree), tree)
  assert fnckpt.metadata(path).location == path
  with pytest.raises(fnckpt.CheckpointError, match="already exists"):
    fnckpt.save(tree, path)
  # a different memory:// path is a different checkpoint
  with pytest.raises(fnckpt.CheckpointError, match=f"No checkpoint at 'memory://{tmp_path.name}"):
    fnckpt.restore(f"memory://{tmp_path.name}/run/2")
