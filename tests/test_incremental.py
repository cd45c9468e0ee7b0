"""Incremental saves (``save(base=)``), the manager's ``incremental=True`` / ``full_every``,
forks, and deletes that respect references (docs/guides/incremental.md).

What is written is counted on disk (files and bytes under the new checkpoint), never taken
from the library's own stats alone; every checkpoint is restored and compared bitwise. A
Hypothesis state machine runs save / incremental save / fork / delete / retention / cleanup /
a failure injected at every phase of the writer, and after every step restores every
committed checkpoint of every run bitwise.
"""

import os
import re
import shutil
import uuid
import warnings

import jax
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._format import manifest as _manifest, parse as _parse, runs as _runs
from fnckpt._sources import source as _source
from fnckpt._io import paths as _paths
from fnckpt import _state
from fnckpt._save import save as _save
from fnckpt._save import staging as _staging
from fnckpt.cli import main as cli_main

import helpers_proc as hp

SMALL = {"inline_bytes": 1024, "pack_bytes": 8192}   # 4 KiB leaves packed, 16 KiB stored
FROZEN = np.arange((1 << 20) + 1024, dtype=np.float32)  # > 4 MiB: a zarr array of its own


def lora_tree(v: int, frozen=FROZEN) -> dict:
  """A LoRA-like state: a large frozen base, small trainable adapters and their moments."""
  return {"base": {"w": frozen, "norm": np.linspace(0, 1, 8192, dtype=np.float32)},
          "lora": {"a": np.full((256, 64), v, np.float32), "b": np.full((64, 256), -v, np.float32)},
          "opt": {"mu": np.full((8192,), v * 0.5, np.float32)}, "step": v}  # (all packed)


def files_under(path: str) -> dict[str, int]:
  out = {}
  for d, _, names in os.walk(path):
    for n in names:
      out[os.path.relpath(os.path.join(d, n), path)] = os.path.getsize(os.path.join(d, n))
  return out


def assert_same(got, want):
  flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(flat_got) == len(flat_want)
  for a, b in zip(flat_got, flat_want):
    if isinstance(b, (np.ndarray, jax.Array)):
      if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
        a, b = jax.random.key_data(a), jax.random.key_data(b)
      a, b = np.asarray(a), np.asarray(b)
      assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    else:
      assert a == b


def hashed_save(tree, path, **kwargs):
  """A full save (every save records its content hashes since format 3)."""
  return fnckpt.save(tree, path, **kwargs)


# --- save(base=) --------------------------------------------------------------------------------

def test_a_plain_save_records_hashes_and_is_a_base(tmp_path):
  """Every save records XXH3-128 hashes of what it stores, so any checkpoint is a base: the
  save after a plain one writes only what changed."""
  a, b = (str(tmp_path / n) for n in "ab")
  fnckpt.save(lora_tree(1), a).wait()
  m = _records_of(a)
  assert m.version == 3 and m.hash == "xxh3-128"
  stored = [l for l in m.leaves if l.is_array and l.inline is None]
  assert stored and all(l.hash is not None and len(l.hash) == 16 for l in stored)
  stats = fnckpt.save(lora_tree(2), b, base=a).wait()
  assert stats.bytes_reused >= FROZEN.nbytes
  assert stats.bytes_written < FROZEN.nbytes / 10
  assert_same(fnckpt.restore(b), lora_tree(2))
  assert_same(fnckpt.restore(a), lora_tree(1))
  for incremental in (False, True):   # a manager's saves hash whether incremental or not
    run = str(tmp_path / f"run{incremental}")
    with fnckpt.CheckpointManager(run, incremental=incremental) as mgr:
      mgr.save(0, lora_tree(0))
    hashed = [l.hash is not None for l in _records_of(f"{run}/0").leaves
              if l.is_array and l.inline is None]
    assert hashed and all(hashed)


def test_a_format2_base_is_written_in_full_with_a_warning(tmp_path):
  """A base written by format 2 (no XXH3 hashes): the save writes everything, says so, and
  records its hashes (the next save with it as base reuses)."""
  import shutil
  src = os.path.join(os.path.dirname(__file__), "fixtures", "format2", "plain")
  base = str(tmp_path / "old")
  shutil.copytree(src, base)
  tree = fnckpt.restore(base)
  small = dict(inline_bytes=64, pack_bytes=4096)   # (as the fixture was saved)
  with pytest.warns(RuntimeWarning, match=r"written in fnckpt format 2, which records no "
                    r"XXH3-128 content hashes.*writes everything"):
    stats = fnckpt.save(tree, str(tmp_path / "new"), base=base, **small).wait()
  assert stats.bytes_reused == 0 and stats.bytes_written > 0
  assert not _records_of(str(tmp_path / "new")).bases
  assert_same(fnckpt.restore(str(tmp_path / "new")), tree)
  again = fnckpt.save(tree, str(tmp_path / "next"), base=str(tmp_path / "new"), **small).wait()
  assert again.bytes_written == 0 and again.bytes_reused == stats.bytes_written


def test_a_format2_step_forks_as_format2_and_its_fork_saves_format3(tmp_path):
  """A fork keeps the format of the step it forks (manifest and commit marker); the fork's
  next save is format 3, full (with the warning), then incremental again."""
  import msgpack
  src = os.path.join(os.path.dirname(__file__), "fixtures", "format2", "run")
  run = str(tmp_path / "run")
  shutil.copytree(src, run)
  mgr = fnckpt.CheckpointManager(run)
  child = mgr.fork(2, str(tmp_path / "fork"))
  forked = str(tmp_path / "fork" / "2")
  assert _records_of(forked).version == 2
  with open(os.path.join(forked, "COMMIT"), "rb") as f:
    assert msgpack.unpackb(f.read())["version"] == 2
  tree = fnckpt.restore(forked)
  assert_same(tree, fnckpt.restore(f"{run}/2"))
  small = dict(inline_bytes=64, pack_bytes=4096)   # (as the fixture was saved)
  with pytest.warns(RuntimeWarning, match="written in fnckpt format 2"):
    fnckpt.save(tree, str(tmp_path / "fork" / "3"), base=forked, **small).wait()
  stats = fnckpt.save(tree, str(tmp_path / "fork" / "4"), base=str(tmp_path / "fork" / "3"),
                      **small).wait()
  assert stats.bytes_written == 0 and _records_of(str(tmp_path / "fork" / "4")).version == 3
  child.close()
  mgr.close()


def _records_of(path):
  with open(os.path.join(path, "manifest.msgpack"), "rb") as f:
    return _manifest.decode(f.read(), path)


