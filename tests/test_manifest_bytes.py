"""The manifests save writes stay byte-identical: representative trees (every leaf kind and
storage: inline, packed, stored, pieces, perprocess; compression; incremental saves with a base;
forks) are saved, and their manifests, normalised (``created``, ``versions`` and the random
``data-<hex>`` names), must equal the golden bytes in ``tests/fixtures/manifests``: written by
the code before the save side built records (commit 0dbbe26), but for ``inc2``, ``fork_parent``
and ``fork``, whose reused packed leaves now have ``hash`` after ``pack`` as every other leaf
(it came first; the maps are otherwise equal). Regenerated for format 3 (the writer's
switch): ``version`` 3, top-level ``hash: "xxh3-128"``, 16-byte hashes on every stored,
packed and pieced leaf (no ``chunk_fps``), pieces with recorded ``runs``/``hashes`` and packs
without ``process``/``pieces``, pieces kept in the incremental saves and the incremental
manager's fork (only compression and ``pack_bytes=0`` store them as zarr arrays); reviewed
leaf by leaf against the format-2 goldens, and ``fnckpt verify`` passed on every case. A
changed golden is a format change: regenerate them only on purpose, with
``FNCKPT_WRITE_GOLDEN=1`` (then review the diff). And the manifest the writer builds as records
is the one a reader parses from its bytes.
"""

import enum
import os
import re

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._format import manifest as _manifest, records as _records

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "manifests")
_DATA = re.compile(r"data-[0-9a-f]{32}")


class Color(enum.IntEnum):
  RED = 1


class Name(str):
  pass


def _tree(v: float = 0.0) -> dict:
  """Every leaf kind; arrays inline, packed, stored and (sharded, small shards) pieced."""
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  return {
      "pieced": jax.device_put(np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024) + v,
                               NamedSharding(mesh, P("a", "b"))),  # 8 MiB, 1 MiB shards
      "pieced2": jax.device_put(np.arange(64 * 64, dtype=np.int32).reshape(64, 64),
                                NamedSharding(mesh, P(("b", "a")))),
      "sharded": jax.device_put(np.ones((4096, 1024), np.float32),
                                NamedSharding(mesh, P("a", None))),
      "replicated": jax.device_put(np.arange(64 * 128, dtype=np.float32).reshape(64, 128),
                                   NamedSharding(mesh, P())),
      "big": np.arange(1100 * 1024, dtype=np.float32).reshape(1100, 1024) * (1 + v),
      "mid": np.arange(64 * 128, dtype=np.float32).reshape(64, 128) + v,
      "mid2": np.arange(32 * 128, dtype=np.int64).reshape(32, 128),
      "small": np.arange(4, dtype=np.float32),
      "empty_array": np.zeros((0, 3), np.float32),
      "single": jnp.ones((2, 3), jnp.bfloat16),
      "key": jax.random.key(0), "rbg": jax.random.key(1, impl="rbg"),
      "keys": jax.random.split(jax.random.key(2), 3),
      "scalars": [1, 2.5, -0.0, 1 - 2j, "s", b"b", True, None, 2 ** 70, np.float32(1.5),
                  np.int64(-3), Color.RED, Name("n")],
      "empties": {"d": {}, "l": [], "t": ()},
      "rng": np.random.default_rng(3),
      "pp": fnckpt.PerProcess({"epoch": 3, "arr": np.arange(3)}),
      "step": int(v),
  }


def _normalised(raw: bytes) -> bytes:
  """The manifest bytes with what differs between two saves of one tree made equal."""
  names: dict[str, str] = {}

  def fix(x):
    if isinstance(x, dict):
      return {k: fix(v) for k, v in x.items()}
    if isinstance(x, list):
      return [fix(v) for v in x]
    if isinstance(x, str):
      return _DATA.sub(lambda m: names.setdefault(m.group(), f"data-{len(names):032x}"), x)
    return x

  m = msgpack.unpackb(raw, raw=False, strict_map_key=False)
  m["created"], m["versions"] = 0.0, {}
  return msgpack.packb(fix(m), use_bin_type=True)


def _manifest_bytes(path: str) -> bytes:
  with open(os.path.join(path, "manifest.msgpack"), "rb") as f:
    return f.read()


