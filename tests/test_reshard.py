"""Resharding: save on one mesh / PartitionSpec, restore onto others (8 virtual CPU devices).
Every restored array must hold the source's values, each shard on the device and covering the
index that the target sharding says. And a restore reads each stored byte once: identical
slices once, overlapping slices' inner chunks once, and only the leaves asked for."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

import fnckpt

from tree_utils import CountIO, assert_placed, host

SHAPE = (16, 24)  # divisible by 2, 4, 8 (rows) and 2, 3, 4, 6, 8 (columns)


def mesh(shape, names, devices=None):
  n = int(np.prod(shape))
  devices = jax.devices()[:n] if devices is None else devices
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), names)


# name -> a function giving the sharding (built lazily, after conftest configured 8 devices)
SHARDINGS = {
    "2x4:xy": lambda: NamedSharding(mesh((2, 4), ("x", "y")), P("x", "y")),
    "2x4:yx": lambda: NamedSharding(mesh((2, 4), ("x", "y")), P("y", "x")),
    "2x4:x": lambda: NamedSharding(mesh((2, 4), ("x", "y")), P("x")),          # 4 replicas
    "2x4:-y": lambda: NamedSharding(mesh((2, 4), ("x", "y")), P(None, "y")),   # 2 replicas
    "2x4:(xy)": lambda: NamedSharding(mesh((2, 4), ("x", "y")), P(("x", "y"))),
    "2x4:replicated": lambda: NamedSharding(mesh((2, 4), ("x", "y")), P()),
    "4x2:xy": lambda: NamedSharding(mesh((4, 2), ("x", "y")), P("x", "y")),
    "4x2:y(x)": lambda: NamedSharding(mesh((4, 2), ("x", "y")), P("y", "x")),
    "8:x": lambda: NamedSharding(mesh((8,), ("x",)), P("x")),
    "8:-x": lambda: NamedSharding(mesh((8,), ("x",)), P(None, "x")),
    "8:x-reversed": lambda: NamedSharding(mesh((8,), ("x",), jax.devices()[::-1]), P("x")),
    "2x2x2:(xy)z": lambda: NamedSharding(mesh((2, 2, 2), ("x", "y", "z")), P(("x", "y"), "z")),
    "2x2x2:z(yx)": lambda: NamedSharding(mesh((2, 2, 2), ("x", "y", "z")), P("z", ("y", "x"))),
    "3:-x": lambda: NamedSharding(mesh((3,), ("x",)), P(None, "x")),          # 3 of 8 devices
    "3x2:yx": lambda: NamedSharding(mesh((3, 2), ("x", "y")), P("y", "x")),   # 6 of 8 devices
    "2x2@4-7:x": lambda: NamedSharding(mesh((2, 2), ("x", "y"), jax.devices()[4:]), P("x")),
    "1:replicated": lambda: NamedSharding(mesh((1,), ("x",), jax.devices()[3:4]), P()),
    "single-device": lambda: SingleDeviceSharding(jax.devices()[6]),
}

# (saved on, restored onto): the cases, then PartitionSpec changes, replication
# changes both ways, meshes of other sizes whose slices cut across the saved chunks.
RESHARDS = [
    ("2x4:xy", "4x2:xy"),
    ("2x4:xy", "4x2:y(x)"),
    ("8:x", "2x2x2:(xy)z"),
    ("8:-x", "2x2x2:z(yx)"),
    ("4x2:xy", "single-device"),
    ("4x2:xy", "1:replicated"),
    ("2x4:xy", "2x4:yx"),
    ("2x4:xy", "2x4:replicated"),
    ("2x4:replicated", "2x4:xy"),
    ("2x4:x", "2x4:-y"),
    ("2x4:-y", "8:x-reversed"),
    ("single-device", "2x4:(xy)"),
    ("2x4:xy", "3:-x"),
    ("2x4:(xy)", "3x2:yx"),
    ("8:x-reversed", "2x2@4-7:x"),
    ("2x2x2:(xy)z", "2x4:xy"),
    ("2x4:xy", "2x4:xy"),
]

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "int4", "int8", "uint32", "bool",
          "complex64"]


def source(dtype, shape=SHAPE) -> np.ndarray:
  dt = np.dtype(jnp.dtype(dtype))
  base = np.arange(int(np.prod(shape))).reshape(shape)
  if dt.kind == "b":
    return (base * 7) % 5 < 2
  if dt.kind == "c":
    return (base + 1j * (base % 7)).astype(dt)
  if dt == jnp.int4:
    return (base % 16 - 8).astype(dt)
  if "float8" in dt.name:
    return ((base % 13 - 6) * 0.5).astype(np.float32).astype(dt)
  return (base % 251).astype(dt)


def _save_restore(tmp_path, src_name, dst_name, x_host, *, inline=False, **restore_kw):
  src = SHARDINGS[src_name]()
  dst = SHARDINGS[dst_name]()
  x = jax.device_put(x_host, src)
  path = tmp_path / "c"
  fnckpt.save({"x": x}, path, inline_bytes=1 << 20 if inline else 0).wait()
  target = {"x": jax.ShapeDtypeStruct(x.shape, restore_kw.pop("dtype", x.dtype), sharding=dst)}
  return fnckpt.restore(path, target, **restore_kw)["x"], dst, path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("src, dst", RESHARDS, ids=[f"{a}->{b}" for a, b in RESHARDS])
def test_reshard(tmp_path, src, dst, dtype):
  x = source(dtype)
  got, sharding, path = _save_restore(tmp_path, src, dst, x)
  assert got.dtype == x.dtype and got.shape == x.shape
  assert_placed(got, sharding, x, "x")
  # the saved sharding is described without device ids
  saved = fnckpt.metadata(path).tree["x"].sharding
  if src == "single-device":
    assert saved.type == "single"
  else:
    assert saved.type == "named" and saved.spec == SHARDINGS[src]().spec
    assert saved.sizes == tuple(SHARDINGS[src]().mesh.shape.values())


@pytest.mark.parametrize("src, dst", RESHARDS[:8], ids=[f"{a}->{b}" for a, b in RESHARDS[:8]])
def test_reshard_inline(tmp_path, src, dst):
  x = source("float32")
  got, sharding, _ = _save_restore(tmp_path, src, dst, x, inline=True)
  assert_placed(got, sharding, x, "x")


@pytest.mark.parametrize("src, dst", [("2x4:xy", "4x2:y(x)"), ("8:x", "2x4:replicated"),
                                      ("2x4:replicated", "3x2:yx")])
def test_reshard_with_cast(tmp_path, src, dst):
  x = source("float32")
  got, sharding, _ = _save_restore(tmp_path, src, dst, x, dtype=jnp.bfloat16, cast=True)
  assert got.dtype == jnp.bfloat16
  assert_placed(got, sharding, x.astype(jnp.bfloat16), "x")


@pytest.mark.parametrize("src, dst", [("2x4:xy", "4x2:xy"), ("8:x", "2x2x2:z(yx)"),
                                      ("2x4:x", "single-device"), ("2x4:replicated", "3:-x")])
def test_reshard_prng_keys(tmp_path, src, dst):
  keys = jax.random.wrap_key_data(
      np.arange(SHAPE[0] * SHAPE[1] * 2, dtype=np.uint32).reshape(*SHAPE, 2))
  k = jax.device_put(keys, SHARDINGS[src]())
  fnckpt.save({"k": k}, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  sharding = SHARDINGS[dst]()
  got = fnckpt.restore(tmp_path / "c", {"k": jax.ShapeDtypeStruct(SHAPE, k.dtype,
                                                                  sharding=sharding)})["k"]
  assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
  assert_placed(got, sharding, host(keys), "k")


def test_numpy_saved_restores_sharded(tmp_path):
  x = source("int8")
  fnckpt.save({"x": x}, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  for name in ("2x4:xy", "3x2:yx", "single-device"):
    sharding = SHARDINGS[name]()
    got = fnckpt.restore(tmp_path / "c", {"x": jax.ShapeDtypeStruct(SHAPE, x.dtype,
                                                                    sharding=sharding)})["x"]
    assert_placed(got, sharding, x, name)


def test_prefix_tree_of_shardings(tmp_path):
  tree = {"params": {"w": jax.device_put(source("float32"), SHARDINGS["2x4:xy"]()),
                     "b": jax.device_put(source("bfloat16", (24,)), SHARDINGS["8:x"]())},
          "opt": {"mu": jax.device_put(source("float32"), SHARDINGS["2x4:x"]())},
          "step": 4}
  fnckpt.save(tree, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  replicated, rows = SHARDINGS["4x2:xy"](), SHARDINGS["2x4:(xy)"]()
  rep = NamedSharding(replicated.mesh, P())
  got = fnckpt.restore(tmp_path / "c", {"params": rep, "opt": rows})
  assert_placed(got["params"]["w"], rep, source("float32"), "w")
  assert_placed(got["params"]["b"], rep, source("bfloat16", (24,)), "b")
  assert_placed(got["opt"]["mu"], rows, source("float32"), "mu")
  assert got["step"] == 4
  # one sharding for everything
  one = SHARDINGS["single-device"]()
  got = fnckpt.restore(tmp_path / "c", one)
  assert_placed(got["opt"]["mu"], one, source("float32"), "mu")


def test_uneven_shardings_are_refused_by_jax_so_cannot_reach_fnckpt():
  """JAX (this version) rejects shardings that do not divide the array: fnckpt never sees an
  uneven shard. (The layout still handles the uneven *chunk* overlaps: see the 3- and 6-device
  meshes above, whose slices cut across the saved chunks.)"""
  with pytest.raises(ValueError, match="divi"):
    jax.device_put(np.zeros(10), NamedSharding(mesh((8,), ("x",)), P("x")))


# --- what a restore reads ----------------------------------------------------------------

def _stored_bytes(path, under=""):
  root = os.path.join(path, under)
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
             if f != "zarr.json")


@pytest.mark.parametrize("src, dst", [
    ("2x4:xy", "2x4:replicated"),   # 8 devices want the same slice: read once
    ("2x4:xy", "2x4:xy"),           # as saved
    ("2x4:xy", "4x2:y(x)"),         # slices overlap saved chunks partially, several times
    ("8:x", "2x2x2:z(yx)"),
    ("2x4:(xy)", "3x2:yx"),
    ("2x4:-y", "single-device"),
])
def test_each_stored_byte_is_read_once(tmp_path, src, dst):
  x = source("float32", (64, 96))
  fnckpt.save({"x": jax.device_put(x, SHARDINGS[src]())}, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  stored = _stored_bytes(tmp_path / "c")  # chunk files + manifest + COMMIT
  sharding = SHARDINGS[dst]()
  with CountIO() as io:
    got = fnckpt.restore(tmp_path / "c",
                         {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)})
  assert_placed(got["x"], sharding, x, "x")
  assert io["bytes_read"] == stored


@pytest.mark.parametrize("dst", ["2x4:x", "2x4:(xy)", "8:-x"])
def test_slices_sharing_a_chunk_file_read_it_in_one_request(tmp_path, dst):
  """A chunk file that several slices need (saved on one device, restored on 8) is read as
  one request, like a restore that reads it whole: not its index once per slice and each
  inner chunk alone (on an object store, each request is a GET)."""
  x = source("float32", (1024, 512))  # 2 MiB: one chunk of two 1 MiB inner chunks
  fnckpt.save({"x": jax.device_put(x, SHARDINGS["single-device"]())}, tmp_path / "c",
              inline_bytes=0, pack_bytes=0).wait()
  requests = {}
  for name in ("single-device", dst):
    with CountIO() as io:
      got = fnckpt.restore(tmp_path / "c", {"x": jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=SHARDINGS[name]())})
    assert_placed(got["x"], SHARDINGS[name](), x, name)
    requests[name] = io["read"]
  assert requests[dst] == requests["single-device"], requests


def test_identical_slices_are_read_once_even_one_read_at_a_time(tmp_path):
  x = source("float32", (64, 96))
  fnckpt.save({"x": jax.device_put(x, SHARDINGS["2x4:xy"]())}, tmp_path / "c",
              inline_bytes=0, pack_bytes=0).wait()
  stored = _stored_bytes(tmp_path / "c")
  # budget_bytes=1: one slice in flight at a time, so nothing is merged by TensorStore; the
  # read plan alone must make the 8 devices of a replicated target share one read
  sharding = SHARDINGS["2x4:replicated"]()
  with CountIO() as io:
    got = fnckpt.restore(tmp_path / "c",
                         {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)},
                         budget_bytes=1)
  assert_placed(got["x"], sharding, x, "x")
  assert io["bytes_read"] == stored


def test_a_partial_restore_reads_only_the_leaves_asked_for(tmp_path):
  tree = {"a": jax.device_put(source("float32", (64, 96)), SHARDINGS["2x4:xy"]()),
          "b": jax.device_put(source("int8", (64, 96)), SHARDINGS["8:x"]())}
  fnckpt.save(tree, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  meta = fnckpt.metadata(tmp_path / "c")
  recs = {r.path[0][1]: r for r in meta.leaves}
  data_dir = recs["b"].stored.dir.split("/")[0]
  header = _stored_bytes(tmp_path / "c") - _stored_bytes(tmp_path / "c", data_dir)
  sharding = SHARDINGS["4x2:xy"]()
  with CountIO() as io:
    got = fnckpt.restore(tmp_path / "c", {"b": jax.ShapeDtypeStruct((64, 96), jnp.int8,
                                                                    sharding=sharding)},
                         partial=True)
  assert_placed(got["b"], sharding, source("int8", (64, 96)), "b")
  assert io["bytes_read"] == header + _stored_bytes(tmp_path / "c", recs["b"].stored.dir)


@pytest.mark.parametrize("src", ["2x4:xy", "2x2x2:(xy)z", "2x2@4-7:x", "single-device"])
def test_saved_sharding_rebuilds_the_layout(tmp_path, src):
  """metadata(path).tree[...].sharding.to_sharding(): the saved mesh shape and spec on this
  job's devices (the first ones: device ids are not saved)."""
  x = source("float32")
  fnckpt.save({"x": jax.device_put(x, SHARDINGS[src]())}, tmp_path / "c", inline_bytes=0, pack_bytes=0).wait()
  sharding = fnckpt.metadata(tmp_path / "c").tree["x"].sharding.to_sharding()
  saved = SHARDINGS[src]()
  if src == "single-device":
    assert isinstance(sharding, SingleDeviceSharding)
  else:
    assert sharding.spec == saved.spec and sharding.mesh.shape == saved.mesh.shape
  got = fnckpt.restore(tmp_path / "c", {"x": jax.ShapeDtypeStruct(SHAPE, x.dtype,
                                                                  sharding=sharding)})
  assert_placed(got["x"], sharding, x, "x")


