"""fnckpt._layout.chunks (pure: chunk shapes, write plan, read plan) and the layout it gives on
disk (format 2): zarr3 + sharding_indexed + crc32c under data-<hex>/, one writer per chunk, no
reads while saving, small leaves inline in a versioned msgpack manifest, medium arrays in a
pack; and the storage locations (local, file://, memory://).
"""

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._layout import chunks as _layout
from fnckpt._format import hashes as _hashes, manifest as _manifest, records as _records

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


@pytest.mark.parametrize("shard, replicas, itemsize, split, floor, expected", [
    ((4, 8), 1, 4, 1, 1, (4, 8)),                       # not replicated: the shard
    ((1024, 4096), 4, 4, 16 << 20, 1, (256, 4096)),     # large and replicated: one piece each
    ((1024, 4096), 4, 4, 32 << 20, 1, (1024, 4096)),    # replicated but small: whole
    ((6, 8), 4, 1, 1, 1, (2, 8)),                       # 4 replicas, 6 rows: 3 pieces
    ((1, 8), 4, 1, 1, 1, (1, 2)),                       # one row: split the next dimension
    ((7,), 4, 1, 1, 1, (7,)),                           # prime length > replicas: whole
    ((0, 3), 1, 4, 1, 1, (1, 3)),                       # never an empty chunk
    ((), 8, 4, 1, 1, ()),                               # 0-d
    ((2, 8), 4, 1, 1, 1, (1, 4)),                       # rows split to 1: on into the next
    ((7, 8), 4, 1, 1, 1, (7, 2)),                       # rows do not divide: the next does
    # the floor: pieces never under `floor` bytes
    ((1024, 4096), 4096, 8, 16 << 20, 8 << 20, (256, 4096)),  # 32 MiB x 4096: 4 x 8 MiB
    ((1024, 4096), 4, 4, 16 << 20, 8 << 20, (512, 4096)),     # 16 MiB: 2 x 8 MiB, not 4 x 4
    ((1000, 8192), 64, 4, 16 << 20, 8 << 20, (500, 8192)),    # <= 3 pieces; 1000 rows: 2
    ((3, 1 << 20), 8, 8, 16 << 20, 8 << 20, (1, 1 << 20)),    # 24 MiB: 3 pieces
])
def test_chunk_shape(shard, replicas, itemsize, split, floor, expected):
  assert _layout.chunk_shape(shard, replicas, itemsize, split, floor) == expected


def test_chunk_shape_defaults_split_large_replicated_shards_into_8_mib_pieces():
  assert _layout.MIN_SPLIT_CHUNK_BYTES == 8 << 20
  assert _layout.chunk_shape((8192, 1024), 4096, 4) == (2048, 1024)  # 32 MiB: 4 pieces
  assert _layout.chunk_shape((4096, 1024), 4096, 4) == (2048, 1024)  # 16 MiB: 2 pieces
  assert _layout.chunk_shape((1024, 1024), 4096, 4) == (1024, 1024)  # 4 MiB: whole


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
  chunk = _layout.chunk_shape(sharding.shard_shape(shape), replicas, itemsize, split, 1)
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
       st.integers(1, 1 << 12), st.sampled_from([1, 7, 64, 1 << 10]))