def test_unchanged_leaves_are_not_written_changed_ones_are(tmp_path):
  a, b = str(tmp_path / "1"), str(tmp_path / "2")
  hashed_save(lora_tree(1), a).wait()
  stats = fnckpt.save(lora_tree(2), b, base=a).wait()
  written = files_under(b)
  data = {k: n for k, n in written.items() if k.startswith("data-")}
  changed = 256 * 64 * 4 * 2 + 8192 * 4       # lora a, b and opt mu: a pack segment
  assert changed <= sum(data.values()) <= 1.05 * changed + 2048, written  # + zarr.json, index
  assert stats.bytes_written <= changed * 1.05 and stats.bytes_reused >= FROZEN.nbytes
  m = fnckpt.metadata(b)
  by = {l.where: l for l in m.leaves}
  assert by["['base']['w']"].stored.base is not None            # referred to
  assert m.leaves and all(l.hash is not None for l in m.leaves if l.stored or l.packed)
  assert_same(fnckpt.restore(b), lora_tree(2))
  assert_same(fnckpt.restore(a), lora_tree(1))
  # nothing changed: only the manifest and marker are written
  fnckpt.save(lora_tree(2), str(tmp_path / "3"), base=b).wait()
  assert sorted(files_under(str(tmp_path / "3"))) == ["COMMIT", "manifest.msgpack"]
  assert_same(fnckpt.restore(str(tmp_path / "3")), lora_tree(2))


def test_references_are_flat_and_name_the_writer(tmp_path):
  """A save based on an incremental save refers to the checkpoint that wrote the bytes."""
  paths = [str(tmp_path / str(i)) for i in range(3)]
  hashed_save(lora_tree(0), paths[0]).wait()
  fnckpt.save(lora_tree(1), paths[1], base=paths[0]).wait()
  fnckpt.save(lora_tree(2), paths[2], base=paths[1]).wait()
  m = fnckpt.metadata(paths[2])
  raw = msgpack.unpackb(open(os.path.join(paths[2], "manifest.msgpack"), "rb").read())
  dirs = sorted(b["dir"] for b in raw["bases"])
  assert dirs == ["0"]  # the frozen base and norm were written by step 0 only
  assert all(l.stored.base is not None for l in m.leaves if l.stored is not None)
  assert_same(fnckpt.restore(paths[2]), lora_tree(2))


def test_a_partly_changed_sharded_leaf_is_written_whole(tmp_path):
  """8 chunks (one per device); one changes: the new zarr array has all 8 chunks (7 copied
  from the base as stored), so it stays a standard zarr array; verify checks every hash."""
  mesh = jax.make_mesh((8,), ("x",))
  s = NamedSharding(mesh, P("x"))
  w = np.arange(8 * 4096, dtype=np.float32).reshape(8, 4096)
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  hashed_save({"w": jax.device_put(w, s)}, a, pack_bytes=0).wait()
  w2 = w.copy()
  w2[3, 7] = -1
  fnckpt.save({"w": jax.device_put(w2, s)}, b, base=a, pack_bytes=0).wait()
  chunks = [k for k in files_under(b) if "/a/0/c/" in k]
  assert len(chunks) == 8
  assert np.asarray(fnckpt.restore(b)["w"]).tobytes() == w2.tobytes()
  assert fnckpt.metadata(b).leaves[0].stored.base is None
  assert cli_main(["verify", b]) == 0


def test_a_missing_reference_is_an_error_naming_leaf_and_reference(tmp_path, capsys):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  hashed_save(lora_tree(1), a).wait()
  fnckpt.save(lora_tree(2), b, base=a).wait()
  shutil.rmtree(a)
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"Cannot restore \['base'\]\['(w|norm)'\] from .*: it refers to the data "
                     r"data-[0-9a-f]{32} of the checkpoint at '.*/a', which is missing"):
    fnckpt.restore(b)
  assert cli_main(["verify", b]) == 1
  out = capsys.readouterr().out
  assert "['base']['w']" in out and f"{a}/data-" in out


def test_export_reads_referenced_data(tmp_path):
  """export_safetensors of an incremental checkpoint reads reused leaves (stored and packed)
  from the checkpoint that wrote them."""
  from safetensors.numpy import load_file
  a, b = str(tmp_path / "1"), str(tmp_path / "2")
  hashed_save(lora_tree(1), a).wait()
  fnckpt.save(lora_tree(2), b, base=a).wait()
  m = _records_of(b)
  assert m.bases and any(l.stored is not None and l.stored.base is not None for l in m.leaves)
  assert any(m.packs[l.packed.pack].base is not None for l in m.leaves if l.packed)
  out = str(tmp_path / "out.safetensors")
  fnckpt.export_safetensors(b, out)
  got, want = load_file(out), lora_tree(2)
  for name in ("base.w", "base.norm", "lora.a", "lora.b", "opt.mu"):
    first, second = name.split(".")
    assert got[name].tobytes() == np.asarray(want[first][second]).tobytes(), name


def test_verify_reads_referenced_data(tmp_path, capsys):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  hashed_save(lora_tree(1), a).wait()
  fnckpt.save(lora_tree(2), b, base=a).wait()
  assert cli_main(["verify", b]) == 0
  (chunk,) = [os.path.join(a, k) for k in files_under(a) if "/a/" in k and "/c/" in k]
  raw = bytearray(open(chunk, "rb").read())
  raw[100] ^= 1
  open(chunk, "wb").write(bytes(raw))
  assert cli_main(["verify", b]) == 1
  out = capsys.readouterr().out
  assert "DAMAGED ['base']['w']" in out and f"{a}/data-" in out


def test_base_must_be_committed_and_on_the_same_storage(tmp_path):
  with pytest.raises(fnckpt.CheckpointError, match="No checkpoint at"):
    fnckpt.save(lora_tree(1), str(tmp_path / "x"), base=str(tmp_path / "nothing")).wait()
  fnckpt.save(lora_tree(1), str(tmp_path / "a")).wait()
  with pytest.raises(fnckpt.CheckpointError, match="same storage"):
    fnckpt.save(lora_tree(1), f"memory://inc/{uuid.uuid4().hex}", base=str(tmp_path / "a"))


# --- validation ---------------------------------------------------------------------------------

