"""Incremental saves on every storage kind x every feature (issue 23): each cell either writes
only what changed (and restores bitwise, and verifies) or says clearly why not.

Storage kinds, with ``SMALL`` sizes (``inline_bytes=1024, pack_bytes=8192``):
- ``inline``: 64 bytes, in the manifest (free);
- ``packed``: 4 KiB numpy, in a pack (reused by hash, pointing into the base's pack);
- ``pieced``: 128 KiB sharded over 8 devices (16 KiB shards: pieces; reused per process run);
- ``stored``: 256 KiB numpy, a zarr array (reused whole when every chunk's hash equals).
Each kind has an unchanged twin, so every save also shows reuse beside the change.
"""

from __future__ import annotations

import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnckpt
from fnckpt.cli import main as cli_main
from test_incremental import SMALL, _records_of, assert_same, files_under

KINDS = ("inline", "packed", "pieced", "stored")


def _mesh():
  return jax.make_mesh((8,), ("x",), devices=jax.devices()[:8])


def _leaf(kind: str, v: int):
  """A leaf of storage ``kind`` whose values depend on ``v``."""
  rng = np.random.default_rng(v)
  if kind == "inline":
    return np.full((16,), v, np.float32)
  if kind == "packed":
    return rng.standard_normal((32, 32)).astype(np.float32)
  if kind == "pieced":
    sharding = jax.sharding.NamedSharding(_mesh(), jax.sharding.PartitionSpec("x"))
    return jax.device_put(jnp.asarray(rng.standard_normal((8, 4096)), jnp.float32), sharding)
  return rng.standard_normal((256, 256)).astype(np.float32)


def tree(changed: str | None = None, v: int = 1) -> dict:
  """One leaf of each kind (values of version 0) plus its twin; ``changed``'s leaf at ``v``."""
  return {k: {"leaf": _leaf(k, v if k == changed else 0), "twin": _leaf(k, 100)}
          for k in KINDS}


def nbytes(kind: str) -> int:
  return int(np.asarray(_leaf(kind, 0)).nbytes)


def storage(path: str) -> dict[str, str]:
  """How each leaf is stored, by key path."""
  out = {}
  for leaf in fnckpt.metadata(path).leaves:
    rec = leaf
    out[rec.where] = ("inline" if rec.inline is not None else "stored" if rec.stored is not None
                      else "pieced" if rec.pieces is not None else "packed" if rec.packed
                      is not None else rec.kind)
  return out


def check(path: str, want: dict) -> None:
  """Restores bitwise and verifies clean."""
  assert_same(fnckpt.restore(path), want)
  assert cli_main(["verify", path]) == 0


# --- base ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_base(tmp_path, kind):
  """A plain save, then one leaf of ``kind`` changed: only that leaf's bytes are written
  (inline: nothing but the manifest), everything else refers to the base."""
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  fnckpt.save(tree(), a, **SMALL).wait()
  kinds = storage(a)
  assert kinds[f"['{kind}']['leaf']"] == kind and kinds[f"['{kind}']['twin']"] == kind
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # nothing is switched off silently, or with a warning
    stats = fnckpt.save(tree(kind), b, base=a, **SMALL).wait()
  changed = 0 if kind == "inline" else nbytes(kind)
  assert stats.bytes_written == changed
  assert (stats.chunks_written > 0) == (changed > 0) and stats.peak_staged_bytes > 0
  assert stats.bytes_reused == sum(2 * nbytes(k) for k in KINDS if k != "inline") - changed
  on_disk = sum(files_under(os.path.join(b, _records_of(b).data)).values()) if changed else 0
  assert on_disk <= changed + 8192   # (+ zarr.json, shard index, pack padding)
  check(b, tree(kind))
  check(a, tree())


@pytest.mark.parametrize("kind", KINDS)
def test_compression(tmp_path, kind):
  """With compression=: packs stay uncompressed, small shards are compressed zarr arrays
  instead of pieces (a layout rule); each kind still reuses. Saved plain then compressed: the
  leaves whose storage changes (stored, pieced) are written in full with a warning naming
  why; the others reuse."""
  a, b, c = (str(tmp_path / n) for n in "abc")
  fnckpt.save(tree(), a, compression="zstd", **SMALL).wait()
  kinds = storage(a)
  assert kinds["['pieced']['leaf']"] == "stored" and kinds["['packed']['leaf']"] == "packed"
  stats = fnckpt.save(tree(kind), b, base=a, compression="zstd", **SMALL).wait()
  assert stats.bytes_written == (0 if kind == "inline" else nbytes(kind))
  check(b, tree(kind))
  plain = str(tmp_path / "plain")
  fnckpt.save(tree(), plain, **SMALL).wait()
  with pytest.warns(RuntimeWarning, match=r"cannot reuse the base's data: (its chunking or "
                    r"compression differs|it is stored as a zarr array here but as pieces)"):
    stats = fnckpt.save(tree(kind), c, base=plain, compression="zstd", **SMALL).wait()
  assert stats.bytes_reused >= 2 * nbytes("packed") - (nbytes("packed") if kind == "packed"
                                                        else 0)
  check(c, tree(kind))