def test_property_chunk_shape_tiles_the_shard(shard, replicas, itemsize, split, floor):
  chunk = _layout.chunk_shape(shard, replicas, itemsize, split, floor)
  assert len(chunk) == len(shard)
  assert all(c >= 1 for c in chunk)
  assert all(n == 0 or n % c == 0 for n, c in zip(shard, chunk))
  pieces = math.prod(max(n, 1) // c for n, c in zip(shard, chunk))
  assert 1 <= pieces <= replicas
  whole = tuple(max(1, n) for n in shard)
  if replicas == 1 or _layout.nbytes(whole, itemsize) < split:
    assert chunk == whole
  if chunk != whole:  # a split never makes pieces under the floor
    assert _layout.nbytes(chunk, itemsize) >= floor


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


def _leaves(path):
  """The validated leaf records (``_records.Leaf``) by flattened key path."""
  return {tuple(x for e in l.path for x in e): l for l in _read_manifest(path).leaves}


def _zarr_json(path, d):
  with open(os.path.join(path, d, "zarr.json")) as f:
    return json.load(f)


def test_zarr3_sharding_indexed_with_crc32c_for_data_and_index(tmp_path):
  mesh = _mesh((2, 4))
  x = jax.device_put(jnp.arange(32 * 64, dtype=jnp.float32).reshape(32, 64),
                     NamedSharding(mesh, P("a", "b")))
  fnckpt.save({"w": x}, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  rec = _leaves(tmp_path / "c")[("dict", "w")]
  assert rec.stored.dir == f"{_read_manifest(tmp_path / 'c').data}/a/0"  # data-<hex>/a/<n>
  meta = _zarr_json(tmp_path / "c", rec.stored.dir)
  assert meta["zarr_format"] == 3 and meta["node_type"] == "array"
  assert meta["shape"] == [32, 64] and meta["data_type"] == "float32"
  assert meta["fill_value"] == 0 and meta["chunk_key_encoding"]["name"] == "default"
  assert meta["chunk_grid"]["name"] == "regular"
  assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [16, 16]  # the device shard
  assert rec.stored.chunks == (16, 16)
  (codec,) = meta["codecs"]
  assert codec["name"] == "sharding_indexed"
  conf = codec["configuration"]
  assert tuple(conf["chunk_shape"]) == rec.stored.inner
  assert [c["name"] for c in conf["codecs"]] == ["bytes", "crc32c"]
  assert conf["codecs"][0].get("configuration", {}).get("endian", "little") == "little"
  assert [c["name"] for c in conf["index_codecs"]] == ["bytes", "crc32c"]
  assert conf.get("index_location", "end") == "end"
  # one file per device shard, named by its chunk-grid position
  chunk_files = [f for f in _files(tmp_path / "c" / rec.stored.dir) if f != "zarr.json"]
  assert sorted(chunk_files) == sorted(f"c/{i}/{j}" for i in range(2) for j in range(4))


def test_medium_arrays_share_a_pack_of_byte_ranges(tmp_path):
  """Arrays over inline_bytes and up to pack_bytes go into this process's pack: a 1-D uint8
  zarr3 array at data-<hex>/p/<process>, each leaf its C-order little-endian bytes at its
  offset; sharding_indexed with bytes + crc32c for data and index."""
  mesh = _mesh((2, 4))
  tree = {"a": jax.device_put(jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128),
                              NamedSharding(mesh, P("a", "b"))),   # sharded, fully addressable
          "b": np.arange(5000, dtype=">i4"),                       # big-endian numpy
          "c": jax.device_put(jnp.arange(9000, dtype=jnp.bfloat16), NamedSharding(mesh, P())),
          "small": np.ones(3, np.float32)}
  fnckpt.save(tree, tmp_path / "c").wait()
  m = _read_manifest(tmp_path / "c")
  assert re.fullmatch(r"data-[0-9a-f]{32}", m.data)
  (pack,) = m.packs
  recs = _leaves(tmp_path / "c")
  assert recs[("dict", "small")].inline is not None
  packed = {k[-1]: r.packed for k, r in recs.items() if r.packed is not None}
  assert set(packed) == {"a", "b", "c"} and all(p.pack == 0 for p in packed.values())
  assert pack.dir == f"{m.data}/p/0"
  # the byte ranges: in leaf order, disjoint, inside the pack, of each array's size
  ranges = [(packed[k].offset, packed[k].offset + packed[k].nbytes) for k in "abc"]
  assert ranges == sorted(ranges) and all(b <= c for (_, b), (c, _) in zip(ranges, ranges[1:]))
  assert ranges[-1][1] <= pack.nbytes
  assert [packed[k].nbytes for k in "abc"] == [64 * 128 * 4, 5000 * 4, 9000 * 2]
  assert pack.nbytes % pack.inner == 0 and pack.chunk % pack.inner == 0
  meta = _zarr_json(tmp_path / "c", pack.dir)
  assert meta["shape"] == [pack.nbytes] and meta["data_type"] == "uint8"
  assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [pack.chunk]
  (codec,) = meta["codecs"]
  assert codec["name"] == "sharding_indexed"
  conf = codec["configuration"]
  assert conf["chunk_shape"] == [pack.inner]
  assert [c["name"] for c in conf["codecs"]] == ["bytes", "crc32c"]
  assert [c["name"] for c in conf["index_codecs"]] == ["bytes", "crc32c"]
  assert conf.get("index_location", "end") == "end"
  # a reader that knows only the README finds each leaf's bytes at its offset
  raw = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(
      tmp_path / "c" / pack.dir)}}, open=True).result().read().result().tobytes()
  for k in "abc":
    p = packed[k]
    want = np.asarray(tree[k]).astype(np.asarray(tree[k]).dtype.newbyteorder("<"))
    assert raw[p.offset:p.offset + p.nbytes] == want.tobytes(), k
  back = fnckpt.restore(tmp_path / "c")
  for k in tree:
    np.testing.assert_array_equal(back[k], np.asarray(tree[k]), err_msg=k)


@pytest.mark.parametrize("nbytes, where", [
    (16384, "inline"), (16385, "pack"), (4 << 20, "pack"), ((4 << 20) + 1, "store")])
def test_size_decides_inline_pack_or_own_array(tmp_path, nbytes, where):
  """inline up to inline_bytes (16 KiB), packed up to pack_bytes (4 MiB), else a zarr3 array
  of its own; inline_bytes=0 packs even a small array, pack_bytes=0 packs nothing."""
  x = np.arange(nbytes, dtype=np.uint8)
  for kwargs, expected in [({}, where), ({"inline_bytes": 0}, "store" if where == "store"
                                         else "pack"),
                           ({"inline_bytes": 0, "pack_bytes": 0}, "store")]:
    path = tmp_path / f"c{len(kwargs)}"
    fnckpt.save({"x": x, "tiny": np.ones(2, np.uint8)}, path, **kwargs).wait()
    recs = _leaves(path)
    got = {k: [w for w in ("inline", "stored", "packed") if getattr(r, w) is not None]
           for k, r in recs.items()}
    name = {"inline": "inline", "pack": "packed", "store": "stored"}
    assert got[("dict", "x")] == [name[expected]], kwargs
    assert got[("dict", "tiny")] == (["inline"] if not kwargs else
                                     ["packed"] if len(kwargs) == 1 else ["stored"]), kwargs
    # one process: one pack at most, holding every packed leaf
    assert len(_read_manifest(path).packs) == any(r.packed for r in recs.values())
    assert all(r.packed is None or r.packed.pack == 0 for r in recs.values())
    np.testing.assert_array_equal(fnckpt.restore(path)["x"], x)


