"""Format 2 stays readable: tests/fixtures/format2 was written by fnckpt at commit 1460648 (the
last code writing format 2) with tests/fixtures/format2/make.py, whose ``values`` recipe
rebuilds the expected values here. Every storage kind of format 2 appears: inline, packed,
pieced (``plain``), stored zarr arrays, SHA-256 hashes (``hashed``, ``run/1``) and an
incremental save referring to its base (``run/2``, ``bases``: ``"1"``). The fixtures are
read in place; a check makes sure nothing writes into them."""

import importlib.util
import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt.cli import main as cli_main

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "format2")
# (fixture, version of make.values it holds)
CASES = [("plain", 1), ("hashed", 1), ("run/1", 1), ("run/2", 2)]


def _make():
  spec = importlib.util.spec_from_file_location("format2_make", os.path.join(FIXTURES, "make.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)  # (defines the recipe; writes nothing)
  return mod


make = _make()


def _listing(root: str) -> list:
  """Every file under ``root`` with its size and mtime: equal before and after a read."""
  out = []
  for d, _, names in os.walk(root):
    for n in names:
      st = os.stat(os.path.join(d, n))
      out.append((os.path.relpath(os.path.join(d, n), root), st.st_size, st.st_mtime_ns))
  return sorted(out)


@pytest.fixture
def untouched():
  """Fails the test if it wrote, removed or changed anything under the fixtures."""
  before = _listing(FIXTURES)
  yield
  assert _listing(FIXTURES) == before


def _assert_bitwise(got, want) -> None:
  assert type(got) is type(want), (type(got), type(want))
  if isinstance(want, (np.ndarray, np.generic)):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
  else:
    assert got == want


@pytest.mark.parametrize("name,version", CASES)
def test_format2_fixture_restores_bitwise(name, version, untouched):
  path = os.path.join(FIXTURES, name)
  assert fnckpt.metadata(path).format_version == 2
  got = fnckpt.restore(path)
  want = make.values(version)
  assert sorted(got) == sorted([*want, "key"])
  for k, v in want.items():
    _assert_bitwise(got[k], v)
  assert jax.random.key_impl(got["key"]) == jax.random.key_impl(jax.random.key(3))
  np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                jax.random.key_data(jax.random.key(3)))


@pytest.mark.parametrize("name,version", CASES)
def test_format2_fixture_verifies(name, version, untouched):
  assert cli_main(["verify", os.path.join(FIXTURES, name)]) == 0


def test_format2_fixtures_hold_every_storage_kind(untouched):
  stored = {n: {k: getattr(v, "stored", None) for k, v in fnckpt.metadata(
      os.path.join(FIXTURES, n)).tree.items()} for n, _ in CASES}
  plain = stored["plain"]
  assert plain["inline"] == plain["key"] == "inline"
  assert plain["pieced"] == "pieces"
  assert {plain[k] for k in ("packed", "packed_rep", "bf16")} == {"pack 0"}
  assert "/a/" in plain["stored"] and "/a/" in plain["stored_jax"]
  assert "/a/" in stored["hashed"]["pieced"]  # (a save that hashes stores no pieces)
  # run/2 wrote `packed` itself and refers to run/1's data for the unchanged arrays:
  data1 = stored["run/1"]["stored"].split("/")[0]
  assert stored["run/2"]["stored"].split("/")[0] == data1
  assert stored["run/2"]["pieced"].split("/")[0] == data1
  assert stored["run/2"]["packed"] != stored["run/2"]["bf16"]


@pytest.mark.parametrize("name", ["plain", "hashed", "run/2"])
def test_format2_fixture_restores_sharded(name, untouched):
  """The sharded leaf onto its saved mesh and onto another; the rest replicated."""
  want = make.values(2 if name == "run/2" else 1)
  path = os.path.join(FIXTURES, name)
  for s in (NamedSharding(make.mesh(), P("x", "y")),
            NamedSharding(jax.make_mesh((4, 2), ("a", "b")), P("b", "a"))):
    got = fnckpt.restore(path, {"pieced": s, "stored": s, "packed": NamedSharding(s.mesh, P())},
                         partial=True)
    for k in ("pieced", "stored", "packed"):
      assert got[k].sharding.is_equivalent_to(NamedSharding(s.mesh, P()) if k == "packed" else s,
                                              want[k].ndim)
      assert np.asarray(got[k]).tobytes() == want[k].tobytes()
