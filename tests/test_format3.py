"""Reading format 3 (docs/format.md "Version 3"): checkpoints of every storage kind (inline, packed,
pieced over the 8 virtual devices, stored zarr arrays, data referenced by an incremental save)
made format 3 by ``v3util.upgrade`` (until the format-3 writer lands) restore, export and
verify bitwise equal; changed data behind valid crc32c checksums (a packed leaf's bytes, a
writer's run of pieces read whole) makes ``restore`` raise :class:`DamagedError` naming the
leaf (a stored chunk rewritten through TensorStore: restore does not hash those) and
``fnckpt verify`` fail naming the mismatch; a
format-2 checkpoint with SHA-256 hashes is verified as before, one without says "crc32c only".
"""

import contextlib
import io
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import fnckpt
import v3util
from fnckpt import _state
from fnckpt._errors import DamagedError
from fnckpt._layout import pieces as _pieces
from fnckpt.cli import main


@pytest.fixture(autouse=True)
def _replicated_pieces(monkeypatch):
  """``q`` of v3util's pieces tree (replicated over an axis) has 1.25 MiB shards."""
  monkeypatch.setattr(_pieces, "PIECE_BYTES", 2 << 20)


def verify(path):
  """(exit code, stdout) of ``fnckpt verify -q PATH``."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = main(["verify", "-q", str(path)])
  return rc, out.getvalue()


def assert_same(got, want):
  g, w = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(g) == len(w)
  for a, b in zip(g, w):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def saved_v3(tmp_path, name, tree=None):
  """A format-3 checkpoint of v3util's tree ``name``."""
  tree = v3util.trees()[name] if tree is None else tree
  path = str(tmp_path / name)
  fnckpt.save(tree, path).wait()
  m = v3util.upgrade(path)
  assert m.version == 3 and m.hash == "xxh3-128"
  return path, tree


@pytest.mark.parametrize("name", ["inline", "packed", "pieces", "stored", "mixed"])
def test_every_storage_kind_restores_exports_and_verifies(tmp_path, name):
  path, tree = saved_v3(tmp_path, name)
  want = {"inline": {"inline"}, "packed": {"packed", "inline"}, "pieces": {"pieces"},
          "stored": {"stored"}, "mixed": {"inline", "packed", "pieces", "stored"}}[name]
  assert v3util.kinds(path) == want
  assert_same(fnckpt.restore(path, tree), tree)
  assert_same(fnckpt.restore(path), jax.tree.map(np.asarray, tree))   # onto the host
  rc, out = verify(path)
  assert rc == 0 and out.startswith("OK "), out
  assert ("(crc32c and xxh3-128 content hashes)" in out) == (name != "inline"), out
  fnckpt.export_safetensors(path, tmp_path / "x.safetensors")
  got = load_file(str(tmp_path / "x.safetensors"))
  for k, v in tree.items():
    if hasattr(v, "dtype"):
      assert np.asarray(v).tobytes() == got[k].tobytes(), k


def test_pieces_are_read_from_their_recorded_runs(tmp_path):
  """Runs anywhere: the chunks of ['p'] moved to a new place in pack 0 (format 3 records where
  they are; a format-2 reader would compute the old place)."""
  path, tree = saved_v3(tmp_path, "pieces")
  from fnckpt._format import manifest as _manifest, records, runs as _runs
  from fnckpt._sources import read as _read, source as _source
  src = _source.open_source(path)
  m = src.manifest
  rec = v3util.leaf(path, "p")
  (r,) = _runs.writer_runs(m, rec)
  data = v3util.read_pack(_read.Opener(src), r.pack, r.lo, r.hi)
  # a new pack 1 holding only ['p']'s run, at offset 4096
  import tensorstore as ts
  from fnckpt._io import arrays as _store
  new = records.Pack(f"{m.data}/p/moved", 4096 + data.size, 4096 + data.size, 4096 + data.size)
  arr = ts.open(_store.pack_spec(src.kv_spec, new.dir, new.nbytes, new.chunk, new.inner),
                create=True, open=True, read=True, write=True).result()
  arr[4096:].write(data).result()
  runs = np.array([(len(m.packs), 4096)], _runs.RUN).tobytes()
  leaves = tuple(records.evolve(l, pieces=records.evolve(l.pieces, runs=runs))
                 if l.index == rec.index else l for l in m.leaves)
  moved = records.evolve(m, leaves=leaves, packs=m.packs + (new,))
  raw = _manifest.pack(records.encode(moved))
  with open(os.path.join(path, "manifest.msgpack"), "wb") as f:
    f.write(raw)
  with open(os.path.join(path, "COMMIT"), "wb") as f:
    f.write(_manifest.pack({"format": "fnckpt", "version": 3,
                            "manifest_sha256": _manifest.digest(raw), "committed": 1.0}))
  v3util.tamper_pack(path, r.pack, r.lo, r.hi)   # the old place no longer holds them
  assert_same(fnckpt.restore(path, tree), tree)
  assert verify(path)[0] == 0