def test_zstd_is_an_inner_codec_before_crc32c(tmp_path):
  fnckpt.save({"w": np.zeros((64, 64), np.float32)}, tmp_path / "c", zstd=3,
              inline_bytes=0, pack_bytes=0).wait()
  rec = _leaves(tmp_path / "c")[("dict", "w")]
  conf = _zarr_json(tmp_path / "c", rec.stored.dir)["codecs"][0]["configuration"]
  assert [c["name"] for c in conf["codecs"]] == ["bytes", "zstd", "crc32c"]
  assert rec.stored.zstd == 3
  assert np.array_equal(fnckpt.restore(tmp_path / "c")["w"], np.zeros((64, 64), np.float32))


@pytest.mark.parametrize("kwargs, codec, field", [
    ({"compression": "blosc"}, "blosc", "blosc"),
    ({"compression": "zstd:5"}, "zstd", "zstd"),
    ({"compression": "zstd"}, "zstd", "zstd"),
])
def test_compression_is_an_inner_codec_before_crc32c(tmp_path, kwargs, codec, field):
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((256, 64)) * 0.02).astype(jnp.bfloat16)  # compressible exponents
  fnckpt.save({"w": x}, tmp_path / "c", inline_bytes=0, pack_bytes=0, **kwargs).wait()
  rec = _leaves(tmp_path / "c")[("dict", "w")]
  conf = _zarr_json(tmp_path / "c", rec.stored.dir)["codecs"][0]["configuration"]
  assert [c["name"] for c in conf["codecs"]] == ["bytes", codec, "crc32c"]
  assert getattr(rec.stored, field)
  got = fnckpt.restore(tmp_path / "c")["w"]
  assert got.dtype == x.dtype and np.array_equal(got.view(np.uint16), x.view(np.uint16))
  stored = sum(f.stat().st_size for f in (tmp_path / "c").rglob("c/*") if f.is_file())
  assert stored < x.nbytes  # it did compress


@pytest.mark.parametrize("kwargs, match", [
    ({"compression": "gzip"}, r"save\(compression='gzip'\): expected None, 'blosc'"),
    ({"compression": "zstd:99"}, r"'zstd:<level>' \(level 1..22"),
    ({"compression": "blosc", "zstd": 3}, r"give one of them"),
])
def test_bad_compression_is_refused_before_anything_is_written(tmp_path, kwargs, match):
  with pytest.raises(fnckpt.CheckpointError, match=match):
    fnckpt.save({"w": np.zeros((64, 64), np.float32)}, tmp_path / "c", **kwargs).wait()
  assert not (tmp_path / "c" / "COMMIT").exists()