# --- fork, two tiers, export ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_fork(tmp_path, kind):
  """A fork of a step, then an incremental save in the fork: refers to the parent's data."""
  parent = fnckpt.CheckpointManager(str(tmp_path / "p"), incremental=True, **_manager_small())
  parent.save(0, tree())
  parent.wait()
  child = parent.fork(0, str(tmp_path / "c"))
  child.save(1, tree(kind))
  child.wait()
  assert child.all_steps() == [0, 1]
  written = sum(files_under(str(tmp_path / "c" / "1")).values())
  assert written <= (0 if kind == "inline" else nbytes(kind)) + 16384
  assert {b.dir for b in _records_of(str(tmp_path / "c" / "1")).bases} == {"../p/0"}
  check(str(tmp_path / "c" / "1"), tree(kind))
  child.close()
  parent.close()


def _manager_small() -> dict:
  return {"save_options": dict(SMALL)}


@pytest.mark.parametrize("kind", KINDS)
def test_two_tiers(tmp_path, kind):
  """An incremental manager with a fast tier: the durable tier alone (fast tier wiped)
  restores every step bitwise; the second durable step wrote only the change."""
  durable, fast = str(tmp_path / "d"), str(tmp_path / "f")
  kw = dict(local_directory=fast, incremental=True, **_manager_small())
  mgr = fnckpt.CheckpointManager(durable, **kw)
  mgr.save(0, tree())
  mgr.wait()
  mgr.save(1, tree(kind))
  mgr.wait()
  mgr.close()
  shutil.rmtree(fast)
  written = sum(files_under(f"{durable}/1").values())
  assert written <= (0 if kind == "inline" else nbytes(kind)) + 16384
  again = fnckpt.CheckpointManager(durable, **kw)
  assert_same(again.restore(1), tree(kind))
  assert_same(again.restore(0), tree())
  again.close()


@pytest.mark.parametrize("kind", KINDS)
def test_export(tmp_path, kind):
  """export_safetensors of an incremental checkpoint reads referenced data bitwise."""
  from safetensors.numpy import load_file
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  fnckpt.save(tree(), a, **SMALL).wait()
  fnckpt.save(tree(kind), b, base=a, **SMALL).wait()
  out = tmp_path / "x.safetensors"
  fnckpt.export_safetensors(b, str(out))
  got = load_file(str(out))
  want = tree(kind)
  for k in KINDS:
    for name in ("leaf", "twin"):
      key = next(x for x in got if k in x and name in x)
      assert got[key].tobytes() == np.asarray(want[k][name]).tobytes()


# --- several processes --------------------------------------------------------------------------


@pytest.mark.slow
def test_several_processes(tmp_path):
  """Two real processes (a 2x2 mesh): each kind changed in turn; unchanged kinds are reused,
  pieces per process run (only process 1's changes: only its run is written), stored arrays
  whole (process 0 copies its unchanged chunks)."""
  import test_collective_mp as cmp
  leaves = {"inline": {"shape": [8], "spec": "replicated"},
            "packed": {"shape": [64, 128], "spec": "replicated"},    # 32 KiB
            "pieced": {"shape": [64, 1024], "spec": ["x", "y"]},     # 64 KiB shards
            "stored": {"shape": [1024, 1024], "spec": ["x", None]}}  # 2 MiB shards: zarr
  base = str(tmp_path / "full")
  attempts = [{"path": "full"}]
  for k in KINDS:
    who = ("1",) if k in ("pieced", "stored") else ("0", "1")
    attempts.append({"path": k, "base": base, "change": {p: {"reseed": [k]} for p in who}})
  outcomes = cmp.run(tmp_path, attempts, leaves=leaves)
  for p in outcomes:
    assert all("ok" in o for o in p), p
  assert storage(base) == {f"['{k}']": k for k in KINDS} | {"['step']": "scalar"}
  full = fnckpt.restore(base)
  for i, k in enumerate(KINDS, start=1):
    written = [p[i]["ok"]["bytes_written"] for p in outcomes]
    reused = sum(p[i]["ok"]["bytes_reused"] for p in outcomes)
    assert reused > 0, (k, outcomes)
    if k == "pieced":   # process 1's run only (its 2 shards of 64 KiB)
      assert written == [0, 128 * 1024], written
    path = str(tmp_path / k)
    assert _records_of(path).bases
    got = fnckpt.restore(path)
    for other in KINDS:
      same = np.asarray(got[other]).tobytes() == np.asarray(full[other]).tobytes()
      assert same == (other != k), (k, other)
    assert cli_main(["verify", path]) == 0