def _manifest_of(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  hashed_save(lora_tree(1), a).wait()
  fnckpt.save(lora_tree(2), b, base=a).wait()
  return msgpack.unpackb(open(os.path.join(b, "manifest.msgpack"), "rb").read(),
                         strict_map_key=False)


def _stored(m):
  return next(r for r in m["leaves"] if "store" in r and "base" in r["store"])


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["bases"][0].update(dir="a/../b"), r"'bases'\[0\].dir must be up to 64 '..'"),
    (lambda m: m["bases"][0].update(dir="/etc"), r"'bases'\[0\].dir must be"),
    (lambda m: m["bases"][0].update(dir="../" * 65 + "a"), r"'bases'\[0\].dir must be"),
    (lambda m: m["bases"][0].update(data="data-xyz"), r"'bases'\[0\].data must be data-"),
    (lambda m: m["bases"].append(dict(m["bases"][0])), "'bases' entries must be distinct"),
    (lambda m: _stored(m)["store"].update(base=5), r"'store'.base must be an integer in"),
    (lambda m: _stored(m)["store"].update(dir="data-" + "0" * 32 + "/a/0"),
     r"'store'.dir .* lies outside the referenced data"),
    (lambda m: _stored(m).update(hash=b"short"), "'hash' must be 16 bytes"),
    (lambda m: _stored(m).update(chunk_hashes=b"x" * 31), r"'chunk_hashes' \(one hash per"),
    (lambda m: m.update(fork={"run": "../a", "step": -1}), r"'fork'.step must be an integer"),
    (lambda m: m.update(fork={"run": "x/..", "step": 1}), r"'fork'.run must be"),
])
def test_references_are_validated(tmp_path, edit, match):
  m = _manifest_of(tmp_path)
  edit(m)
  with pytest.raises(fnckpt.CheckpointError, match=match):
    _parse.parse(m, "loc", 3)


def test_a_reference_above_the_storage_root_is_refused():
  kv = _paths.open_kvstore("memory://inc-root/c")
  tree = {"w": np.arange(10000, dtype=np.float32)}
  hashed_save(tree, "memory://inc-root/b").wait()
  fnckpt.save(tree, "memory://inc-root/c", base="memory://inc-root/b").wait()
  raw = msgpack.unpackb(kv.read("manifest.msgpack").result().value, strict_map_key=False)
  raw["bases"][0]["dir"] = "../../../b"
  body = _manifest.pack(raw)
  kv.write("manifest.msgpack", body).result()
  kv.write("COMMIT", _manifest.encode_commit(body, 0.0)).result()
  with pytest.raises(fnckpt.CheckpointError, match="leads above the root of its storage"):
    fnckpt.restore("memory://inc-root/c")


# --- the manager ------------------------------------------------------------------------------

def test_manager_incremental_keeps_referenced_data_and_full_every(tmp_path):
  root = str(tmp_path / "run")
  mgr = fnckpt.CheckpointManager(root, max_to_keep=2, incremental=True, full_every=3)
  for v in range(7):
    mgr.save(v, lora_tree(v))
    mgr.wait()
  assert mgr.all_steps() == [5, 6]
  for s in (5, 6):
    assert_same(mgr.restore(s), lora_tree(s))
  # saves 0, 3, 6 are full; 6 refers to nothing, 5 to 3 (held: its COMMIT is gone)
  assert "bases" not in msgpack.unpackb(open(f"{root}/6/manifest.msgpack", "rb").read())
  listing = fnckpt._manager.steps.StepIndex(root).list()
  assert listing.held == [3] and listing.uncommitted == []
  assert not os.path.exists(f"{root}/3/COMMIT") and not os.path.exists(f"{root}/0")
  mgr.save(7, lora_tree(7))
  mgr.wait()  # retention drops 5: nothing refers to step 3 any more
  assert not os.path.exists(f"{root}/3") and mgr.all_steps() == [6, 7]
  size = sum(files_under(root).values())
  assert size < FROZEN.nbytes * 1.2  # one full state plus deltas
  with pytest.raises(fnckpt.CheckpointError, match="cannot be replaced: steps \\[7\\] refer"):
    mgr.save(6, lora_tree(0), force=True)
  mgr.close()


def test_manager_delete_and_cleanup_spare_referenced_data(tmp_path):
  root = str(tmp_path / "run")
  mgr = fnckpt.CheckpointManager(root, incremental=True)
  for v in range(3):
    mgr.save(v, lora_tree(v))
  mgr.wait()
  mgr.delete(0)
  mgr.delete(1)
  assert mgr.all_steps() == [2] and mgr.cleanup() == []
  assert_same(mgr.restore(2), lora_tree(2))
  with pytest.raises(ValueError, match="full_every needs incremental=True"):
    fnckpt.CheckpointManager(root, full_every=2)
  mgr.close()


def test_fork_shares_data_and_both_runs_go_their_own_way(tmp_path, capsys):
  parent_dir, fork_dir = str(tmp_path / "a"), str(tmp_path / "b")
  mgr = fnckpt.CheckpointManager(parent_dir, max_to_keep=1, incremental=True)
  for v in range(3):
    mgr.save(v, lora_tree(v))
  mgr.wait()
  child = mgr.fork(2, fork_dir)
  assert sorted(files_under(fork_dir)) == ["2/COMMIT", "2/manifest.msgpack", "LINEAGE"]
  assert child.all_steps() == [2] and child.restore()["step"] == 2
  for v in range(3, 6):
    mgr.save(v, lora_tree(v))
    child.save(v, lora_tree(100 + v))
  mgr.wait()
  child.wait()
  assert mgr.all_steps() == [5] and child.all_steps() == [5]
  assert_same(child.restore(5), lora_tree(105))
  assert_same(mgr.restore(5), lora_tree(5))
  assert os.listdir(f"{parent_dir}/forks") and os.path.exists(f"{fork_dir}/LINEAGE")
  assert cli_main(["ls", fork_dir]) == 0 and cli_main(["inspect", f"{fork_dir}/5"]) == 0
  out = capsys.readouterr().out
  assert f"fork of run '{parent_dir}' at step 2" in out and "<- reused from" in out
  assert "reused (references to" in out
  # the fork's retention deleted its step 2: the parent's data it referred to is still kept
  child2 = child.fork(5, str(tmp_path / "c"))
  assert_same(child2.restore(5), lora_tree(105))
  for m_ in (mgr, child, child2):
    m_.close()


# --- with two tiers and self-healing -----------------------------------------------------------

def tiered_tree(v: int) -> dict:
  """lora_tree whose optimizer moments change at step 1 only: later steps refer to step 1's
  data for them (and to step 0's for the frozen base)."""
  out = lora_tree(v)
  out["opt"]["mu"] = np.full((8192,), min(v, 1) * 0.5, np.float32)
  return out