def _cases(tmp) -> dict[str, str]:
  """Save each case under ``tmp``; case name -> checkpoint path."""
  out = {}
  for name, kwargs in [("plain", {}), ("no_packs", {"pack_bytes": 0}),
                       ("blosc", {"compression": "blosc"}), ("zstd", {"zstd": 3})]:
    out[name] = f"{tmp}/{name}"
    fnckpt.save(_tree(), out[name], metadata={"note": name, "n": [1, 2.5]}, **kwargs).wait()
  # incremental: a plain save as the base (format 3: every save records hashes), then one
  # that reuses all of it, then one that reuses part (leaves and runs referring to a base)
  fnckpt.save(_tree(), f"{tmp}/inc0").wait()
  for k in (1, 2):
    out[f"inc{k}"] = f"{tmp}/inc{k}"
    fnckpt.save(_tree(float(k == 2)), out[f"inc{k}"], base=f"{tmp}/inc{k - 1}").wait()
  for name, opts in [("fork", {"incremental": True}), ("fork_pieces", {})]:
    mgr = fnckpt.CheckpointManager(f"{tmp}/{name}/a", **opts)
    for step in range(2):
      mgr.save(step, _tree(float(step)))
      mgr.wait()  # (step 1 of an incremental run refers to step 0 only once it is committed)
    mgr.fork(1, f"{tmp}/{name}/b").close()
    mgr.close()
    out[f"{name}_parent"] = f"{tmp}/{name}/a/1"
    out[name] = f"{tmp}/{name}/b/1"
  return out


def test_saved_manifests_equal_the_golden_bytes(tmp_path):
  cases = _cases(str(tmp_path))
  if os.environ.get("FNCKPT_WRITE_GOLDEN"):
    os.makedirs(GOLDEN, exist_ok=True)
    for name, path in cases.items():
      with open(os.path.join(GOLDEN, f"{name}.msgpack"), "wb") as f:
        f.write(_normalised(_manifest_bytes(path)))
    pytest.skip(f"wrote {len(cases)} golden manifests to {GOLDEN} with {fnckpt.__file__}")
  assert sorted(os.listdir(GOLDEN)) == sorted(f"{n}.msgpack" for n in cases)
  for name, path in cases.items():
    with open(os.path.join(GOLDEN, f"{name}.msgpack"), "rb") as f:
      want = f.read()
    got = _normalised(_manifest_bytes(path))
    assert got == want, (name, msgpack.unpackb(got, raw=False, strict_map_key=False),
                         msgpack.unpackb(want, raw=False, strict_map_key=False))
    # the goldens are the format save writes: every leaf outside the manifest hashed
    m = _manifest.decode(want, name)
    assert (m.version, m.hash) == (_manifest.FORMAT_VERSION, "xxh3-128"), name
    for leaf in m.leaves:
      if leaf.is_array and leaf.inline is None:
        assert len(leaf.hash) == 16, (name, leaf.path)
        assert leaf.stored is None or leaf.chunk_fps is None, (name, leaf.path)
        assert leaf.pieces is None or (leaf.pieces.runs is not None and
                                       len(leaf.pieces.hashes) % 16 == 0), (name, leaf.path)
    assert all(p.process is None and p.pieces is None for p in m.packs), name


@pytest.mark.parametrize("name", sorted(n[:-len(".msgpack")] for n in os.listdir(GOLDEN)))
def test_encoding_the_parsed_golden_gives_its_bytes(name):
  """The records of a manifest encode to its very bytes (key order included)."""
  with open(os.path.join(GOLDEN, f"{name}.msgpack"), "rb") as f:
    raw = f.read()
  m = _manifest.decode(raw, name)
  wire = _records.encode(m)
  assert _manifest.pack(wire) == raw


def test_the_manifest_the_writer_builds_is_the_one_read(tmp_path, monkeypatch):
  """Saves with packs, pieces, stored and inline arrays, and one with a base: the bytes
  written decode to the very records the writer encoded (meshes and layout included)."""
  built = []
  encode = _manifest.encode
  monkeypatch.setattr(_manifest, "encode", lambda m: built.append(m) or encode(m))
  fnckpt.save(_tree(), f"{tmp_path}/a").wait()
  fnckpt.save(_tree(), f"{tmp_path}/b", base=f"{tmp_path}/a").wait()
  fnckpt.save(_tree(1.0), f"{tmp_path}/c", base=f"{tmp_path}/b").wait()
  assert len(built) == 3
  for m, name in zip(built, "abc"):
    got = _manifest.decode(_manifest_bytes(f"{tmp_path}/{name}"), name)
    assert got == m
    assert [a.tolist() for a in got.meshes] == [a.tolist() for a in m.meshes]
  assert built[0].layout is not None and built[0].meshes       # pieces
  assert built[2].bases and any(p.base is not None for p in built[2].packs)
  assert any(l.stored is not None and l.stored.base is not None for l in built[2].leaves)