@pytest.mark.parametrize("spec, n_chunks", [
    (P("a", "b"), 8),   # fully sharded: 8 distinct shards
    (P("a"), 2),        # 4 replicas of each of 2 shards
    (P(None, "b"), 4),  # 2 replicas of each of 4 shards
    (P(), 1),           # replicated, small: one chunk, written once
])
def test_each_chunk_is_written_once_whatever_the_replication(tmp_path, spec, n_chunks):
  x = jax.device_put(jnp.arange(64 * 64, dtype=jnp.int32).reshape(64, 64),
                     NamedSharding(_mesh((2, 4)), spec))
  stats = fnckpt.save({"x": x}, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  assert stats.chunks_written == n_chunks
  assert stats.bytes_written == x.nbytes  # no replica wrote twice
  rec = _leaves(tmp_path / "c")[("dict", "x")]
  files = [f for f in _files(tmp_path / "c" / rec.stored.dir) if f.startswith("c/")]
  assert len(files) == n_chunks
  assert np.array_equal(fnckpt.restore(tmp_path / "c")["x"], np.asarray(x))


def test_a_packed_leaf_is_written_once_whatever_the_replication(tmp_path):
  """The same array replicated on 8 devices, packed: its bytes land once, in one pack."""
  x = jax.device_put(jnp.arange(64 * 64, dtype=jnp.int32).reshape(64, 64),
                     NamedSharding(_mesh((2, 4)), P()))
  stats = fnckpt.save({"x": x}, tmp_path / "c", inline_bytes=0).wait()
  (pack,) = _read_manifest(tmp_path / "c").packs
  assert _leaves(tmp_path / "c")[("dict", "x")].packed.nbytes == x.nbytes
  assert stats.bytes_written == pack.nbytes and pack.nbytes < 2 * x.nbytes
  files = [f for f in _files(tmp_path / "c" / pack.dir) if f.startswith("c/")]
  assert len(files) == stats.chunks_written == pack.nbytes // pack.chunk
  assert np.array_equal(fnckpt.restore(tmp_path / "c")["x"], np.asarray(x))


def test_large_replicated_arrays_are_written_in_pieces_by_different_replicas(tmp_path):
  n = 4096  # 16 MiB of uint8, on 8 devices: 2 pieces of MIN_SPLIT_CHUNK_BYTES, not 8 of 2 MiB
  assert n * n >= _layout.SPLIT_REPLICATED_BYTES == 2 * _layout.MIN_SPLIT_CHUNK_BYTES
  x = jax.device_put(jnp.arange(n * n, dtype=jnp.uint8).reshape(n, n),
                     NamedSharding(_mesh((8,)), P()))
  stats = fnckpt.save({"x": x}, tmp_path / "c", inline_bytes=0).wait()  # > 4 MiB: not packed
  rec = _leaves(tmp_path / "c")[("dict", "x")]
  assert rec.stored.chunks == (n // 2, n)
  assert stats.chunks_written == 2 and stats.bytes_written == n * n
  shards = _shards(x.sharding, x.shape)
  units = _layout.write_plan(shards, shards, rec.stored.chunks)
  assert len({u.device for u in units}) == 2  # two replicas write one piece each
  back = fnckpt.restore(tmp_path / "c")["x"]
  assert np.array_equal(back, np.asarray(x))


@pytest.mark.parametrize("layout", ["array", "pack"])
def test_a_save_reads_no_chunk_only_the_commit_marker_and_zarr_json(tmp_path, layout,
                                                                    monkeypatch):
  from fnckpt._io import direct as _direct
  direct = []   # a local pack's chunks and the manifest: written by fnckpt (no read)
  real = _direct.write_file
  monkeypatch.setattr(_direct, "write_file", lambda *a: (direct.append(a[0]), real(*a))[1])
  mesh = _mesh((2, 4))
  tree = {"a": jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("a", "b"))),
          "b": jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("a"))),
          "c": np.ones((1000,), np.int64), "small": jnp.ones(3), "step": 3}
  # a, b, c ("small" and "step" go inline): each its own zarr array, or all in one pack
  kwargs = {"inline_bytes": 1024, **({"pack_bytes": 0} if layout == "array" else {})}
  n_arrays, n_chunks = (3, 8 + 2 + 1) if layout == "array" else (1, 1)
  with CountIO() as io:
    fnckpt.save(tree, tmp_path / "c", **kwargs).wait()
  m = _read_manifest(tmp_path / "c")
  assert len({l.stored.dir for l in m.leaves if l.stored} | {p.dir for p in m.packs}) == n_arrays
  # The reads of a save: one of COMMIT (is a checkpoint there?) and, by process 0 creating
  # the arrays, one of each array's zarr.json (open-or-create). None of a chunk: nothing
  # was there to read, so no bytes at all, and no read-modify-write of a chunk.
  assert io["read"] == 1 + n_arrays
  assert io["bytes_read"] == 0
  # chunks, zarr.json files, manifest, COMMIT
  assert io["write"] + len(direct) == n_chunks + n_arrays + 2
  assert len(direct) == (n_chunks if layout == "pack" else 0) + 1   # (+ the manifest)
  # overwriting reads the old COMMIT (it is a checkpoint), clears it, then reads no chunk
  commit = (tmp_path / "c" / _manifest.COMMIT).read_bytes()
  direct.clear()
  with CountIO() as io:
    fnckpt.save(tree, tmp_path / "c", overwrite=True, **kwargs).wait()
  assert io["read"] == 1 + n_arrays and io["bytes_read"] == len(commit)
  assert io["write"] + len(direct) == n_chunks + n_arrays + 2
  # all-inline: only COMMIT is read
  with CountIO() as io:
    fnckpt.save({"small": jnp.ones(3), "step": 3}, tmp_path / "d").wait()
  assert io["read"] == 1 and io["bytes_read"] == 0


def test_small_leaves_are_inline_in_the_manifest(tmp_path):
  tree = {"bias": jnp.arange(4.0), "step": 7, "big": np.arange(5000, dtype=np.float32),
          "name": "run", "rng": jax.random.key(1)}
  fnckpt.save(tree, tmp_path / "c").wait()
  recs = _leaves(tmp_path / "c")
  assert recs[("dict", "bias")].inline == np.arange(4.0, dtype=np.float32).tobytes()
  assert recs[("dict", "step")].value == 7
  assert recs[("dict", "name")].value == "run"
  assert recs[("dict", "rng")].inline is not None and recs[("dict", "rng")].kind == "key"
  assert recs[("dict", "rng")].inline == np.asarray(jax.random.key_data(tree["rng"])).tobytes()
  big = recs[("dict", "big")]  # 20,000 bytes: over inline_bytes, packed
  assert big.inline is None and big.stored is None and big.packed is not None
  assert [k for k, r in recs.items() if r.stored or r.packed] == [("dict", "big")]
  # on disk: the manifest, COMMIT and this save's data: one pack, nothing else
  m = _read_manifest(tmp_path / "c")
  assert sorted(os.listdir(tmp_path / "c")) == sorted(
      [_manifest.COMMIT, _manifest.MANIFEST, m.data])
  assert [p.dir for p in m.packs] == [f"{m.data}/p/0"]
  files = _files(tmp_path / "c" / m.data)
  assert "p/0/zarr.json" in files and all(f.startswith("p/0/") for f in files), files
  # inline_bytes=0: no array is inline (packed, as they are small); pack_bytes=0 too: every
  # array gets its own zarr array
  fnckpt.save(tree, tmp_path / "d", inline_bytes=0).wait()
  recs = _leaves(tmp_path / "d")
  assert all(r.packed for r in recs.values() if r.is_array)
  fnckpt.save(tree, tmp_path / "e", inline_bytes=0, pack_bytes=0).wait()
  recs = _leaves(tmp_path / "e")
  assert all(r.stored for r in recs.values() if r.is_array)
  assert sum(r.is_array for r in recs.values()) == 3


