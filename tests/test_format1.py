"""Format 1 stays readable: tests/fixtures/format1 was written by fnckpt 0.1.0 (format 1,
commit 2d03b30) from the tree below; today's reader restores it bitwise, also resharded."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "format1")


def expected():
  return {"params": {"w": np.arange(64 * 48, dtype=np.float32).reshape(64, 48),
                     "b": np.arange(8).astype(jnp.bfloat16)},
          "step": 7, "n": np.arange(6, dtype=np.int64).reshape(2, 3), "name": "fixture",
          "none": None, "big": 2 ** 70}


def test_format1_fixture_metadata():
  meta = fnckpt.metadata(FIXTURE)
  assert meta.format_version == 1
  w = meta.tree["params"]["w"]
  assert w.shape == (64, 48) and w.dtype == np.float32 and w.stored == "d/6"
  assert w.sharding.axes == ("x", "y") and w.sharding.spec == P("x", "y")


def test_format1_fixture_restores_to_host():
  got = fnckpt.restore(FIXTURE)
  want = expected()
  np.testing.assert_array_equal(got["params"]["w"], want["params"]["w"])
  assert got["params"]["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(got["params"]["b"], want["params"]["b"])
  np.testing.assert_array_equal(got["n"], want["n"])
  assert (got["step"], got["name"], got["none"], got["big"]) == (7, "fixture", None, 2 ** 70)
  assert jax.random.key_impl(got["key"]) == jax.random.key_impl(jax.random.key(3))
  np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                jax.random.key_data(jax.random.key(3)))
  assert got["rng"].random() == np.random.default_rng(5).random()


def test_format1_fixture_restores_onto_another_mesh():
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  s = NamedSharding(mesh, P("b", "a"))
  got = fnckpt.restore(FIXTURE, {"params": {"w": s}})  # prefix tree of shardings, partial
  assert got["params"]["w"].sharding == s
  np.testing.assert_array_equal(np.asarray(got["params"]["w"]), expected()["params"]["w"])