def test_referenced_data_of_an_incremental_save(tmp_path):
  tree = v3util.trees()["mixed"]
  a, b, c = (str(tmp_path / n) for n in "abc")
  fnckpt.save(tree, a).wait()
  fnckpt.save(tree, b, base=a).wait()
  stats = fnckpt.save(tree, c, base=b).wait()
  assert stats.bytes_reused > 0
  for p in (b, c):
    v3util.upgrade(p)
  assert_same(fnckpt.restore(c, tree), tree)
  rc, out = verify(c)
  assert rc == 0, out
  v3util.tamper_packed(a, "w")          # the referenced data changed: c is damaged too
  with pytest.raises(DamagedError, match=r"\['w'\].*does not match its recorded content hash"):
    fnckpt.restore(c, tree)
  rc, out = verify(c)
  assert rc == 1 and "DAMAGED ['w'] (referenced:" in out and "content hash mismatch" in out


def test_a_changed_packed_leaf_is_damage(tmp_path):
  path, tree = saved_v3(tmp_path, "packed")
  v3util.tamper_packed(path, "w")
  with pytest.raises(DamagedError, match=r"Cannot restore \['w'\] from '.*/p/0': its data "
                     r"does not match its recorded content hash \(xxh3-128\)"):
    fnckpt.restore(path, tree)
  rc, out = verify(path)
  assert rc == 1, out
  assert "DAMAGED ['w']: content hash mismatch: its bytes [0, 65536) of the pack at " in out
  assert "do not hash to the recorded xxh3-128" in out


def test_a_changed_stored_chunk_is_found_by_verify(tmp_path):
  """Restore does not hash stored chunks (5% of a large restore: their crc32c is checked on
  every read); verify does."""
  path, tree = saved_v3(tmp_path, "stored")
  box = v3util.tamper_chunk(path, "sh")
  assert box == (slice(0, 512), slice(0, 1280))
  got = np.asarray(fnckpt.restore(path, tree)["sh"])
  np.testing.assert_array_equal(got[box], np.asarray(tree["sh"])[box] + 1)
  rc, out = verify(path)
  assert rc == 1, out
  assert "DAMAGED ['sh']: content hash mismatch: chunk [0:512, 0:1280] (" in out


def test_a_changed_pieces_run_is_damage(tmp_path):
  path, tree = saved_v3(tmp_path, "pieces")
  r = v3util.tamper_run(path, "q")
  host = jax.tree.map(np.asarray, tree)
  with pytest.raises(DamagedError, match=r"Cannot restore \['q'\] from .*: the run of chunks "
                     r"process 0 wrote \(bytes \[\d+, \d+\) of pack 0\) does not match its recorded content "
                     r"hash"):
    fnckpt.restore(path, host)   # onto the host: each writer's run is read whole
  rc, out = verify(path)
  assert rc == 1, out
  assert (f"DAMAGED ['q']: content hash mismatch: the chunks process 0 wrote (bytes "
          f"[{r.lo}, {r.hi}) of the pack at ") in out


def test_restore_checks_can_be_turned_off_for_the_bench(tmp_path, monkeypatch):
  path, tree = saved_v3(tmp_path, "packed")
  v3util.tamper_packed(path, "w")
  monkeypatch.setattr(_state.hooks, "check_hashes", False)
  got = fnckpt.restore(path, tree)
  assert np.asarray(got["w"]).tobytes() != np.asarray(tree["w"]).tobytes()


def _fixture(tmp_path, name: str) -> str:
  """A copy of the format-2 fixture ``name`` (tests/fixtures/format2)."""
  import shutil
  path = str(tmp_path / name)
  shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures", "format2", name), path)
  return path


def test_format_2_hashes_are_verified_as_before(tmp_path):
  path = _fixture(tmp_path, "hashed")
  rc, out = verify(path)
  assert rc == 0 and "SHA-256 content hashes of" in out, out
  v3util.tamper_chunk(path, "stored")
  restored = fnckpt.restore(path)   # (format 2: stored chunks are not checked on read)
  assert np.asarray(restored["stored_jax"]).size
  rc, out = verify(path)
  assert rc == 1 and "DAMAGED ['stored']: content hash mismatch: chunk [" in out, out


def test_a_checkpoint_without_hashes_verifies_by_crc32c_only(tmp_path):
  path = _fixture(tmp_path, "plain")
  rc, out = verify(path)
  assert rc == 0 and "(crc32c only: this checkpoint records no content hashes)" in out, out


def test_the_manager_falls_back_past_a_step_whose_data_changed(tmp_path):
  """A hash mismatch is damage: the manager's restore of the latest step skips it (marked,
  with a warning naming the mismatch) and restores the one before."""
  run = str(tmp_path / "run")
  trees = [{"w": v3util.trees()["packed"]["w"] + i, "step": i} for i in (1, 2)]
  with fnckpt.CheckpointManager(run) as mgr:
    for i, t in zip((1, 2), trees):
      mgr.save(i, t)
  for i in (1, 2):
    v3util.upgrade(f"{run}/{i}")
  v3util.tamper_packed(f"{run}/2", "w")
  with fnckpt.CheckpointManager(run) as mgr:
    with pytest.warns(RuntimeWarning, match=r"Step 2 .* is damaged: .*\['w'\].*does not match its recorded content hash"):
      got = mgr.restore(target=trees[0])
  assert got["step"] == 1
  assert_same(got, trees[0])