@pytest.mark.parametrize("budget", [1, 700, 5000])
def test_a_small_read_budget_gives_the_same_result(tmp_path, budget):
  x = source("float32", (64, 96))
  fnckpt.save({"x": jax.device_put(x, SHARDINGS["2x4:xy"]()), "y": x[:8]}, tmp_path / "c",
              inline_bytes=0, pack_bytes=0).wait()
  sharding = SHARDINGS["3x2:yx"]()
  got = fnckpt.restore(tmp_path / "c",
                       {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        "y": np.zeros((8, 96), np.float32)}, budget_bytes=budget)
  assert_placed(got["x"], sharding, x, "x")
  np.testing.assert_array_equal(got["y"], x[:8])


def _buffers(arr) -> dict:
  """Shard index -> the distinct device buffers holding it."""
  out: dict = {}
  for s in arr.addressable_shards:
    out.setdefault(str(s.index), set()).add(s.data.unsafe_buffer_pointer())
  return out


@pytest.mark.parametrize("how", ["stored", "pieces", "packed"])
def test_replicas_restored_on_cpu_share_one_buffer_and_donation_is_safe(tmp_path, how):
  """On CPU devices, the replicas of a restored slice are one host buffer (JAX adopts an
  aligned buffer instead of copying it): a replicated state takes its size in memory once,
  not once per device. Donating such an array in a jitted step must still compute right on
  every device."""
  x = source("float32", (64, 96))
  saving = {"stored": dict(inline_bytes=0, pack_bytes=0),
            "pieces": dict(inline_bytes=0, pack_bytes=4096),
            "packed": dict(inline_bytes=0, pack_bytes=1 << 20)}[how]
  fnckpt.save({"x": jax.device_put(x, SHARDINGS["2x4:xy"]())}, tmp_path / "c", **saving).wait()
  stored = fnckpt.metadata(tmp_path / "c").tree["x"].stored
  assert {"stored": stored.startswith("d"), "pieces": stored == "pieces",
          "packed": stored.startswith("pack")}[how], stored
  got = {}
  # (2x3:-y: 2 replicas of column slices of 32 that cut the saved 24-column chunks: read
  # through the batch, then shared)
  shardings = dict(SHARDINGS, **{"2x3:-y": lambda: NamedSharding(
      mesh((2, 3), ("x", "y")), P(None, "y"))})
  for key, name in (("a", "2x4:replicated"), ("b", "2x4:-y"), ("c", "2x3:-y")):
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[name]())}
    got[key] = fnckpt.restore(tmp_path / "c", target)["x"]
    assert_placed(got[key], shardings[name](), x, key)
    if how != "packed" or name.endswith("replicated"):  # (a packed leaf: when replicated)
      shared = {k: len(v) for k, v in _buffers(got[key]).items()}
      assert set(shared.values()) == {1}, f"{key} ({how}): buffers per distinct slice {shared}"
  step = jax.jit(lambda v: v * 2 + 1, donate_argnums=0)
  a, b = got["a"], got["b"]
  for _ in range(3):
    a, b = step(a), step(b)
  want = ((x * 2 + 1) * 2 + 1) * 2 + 1
  assert_placed(a, SHARDINGS["2x4:replicated"](), want, "a stepped")
  assert_placed(b, SHARDINGS["2x4:-y"](), want, "b stepped")
  # Deterministic: each device writes its own values from the donated shared replicas; were
  # they written into the one shared buffer, the devices would end up with the same values.
  m = SHARDINGS["2x4:replicated"]().mesh
  own = jax.jit(jax.shard_map(
      lambda v: v + (jax.lax.axis_index("x") * 4 + jax.lax.axis_index("y")).astype(v.dtype),
      mesh=m, in_specs=P(), out_specs=P(("x", "y"))), donate_argnums=0)
  again = fnckpt.restore(tmp_path / "c", {"x": jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=SHARDINGS["2x4:replicated"]())})["x"]
  out = np.asarray(own(again)).reshape((8,) + x.shape)
  for k in range(8):
    np.testing.assert_array_equal(out[k], x + k, err_msg=f"device block {k}")