def test_manifest_is_versioned_and_describes_each_leaf(tmp_path):
  mesh = _mesh((2, 4))
  x = jax.device_put(jnp.zeros((16, 64), jnp.bfloat16), NamedSharding(mesh, P(("b", "a"))))
  fnckpt.save({"p": {"w": x}}, tmp_path / "c", metadata={"run": "r1"}, inline_bytes=0,
              pack_bytes=0).wait()
  m = _read_manifest(tmp_path / "c")
  assert isinstance(m, _records.Manifest) and m.version == _manifest.FORMAT_VERSION == 3
  assert m.hash == "xxh3-128"
  assert set(m.versions) >= {"fnckpt", "jax", "tensorstore"}
  assert m.versions["jax"] == jax.__version__ and m.versions["fnckpt"] == fnckpt.__version__
  assert m.metadata == {"run": "r1"} and m.process_count == 1
  assert re.fullmatch(r"data-[0-9a-f]{32}", m.data) and m.packs == ()
  (rec,) = m.leaves
  assert rec.path == (("dict", "p"), ("dict", "w"))
  assert rec.kind == "array" and rec.dtype == "bfloat16" and rec.shape == (16, 64)
  assert rec.source == "jax"
  assert rec.sharding == _records.Sharding("named", ("a", "b"), (2, 4), (("b", "a"),), 8)
  assert rec.stored == _records.Stored(f"{m.data}/a/0", (2, 64), (2, 64), None)
  assert rec.inline is None and rec.packed is None
  # format 3: the xxh3-128 of each (zero) chunk's 2 x 64 bf16 bytes, C order over the 8 x 1
  # chunk grid, and the hash of those hashes
  chunk_hashes = _hashes.digest(bytes(2 * 64 * 2)) * 8
  assert rec.chunk_hashes == chunk_hashes and rec.hash == _hashes.digest(chunk_hashes)
  assert len(rec.hash) == 16 and rec.chunk_fps is None
  # the bytes on disk: exactly the README's keys and record fields
  with open(tmp_path / "c" / _manifest.MANIFEST, "rb") as f:
    raw = msgpack.unpackb(f.read(), raw=False, strict_map_key=False)
  assert set(raw) == {"format", "version", "created", "process_count", "versions",
                      "metadata", "data", "packs", "leaves", "hash"}
  assert raw["format"] == "fnckpt" and raw["version"] == 3 and raw["data"] == m.data
  assert raw["hash"] == "xxh3-128"
  assert isinstance(raw["created"], float) and raw["packs"] == []
  assert raw["leaves"] == [{
      "path": [["dict", "p"], ["dict", "w"]], "kind": "array", "dtype": "bfloat16",
      "shape": [16, 64], "source": "jax",
      "sharding": {"type": "named", "axes": ["a", "b"], "sizes": [2, 4], "spec": [["b", "a"]]},
      "store": {"dir": f"{m.data}/a/0", "chunks": [2, 64], "inner": [2, 64], "zstd": None},
      "hash": _hashes.digest(chunk_hashes), "chunk_hashes": chunk_hashes}]
  # the commit marker names this manifest
  with open(tmp_path / "c" / _manifest.COMMIT, "rb") as f:
    commit = _manifest.decode_commit(f.read(), "c")
  assert set(commit) == {"format", "version", "manifest_sha256", "committed"}
  assert commit["version"] == 3
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


@pytest.mark.parametrize("pack_bytes", [0, 4 << 20], ids=["arrays", "pack"])
def test_memory_locations_survive_across_save_and_restore(tmp_path, pack_bytes):
  tree = _tree()
  path = f"memory://{tmp_path.name}/run/1"
  with CountIO() as io:
    fnckpt.save(tree, path, inline_bytes=0, pack_bytes=pack_bytes).wait()
  assert io["write"] == 0  # no file written
  assert [l.stored is not None for l in fnckpt.metadata(path).leaves if l.is_array] == [
      pack_bytes == 0] * 2
  assert_trees_all_equal(fnckpt.restore(path, tree), tree)
  assert fnckpt.metadata(path).location == path
  with pytest.raises(fnckpt.CheckpointError, match="already exists"):
    fnckpt.save(tree, path)
  # a different memory:// path is a different checkpoint
  with pytest.raises(fnckpt.CheckpointError, match=f"No checkpoint at 'memory://{tmp_path.name}"):
    fnckpt.restore(f"memory://{tmp_path.name}/run/2")


# --- structural planning: local plans from mesh coordinates, O(local devices) -------------
# The reference is the generic path over the map of every device to its shard: JAX's
# devices_indices_map on the 8 virtual devices, and a numpy model of it (the mesh's device
# array transposed to (axes of dim 0, axes of dim 1, ..., unused axes)) for bigger simulated
# meshes, itself checked against JAX.

