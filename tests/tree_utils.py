"""Small tree asserts for the tests (in the spirit of optax's ``test_utils``).

Every assert names the key path that differs, so a failing case says where.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import tensorstore as ts


def keystr(path) -> str:
  return jax.tree_util.keystr(path)


def _is_leaf(x: Any) -> bool:
  return x is None or (isinstance(x, (dict, list, tuple)) and len(x) == 0)


def is_key(x: Any) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def host(x: Any) -> np.ndarray:
  """A leaf's values on the host (typed PRNG keys as their key data)."""
  if is_key(x):
    x = jax.random.key_data(x)
  return np.asarray(x)


def assert_leaf_equal(actual: Any, expected: Any, where: str = "<root>", *,
                      check_dtype: bool = True) -> None:
  """One leaf: arrays by value (bit-exact, NaN == NaN) and dtype; PRNG keys by impl and key
  data; numpy Generators by state; everything else by ``==`` and type."""
  if is_key(expected):
    assert is_key(actual), f"{where}: expected a PRNG key array, got {type(actual)}"
    assert str(jax.random.key_impl(actual)) == str(jax.random.key_impl(expected)), where
    np.testing.assert_array_equal(host(actual), host(expected), err_msg=where)
    return
  if isinstance(expected, np.random.Generator):
    assert isinstance(actual, np.random.Generator), f"{where}: got {type(actual)}"
    assert actual.bit_generator.state == expected.bit_generator.state, where
    return
  if isinstance(expected, (jax.Array, np.ndarray, np.generic)):
    assert isinstance(actual, (jax.Array, np.ndarray, np.generic)), (
        f"{where}: expected an array, got {type(actual).__name__}")
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{where}: shape {a.shape} != {e.shape}"
    if check_dtype:
      assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != {e.dtype}"
    # compare bits where the dtype has NaNs that are not equal to themselves
    floating = a.dtype.kind == "f" or "float" in a.dtype.name
    if a.dtype == e.dtype and floating and a.dtype.itemsize in (1, 2, 4, 8):
      view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
      np.testing.assert_array_equal(a.view(view), e.view(view), err_msg=where)
    else:
      np.testing.assert_array_equal(a, e, err_msg=where)
    return
  assert type(actual) is type(expected), (
      f"{where}: type {type(actual).__name__} != {type(expected).__name__}")
  assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_trees_all_equal(actual: Any, expected: Any, *, check_dtype: bool = True) -> None:
  """Same structure (treedef, empty containers and None included) and equal leaves."""
  a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual, is_leaf=_is_leaf)
  e_leaves, e_def = jax.tree_util.tree_flatten_with_path(expected, is_leaf=_is_leaf)
  assert a_def == e_def, f"tree structures differ:\n  actual:   {a_def}\n  expected: {e_def}"
  for (path, a), (_, e) in zip(a_leaves, e_leaves):
    assert_leaf_equal(a, e, keystr(path), check_dtype=check_dtype)


def assert_placed(actual: jax.Array, sharding: jax.sharding.Sharding,
                  source: np.ndarray, where: str = "<root>") -> None:
  """``actual`` is laid out exactly as ``sharding`` says: each addressable shard sits on the
  device and covers the index that ``addressable_devices_indices_map`` gives, and holds the
  source's values for that index."""
  assert isinstance(actual, jax.Array), f"{where}: expected a jax.Array, got {type(actual)}"
  assert actual.sharding.is_equivalent_to(sharding, actual.ndim), (
      f"{where}: sharding {actual.sharding} is not {sharding}")
  key = is_key(actual)
  wanted = sharding.addressable_devices_indices_map(actual.shape)
  shards = actual.addressable_shards
  assert {s.device for s in shards} == set(wanted), f"{where}: shards on the wrong devices"
  for s in shards:
    index = s.index[:actual.ndim] if key else s.index
    want = tuple(wanted[s.device])
    norm = lambda idx: tuple(sl.indices(n)[:2] for sl, n in zip(idx, actual.shape))
    assert norm(index) == norm(want), (
        f"{where}: the shard on {s.device} covers {index}, the sharding says {want}")
    data = host(s.data)
    np.testing.assert_array_equal(data, np.asarray(source)[want], err_msg=f"{where} @ {s.device}")


def kvstore_counters(prefix: str = "/tensorstore/kvstore/file/") -> dict[str, int]:
  """TensorStore's process-wide kvstore counters (reads, bytes_read, writes, ...)."""
  out = {}
  for m in ts.experimental_collect_matching_metrics(prefix):
    v = m["values"][0]
    out[m["name"].rsplit("/", 1)[-1]] = int(v.get("value", v.get("count", 0)))
  return out


class CountIO:
  """``with CountIO() as io: ...`` then ``io.delta["bytes_read"]``: the counters' change."""

  def __init__(self, prefix: str = "/tensorstore/kvstore/file/"):
    self.prefix = prefix
    self.delta: dict[str, int] = {}

  def __enter__(self) -> "CountIO":
    self._before = kvstore_counters(self.prefix)
    return self

  def __exit__(self, *exc) -> None:
    after = kvstore_counters(self.prefix)
    keys = set(after) | set(self._before)
    self.delta = {k: after.get(k, 0) - self._before.get(k, 0) for k in keys}

  def __getitem__(self, name: str) -> int:
    return self.delta.get(name, 0)