@pytest.mark.parametrize("dst", ["2x4:xy", "4x2:y(x)"])
def test_a_restore_leaves_no_garbage_cycle_holding_what_it_read(tmp_path, dst):
  """Restore makes no reference cycle: the arrays it read are freed as soon as the result is
  dropped, not at some later garbage collection (a cycle through its placer kept them all,
  and each restore in a loop then took fresh memory)."""
  import gc
  x = source("float32", (2048, 2048))   # 2 MiB shards: a zarr array; 1 MiB: pieces
  fnckpt.save({"stored": jax.device_put(x, SHARDINGS["2x4:xy"]()),
               "pieces": jax.device_put(x[:1024], SHARDINGS["2x4:xy"]()),
               "packed": x[:16], "inline": x[0, :4]}, tmp_path / "c", inline_bytes=64).wait()
  stored = {"stored": "d", "pieces": "pieces", "packed": "pack", "inline": "inline"}
  meta = fnckpt.metadata(tmp_path / "c").tree
  assert all(meta[k].stored.startswith(v) for k, v in stored.items()), meta
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=SHARDINGS[
      dst if k in ("stored", "pieces") else "2x4:replicated"]()) for k, v in meta.items()}
  fnckpt.restore(tmp_path / "c", target)  # (first calls: JAX's caches)
  gc.collect()
  gc.disable()
  try:
    got = fnckpt.restore(tmp_path / "c", target)
    assert_placed(got["stored"], SHARDINGS[dst](), x, "stored")
    del got
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    kept = {type(o).__qualname__ for o in gc.garbage  # (JAX's own cycles are no concern)
            if isinstance(o, (np.ndarray, jax.Array)) or type(o).__module__.startswith("fnckpt")}
    assert not kept, kept
  finally:
    gc.set_debug(0)
    gc.garbage.clear()
    gc.enable()