from jax.sharding import SingleDeviceSharding  # noqa: E402


def _restricted(info, group):
  """``info`` as seen by a process holding only the devices in ``group``."""
  keep = [i for i, d in enumerate(info.devices) if d in set(group)]
  return _layout.ShardingInfo(info.axis_sizes, info.dim_axes,
                              tuple(info.devices[i] for i in keep),
                              tuple(info.coords[i] for i in keep))


def _sim_info(axis_sizes, dim_axes, local_ids=()):
  """A simulated ShardingInfo: devices are flat positions in the mesh."""
  coords = tuple(tuple(int(x) for x in np.unravel_index(i, axis_sizes)) for i in local_ids)
  return _layout.ShardingInfo(tuple(axis_sizes), tuple(dim_axes), tuple(local_ids), coords)


def _model_map(axis_sizes, dim_axes, shape):
  """flat device -> (shard index, replica), in device order, by transposing the mesh."""
  ids = np.arange(math.prod(axis_sizes)).reshape(axis_sizes)
  used = [a for axes in dim_axes for a in axes]
  unused = [a for a in range(len(axis_sizes)) if a not in used]
  blocks = [math.prod(axis_sizes[a] for a in axes) for axes in dim_axes]
  blocks += [1] * (len(shape) - len(blocks))
  table = ids.transpose(used + unused).reshape(blocks + [-1])
  out = {}
  for pos in np.ndindex(*table.shape):
    *block, replica = pos
    out[int(table[pos])] = (tuple((b * n // k, (b + 1) * n // k)
                                  for b, n, k in zip(block, shape, blocks)), replica)
  return dict(sorted(out.items()))


def _keyed(units):
  return sorted((u.index, getattr(u.device, "id", u.device), u.local) for u in units)


def _assert_writes_partition_the_grid(units, shape, chunk, index_of):
  """Every chunk-grid cell written exactly once, by a device holding it (so every element
  once); ``index_of``: device -> its shard index."""
  cells = [u.index for u in units]
  assert len(set(cells)) == len(cells)
  grid = math.prod(-(-n // c) for n, c in zip(shape, chunk)) if math.prod(shape) else 0
  assert len(cells) == grid
  for u in units:
    for (a, b), c, n, (s, e) in zip(u.index, chunk, shape, index_of(u.device)):
      assert a % c == 0 and b == min(a + c, n) and s <= a < b <= e
    assert u.local == tuple((a - s, b - s) for (a, b), (s, _) in
                            zip(u.index, index_of(u.device)))


def _check_against_generic(info, full, shape, itemsize, salts=(0, 1, 977), split=()):
  """One process's structural plans equal the generic ones built from ``full``."""
  shard_shape = _layout.shard_shape_of(info, shape)
  generic = _layout.generic_write_layout(full, info.devices, shape, shard_shape, itemsize,
                                         *split)
  layout = _layout.write_layout(info, shape, itemsize, *split)
  assert layout.chunk == generic.chunk and layout.shape == generic.shape
  if math.prod(shape):  # (in an empty array, the generic path merges the empty shards)
    assert set(layout.shards) == set(generic.shards)
  for salt in salts:
    assert _keyed(_layout.local_writes(layout, salt)) == _keyed(
        _layout.local_writes(generic, salt))
  assert _layout.local_reads(info, shape) == _layout.read_plan(
      {d: full[d] for d in info.devices})


REAL_CASES = [  # mesh shape, device order (None: as jax.devices()), spec, shape
    ((8,), None, P("a"), (16, 4)),
    ((8,), [3, 1, 4, 0, 5, 7, 2, 6], P(None, "a"), (3, 16)),
    ((2, 4), None, P("a", "b"), (4, 8)),
    ((2, 4), None, P("a"), (4, 8)),                 # partially replicated
    ((2, 4), None, P(None, ("a", "b")), (3, 16)),   # a tuple of axes
    ((2, 4), [7, 6, 5, 4, 3, 2, 1, 0], P(("b", "a")), (16, 64)),
    ((2, 4), None, P("b", "a"), (8, 2)),
    ((2, 4), None, P(), (4, 8)),                    # replicated
    ((2, 4), None, P(), ()),                        # 0-d
    ((2, 4), None, P("a", "b"), (0, 8)),            # zero-size
    ((2, 2, 2), [6, 2, 0, 4, 7, 1, 3, 5], P(("c", "a"), None, "b"), (4, 3, 2)),
    ((2, 2, 2), None, P(None, "c"), (2, 4)),
    ((2, 2, 2), None, P("b"), (1 << 13, 1 << 12)),  # 32 MiB replicated 4 ways: split
    ((1, 8), None, P("a", "b"), (5, 8)),            # an axis of size 1
    ((1,), None, P(), (5,)),
]


@pytest.mark.parametrize("mesh_shape, order, spec, shape", REAL_CASES)
def test_structural_plans_equal_devices_indices_map(mesh_shape, order, spec, shape):
  devices = None if order is None else [jax.devices()[i] for i in order]
  sharding = NamedSharding(_mesh(mesh_shape, devices=devices), spec)
  full = _shards(sharding, shape)
  info = _layout.sharding_info(sharding)
  assert info.devices == tuple(sharding.mesh.devices.flat)  # one process: all, mesh order
  assert _layout.shard_shape_of(info, shape) == sharding.shard_shape(shape)
  assert info.replicas == _layout.replica_count(full) or not math.prod(shape)
  for itemsize in (1, 4):
    for k in (1, 2, 4, 8):  # every split of the devices into k "processes"
      step = len(info.devices) // k
      for p in range(k):
        _check_against_generic(_restricted(info, info.devices[p * step:(p + 1) * step]),
                               full, shape, itemsize)
    chunk, units = _layout.plan_write(sharding, shape, itemsize, salt=5)
    _assert_writes_partition_the_grid(units, shape, chunk, full.__getitem__)
  assert _layout.plan_read(sharding, shape) == _layout.read_plan(full)


@pytest.mark.parametrize("mesh_shape, order, spec, shape",
                         [c for c in REAL_CASES[:11] if math.prod(c[3])])  # (JAX merges empties)
def test_replica_ids_are_jaxs(mesh_shape, order, spec, shape):
  devices = None if order is None else [jax.devices()[i] for i in order]
  sharding = NamedSharding(_mesh(mesh_shape, devices=devices), spec)
  x = jax.device_put(np.zeros(shape, np.int8), sharding)
  mine = {s.device: s for s in _layout.local_shards(_layout.sharding_info(sharding), shape)}
  for shard in x.addressable_shards:
    assert mine[shard.device].replica == shard.replica_id
    assert mine[shard.device].index == _layout.normalize_index(shard.index, shape)


@settings(max_examples=100, deadline=None)
@given(_sharded_arrays(), st.sampled_from([1, 2, 4]), st.data())
def test_property_structural_plans_equal_generic_for_every_process(arr, itemsize, data):
  sharding, shape = arr
  full = _shards(sharding, shape)
  info = _layout.sharding_info(sharding)
  processes = _processes(data.draw, list(sharding.mesh.devices.flat))
  split = data.draw(st.sampled_from([(1, 1), (8, 4), ()]))  # (): the defaults, no splits here
  salt = data.draw(st.integers(0, 99))  # one for all processes, as the leaf's index would be
  units = []
  for group in processes:
    local = _restricted(info, group)
    _check_against_generic(local, full, shape, itemsize, salts=(salt,), split=split)
    units += _layout.local_writes(_layout.write_layout(local, shape, itemsize, *split), salt)
  chunk = _layout.write_layout(info, shape, itemsize, *split).chunk
  _assert_writes_partition_the_grid(units, shape, chunk, full.__getitem__)
  cover = np.zeros(shape, dtype=np.int32)
  for u in units:
    cover[tuple(slice(a, b) for a, b in u.index)] += 1
  assert np.all(cover == 1)


def test_the_mesh_model_is_jaxs():
  for mesh_shape, order, spec, shape in REAL_CASES:
    devices = None if order is None else [jax.devices()[i] for i in order]
    sharding = NamedSharding(_mesh(mesh_shape, devices=devices), spec)
    info = _layout.sharding_info(sharding)
    flat = list(sharding.mesh.devices.flat)
    model = _model_map(info.axis_sizes, info.dim_axes, shape)
    assert {flat[i]: idx for i, (idx, _) in model.items()} == _shards(sharding, shape)


@st.composite
def _simulated(draw):
  """A mesh of up to 4 axes and 512 devices (no devices needed), a spec over it, a shape it
  divides (sometimes large enough for replicated shards to be split), and processes: equal
  groups of the devices, in a random order."""
  sizes = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=1, max_size=4)))
  assume(math.prod(sizes) <= 512)
  free = list(range(len(sizes)))
  dim_axes = []
  for _ in range(draw(st.integers(0, 3))):
    axes = draw(st.permutations(free))[:draw(st.integers(0, min(2, len(free))))]
    free = [a for a in free if a not in axes]
    dim_axes.append(tuple(axes))
  shape = tuple(math.prod(sizes[a] for a in axes) * draw(st.sampled_from([0, 1, 2, 3, 2048]))
                for axes in dim_axes)
  shape += tuple(draw(st.lists(st.sampled_from([1, 5, 4096]), max_size=1)))
  n = math.prod(sizes)
  per = draw(st.sampled_from([d for d in (1, 2, 4, 8, n) if n % d == 0]))
  order = draw(st.permutations(range(n)))
  return sizes, tuple(dim_axes), shape, [order[i:i + per] for i in range(0, n, per)]


