"""Plans made once per structure (``fnckpt._save.plan_cache``): a save of a tree whose
structure, shapes, dtypes, shardings and options equal an earlier save's reuses its plan, and
anything different makes a new one. Each case checks the reuse (or not) through the cache's
counters, and that every checkpoint restores bitwise, with and without a target."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tree_utils import assert_trees_all_equal

import fnckpt
from fnckpt import _state


@pytest.fixture(autouse=True)
def _fresh_plans():
  _state.plans.clear()
  yield
  _state.plans.clear()


def _mesh(order=None):
  devices = np.array(jax.devices()[:8] if order is None else [jax.devices()[i] for i in order])
  return jax.sharding.Mesh(devices.reshape(2, 4), ("data", "model"))


def _on(x, mesh, spec, memory_kind=None):
  return jax.device_put(x, NamedSharding(mesh, spec, memory_kind=memory_kind))


def _state_tree(seed: int, mesh=None):
  """Every kind of leaf a loop saves: sharded (stored, packed, pieced), replicated, inline,
  a typed key, numpy, Python scalars, None."""
  mesh = mesh if mesh is not None else _mesh()
  r = np.random.default_rng(seed)
  return {
    "w": _on(r.standard_normal((512, 256), np.float32), mesh, P("data", "model")),
    "b": _on(r.standard_normal((4096,), np.float32), mesh, P()),
    "small": _on(r.standard_normal((64, 32), np.float32), mesh, P("model", None)),
    "tiny": _on(jnp.float32(seed), mesh, P()),
    "key": jax.random.key(seed),
    "host": r.integers(0, 1 << 20, (300,), np.int64),
    "step": seed,
    "lr": 0.5 * seed,
    "none": None,
  }


def _save(tree, path, **kw):
  fnckpt.save(tree, path, **kw).wait()


def _check(path, tree):
  """The checkpoint at ``path`` holds ``tree``: onto its shardings, and without a target."""
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.Array)
    else x,
    tree,
  )
  got = fnckpt.restore(path, target)
  assert_trees_all_equal(got, tree, check_dtype=False)  # (byte order: below)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
    if isinstance(b, jax.Array):
      assert a.sharding == b.sharding
  plain = fnckpt.restore(path)  # (numpy arrays come back in native byte order)
  native = jax.tree.map(
    lambda x: x.astype(x.dtype.newbyteorder("=")) if isinstance(x, np.ndarray) else x, tree
  )
  assert_trees_all_equal(plain, native)


def _counts(kind="saves"):
  return _state.plans.hits[kind], _state.plans.misses[kind]


def test_a_loop_plans_once_and_every_step_restores_bitwise(tmp_path):
  for step in range(4):
    tree = _state_tree(step)
    _save(tree, str(tmp_path / f"s{step}"))
    _check(str(tmp_path / f"s{step}"), tree)
  assert _counts() == (3, 1)  # the first save planned; the three after reused its plan


def _change(kind: str, tree: dict) -> dict:
  mesh = _mesh()
  t = dict(tree)
  if kind == "spec":
    t["w"] = _on(np.asarray(t["w"]), mesh, P("model", "data"))
  elif kind == "dtype":
    t["b"] = t["b"].astype(jnp.bfloat16)
  elif kind == "shape":
    t["small"] = _on(np.zeros((64, 16), np.float32), mesh, P("model", None))
  elif kind == "new leaf":
    t["extra"] = _on(np.arange(1024, dtype=np.float32), mesh, P("data"))
  elif kind == "leaf gone":
    del t["small"]
  elif kind == "device order":
    t = _state_tree(7, _mesh(order=[1, 0, 3, 2, 5, 4, 7, 6]))
  elif kind == "memory kind":
    t["b"] = _on(np.asarray(t["b"]), mesh, P(), memory_kind="pinned_host")
  elif kind == "numpy byte order":
    t["host"] = t["host"].astype(">i8")
  elif kind == "key type":  # True == 1 as a dict key: another leaf all the same
    t = {**{k: v for k, v in t.items() if k != "step"}, "n": {1: tree["step"]}}
    return t
  elif kind == "scalar type":
    t["lr"] = np.float32(t["lr"])
  elif kind == "big int":
    t["step"] = 1 << 70
  elif kind == "array to scalar":
    t["tiny"] = 3.0
  else:
    raise AssertionError(kind)
  return t


CHANGES = [
  "spec",
  "dtype",
  "shape",
  "new leaf",
  "leaf gone",
  "device order",
  "memory kind",
  "numpy byte order",
  "key type",
  "scalar type",
  "big int",
  "array to scalar",
]


@pytest.mark.parametrize("kind", CHANGES)
def test_a_change_makes_a_new_plan_and_the_checkpoint_is_right(tmp_path, kind):
  before = _state_tree(1)
  _save(before, str(tmp_path / "a"))
  after = _change(kind, _state_tree(2))
  _save(after, str(tmp_path / "b"))
  hits, misses = _counts()
  if kind == "big int":  # a value, not the structure: the same plan, the record made anew
    assert (hits, misses) == (1, 1)
  else:
    assert (hits, misses) == (0, 2), kind
  _check(str(tmp_path / "b"), after)
  again = _change(kind, _state_tree(3))  # the changed structure's own plan, reused
  _save(again, str(tmp_path / "c"))
  assert _counts()[0] == hits + 1
  _check(str(tmp_path / "c"), again)
  _check(str(tmp_path / "a"), before)


def test_a_key_refused_is_refused_under_a_reused_plan_too(tmp_path):
  _save({"n": {1: np.arange(3)}}, str(tmp_path / "a"))
  with pytest.raises(fnckpt.CheckpointError, match=r"Unsupported dict key True \(type bool\)"):
    fnckpt.save({"n": {True: np.arange(3)}}, str(tmp_path / "b"))


def test_other_options_or_a_base_plan_anew(tmp_path):
  tree = _state_tree(1)
  _save(tree, str(tmp_path / "a"))
  _save(tree, str(tmp_path / "b"), inline_bytes=0)
  _save(tree, str(tmp_path / "c"), compression="zstd")
  assert _counts() == (0, 3)
  nxt = _state_tree(2)
  _save(nxt, str(tmp_path / "d"), base=str(tmp_path / "a"))  # planned with its base
  assert _counts() == (0, 3)
  for p, t in (("b", tree), ("c", tree), ("d", nxt)):
    _check(str(tmp_path / p), t)


def test_a_deleted_array_is_refused_under_a_reused_plan(tmp_path):
  _save(_state_tree(1), str(tmp_path / "a"))
  tree = _state_tree(2)
  tree["w"].delete()
  with pytest.raises(fnckpt.CheckpointError, match=r"\['w'\] was deleted \(or donated\)"):
    fnckpt.save(tree, str(tmp_path / "b"))
  assert _counts() == (1, 1)
  assert not (tmp_path / "b" / "COMMITTED").exists()


def test_a_per_process_value_no_reader_accepts_is_refused_under_a_reused_plan(tmp_path):
  _save({"x": np.zeros(4), "pp": fnckpt.PerProcess({"epoch": 1})}, str(tmp_path / "a"))
  bad = fnckpt.PerProcess({"epoch": fnckpt.PerProcess(2)})
  with pytest.raises(fnckpt.CheckpointError, match=r"is inside another PerProcess"):
    fnckpt.save({"x": np.zeros(4), "pp": bad}, str(tmp_path / "b"))
  assert _counts() == (1, 1)
  good = {"x": np.ones(4), "pp": fnckpt.PerProcess({"epoch": 3})}
  _save(good, str(tmp_path / "c"))
  got = fnckpt.restore(str(tmp_path / "c"), {"x": np.zeros(4), "pp": fnckpt.PerProcess(None)})
  assert got["pp"].value == {"epoch": 3} and float(got["x"][0]) == 1.0


def test_the_cache_holds_no_array_and_is_bounded(tmp_path):
  tree = _state_tree(1)
  ref = weakref.ref(tree["w"])
  _save(tree, str(tmp_path / "a"))
  del tree
  gc.collect()
  assert ref() is None  # the plan kept for it does not keep the first save's arrays
  for n in range(_state.MAX_PLANS + 3):
    _save({"x": np.zeros(n + 1)}, str(tmp_path / f"n{n}"))
  assert len(_state.plans.saves) == _state.MAX_PLANS


def test_values_changed_in_place_under_a_reused_plan_are_the_ones_saved(tmp_path):
  host = np.zeros(1000, np.float32)
  for k in range(3):
    host[:] = k
    tree = {"h": host, "x": _on(np.full(4096, k, np.float32), _mesh(), P("data"))}
    _save(tree, str(tmp_path / f"s{k}"))
  for k in range(3):
    got = fnckpt.restore(str(tmp_path / f"s{k}"))
    assert float(got["h"][0]) == k and float(np.asarray(got["x"])[0]) == k


_LEAVES = {
  "w": lambda r, m: _on(r.standard_normal((256, 64), np.float32), m, P("data", "model")),
  "v": lambda r, m: _on(r.standard_normal((256, 64), np.float32), m, P("model", None)),
  "p": lambda r, m: _on(r.standard_normal((32, 8), np.float32), m, P("data")),
  "r": lambda r, m: _on(r.standard_normal((2048,), np.float32), m, P()),
  "i": lambda r, m: _on(r.integers(0, 9, (64,), np.int32), m, P("model")),
  "h": lambda r, m: r.standard_normal((100,)).astype(np.float16),
  "s": lambda r, m: int(r.integers(0, 100)),
  "k": lambda r, m: jax.random.key(int(r.integers(0, 100))),
}


@settings(
  max_examples=12,
  deadline=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
  st.lists(
    st.tuples(st.sampled_from(sorted(_LEAVES)), st.sampled_from(["keep", "drop", "bf16"])),
    min_size=2,
    max_size=5,
  ),
  st.integers(0, 1 << 16),
)
def test_trees_mutated_between_saves_always_restore_bitwise(tmp_path_factory, ops, seed):
  """A loop of saves, the tree changing between some of them (a leaf dropped or added, a
  dtype changed) and its values between all: every checkpoint restores bitwise."""
  d = tmp_path_factory.mktemp("prop")
  r, mesh = np.random.default_rng(seed), _mesh()
  names = set(_LEAVES)
  for k, (name, op) in enumerate(ops):
    if op == "drop" and len(names) > 1:
      names.discard(name)
    else:
      names.add(name)
    tree = {n: _LEAVES[n](r, mesh) for n in sorted(names)}
    if op == "bf16" and isinstance(tree[name], jax.Array) and tree[name].dtype == jnp.float32:
      tree[name] = tree[name].astype(jnp.bfloat16)
    for again in range(2):  # the second save of each tree reuses its plan, new values
      if again:
        tree = jax.tree.map(lambda x: x + 1 if isinstance(x, (jax.Array, np.ndarray)) and
                            not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree)
      _save(tree, str(d / f"{k}-{again}"))
      _check(str(d / f"{k}-{again}"), tree)


def test_overwriting_one_path_under_a_reused_plan(tmp_path):
  path = str(tmp_path / "latest")
  for step in range(3):
    tree = _state_tree(step)
    _save(tree, path, overwrite=True)
    _check(path, tree)
  assert _counts() == (2, 1)


# --- restore: the match of target and checkpoint made once per structure -------------------


def _target_of(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.Array)
    else x,
    tree,
  )


def _restores():
  return len(_state.plans.restores)


def test_restores_of_one_structure_match_once_and_are_bitwise(tmp_path):
  trees = [_state_tree(k) for k in range(3)]
  for k, t in enumerate(trees):
    _save(t, str(tmp_path / f"s{k}"))
  target = _target_of(trees[0])
  _state.plans.clear()
  for k, t in enumerate(trees):
    assert_trees_all_equal(fnckpt.restore(str(tmp_path / f"s{k}"), target), t)
  assert _counts("restores") == (2, 1) and _restores() == 1


@pytest.mark.parametrize("kind", ["spec", "dtype", "device order", "memory kind", "scalar"])
def test_another_target_or_layout_matches_anew(tmp_path, kind):
  tree = _state_tree(1)
  _save(tree, str(tmp_path / "a"))
  fnckpt.restore(str(tmp_path / "a"), _target_of(tree))
  target = _target_of(tree)
  want = dict(tree)
  if kind == "spec":
    s = NamedSharding(_mesh(), P(None, "data"))
    target["w"] = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=s)
    want["w"] = jax.device_put(tree["w"], s)
  elif kind == "dtype":  # cast to another dtype
    target["b"] = jax.ShapeDtypeStruct((4096,), jnp.bfloat16, sharding=tree["b"].sharding)
    want["b"] = tree["b"].astype(jnp.bfloat16)
  elif kind == "device order":
    s = NamedSharding(_mesh(order=[7, 6, 5, 4, 3, 2, 1, 0]), P("data", "model"))
    target["w"] = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=s)
    want["w"] = jax.device_put(tree["w"], s)
  elif kind == "memory kind":
    s = NamedSharding(_mesh(), P(), memory_kind="pinned_host")
    target["b"] = jax.ShapeDtypeStruct((4096,), jnp.float32, sharding=s)
    want["b"] = jax.device_put(tree["b"], s)
  elif kind == "scalar":  # a saved Python int into a 0-d array target, then a plain int
    target["step"] = jax.ShapeDtypeStruct((), jnp.int32)
    want["step"] = np.int32(1)
  got = fnckpt.restore(str(tmp_path / "a"), target, cast=kind == "dtype")
  assert _restores() == 2, kind
  assert_trees_all_equal(got, want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if isinstance(b, jax.Array):
      assert a.sharding == b.sharding


def test_a_checkpoint_of_another_layout_under_a_kept_match(tmp_path):
  """The same target restores a checkpoint whose leaves differ (a dtype saved otherwise):
  matched anew, and its mismatch is reported, not hidden by the kept match."""
  tree = _state_tree(1)
  _save(tree, str(tmp_path / "a"))
  target = _target_of(tree)
  fnckpt.restore(str(tmp_path / "a"), target)
  other = dict(tree, b=tree["b"].astype(jnp.bfloat16))
  _save(other, str(tmp_path / "b"))
  with pytest.raises(fnckpt.TreeMismatchError, match=r"\['b'\]: dtype bfloat16 saved"):
    fnckpt.restore(str(tmp_path / "b"), target)


def test_a_saved_value_out_of_range_is_caught_under_a_kept_match(tmp_path):
  target = {"x": np.zeros(4, np.float32), "n": jax.ShapeDtypeStruct((), jnp.int8)}
  _save({"x": np.ones(4, np.float32), "n": 5}, str(tmp_path / "a"))
  assert int(fnckpt.restore(str(tmp_path / "a"), target)["n"]) == 5
  _save({"x": np.ones(4, np.float32), "n": 1000}, str(tmp_path / "b"))
  with pytest.raises(fnckpt.TreeMismatchError, match=r"1000 saved, a int8 array"):
    fnckpt.restore(str(tmp_path / "b"), target)