def test_incremental_manager_with_a_fast_tier_restores_from_the_durable_tier_alone(tmp_path,
                                                                                   capsys):
  """Saves go to the fast tier, incremental on its newest step; every durable copy brings the
  referenced data the durable tier lacks (step 1 was never durable: its data arrives as a
  REFERENCED step). Both tiers' retention keeps referenced data. With the fast tier wiped, a
  new manager restores the newest durable step bitwise."""
  durable, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
  kw = dict(max_to_keep=2, save_interval_steps=2, local_directory=fast,
            local_save_interval_steps=1, local_max_to_keep=2, incremental=True)
  mgr = fnckpt.CheckpointManager(durable, **kw)
  for v in range(6):
    mgr.save(v, tiered_tree(v))
    mgr.wait()
  for s in (4, 5):
    assert_same(mgr.restore(s), tiered_tree(s))
  mgr.close()
  m4 = _records_of(f"{durable}/4")
  assert sorted(b.dir for b in m4.bases) == ["0", "1"]   # the frozen base; the moments
  listing = fnckpt._manager.steps.StepIndex(durable).list()
  assert listing.steps == [2, 4] and listing.held == [0, 1]
  assert not os.path.exists(f"{durable}/1/COMMIT") and os.path.exists(f"{durable}/1/REFERENCED")
  assert fnckpt._manager.steps.StepIndex(fast).list().held == [0, 1]
  assert cli_main(["ls", durable, "--local", fast]) == 0
  rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()]
  for tier in ("durable", "local"):
    assert [tier, "0", "referenced"] in rows and [tier, "1", "referenced"] in rows
  assert ["durable", "4", "committed"] in rows and ["local", "5", "committed"] in rows
  # a copy interrupted midway is completed by the next one (missing objects copied again)
  from fnckpt._manager import tiers as _tiers
  held = sorted(k for k in files_under(f"{durable}/1") if k.startswith("data-"))
  os.remove(f"{durable}/1/{held[0]}")
  with open(f"{fast}/5/manifest.msgpack", "rb") as f:
    assert _tiers.copy_referenced(fast, durable, 5, f.read(), None, None) > 0
  assert sorted(k for k in files_under(f"{durable}/1") if k.startswith("data-")) == held
  shutil.rmtree(fast)
  again = fnckpt.CheckpointManager(durable, **kw)
  state, step = again.restore_or_init(tiered_tree(0))
  assert step == 4
  assert_same(state, tiered_tree(4))
  assert_same(again.restore(2), tiered_tree(2))
  again.close()


def test_a_missing_reference_is_damage_self_healing_falls_back(tmp_path):
  """Data a newer step refers to is gone: restore() warns, marks the steps that cannot be
  restored and restores the newest one that can (never one with a missing reference)."""
  root = str(tmp_path / "run")
  mgr = fnckpt.CheckpointManager(root, incremental=True, full_every=2)
  for v in range(4):   # 0 full, 1 -> 0, 2 full, 3 -> 2
    mgr.save(v, lora_tree(v))
    mgr.wait()
  data = [d for d in os.listdir(f"{root}/2") if d.startswith("data-")]
  shutil.rmtree(f"{root}/2/{data[0]}")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = mgr.restore()
  texts = [str(w.message) for w in caught if w.category is RuntimeWarning]
  assert len(texts) == 2, texts
  assert re.search(r"Step 3 of .* is damaged: .*refers to the data data-\w+ of the checkpoint "
                   r"at '.*/2', which is missing", texts[0]), texts[0]
  assert re.search(r"Step 2 of .* is damaged: .*a chunk of its data is missing", texts[1])
  assert_same(state, lora_tree(1))
  listing = fnckpt._manager.steps.StepIndex(root).list()
  assert sorted(listing.damaged) == [2, 3] and mgr.all_steps() == [0, 1]
  with pytest.raises(fnckpt.CheckpointError, match="Step 3 of .* is marked damaged"):
    mgr.restore(3)
  mgr.close()


def test_a_damaged_step_whose_data_others_refer_to(tmp_path, capsys):
  """A step marked damaged is never deleted by retention, and the data it refers to stays;
  deleting it keeps the data that other steps refer to (its REFERENCED rest)."""
  from fnckpt._manager import health as _health
  root = str(tmp_path / "run")
  mgr = fnckpt.CheckpointManager(root, max_to_keep=2, incremental=True)
  for v in range(3):
    mgr.save(v, tiered_tree(v))
    mgr.wait()
  _health.mark_step(root, 1, "found damaged (test)")
  for v in range(3, 6):
    mgr.save(v, tiered_tree(v))
    mgr.wait()
  listing = fnckpt._manager.steps.StepIndex(root).list()
  assert listing.steps == [4, 5] and list(listing.damaged) == [1] and listing.held == [0]
  assert 1 in listing.referrers and os.path.exists(f"{root}/1/COMMIT")
  mgr.delete(1)   # steps 4 and 5 refer to its moments: that data stays
  assert fnckpt._manager.steps.StepIndex(root).list().held == [0, 1]
  for s in (4, 5):
    assert_same(mgr.restore(s), tiered_tree(s))
  assert cli_main(["ls", root]) == 0
  assert "referenced" in capsys.readouterr().out
  mgr.close()


# --- memory://, S3 and GCS ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["memory", "s3", "gcs"])
def test_contract_on_memory_and_object_stores(kind, request):
  if kind == "memory":
    root, options = f"memory://inc/{uuid.uuid4().hex}", None
  else:
    server = request.getfixturevalue(f"{kind}_env")
    root, options = server.unique_url("inc"), dict(server.storage_options)
  hashed_save(lora_tree(1), f"{root}/x/1", storage_options=options).wait()
  fnckpt.save(lora_tree(2), f"{root}/x/2", storage_options=options, base=f"{root}/x/1").wait()
  assert_same(fnckpt.restore(f"{root}/x/2", storage_options=options), lora_tree(2))
  assert not [k for k in _paths.list_keys(f"{root}/x/2", options) if "/a/" in k]
  mgr = fnckpt.CheckpointManager(f"{root}/run", max_to_keep=1, incremental=True,
                                 storage_options=options)
  for v in range(3):  # (each committed before the next: a save refers to a committed step)
    mgr.save(v, lora_tree(v))
    mgr.wait()
  child = mgr.fork(2, f"{root}/fork")
  mgr.save(3, lora_tree(3))
  child.save(3, lora_tree(33))
  mgr.wait()
  child.wait()
  assert child.all_steps() == [3]  # its retention dropped the forked step 2
  assert_same(child.restore(3), lora_tree(33))
  assert_same(mgr.restore(3), lora_tree(3))
  held = fnckpt._manager.steps.StepIndex(f"{root}/run", options).list().held
  assert held == [0, 2]  # 2: the fork
  mgr.close()
  child.close()


# --- two processes ------------------------------------------------------------------------------