@settings(max_examples=100, deadline=None)
@given(_simulated(), st.sampled_from([1, 4]), st.integers(0, 1 << 20),
       st.sampled_from([(), (1, 1), (64, 16)]))
def test_property_simulated_meshes_every_process_and_every_chunk_once(case, itemsize, salt,
                                                                      split):
  sizes, dim_axes, shape, processes = case
  model = _model_map(sizes, dim_axes, shape)
  full = {d: idx for d, (idx, _) in model.items()}
  units = []
  for group in processes:
    info = _sim_info(sizes, dim_axes, sorted(group))
    for s in _layout.local_shards(info, shape):
      assert (s.index, s.replica) == model[s.device]
    _check_against_generic(info, full, shape, itemsize, salts=(salt,), split=split)
    units += _layout.local_writes(_layout.write_layout(info, shape, itemsize, *split), salt)
  layout = _layout.write_layout(_sim_info(sizes, dim_axes), shape, itemsize, *split)
  _assert_writes_partition_the_grid(units, shape, layout.chunk, full.__getitem__)
  # the pieces of one shard go to different replicas (never two to one, while k <= R)
  writers = {}
  for u in units:
    writers.setdefault(full[u.device], []).append(u.device)
  for devices in writers.values():
    assert len(set(devices)) == len(devices) or len(devices) > math.prod(sizes)


