"""Every kind of leaf a training state holds, saved and restored: jax.Arrays of every dtype
under every kind of sharding, 0-d and empty arrays, numpy arrays and scalars, Python scalars
and strings, None and empty containers, PRNG keys, optax / flax / nnx states, data-loader and
numpy RNG state; restored without a target (host values) and into full targets.

What ``restore(path)`` (no target) gives back, which these tests pin down:
  - every jax or numpy array -> a writable ``np.ndarray`` of the saved dtype and shape;
  - a typed PRNG key array -> a typed key array (same impl) on the default device;
  - numpy scalars -> numpy scalars; Python bool/int/float/complex/str/bytes -> the same type
    (int subclasses such as IntEnum -> int); ints beyond 64 bits -> int;
  - None and empty dicts/lists/tuples -> themselves (a NamedTuple with no fields, such as
    optax's EmptyState -> ());
  - containers -> dicts (dict keys, dataclass / namedtuple / flax struct fields) and lists
    (lists, tuples, custom nodes without keys);
  - a numpy Generator -> a numpy Generator in the same state.
With a target, the target's containers and classes come back, arrays placed as it says.
"""

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import fnckpt

from tree_utils import assert_leaf_equal, assert_placed, assert_trees_all_equal, host

SHAPE = (8, 16)

# The dtypes of the issue, then JAX dtypes zarr3 has no name for (stored as their bits).
DTYPES = ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "int8",
          "uint32", "bool", "complex64", "int2", "float4_e2m1fn", "uint4", "uint2",
          "float8_e4m3"]


def mesh24():
  return jax.make_mesh((2, 4), ("a", "b"))


SHARDINGS = {
    "fully-sharded": lambda: NamedSharding(mesh24(), P("a", "b")),
    "partially-replicated": lambda: NamedSharding(mesh24(), P(None, "b")),
    "replicated": lambda: NamedSharding(mesh24(), P()),
    "single-device": lambda: SingleDeviceSharding(jax.devices()[5]),
}


def values(dtype, shape=SHAPE) -> np.ndarray:
  """Distinct-ish values that ``dtype`` represents exactly."""
  dt = np.dtype(jnp.dtype(dtype))
  base = np.arange(math.prod(shape)).reshape(shape)
  if dt.kind == "b":
    return base % 3 == 0
  if dt.kind == "c":
    return (base - 3 + 1j * (base % 5)).astype(dt)
  if "float" in dt.name:
    return ((base % 7 - 3) * 0.5).astype(np.float32).astype(dt)
  info = ml_dtypes.iinfo(dt) if dt.kind == "V" else np.iinfo(dt)
  span = int(info.max) - int(info.min) + 1
  return (base % min(span, 1 << 16) + int(info.min)).astype(dt)


def _saved(tmp_path, tree, name="c", **kw):
  path = tmp_path / name
  fnckpt.save(tree, path, **kw).wait()
  return path


# --- arrays: every dtype x every sharding, inline and in their own zarr3 arrays ----------