def test_two_processes_incremental_save(tmp_path):
  """A leaf sharded over both processes (pieces: 64 KiB device shards): unchanged -> reused
  (no chunk written by either); changed on process 1 only -> process 1 writes its run of the
  leaf's chunks and process 0's run is the base's, reused (format 3: pieces stay on with a
  base, each writer's run reused or written on its own); all restore."""
  import test_collective_mp as cmp
  leaves = {"a": {"shape": [64, 1024], "spec": ["x", "y"]},     # 256 KiB, chunks on both
            "b": {"shape": [128, 64], "spec": "replicated"},      # packed
            "f": {"shape": [8], "spec": "replicated"}}
  base = str(tmp_path / "full")
  outcomes = cmp.run(tmp_path, [
      {"path": "full"},
      {"path": "same", "base": base},
      {"path": "half", "base": base, "change": {"1": {"reseed": ["a"]}}},
  ], leaves=leaves)
  for p in outcomes:
    assert all("ok" in o for o in p), p
    assert p[1]["ok"]["chunks_written"] == 0 and p[1]["ok"]["bytes_reused"] > 0
  cmp.check_restores(str(tmp_path / "same"), leaves)
  full = fnckpt.restore(base)["a"]
  half = fnckpt.restore(str(tmp_path / "half"))["a"]
  equal_rows = [np.array_equal(full[r], half[r]) for r in range(64)]
  assert any(equal_rows) and not all(equal_rows)
  ms = {k: _source.open_source(str(tmp_path / k)).manifest for k in ("full", "same", "half")}
  a = {k: next(l for l in m.leaves if l.path == (("dict", "a"),)) for k, m in ms.items()}
  assert all(l.pieces is not None for l in a.values()), a
  runs = {k: _runs.writer_runs(ms[k], a[k]) for k in ms}
  assert [r.process for r in runs["half"]] == [0, 1]
  based = lambda k, r: ms[k].packs[r.pack].base is not None  # noqa: E731
  assert not any(based("full", r) for r in runs["full"])
  assert all(based("same", r) for r in runs["same"])           # both runs reused
  assert a["same"].pieces.hashes == a["full"].pieces.hashes
  p0, p1 = runs["half"]
  assert based("half", p0) and not based("half", p1), runs["half"]   # 0 reused, 1 written
  assert a["half"].pieces.hashes[:16] == a["full"].pieces.hashes[:16]
  assert a["half"].pieces.hashes[16:] != a["full"].pieces.hashes[16:]
  assert ms["half"].packs[p0.pack].dir == ms["full"].packs[runs["full"][0].pack].dir
  assert p0.lo == runs["full"][0].lo
  half0, half1 = (p[2]["ok"] for p in outcomes)
  assert half0["bytes_written"] == half0["chunks_written"] == 0, half0
  assert half0["bytes_reused"] >= p0.hi - p0.lo, half0
  assert half1["bytes_written"] >= p1.hi - p1.lo, half1
  assert cli_main(["verify", str(tmp_path / "half")]) == 0


def test_two_processes_incremental_manager_and_fork(tmp_path):
  """The manager's collective choice of base (process 0 decides and claims), retention that
  keeps referenced data, and a fork, under 2 real processes."""
  import json, sys
  worker = os.path.join(hp.HERE, "mp_manager_worker.py")
  port = hp.free_port()
  cfg = {"mode": "incremental", "root": str(tmp_path / "run"), "fork": str(tmp_path / "fork"),
         "barrier_s": 60, "port": port, "num_processes": 2}
  procs = [hp.start([sys.executable, worker, json.dumps({**cfg, "process_id": i})],
                    hp.child_env()) for i in range(2)]
  runs = hp.finish(procs, timeout=240)
  for r in runs:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
    out = r.result
    assert out["parent"] == [4, 6] and out["fork"] == [4, 5]  # (max_to_keep=2 too)
    assert out["checked"] and all(n > 0 for n in out["checked"].values())
  assert fnckpt._manager.steps.StepIndex(str(tmp_path / "run")).list().held  # data kept for others


# --- the state machine --------------------------------------------------------------------------

MESH8 = None


def machine_tree(v: int) -> dict:
  """Leaves that change at different rates: a frozen zarr array, a packed leaf changing every
  save and one every other save, and a leaf sharded 8 ways whose first row alone changes."""
  global MESH8
  if MESH8 is None:
    MESH8 = jax.make_mesh((8,), ("x",))
  rows = np.arange(8 * 512, dtype=np.float32).reshape(8, 512)
  rows[0] = v
  return {"frozen": np.arange(4096, dtype=np.float32),
          "fast": np.full(1024, v, np.float32), "slow": np.full(1024, v // 2, np.int32),
          "sharded": jax.device_put(rows, NamedSharding(MESH8, P("x"))), "v": v}


CRASH_PHASES = ("staging", "written", "manifest", "committing")


class IncrementalMachine(RuleBasedStateMachine):
  """Runs (a parent and its forks), each a dict step -> value, under retention max_to_keep."""

  def __init__(self):
    super().__init__()
    self.runs = []          # [(manager, model)]
    self.counter = 0

  root_kind = "memory"

  @initialize(k=st.integers(1, 3), full_every=st.none() | st.integers(2, 3))
  def start(self, k, full_every):
    self.k, self.full_every = k, full_every
    if self.root_kind == "memory":
      self.prefix = f"memory://inc-machine/{uuid.uuid4().hex}"
    else:
      import tempfile
      self.prefix = tempfile.mkdtemp(prefix="fnckpt-inc-machine-")
    self.runs.append((self._manager(f"{self.prefix}/r0"), {}))

  def _manager(self, root):
    return fnckpt.CheckpointManager(root, max_to_keep=self.k, incremental=True,
                                    full_every=self.full_every, save_options=SMALL)

  def _next_step(self, model):
    self.counter += 1
    return max(max(model, default=0) + 1, self.counter)

  @rule(r=st.integers(0, 3))
  def save(self, r):
    mgr, model = self.runs[r % len(self.runs)]
    step = self._next_step(model)
    mgr.save(step, machine_tree(step))
    mgr.wait()
    model[step] = step
    for s in sorted(model)[:-self.k]:
      del model[s]

  @rule(r=st.integers(0, 3), phase=st.sampled_from(CRASH_PHASES))
  def crash(self, r, phase):
    mgr, model = self.runs[r % len(self.runs)]
    step = self._next_step(model)
    original = _state.hooks.on_phase

    def fail(name):
      if name == phase:
        raise OSError(f"injected failure at {name}")

    _state.hooks.on_phase = fail
    try:
      with pytest.raises(fnckpt.CheckpointError, match="injected failure"):
        mgr.save(step, machine_tree(step))
        mgr.wait()
    finally:
      _state.hooks.on_phase = original

  @precondition(lambda self: len(self.runs) < 3)
  @rule(r=st.integers(0, 3), data=st.data())
  def fork(self, r, data):
    mgr, model = self.runs[r % len(self.runs)]
    if not model:
      return
    step = data.draw(st.sampled_from(sorted(model)))
    child = mgr.fork(step, f"{self.prefix}/r{len(self.runs)}")
    self.runs.append((child, {step: model[step]}))

  @rule(r=st.integers(0, 3), data=st.data())
  def delete(self, r, data):
    mgr, model = self.runs[r % len(self.runs)]
    if len(model) < 2:
      return
    step = data.draw(st.sampled_from(sorted(model)[:-1]))
    mgr.delete(step)
    del model[step]

  @rule(r=st.integers(0, 3))
  def cleanup(self, r):
    mgr, _ = self.runs[r % len(self.runs)]
    mgr.cleanup()

  @invariant()
  def every_committed_checkpoint_restores_bitwise(self):
    for mgr, model in self.runs:
      mgr.wait()
      assert mgr.all_steps() == sorted(model)
      for step, v in model.items():
        got = mgr.restore(step)
        want = machine_tree(v)
        for name in ("frozen", "fast", "slow", "sharded"):
          assert np.asarray(got[name]).tobytes() == np.asarray(want[name]).tobytes(), (step, name)
        assert got["v"] == v

  def teardown(self):
    for mgr, _ in self.runs:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.close()
    if self.root_kind == "file" and hasattr(self, "prefix"):
      shutil.rmtree(self.prefix, ignore_errors=True)


class FileIncrementalMachine(IncrementalMachine):
  root_kind = "file"


IncrementalMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestIncrementalMachine = IncrementalMachine.TestCase
FileIncrementalMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestFileIncrementalMachine = FileIncrementalMachine.TestCase


def test_a_format_1_step_is_not_forked_and_nothing_is_written(tmp_path):
  """A format-1 step (fnckpt 0.1) has no data directory a fork could refer to: the fork is
  refused before anything is written (it used to write the fork record and LINEAGE, then fail
  on the manifest it had made)."""
  run, fork = tmp_path / "run", tmp_path / "fork"
  shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "format1"), run / "7")
  mgr = fnckpt.CheckpointManager(str(run))
  assert mgr.all_steps() == [7]
  with pytest.raises(fnckpt.CheckpointError, match=(
      r"Cannot fork .*/run/7': it is a format-1 checkpoint \(fnckpt 0\.1\), whose data no "
      r"other checkpoint can refer to\. Restore it and save it again with this fnckpt "
      r"\(e\.g\. mgr\.save\(7, mgr\.restore\(7\), force=True\)\), then fork it\.")):
    mgr.fork(7, str(fork))
  assert not os.path.exists(run / "forks") or not os.listdir(run / "forks")
  assert not os.path.exists(fork)
  mgr.save(7, mgr.restore(7), force=True)   # as the error says: then it forks
  mgr.wait()
  child = mgr.fork(7, str(fork))
  assert child.restore(7)["name"] == "fixture" and os.path.exists(fork / "LINEAGE")
  mgr.close()
  child.close()