def _all_writes(sizes, dim_axes, shape, itemsize, salt, per_process):
  """Write units of every process of a simulated mesh (devices in flat order)."""
  n = math.prod(sizes)
  return [_layout.local_writes(_layout.write_layout(
      _sim_info(sizes, dim_axes, range(p, p + per_process)), shape, itemsize), salt)
      for p in range(0, n, per_process)]


def test_a_32_mib_shard_replicated_4096_ways_is_4_pieces_on_4_hosts():
  sizes, per = (512, 8), 8  # 4,096 devices on 512 hosts; P(): every device a replica
  plans = _all_writes(sizes, (), (8192, 1024), 4, salt=7, per_process=per)
  units = [u for plan in plans for u in plan]
  assert sorted(u.index for u in units) == [((a, a + 2048), (0, 1024))
                                            for a in range(0, 8192, 2048)]
  assert sum(1 for plan in plans if plan) == 4  # 4 pieces of 8 MiB, on 4 different hosts


def test_replicated_leaves_spread_over_processes():
  """Each of 256 small replicated leaves is written once; the salt (a leaf's index) spreads
  them over the 16 processes instead of giving them all to replica 0."""
  sizes, per = (16, 8), 8
  counts = np.zeros(16, int)
  for salt in range(256):
    plans = _all_writes(sizes, (), (64,), 4, salt=salt, per_process=per)
    assert sum(len(p) for p in plans) == 1
    counts += [len(p) for p in plans]
  assert counts.max() <= 2 * counts.mean() and (counts > 0).all()
  # and the pieces of partially replicated shards: P(None, "model") on (16, 8), 4 pieces each
  plans = _all_writes(sizes, ((), (1,)), (8192, 8 * 1024), 4, salt=0, per_process=per)
  assert [len(p) for p in plans] == [2] * 16  # 32 pieces of 8 MiB: 2 on every process


@pytest.mark.parametrize("spec, shape, match", [
    (P("a"), (5, 4), r"splits dimension 0 of shape \(5, 4\) into 2 parts, which do not divide 5"),
    (P(None, ("a", "b")), (2, 12), r"splits dimension 1 of shape \(2, 12\) into 8 parts"),
    (P("a", "b"), (4,), r"A PartitionSpec of 2 entries cannot shard an array of shape \(4,\)"),
])
def test_shardings_that_do_not_fit_the_shape_are_refused(spec, shape, match):
  sharding = NamedSharding(_mesh((2, 4)), spec)
  with pytest.raises(Exception):  # JAX refuses them too
    sharding.shard_shape(shape)
  for plan in (lambda: _layout.plan_write(sharding, shape, 4), lambda: _layout.plan_read(
      sharding, shape)):
    with pytest.raises(fnckpt.CheckpointError, match=match) as e:
      plan()
    assert "NamedSharding" in str(e.value)


def test_other_shardings_take_the_generic_path():
  sharding = SingleDeviceSharding(jax.devices()[3])
  assert _layout.sharding_info(sharding) is None
  chunk, units = _layout.plan_write(sharding, (6, 4), 4)
  assert chunk == (6, 4)
  assert [(u.index, u.device, u.local) for u in units] == [
      (((0, 6), (0, 4)), jax.devices()[3], ((0, 6), (0, 4)))]
  assert _layout.plan_read(sharding, (6, 4)) == {((0, 6), (0, 4)): [jax.devices()[3]]}


def test_plans_are_cached_per_sharding_shape_and_itemsize():
  sharding = NamedSharding(_mesh((2, 4)), P("a"))
  _layout.plan_write(sharding, (8, 8), 4)
  before = _layout._cached_write_layout.cache_info()
  same = NamedSharding(sharding.mesh, P("a"))  # an equal sharding shares the entry
  first = _layout.plan_write(same, (8, 8), 4, salt=1)
  after = _layout._cached_write_layout.cache_info()
  assert after.hits == before.hits + 1 and after.misses == before.misses
  assert after.maxsize == _layout.PLAN_CACHE_SIZE  # bounded
  assert _layout.plan_write(sharding, (8, 8), 4, salt=1) == first
  # read plans are new dicts: a caller may change one without touching the cache
  plan = _layout.plan_read(sharding, (8, 8))
  plan.clear()
  assert _layout.plan_read(sharding, (8, 8)) == _layout.read_plan(_shards(sharding, (8, 8)))


def test_sharding_info_rejects_inconsistent_records():
  with pytest.raises(ValueError, match="distinct"):
    _layout.ShardingInfo((2, 4), ((0,), (0,)))
  with pytest.raises(ValueError, match="do not place"):
    _layout.ShardingInfo((2, 4), ((0,),), devices=(0,), coords=((2, 0),))