@pytest.mark.parametrize("stored", ["zarr", "inline"])
@pytest.mark.parametrize("sharding", list(SHARDINGS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_array_round_trip(tmp_path, dtype, sharding, stored):
  src = values(dtype)
  s = SHARDINGS[sharding]()
  x = jax.device_put(src, s)
  assert x.dtype == src.dtype
  path = _saved(tmp_path, {"x": x}, inline_bytes=0 if stored == "zarr" else 1 << 20)

  meta = fnckpt.metadata(path).tree["x"]
  assert (meta.shape, meta.dtype, meta.impl) == (SHAPE, src.dtype, None)
  assert (meta.stored == "inline") == (stored == "inline")
  if sharding == "single-device":
    assert meta.sharding.type == "single"
  else:
    assert (meta.sharding.type, meta.sharding.axes, meta.sharding.sizes) == (
        "named", ("a", "b"), (2, 4))
    assert meta.sharding.spec == s.spec

  # no target: a host numpy array
  back = fnckpt.restore(path)["x"]
  assert type(back) is np.ndarray and back.flags.writeable
  assert_leaf_equal(back, src, "x")
  # the array itself as target: same sharding, each shard in place
  assert_placed(fnckpt.restore(path, {"x": x})["x"], s, src, "x")
  # a ShapeDtypeStruct with another sharding
  other = NamedSharding(jax.make_mesh((4, 2), ("p", "q")), P("q", "p"))
  got = fnckpt.restore(path, {"x": jax.ShapeDtypeStruct(SHAPE, x.dtype, sharding=other)})["x"]
  assert got.dtype == src.dtype
  assert_placed(got, other, src, "x")
  # a numpy target: numpy back
  np_back = fnckpt.restore(path, {"x": np.zeros(SHAPE, src.dtype)})["x"]
  assert type(np_back) is np.ndarray
  assert_leaf_equal(np_back, src, "x")


@pytest.mark.parametrize("stored", ["zarr", "inline"])
def test_int64_numpy_and_x64_jax_arrays(tmp_path, stored):
  kw = {"inline_bytes": 0 if stored == "zarr" else 1 << 20}
  big = np.array([[-(1 << 62), 1 << 62, -1, 0]] * 2, dtype=np.int64)
  with jax.enable_x64(True):
    x = jax.device_put(big, NamedSharding(mesh24(), P("a", "b")))
    assert x.dtype == np.int64
    path = _saved(tmp_path, {"np": big, "u64": big.view(np.uint64), "jax": x}, **kw)
    got = fnckpt.restore(path, {"np": big, "u64": big.view(np.uint64), "jax": x})
    assert_placed(got["jax"], x.sharding, big, "jax")
  assert_leaf_equal(got["np"], big, "np")
  assert_leaf_equal(got["u64"], big.view(np.uint64), "u64")
  back = fnckpt.restore(path)  # no target: numpy int64 even with x64 off
  assert_leaf_equal(back["jax"], big, "jax")
  assert_leaf_equal(back["np"], big, "np")


@pytest.mark.parametrize("stored", ["zarr", "inline"])
def test_zero_d_and_empty_arrays(tmp_path, stored):
  mesh = mesh24()
  tree = {
      "jax0": jax.device_put(jnp.float32(2.5), NamedSharding(mesh, P())),
      "jax0_single": jnp.int32(-7),
      "np0": np.array(3, np.int8),
      "empty": jax.device_put(jnp.zeros((0, 8), jnp.bfloat16), NamedSharding(mesh, P(None, "b"))),
      "np_empty": np.zeros((3, 0), np.float32),
  }
  path = _saved(tmp_path, tree, inline_bytes=0 if stored == "zarr" else 1 << 20)
  back = fnckpt.restore(path)
  for k, v in tree.items():
    assert type(back[k]) is np.ndarray, k
    assert_leaf_equal(back[k], np.asarray(v), k)
  got = fnckpt.restore(path, tree)
  assert_placed(got["jax0"], tree["jax0"].sharding, np.float32(2.5), "jax0")
  assert_placed(got["empty"], tree["empty"].sharding, np.zeros((0, 8), jnp.bfloat16), "empty")
  assert_trees_all_equal(got, tree)


def test_numpy_arrays_keep_their_values_whatever_their_layout(tmp_path):
  base = np.arange(6000, dtype=np.float32).reshape(60, 100)
  tree = {"fortran": np.asfortranarray(base), "strided": base[::2, ::3],
          "big_endian": base.astype(">f4"), "small_big_endian": np.array([1, 2], ">i4"),
          "bf16": base.astype(jnp.bfloat16), "int4": (np.arange(10) % 8).astype(jnp.int4)}
  path = _saved(tmp_path, tree)
  back = fnckpt.restore(path)
  for k, v in tree.items():
    np.testing.assert_array_equal(back[k], v, err_msg=k)
    assert back[k].dtype == v.dtype.newbyteorder("="), k
    assert back[k].flags.writeable, k


# --- scalars, strings, None, empty containers -------------------------------------------

class Color(enum.IntEnum):
  RED = 2


SCALARS = {
    "int": 3, "neg": -(1 << 63), "u64": (1 << 64) - 1, "bigint": 1 << 100, "negbig": -(1 << 80),
    "float": 0.1, "inf": float("inf"), "bool": True, "complex": 1 - 2j, "str": "héllo",
    "bytes": b"\x00\xff", "none": None, "dict": {}, "list": [], "tuple": (),
    "np_f32": np.float32(1.5), "np_i8": np.int8(-3), "np_bool": np.bool_(False),
    "np_u64": np.uint64(1 << 63), "np_c64": np.complex64(1j), "np_bf16": jnp.bfloat16(0.5),
}


def test_scalars_strings_none_and_empty_containers(tmp_path):
  path = _saved(tmp_path, SCALARS)
  for target in (None, SCALARS):
    back = fnckpt.restore(path, target)
    assert_trees_all_equal(back, SCALARS)
  recs = {r.path[0][1]: r for r in fnckpt.metadata(path).leaves}
  assert recs["bigint"].kind == recs["negbig"].kind == "bigint"
  assert recs["u64"].kind == "scalar"
  assert recs["np_f32"].kind == "npscalar"
  assert {recs[k].kind for k in ("none", "dict", "list", "tuple")} == {"empty"}
  # restored without a target, the metadata tree shows the values themselves
  assert fnckpt.metadata(path).tree["str"] == "héllo"


def test_int_subclasses_come_back_as_int(tmp_path):
  path = _saved(tmp_path, {"c": Color.RED, "nan": float("nan")})
  back = fnckpt.restore(path)
  assert back["c"] == 2 and type(back["c"]) is int
  assert math.isnan(back["nan"])


def test_root_leaves(tmp_path):
  for i, tree in enumerate([5, None, [], "s", np.arange(3)]):
    path = _saved(tmp_path, tree, name=f"r{i}")
    assert_trees_all_equal(fnckpt.restore(path), tree)
    assert_trees_all_equal(fnckpt.restore(path, tree), tree)


def test_nested_empty_containers_keep_their_place(tmp_path):
  tree = {"a": [{}, [None, ()], {"b": []}], "c": ({}, 1)}
  path = _saved(tmp_path, tree)
  assert_trees_all_equal(fnckpt.restore(path, tree), tree)
  # without a target tuples become lists; the empty ones are kept as saved
  assert fnckpt.restore(path) == {"a": [{}, [None, ()], {"b": []}], "c": [{}, 1]}


# --- PRNG keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("stored", ["zarr", "inline"])
def test_typed_prng_keys(tmp_path, impl, stored):
  mesh = mesh24()
  key = jax.random.key(42, impl=impl)
  keys = jax.device_put(jax.random.split(key, 8), NamedSharding(mesh, P(("a", "b"))))
  grid = jax.device_put(jax.random.split(key, (2, 4)), NamedSharding(mesh, P("a", "b")))
  tree = {"key": key, "keys": keys, "grid": grid}
  path = _saved(tmp_path, tree, inline_bytes=0 if stored == "zarr" else 1 << 20)
  meta = fnckpt.metadata(path).tree
  assert meta["keys"].impl == impl and meta["keys"].key_shape == (8,)
  assert meta["keys"].dtype == np.uint32

  back = fnckpt.restore(path)  # typed keys come back as typed keys
  assert_trees_all_equal(back, tree)
  got = fnckpt.restore(path, tree)
  assert_trees_all_equal(got, tree)
  assert_placed(got["keys"], keys.sharding, host(keys), "keys")
  assert_placed(got["grid"], grid.sharding, host(grid), "grid")
  # onto another mesh, via ShapeDtypeStructs of key dtype
  mesh42 = jax.make_mesh((4, 2), ("p", "q"))
  other, other2 = NamedSharding(mesh42, P("p")), NamedSharding(mesh42, P("q", "p"))
  target = {"key": jax.ShapeDtypeStruct((), key.dtype),
            "keys": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=other),
            "grid": jax.ShapeDtypeStruct((2, 4), grid.dtype, sharding=other2)}
  got = fnckpt.restore(path, target)
  assert_placed(got["keys"], other, host(keys), "keys")
  assert_placed(got["grid"], other2, host(grid), "grid")
  # the restored key draws the same numbers
  assert jax.random.uniform(got["key"]) == jax.random.uniform(key)


def test_raw_uint32_prng_keys_are_plain_arrays(tmp_path):
  raw = jax.random.PRNGKey(7)
  path = _saved(tmp_path, {"rng": raw})
  assert fnckpt.metadata(path).tree["rng"].impl is None
  back = fnckpt.restore(path)["rng"]
  assert back.dtype == np.uint32
  np.testing.assert_array_equal(back, raw)
  got = fnckpt.restore(path, {"rng": raw})["rng"]
  np.testing.assert_array_equal(jax.random.normal(got, (3,)), jax.random.normal(raw, (3,)))


# --- optax, flax, nnx --------------------------------------------------------------------

def _params():
  # numpy-made: eager jax.random ops would compile for seconds
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
  return {"dense": {"kernel": normal(64, 80), "bias": jnp.asarray(np.zeros(80, np.float32))},
          "out": {"kernel": normal(80, 3)}}


def _stepped_adam(opt_state, params):
  """The adamw state after a step (made directly, not by a slow eager tx.update)."""
  adam = opt_state[0]._replace(
      count=jnp.asarray(np.int32(1)),
      mu=jax.tree.map(lambda p: jnp.asarray(np.full(p.shape, 0.1, np.float32)), params),
      nu=jax.tree.map(lambda p: jnp.asarray(np.full(p.shape, 0.01, np.float32)), params))
  return (adam, *opt_state[1:])


def test_optax_adamw_state(tmp_path):
  params = _params()
  tx = optax.adamw(1e-3)
  opt_state = _stepped_adam(tx.init(params), params)
  path = _saved(tmp_path, {"params": params, "opt": opt_state}, inline_bytes=1024)

  got = fnckpt.restore(path, {"params": params, "opt": opt_state})
  assert_trees_all_equal(got, {"params": params, "opt": opt_state})
  assert type(got["opt"][0]).__name__ == "ScaleByAdamState"
  assert isinstance(got["opt"][1], optax.EmptyState)
  # an abstract target works too
  abstract = jax.eval_shape(lambda: {"params": params, "opt": tx.init(params)})
  got = fnckpt.restore(path, abstract)
  assert_trees_all_equal(got, {"params": params, "opt": opt_state})
  # no target: plain containers (a namedtuple's fields become a dict, EmptyState -> ())
  back = fnckpt.restore(path)
  assert back["opt"][0]["count"] == 1 and back["opt"][1] == ()
  np.testing.assert_array_equal(back["opt"][0]["mu"]["dense"]["kernel"],
                                opt_state[0].mu["dense"]["kernel"])


def _flax_state():
  import flax.linen as nn

  model = nn.Dense(80)
  params = _params()["dense"]
  tx = optax.adamw(1e-3)

  def init():  # what model.init(...) then TrainState.create(...) give, without compiling
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  return init


def test_flax_train_state(tmp_path):
  init = _flax_state()
  state = init()
  assert type(state.step) is int  # TrainState.create starts from a Python int
  path = _saved(tmp_path, state)
  got = fnckpt.restore(path, state)
  assert type(got) is train_state.TrainState
  assert got.apply_fn is state.apply_fn and got.tx is state.tx
  assert_trees_all_equal(got, state)
  # into jax.eval_shape(init): step is a 0-d int32 array there
  abstract = jax.eval_shape(init)
  got = fnckpt.restore(path, abstract)
  assert isinstance(got.step, jax.Array) and got.step.dtype == jnp.int32 and got.step == 0
  assert_trees_all_equal(got.params, state.params)
  # after a jitted step, step is a 0-d array; restoring it into the Python-int target works
  stepped = state.replace(step=jnp.asarray(np.int32(1)),
                          opt_state=_stepped_adam(state.opt_state, state.params))
  path2 = _saved(tmp_path, stepped, name="stepped")
  got = fnckpt.restore(path2, state)
  assert got.step == 1 and type(got.step) is int
  got = fnckpt.restore(path2, abstract)
  assert_trees_all_equal((got.step, got.params, got.opt_state),
                         (stepped.step, stepped.params, stepped.opt_state))


class _Model(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(64, 80, rngs=rngs)
    self.bn = nnx.BatchNorm(80, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.count = nnx.Variable(jnp.array(1))


def test_nnx_state(tmp_path):
  model = _Model(nnx.Rngs(0, dropout=1))
  state = nnx.state(model)
  path = _saved(tmp_path, state, inline_bytes=1024)

  # into the abstract state of an abstract model, then nnx.update
  abstract_model = nnx.eval_shape(lambda: _Model(nnx.Rngs(0, dropout=1)))
  abstract_state = nnx.state(abstract_model)
  restored = fnckpt.restore(path, abstract_state)
  assert type(restored) is type(state)
  assert_trees_all_equal(restored, state)
  nnx.update(abstract_model, restored)
  assert_trees_all_equal(nnx.state(abstract_model), state)
  x = jnp.ones((2, 64))
  abstract_model.eval()
  model.eval()
  np.testing.assert_array_equal(abstract_model.linear(x), model.linear(x))

  # the state itself as target, into a differently initialised model
  other = _Model(nnx.Rngs(5, dropout=6))
  nnx.update(other, fnckpt.restore(path, nnx.state(other)))
  assert_trees_all_equal(nnx.state(other), state)

  # onto a mesh: one sharding for the whole state (a prefix of it)
  replicated = NamedSharding(mesh24(), P())
  on_mesh = fnckpt.restore(path, replicated)
  w = on_mesh["linear"]["kernel"]["value"]
  assert_placed(w, replicated, host(state["linear"]["kernel"][...]), "kernel")


# --- small msgpack-able values: data-loader position, numpy RNG --------------------------

def test_data_loader_position_and_numpy_rng(tmp_path):
  gen = np.random.default_rng(1234)
  gen.random(5)
  loader = {"epoch": 3, "index": 1 << 40, "files": ["a.tfrecord", "b.tfrecord"],
            "shuffle_seed": 7, "done": False, "weights": [0.5, 0.25]}
  tree = {"loader": loader, "gen": gen, "gen_state": gen.bit_generator.state,
          "legacy": np.random.RandomState(3).get_state(legacy=False)}
  path = _saved(tmp_path, tree)

  state = gen.bit_generator.state
  recs = {tuple(e[1] for e in r.path): r for r in fnckpt.metadata(path).leaves}
  assert recs[("gen",)].kind == "npgen"
  # the 128-bit PCG64 state: each int is a leaf of its own, stored as a 'bigint'
  assert recs[("gen_state", "state", "state")].kind == "bigint"
  assert state["state"]["state"] >= 1 << 64 or state["state"]["inc"] >= 1 << 64

  for target in (None, tree):
    back = fnckpt.restore(path, target)
    assert back["loader"] == loader
    assert back["gen_state"] == state
    assert back["gen"].bit_generator.state == state
    # the restored generator continues the same stream
    assert back["gen"].random() == _with_state(state).random()
    np.testing.assert_array_equal(back["legacy"]["state"]["key"],
                                  tree["legacy"]["state"]["key"])
    g = np.random.default_rng()
    g.bit_generator.state = back["gen_state"]
    assert g.random() == _with_state(state).random()


def _with_state(state):
  bitgen = getattr(np.random, state["bit_generator"])()
  bitgen.state = state
  return np.random.Generator(bitgen)


def test_user_metadata_round_trip(tmp_path):
  meta = {"step": 10, "config": {"lr": 0.1, "layers": [1, 2]}, "note": None}
  path = _saved(tmp_path, {"x": 1}, metadata=meta)
  assert fnckpt.metadata(path).user_metadata == meta


# --- a whole training state at once ------------------------------------------------------

@dataclasses.dataclass
class _Loop:
  step: int
  loss: float


jax.tree_util.register_dataclass(_Loop, data_fields=["step", "loss"], meta_fields=[])


def test_a_whole_training_state(tmp_path):
  mesh = mesh24()
  params = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("b"))), _params())
  tx = optax.adamw(1e-3)
  tree = {"params": params, "opt": tx.init(params), "rng": jax.random.key(0),
          "loop": _Loop(5, 0.25), "data": {"pos": 17}, "np_rng": np.random.default_rng(0),
          "tags": ("train", None), "ema": None}
  path = _saved(tmp_path, tree, inline_bytes=4096)
  got = fnckpt.restore(path, tree)
  assert_trees_all_equal(got, tree)
  assert isinstance(got["loop"], _Loop)
  for k in ("dense", "out"):
    w = got["params"][k]["kernel"]
    assert_placed(w, params[k]["kernel"].sharding, host(params[k]["kernel"]), k)
  back = fnckpt.restore(path)
  assert back["loop"] == {"step": 5, "loss": 0.25}
  assert back["tags"] == ["train", None]