def test_fork_keeps_per_process_values(tmp_path):
  mgr = fnckpt.CheckpointManager(str(tmp_path / "a"))
  mgr.save(1, {"w": np.arange(10000.0), "pos": fnckpt.PerProcess({"i": 7})})
  mgr.wait()
  child = mgr.fork(1, str(tmp_path / "b"))
  got = child.restore(1, {"w": np.zeros(10000), "pos": fnckpt.PerProcess(None)})
  assert got["pos"].value == {"i": 7} and got["w"][-1] == 9999.0
  with pytest.raises(fnckpt.CheckpointError, match="exists there already"):
    mgr.fork(1, str(tmp_path / "b"))
  with pytest.raises(fnckpt.CheckpointError, match="inside\\) the run"):
    mgr.fork(1, str(tmp_path / "a" / "sub"))
  mgr.close()
  child.close()


def test_a_base_deleted_during_the_save_fails_it(tmp_path, monkeypatch):
  """No committed checkpoint ever refers to data that may be gone."""
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  hashed_save(lora_tree(1), a).wait()

  def hook(name):
    if name == "staging":
      shutil.rmtree(a)

  monkeypatch.setattr(_state.hooks, "on_phase", hook)
  with pytest.raises(fnckpt.CheckpointError, match="was deleted or replaced while this save "
                     "was writing; the new checkpoint would refer to its data, so it is not "
                     "committed"):
    fnckpt.save(lora_tree(2), b, base=a).wait()
  assert not os.path.exists(os.path.join(b, "COMMIT"))


# --- review findings (issue 12) -----------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_small_budget_does_not_hang_an_incremental_save(tmp_path):
  """The writer's buffered pack segment holds budget: it is written before the writer waits
  for more (else the caller, waiting for budget, and the writer wait for each other)."""
  def t(v):
    return {"a": np.full((1 << 18,), v, np.float32),             # 1 MiB, packed
            "b": np.full(((4 << 20) // 4 - 16,), v, np.float32)}  # ~4 MiB, packed
  a, b = str(tmp_path / "1"), str(tmp_path / "2")
  fnckpt.save(t(1), a, budget_bytes=8 << 20).wait()
  fnckpt.save(t(2), b, base=a, budget_bytes=8 << 20).wait()
  assert_same(fnckpt.restore(b), t(2))
  assert_same(fnckpt.restore(a), t(1))


def test_verify_reports_a_reference_above_the_root_naming_the_leaf(tmp_path, capsys):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  hashed_save({"w": FROZEN}, a).wait()
  fnckpt.save({"w": FROZEN}, b, base=a).wait()
  raw = msgpack.unpackb(open(f"{b}/manifest.msgpack", "rb").read(), strict_map_key=False)
  assert raw["bases"], "the test needs b to refer to a"
  raw["bases"][0]["dir"] = "../" * 40 + "x"
  body = _manifest.pack(raw)
  open(f"{b}/manifest.msgpack", "wb").write(body)
  open(f"{b}/COMMIT", "wb").write(_manifest.encode_commit(body, 0.0))
  assert cli_main(["verify", "-q", b]) == 1
  out = capsys.readouterr()
  assert "['w']" in out.out + out.err and "leads above the root of its storage" in out.out + out.err


def test_a_fork_by_another_job_during_retention_keeps_its_data(tmp_path):
  """Retention read forks/ before another job forked the doomed step: the deletion reads the
  fork records again once the step's marker is gone."""
  run, fk = str(tmp_path / "run"), str(tmp_path / "fork")
  t = lambda s: {"big": FROZEN + s, "s": s}
  a = fnckpt.CheckpointManager(run, max_to_keep=2)   # training
  b = fnckpt.CheckpointManager(run)                  # another job on the same run
  for s in (1, 2):
    a.save(s, t(s))
    a.wait()
  real = a._index.refs.kept

  def kept(listing, doomed):
    out = real(listing, doomed)           # forks/ read (none yet) ...
    if doomed and not getattr(kept, "done", False):
      kept.done = True
      b.fork(1, fk)                       # ... the other job forks step 1 now
    return out

  a._index.refs.kept = kept
  a.save(3, t(3))
  a.wait()
  assert kept.done and a.all_steps() == [2, 3]
  assert_same(fnckpt.CheckpointManager(fk).restore(1), t(1))
  a.close()
  b.close()


def test_a_fork_of_a_step_deleted_meanwhile_is_not_committed(tmp_path, monkeypatch):
  from fnckpt._manager import fork as _fork
  run, fk = str(tmp_path / "run"), str(tmp_path / "fork")
  mgr = fnckpt.CheckpointManager(run)
  mgr.save(1, {"w": FROZEN})
  mgr.wait()
  real = _fork._copy_per_process

  def racing(*a):  # another job deletes step 1 after the fork read it
    os.remove(os.path.join(run, "1", "COMMIT"))
    return real(*a)

  monkeypatch.setattr(_fork, "_copy_per_process", racing)
  with pytest.raises(fnckpt.CheckpointError, match="Cannot fork '.*1': it was deleted or "
                     "replaced \\(by another job\\) while the fork was being written"):
    mgr.fork(1, fk)
  assert not os.path.exists(os.path.join(fk, "1", "COMMIT"))
  assert not os.listdir(os.path.join(run, "forks"))
  mgr.close()


def _pause_save_of(monkeypatch, path: str):
  """Hold the writer of the save to ``path`` at its "written" phase: (paused, gate) events;
  set ``gate`` to let it go on."""
  import threading
  gate, paused = threading.Event(), threading.Event()

  def hook(name):
    if name == "written" and threading.current_thread().name.endswith(path):
      paused.set()
      gate.wait(60)

  monkeypatch.setattr(_state.hooks, "on_phase", hook)
  return paused, gate


def test_force_save_of_the_base_of_a_save_in_flight_is_refused(tmp_path, monkeypatch):
  d = str(tmp_path)
  mgr = fnckpt.CheckpointManager(d, incremental=True)
  mgr.save(1, lora_tree(1))
  mgr.wait()
  paused, gate = _pause_save_of(monkeypatch, f"{d}/2")
  mgr.save(2, lora_tree(2))   # refers to step 1's data
  assert paused.wait(60)
  try:
    with pytest.raises(fnckpt.CheckpointError, match="Step 1 of .* cannot be replaced: an "
                       "incremental save in flight refers to its data"):
      mgr.save(1, lora_tree(11), force=True)
  finally:
    gate.set()
  mgr.wait()
  assert_same(mgr.restore(1), lora_tree(1))
  assert_same(mgr.restore(2), lora_tree(2))
  with pytest.raises(fnckpt.CheckpointError, match=r"Step 1 of .* cannot be replaced: steps "
                     r"\[2\] refer to its data"):
    mgr.save(1, lora_tree(11), force=True)   # (step 2 is committed now)
  mgr.close()


def test_retention_reads_references_after_claiming(tmp_path, monkeypatch):
  """A save that commits after retention listed the steps may refer to a step it dooms."""
  import threading
  d = str(tmp_path)
  x0, y0 = np.arange(1 << 18, dtype=np.float32), np.arange(1 << 18, dtype=np.float32) * 3
  mgr = fnckpt.CheckpointManager(d, incremental=True, max_to_keep=1, keep_every=2)
  mgr.save(1, {"x": x0, "y": y0})
  mgr.wait()
  paused, gate = _pause_save_of(monkeypatch, f"{d}/2")
  h2 = mgr.save(2, {"x": x0 + 1, "y": y0})   # refers to step 1's y; held at "written"
  assert paused.wait(60)
  real_list = mgr._index.list

  def listing(*a, **k):
    out = real_list(*a, **k)
    if threading.current_thread().name.endswith("/3") and not getattr(listing, "done", 0):
      listing.done = 1   # (step 3's retention: its policy's listing, without step 2)
      gate.set()
      h2.wait()          # step 2 commits (and stops claiming its base) after this listing
      with mgr._claims._cond:   # step 2's retention has held step 1 (and is done with it)
        mgr._claims._cond.wait_for(lambda: os.path.exists(os.path.join(d, "1", "REFERENCED"))
                                   and not mgr._claims._deleting)
    return out

  monkeypatch.setattr(mgr._index, "list", listing)
  mgr.save(3, {"x": x0 + 2, "y": y0 + 2})
  mgr.wait()
  assert listing.done and mgr.all_steps() == [2, 3]
  assert_same(mgr.restore(2), {"x": x0 + 1, "y": y0})
  mgr.close()


def test_held_data_is_collected_from_a_listing_taken_after_claiming(tmp_path, monkeypatch):
  """Step 1 is held (step 2 refers to its y). Step 4's retention lists the steps before step
  3 (which refers to step 1's y too) commits: dropping held data by that listing would lose
  what step 3 refers to."""
  import threading
  d = str(tmp_path)
  x0, y0 = np.arange(1 << 18, dtype=np.float32), np.arange(1 << 18, dtype=np.float32) * 3
  mgr = fnckpt.CheckpointManager(d, incremental=True, max_to_keep=1, keep_every=3)
  for s in (1, 2):
    mgr.save(s, {"x": x0 + s, "y": y0})
    mgr.wait()
  assert os.path.exists(os.path.join(d, "1", "REFERENCED"))
  paused, gate = _pause_save_of(monkeypatch, f"{d}/3")
  h3 = mgr.save(3, {"x": x0 + 3, "y": y0})   # refers to step 1's y; held at "written"
  assert paused.wait(60)
  real_list = mgr._index.list

  def listing(*a, **k):
    out = real_list(*a, **k)
    if threading.current_thread().name.endswith("/4") and not getattr(listing, "done", 0):
      listing.done = 1   # (step 4's retention: its policy's listing, without step 3)
      gate.set()
      h3.wait()          # step 3 commits; its retention deletes step 2
      with mgr._claims._cond:
        mgr._claims._cond.wait_for(lambda: not os.path.exists(os.path.join(d, "2"))
                                   and not mgr._claims._deleting)
    return out

  monkeypatch.setattr(mgr._index, "list", listing)
  mgr.save(4, {"x": x0 + 4, "y": y0 + 4})
  mgr.wait()
  assert listing.done and mgr.all_steps() == [3, 4]
  assert_same(mgr.restore(3), {"x": x0 + 3, "y": y0})
  mgr.close()


def test_held_data_is_collected_when_the_policy_keeps_every_step(tmp_path):
  mgr = fnckpt.CheckpointManager(str(tmp_path), incremental=True)   # no retention rule
  for s in (1, 2):
    mgr.save(s, lora_tree(s))
    mgr.wait()
  mgr.delete(1)
  assert os.path.exists(tmp_path / "1" / "REFERENCED")   # step 2 refers to its data
  shutil.rmtree(tmp_path / "2")          # another tool removed the step referring to it
  mgr.save(3, lora_tree(3))
  mgr.wait()
  assert not os.path.exists(tmp_path / "1") and mgr.all_steps() == [3]
  assert_same(mgr.restore(3), lora_tree(3))
  mgr.close()


def test_overwrite_with_a_base_that_refers_to_the_new_path_reuses_nothing_there(tmp_path):
  """save(p2, base=p3, overwrite=True) where p3 refers to p2's data: p2's old data goes, so
  the new p2 must not refer to it (it writes those leaves itself)."""
  p2, p3 = str(tmp_path / "2"), str(tmp_path / "3")
  hashed_save(lora_tree(2), p2).wait()
  fnckpt.save(lora_tree(3), p3, base=p2).wait()
  assert _records_of(p3).bases, "the test needs p3 to refer to p2"
  fnckpt.save(lora_tree(22), p2, base=p3, overwrite=True).wait()
  assert not _records_of(p2).bases
  assert_same(fnckpt.restore(p2), lora_tree(22))


def test_a_base_that_contains_the_new_checkpoint_is_an_error_naming_both(tmp_path):
  anc = str(tmp_path / "anc")
  hashed_save({"a": np.ones(5000, np.float32)}, anc).wait()
  with pytest.raises(fnckpt.CheckpointError, match=r"Cannot refer to '.*anc' from a checkpoint "
                     r"in '.*anc': the reference would be '\.'.*not to a directory that "
                     "contains it"):
    fnckpt.save({"a": np.ones(5000, np.float32)}, f"{anc}/sub", base=anc).wait()


def test_delete_collects_data_nothing_refers_to_any_more(tmp_path):
  mgr = fnckpt.CheckpointManager(str(tmp_path), incremental=True)   # no retention rule
  for s in (1, 2, 3):
    mgr.save(s, lora_tree(s))
    mgr.wait()
  mgr.delete(1)
  assert os.path.exists(tmp_path / "1" / "REFERENCED")   # 2 and 3 refer to its data
  mgr.delete(2)
  mgr.delete(3)
  assert sorted(os.listdir(tmp_path)) == []
  mgr.save(1, lora_tree(100))   # the step number is free again
  mgr.wait()
  assert_same(mgr.restore(1), lora_tree(100))
  mgr.close()


def test_cleanup_collects_data_nothing_refers_to_any_more(tmp_path):
  mgr = fnckpt.CheckpointManager(str(tmp_path), incremental=True)
  for s in (1, 2):
    mgr.save(s, lora_tree(s))
    mgr.wait()
  mgr.delete(1)
  shutil.rmtree(tmp_path / "2")          # another tool removed the step referring to it
  assert mgr.cleanup() == [] and not os.path.exists(tmp_path / "1")
  mgr.close()


def test_saving_a_held_step_number(tmp_path):
  """A deleted step whose data is kept: refused while referred to, cleared once not."""
  mgr = fnckpt.CheckpointManager(str(tmp_path), incremental=True)
  for s in (1, 2):
    mgr.save(s, lora_tree(s))
    mgr.wait()
  mgr.delete(1)
  with pytest.raises(fnckpt.CheckpointError, match=r"Step 1 of .* cannot be replaced: steps "
                     r"\[2\] refer to its data"):
    mgr.save(1, lora_tree(10), force=True)
  shutil.rmtree(tmp_path / "2")          # another tool removed the step referring to it
  mgr.save(1, lora_tree(10), force=True)
  mgr.wait()
  assert_same(mgr.restore(1), lora_tree(10))
  assert not os.path.exists(tmp_path / "1" / "REFERENCED")
  mgr.close()


@pytest.mark.parametrize("zstd", [None, 3])
def test_stats_of_a_leaf_written_whole_and_copies_under_a_small_budget(tmp_path, zstd,
                                                                         monkeypatch):
  """One of 8 chunks changed: all 8 are in the new array (7 copied from the base), so the
  stats say 8 chunks written, nothing reused; the copies hold budget (a tiny one, few reads
  in flight) and still finish."""
  from fnckpt._save import delta as _delta
  monkeypatch.setattr(_delta, "COPY_WINDOW", 2)
  held, real_copy = [], _delta._copy_one

  def copy_one(plan, delta, kv, item):   # what the save's budget holds as each copy is written
    held.append((_state.saves.budget.held, item[3], _state.saves.budget.limit))
    return real_copy(plan, delta, kv, item)

  monkeypatch.setattr(_delta, "_copy_one", copy_one)
  s = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  w = np.random.default_rng(0).standard_normal((8, 4096)).astype(np.float32)
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  hashed_save({"w": jax.device_put(w, s)}, a, pack_bytes=0, zstd=zstd).wait()
  w2 = w.copy()
  w2[3, 7] = -1
  st = fnckpt.save({"w": jax.device_put(w2, s)}, b, base=a, pack_bytes=0, zstd=zstd,
                   budget_bytes=4096 * 4 * 2).wait()
  assert (st.bytes_written, st.bytes_reused, st.chunks_written) == (w.nbytes, 0, 8)
  assert len(held) == 7 and all(n <= h <= limit for h, n, limit in held)  # charged, bounded
  assert len(files_under(os.path.join(b, _records_of(b).data))) >= 8  # (all chunks there)
  assert np.asarray(fnckpt.restore(b)["w"]).tobytes() == w2.tobytes()
  assert cli_main(["verify", b]) == 0


def test_packed_candidates_are_copied_off_the_devices_up_front(tmp_path, monkeypatch):
  """save(base=): the packed leaves that may reuse the base's are among the device data whose
  host copies start at once (on accelerators), like every other leaf."""
  seen = []
  real = _staging.to_copy
  monkeypatch.setattr(_staging, "to_copy", lambda plan: seen.append(real(plan)) or seen[-1])
  # (the staging start_copies serves: on CPU the default, "asarray", stages views)
  monkeypatch.setattr(_state.hooks, "staging", "asarray")
  t = {f"m{i}": jax.numpy.full((8192,), i, jax.numpy.float32) for i in range(20)}
  hashed_save(t, str(tmp_path / "1")).wait()
  fnckpt.save(t, str(tmp_path / "2"), base=str(tmp_path / "1")).wait()
  assert [len(s) for s in seen] == [20, 20]
  assert _records_of(str(tmp_path / "2")).bases   # (the packed leaves were candidates)
  assert_same(fnckpt.restore(str(tmp_path / "2")), t)


def test_a_base_deleted_while_it_is_chosen_is_looked_for_again(tmp_path, monkeypatch):
  """A listing taken just before a newer step committed names an older step that retention
  then deletes: the save looks again and refers to the newer step instead of writing in full
  (the race CI saw under load: a fork's step 5 written in full)."""
  import dataclasses
  d = str(tmp_path)
  mgr = fnckpt.CheckpointManager(d, incremental=True)
  for s in (1, 2):
    mgr.save(s, lora_tree(s))
    mgr.wait()
  real, looks = mgr._index.list, []

  def stale(*a, **k):
    out = real(*a, **k)
    looks.append(out.steps)
    return dataclasses.replace(out, committed={0: b"gone"}) if len(looks) == 1 else out

  monkeypatch.setattr(mgr._index, "list", stale)
  stats = mgr.save(3, lora_tree(3)).wait()
  monkeypatch.undo()
  assert len(looks) >= 2 and stats.bytes_reused > 0
  assert_same(mgr.restore(3), lora_tree(3))
  mgr.close()
