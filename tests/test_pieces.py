"""Pieces (docs/format.md "Pieces"): small device shards of sharded arrays stored as byte ranges of
the per-process packs: which process writes each chunk is a pure function of the sharding;
where its chunks lie is recorded as one run per writing process (format 3; format 2 computed
it from per-process pieces regions, still read).

On 8 virtual devices: several shardings (fully sharded, replicated over some axes, replicated
over all), bf16 and a dtype stored as bits; restores onto the same mesh (exactly the bytes
needed are read), another mesh (at most 1.1x), host targets, partial targets and a budget
smaller than a chunk; a flipped byte is caught by the pack's crc32c; hostile manifests are
refused naming the field; the layout agrees with the write plan's rule for every process of
simulated meshes.
"""

import os

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._layout import chunks as _layout, pieces as _pieces
from fnckpt._format import hashes as _hashes, manifest as _manifest, runs as _runs
from fnckpt._sources import read as _read, source as _source
from fnckpt import _state
from fnckpt._errors import DamagedError

import v3util

MiB = 1 << 20


def _mesh(shape=(2, 4), axes=("x", "y")):
  return jax.make_mesh(shape, axes)


@pytest.fixture(scope="module", autouse=True)
def _pieces_up_to_8_mib():
  """These tests use shards of up to 6 MiB as pieces (the default is 1 MiB: see
  test_default_threshold_is_a_pack_inner_chunk), so that they stay small and fast."""
  saved, _pieces.PIECE_BYTES = _pieces.PIECE_BYTES, 8 << 20
  yield
  _pieces.PIECE_BYTES = saved


def test_default_threshold_is_a_pack_inner_chunk(tmp_path, monkeypatch):
  """By default a device shard of at most 1 MiB is a piece, a larger one its own zarr array
  (whose inner chunks serve resharded reads)."""
  from fnckpt._layout import packing as _packing
  monkeypatch.setattr(_pieces, "PIECE_BYTES", 1 << 20)
  assert _pieces.PIECE_BYTES == _packing.PACK_INNER_BYTES
  mesh = _mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  t = {"one": put(np.ones((2048, 1024), np.float32), P("x", "y")),      # 1 MiB shards
       "more": put(np.ones((2048, 1056), np.float32), P("x", "y"))}  # 1.03 MiB shards
  fnckpt.save(t, tmp_path / "c").wait()
  m = manifest(str(tmp_path / "c"))
  assert "pieces" in rec(m, "one") and "store" in rec(m, "more")
  got = fnckpt.restore(str(tmp_path / "c"))
  assert all(np.array_equal(got[k], np.asarray(t[k])) for k in t)


def state():
  """Arrays larger than a pack leaf (4 MiB) whose device shards are small."""
  mesh = _mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  rng = np.random.default_rng(0)
  return {
      "fsdp_tp": put(rng.standard_normal((1024, 2048), np.float32), P("x", "y")),
      "tp": put(rng.integers(-9, 9, (2048, 1024), np.int32), P("y")),      # 2 replicas
      "mu": put(rng.standard_normal((960, 4000)).astype(jnp.bfloat16), P(None, "x")),  # 4
      "rep": put(rng.standard_normal((1536, 1024), np.float32), P()),    # 8 replicas
      "f8": put(rng.standard_normal((4096, 2048)).astype(jnp.float8_e4m3), P("x", "y")),
      "i4": put(rng.integers(-8, 8, (2048, 4096)).astype(jnp.int4), P("y", "x")),
      "small": put(np.arange(64, dtype=np.float32), P("x")),              # inline
  }


def nb(v):
  """Host bytes of an array (int4: one byte per element, as stored)."""
  return _layout.nbytes(v.shape, np.dtype(v.dtype).itemsize)


def manifest(path):
  with open(os.path.join(path, _manifest.MANIFEST), "rb") as f:
    return msgpack.unpackb(f.read(), raw=False, strict_map_key=False)


def rec(m, key):
  return next(r for r in m["leaves"] if r["path"][-1][1] == key)


def files(path):
  return sorted(os.path.relpath(os.path.join(root, f), path)
                for root, _, fs in os.walk(path) for f in fs)


def same(got, want):
  assert np.asarray(got).dtype == np.asarray(want).dtype
  assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("pieces") / "c")
  t = state()
  fnckpt.save(t, path).wait()
  return path, t


def test_small_shards_are_pieces_in_one_pack(saved):
  path, t = saved
  m = manifest(path)
  for key in ("fsdp_tp", "tp", "mu", "rep", "f8", "i4"):
    r = rec(m, key)
    assert "store" not in r and "pack" not in r, key
    assert set(r["pieces"]) == {"chunks", "runs", "hashes"}, key
    assert r["pieces"]["chunks"] == list(t[key].sharding.shard_shape(t[key].shape)), key
    assert r["sharding"]["mesh"] == 0
  assert "inline" in rec(m, "small")
  assert m["meshes"] == [[0] * 8]
  # format 3: one pack, no 'process'/'pieces' in it; each leaf's one writer (process 0)
  # records a run, and the runs lie back to back from byte 0 of pack 0, in leaf order
  (pack,) = m["packs"]
  assert set(pack) == {"dir", "nbytes", "chunk", "inner"}
  src = _source.open_source(path)
  opener = _read.Opener(src, check_hashes=False)
  end = 0
  for r in m["leaves"]:
    if "pieces" not in r:
      continue
    (k, offset), = np.frombuffer(r["pieces"]["runs"], _runs.RUN).tolist()
    assert (k, offset) == (0, end), r["path"]
    end += nb(t[r["path"][-1][1]])
    run = v3util.read_pack(opener, 0, offset, end)    # the run's hash is of its bytes
    assert r["pieces"]["hashes"] == _hashes.array_digest(run), r["path"]
    assert r["hash"] == _hashes.digest(r["pieces"]["hashes"]), r["path"]
  region = sum(nb(t[k]) for k in ("fsdp_tp", "tp", "mu", "rep", "f8", "i4"))
  assert end == region
  assert m["packs"][0]["nbytes"] >= region
  data = [f for f in files(path) if f.startswith("data-")]
  assert all("/p/0/" in f for f in data), data  # no zarr array of its own for any leaf
  assert len(data) <= 2 + region // (_pieces.PACK_CHUNK_BYTES)


def test_restore_host_same_mesh_reads_exactly_what_is_needed(saved):
  path, t = saved
  before = _state.reads.bytes_read
  got = fnckpt.restore(path)
  assert _state.reads.bytes_read - before == sum(nb(t[k]) for k in t if k != "small")
  for k in t:
    same(got[k], t[k])
  before = _state.reads.bytes_read
  got = fnckpt.restore(path, {k: v.sharding for k, v in t.items()})
  needed = sum(_needed(v.sharding, v.shape, v.dtype.itemsize) for k, v in t.items()
               if k != "small")
  assert _state.reads.bytes_read - before == needed
  for k in t:
    assert got[k].sharding == t[k].sharding
    same(got[k], t[k])


def _needed(sharding, shape, itemsize):
  return sum(_layout.nbytes([b - a for a, b in index], itemsize)
             for index in _layout.plan_read(sharding, shape))


def _row_spans(sharding, shape, itemsize, chunk):
  """Bytes of the chunk rows each distinct slice intersects (the most a reader may ask)."""
  total = 0
  row = int(np.prod(chunk[1:])) * itemsize
  for index in _layout.plan_read(sharding, shape):
    counts = [len(range(a // c, -(-b // c))) for (a, b), c in zip(index[1:], chunk[1:])]
    total += (index[0][1] - index[0][0]) * row * int(np.prod(counts))
  return total


@pytest.mark.parametrize("spec, rows_only", [(P("q", "p"), False), (P("p"), True),
                                             (P(None, "q"), False), (P(("p", "q")), True)])
def test_restore_onto_another_mesh_reads_only_the_rows_it_needs(saved, spec, rows_only):
  """A cut along the first dimension reads exactly the bytes needed; a cut along a later one
  at most the chunk rows it intersects (a pack is read in whole 1 MiB inner chunks anyway)."""
  path, t = saved
  mesh = _mesh((4, 2), ("p", "q"))
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec))
            for k, v in t.items() if k != "small"}
  before = _state.reads.bytes_read
  got = fnckpt.restore(path, target, partial=True)
  needed = sum(_needed(v.sharding, v.shape, v.dtype.itemsize) for v in target.values())
  read = _state.reads.bytes_read - before
  if rows_only:
    assert read == needed
  else:
    spans = sum(_row_spans(v.sharding, v.shape, v.dtype.itemsize,
                           t[k].sharding.shard_shape(v.shape)) for k, v in target.items())
    assert needed < read <= spans, (read, needed, spans)
  for k in target:
    assert got[k].sharding == target[k].sharding
    same(got[k], t[k])


def test_large_runs_are_read_alone(tmp_path):
  """A column cut of chunks whose rows are 4 MiB: each needed run (2 MiB, over a pack's
  inner chunk) is its own byte range, so exactly the bytes needed are read."""
  v = jax.device_put(np.arange(8 * 2 ** 20, dtype=np.float32).reshape(8, 2 ** 20),
                     NamedSharding(_mesh((8,), ("z",)), P("z")))   # 8 chunks of one row
  path = str(tmp_path / "c")
  fnckpt.save({"v": v}, path).wait()
  sharding = NamedSharding(_mesh((4, 2), ("p", "q")), P(None, "q"))
  target = {"v": jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)}
  before = _state.reads.bytes_read
  got = fnckpt.restore(path, target)
  assert _state.reads.bytes_read - before == _needed(sharding, v.shape, 4)
  same(got["v"], v)


def test_partial_restore_and_a_budget_smaller_than_a_chunk(saved):
  path, t = saved
  got = fnckpt.restore(path, {"mu": np.zeros((960, 4000), jnp.bfloat16)}, partial=True)
  same(got["mu"], t["mu"])
  sharding = NamedSharding(_mesh((8,), ("z",)), P(None, "z"))
  got = fnckpt.restore(path, {"fsdp_tp": sharding, "f8": sharding}, partial=True,
                       budget_bytes=4096)
  same(got["fsdp_tp"], t["fsdp_tp"])
  same(got["f8"], t["f8"])


def test_a_flipped_byte_in_a_piece_is_caught(tmp_path):
  path = str(tmp_path / "c")
  t = state()
  fnckpt.save({"fsdp_tp": t["fsdp_tp"]}, path).wait()
  [chunk] = [os.path.join(path, f) for f in files(path) if "/p/0/c/" in f]
  with open(chunk, "r+b") as f:
    f.seek(3 * MiB + 12345)
    b = f.read(1)
    f.seek(3 * MiB + 12345)
    f.write(bytes([b[0] ^ 0x40]))
  with pytest.raises(DamagedError, match=r"crc32c|corrupt"):
    fnckpt.restore(path)
  from fnckpt.cli import main
  assert main(["verify", "-q", path]) == 1


def test_cli_inspect_and_verify_show_pieces(saved, capsys):
  from fnckpt.cli import main
  path, _ = saved
  assert main(["inspect", path]) == 0
  out = capsys.readouterr().out
  assert "pieces (512, 512) in the packs (mesh 0)" in out
  assert "6 as pieces in the packs" in out
  assert main(["verify", path]) == 0
  assert "OK" in capsys.readouterr().out
  meta = fnckpt.metadata(path).tree
  assert meta["tp"].stored == "pieces" and meta["tp"].shape == (2048, 1024)


def test_no_pieces_with_compression_or_no_packs_and_a_based_save_keeps_pieces(tmp_path):
  """Format 3: only ``compression=`` and ``pack_bytes=0`` store pieces as zarr arrays; a save
  with a base keeps them, reusing the base's run of an unchanged leaf and writing the run of
  a changed one."""
  t = {k: v for k, v in state().items() if k in ("fsdp_tp", "tp")}
  for name, opts in [("z", {"compression": "blosc"}), ("n", {"pack_bytes": 0})]:
    fnckpt.save(t, str(tmp_path / name), **opts).wait()
    m = manifest(str(tmp_path / name))
    assert all("store" in r and "pieces" not in r for r in m["leaves"]), name
    assert "meshes" not in m, name
  fnckpt.save(t, str(tmp_path / "a")).wait()
  assert all("pieces" in r for r in manifest(str(tmp_path / "a"))["leaves"])
  t2 = {**t, "tp": t["tp"] + 1}   # (its spec is now P('y', None): the same split as P('y'))
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")   # (no "cannot reuse" for a spec spelled otherwise)
    fnckpt.save(t2, str(tmp_path / "b"), base=str(tmp_path / "a")).wait()
  a, m = manifest(str(tmp_path / "a")), manifest(str(tmp_path / "b"))
  assert all("pieces" in r and "store" not in r and "hash" in r for r in m["leaves"])
  assert m["meshes"] == [[0] * 8]
  runs = {k: np.frombuffer(rec(m, k)["pieces"]["runs"], _runs.RUN).tolist() for k in t}
  (kf, of), = runs["fsdp_tp"]
  (kt, ot), = runs["tp"]
  assert m["packs"][kf].get("base") is not None     # unchanged: the base's run, reused
  assert m["packs"][kf]["dir"] == a["packs"][0]["dir"]
  assert np.frombuffer(rec(a, "fsdp_tp")["pieces"]["runs"], _runs.RUN).tolist() == [(0, of)]
  assert rec(m, "fsdp_tp")["pieces"]["hashes"] == rec(a, "fsdp_tp")["pieces"]["hashes"]
  assert m["packs"][kt].get("base") is None         # changed: written by this save
  assert rec(m, "tp")["pieces"]["hashes"] != rec(a, "tp")["pieces"]["hashes"]
  got = fnckpt.restore(str(tmp_path / "b"))
  same(got["fsdp_tp"], t["fsdp_tp"])
  same(got["tp"], t2["tp"])


def test_diff_and_export_read_pieces(saved, tmp_path):
  from fnckpt.cli import main
  path, t = saved
  assert main(["diff", "--values", path, path]) == 0
  other = str(tmp_path / "o")
  fnckpt.save({**t, "tp": t["tp"] * 2}, other).wait()
  assert main(["diff", "--values", path, other]) == 1


@pytest.mark.parametrize("mesh, procs, spec", [
    ((8, 4), 4, ((0,), (1,))),
    ((8, 4), 4, ((1,),)),
    ((8, 4), 8, ((), (0,))),
    ((2, 4, 4), 4, ((2, 0),)),
    ((4, 4), 2, ()),
])
def test_layout_agrees_with_the_write_rule_on_every_process(mesh, procs, spec):
  shape = (64, 32)
  per = int(np.prod(mesh)) // procs
  proc_map = np.arange(np.prod(mesh)) // per
  dim_axes = tuple(spec) + ((),) * (2 - len(spec))
  info = _layout.ShardingInfo(mesh, dim_axes)
  shard = _layout.shard_shape_of(info, shape)
  leaves = [_pieces.PieceLeaf(i, 0, mesh, dim_axes, _pieces.shift_of(i, mesh, dim_axes),
                              shard, int(np.prod(shard)) * 4) for i in (0, 5, 17)]
  lay = _pieces.build([proc_map], leaves, procs)
  for p in range(procs):
    ids = range(p * per, (p + 1) * per)
    coords = tuple(zip(*(c.tolist() for c in np.unravel_index(list(ids), mesh))))
    local = _layout.ShardingInfo(mesh, dim_axes, tuple(ids), coords)
    layout = _layout.WriteLayout(shape, shard, _layout.local_shards(local, shape))
    for leaf in leaves:
      units = _layout.local_writes(layout, salt=leaf.index)
      numbers = sorted(_layout._cell_number(u.index, shard, shape) for u in units)
      assert numbers == lay.mine(leaf.index, p)[0].tolist()
  total = sum(int(np.prod(shape)) * 4 for _ in leaves)
  assert int(lay.region.sum()) == total


def _rewrite(path, change):
  m = manifest(path)
  change(m)
  data = _manifest.pack(m)
  with open(os.path.join(path, _manifest.MANIFEST), "wb") as f:
    f.write(data)
  with open(os.path.join(path, _manifest.COMMIT), "wb") as f:
    f.write(_manifest.encode_commit(data, 0.0, m["version"]))


def _set(getter, key, value):
  return lambda m: getter(m).__setitem__(key, value)


def _as_format_2(m):
  """A format-3 manifest of one process whose runs lie back to back from byte 0 of pack 0 in
  leaf order, rewritten as the format-2 manifest of the same bytes (docs/format.md "Pieces" rule 2:
  process 0's pieces region at 'packs'[0].pieces = 0; no content hashes)."""
  end = 0
  for r in m["leaves"]:
    if "pieces" in r:
      (run,) = np.frombuffer(r["pieces"]["runs"], _runs.RUN).tolist()
      assert run == (0, end), "not format-2 placement"
      end += int(np.prod(r["shape"])) * np.dtype(jnp.dtype(r["dtype"])).itemsize
      r["pieces"] = {"chunks": r["pieces"]["chunks"]}
    for k in ("hash", "chunk_hashes"):
      r.pop(k, None)
  del m["hash"]
  m["version"] = 2
  m["packs"][0].update(process=0, pieces=0)


def _v2(change):
  """``change`` applied to the format-2 form of the manifest (:func:`_as_format_2`)."""
  return lambda m: (_as_format_2(m), change(m))


def _runs_of(key, runs):
  return _set(lambda m: rec(m, key)["pieces"], "runs", np.array(runs, _runs.RUN).tobytes())


def test_the_format_2_form_of_a_pieced_save_reads(tmp_path):
  """(The base of the format-2 cases below: unchanged, it restores the saved values.)"""
  path = str(tmp_path / "c")
  t = {k: v for k, v in state().items() if k in ("fsdp_tp", "tp")}
  fnckpt.save(t, path).wait()
  _rewrite(path, _as_format_2)
  assert _manifest.decode(open(os.path.join(path, _manifest.MANIFEST), "rb").read(),
                          path).version == 2
  got = fnckpt.restore(path)
  same(got["fsdp_tp"], t["fsdp_tp"])
  same(got["tp"], t["tp"])


@pytest.mark.parametrize("change, message", [
    (lambda m: m["meshes"][0].__setitem__(3, 1),
     r"'meshes'\[0\] must list process indices in \[0, 1\)"),
    (lambda m: m["meshes"].__setitem__(0, [0] * 4),
     r"record of \['fsdp_tp'\] is invalid: 'meshes'\[0\] has 4 entries, but the sharding's mesh "
     r"\[2, 4\] has 8"),
    (_set(lambda m: rec(m, "tp")["sharding"], "mesh", 1),
     r"record of \['tp'\] is invalid: 'sharding'.mesh must be an integer in \[0, 0\], "
     r"found 1"),
    (_set(lambda m: rec(m, "tp")["pieces"], "chunks", [1024, 1024]),
     r"record of \['tp'\] is invalid: 'pieces'.chunks must be the shard shape \[512, 1024\]"),
    (_set(lambda m: rec(m, "tp")["pieces"], "offsets", [0]),
     r"record of \['tp'\] is invalid: 'pieces' has an unknown field 'offsets'"),
    (lambda m: rec(m, "tp")["sharding"].pop("mesh"),
     r"record of \['tp'\] is invalid: a pieced array needs a named 'sharding' with 'mesh'"),
    # format 3: the recorded runs (fsdp_tp's 8 MiB at 0, tp's 8 MiB at 8 MiB of one pack)
    (_runs_of("tp", [(1, 8 * MiB)]),
     r"record of \['tp'\] is invalid: 'pieces'.runs\[0\] \(process 0's chunks\) names pack 1, "
     r"but there are 1 packs"),
    (_runs_of("tp", [(0, 8 * MiB + 4096)]),
     r"record of \['tp'\] is invalid: 'pieces'.runs\[0\] \(process 0's chunks\) bytes "
     r"\[8392704, 16781312\) lie outside pack 0 \(\d+ bytes\)"),
    (_set(lambda m: rec(m, "tp")["pieces"], "runs", bytes(24)),
     r"record of \['tp'\] is invalid: 'pieces'.runs and 'pieces'.hashes must hold 12 and 16 "
     r"bytes per process writing its chunks \(1 processes\), found 24 and 16"),
    (_set(lambda m: m["packs"][0], "process", 0),
     r"'packs'\[0\] has an unknown field 'process'"),
    # format 2: pieces regions computed from the packs' 'process' and 'pieces'
    (_v2(lambda m: [m["packs"][0].pop(k) for k in ("process", "pieces")]),
     r"record of \['fsdp_tp'\] is invalid: 'pieces' are written by process 0, which has no "
     r"pack with 'process': 0"),
    (_v2(_set(lambda m: m["packs"][0], "pieces", 4096)),
     r"record of \['fsdp_tp'\] is invalid: process 0's pieces region \(\d+ bytes from "
     r"'packs'\[0\].pieces = 4096\) lies outside its pack"),
    (_v2(_set(lambda m: m["packs"][0], "process", 3)),
     r"'packs'\[0\].process must be an integer in \[0, 0\]"),
    (_v2(lambda m: m["packs"][0].pop("pieces")),
     r"'packs'\[0\] needs both 'process' and 'pieces' or neither"),
])
def test_hostile_pieces_manifests_are_refused_naming_the_field(tmp_path, change, message):
  path = str(tmp_path / "c")
  t = state()
  fnckpt.save({k: t[k] for k in ("fsdp_tp", "tp")}, path).wait()
  _rewrite(path, change)
  for call in (fnckpt.metadata, fnckpt.restore):
    with pytest.raises(fnckpt.CheckpointError, match=message):
      call(path)


def test_a_fork_of_a_pieced_step_restores_and_outlives_its_parent(tmp_path):
  """A fork refers to the parent's packs (their records gain 'base'), pieces regions
  included: it restores onto another mesh, and still after the parent step is deleted."""
  mesh = _mesh()
  x = jax.device_put(np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024),
                     NamedSharding(mesh, P("x", "y")))
  run = fnckpt.CheckpointManager(str(tmp_path / "run"))
  run.save(1, {"w": x})
  run.wait()
  assert "pieces" in rec(manifest(str(tmp_path / "run" / "1")), "w")
  fork = run.fork(1, str(tmp_path / "fork"))
  assert all("base" in p for p in manifest(str(tmp_path / "fork" / "1"))["packs"])
  other = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("y", "x")))}
  same(fork.restore(1, other)["w"], x)
  fork.save(2, {"w": x + 1})
  fork.wait()
  run.delete(1)
  same(fork.restore(1)["w"], x)
  same(fork.restore(2)["w"], x + 1)


def test_inspect_and_ls_count_a_forks_pieces_as_reused(tmp_path, capsys):
  """A fork's pieced leaf is its parent's data: inspect and ls count it as reused, not written
  by the fork (as stored and packed references)."""
  from fnckpt.cli import main
  step = _pieced_fork(tmp_path)
  assert main(["inspect", step]) == 0
  out = capsys.readouterr().out
  assert "written by this save: 0 B in 0 array(s); reused (references to 1 earlier " \
      "checkpoint(s)): 8.0 MiB in 1 array(s)" in out, out
  assert f"<- reused from {tmp_path / 'run' / '0'}" in out
  assert main(["ls", step]) == 0
  row = capsys.readouterr().out.splitlines()[2].split()
  assert row[:6] == [".", "committed", "8.0", "MiB", "0", "B"], row


def _pieced_fork(tmp_path) -> str:
  """Step 0 of a fork (in ``tmp_path/fork``) of a run (``tmp_path/run``) whose leaf ``w`` is
  pieces."""
  x = jax.device_put(np.arange(1024 * 2048, dtype=np.float32).reshape(1024, 2048),
                     NamedSharding(_mesh((8,), ("x",)), P("x")))
  run = fnckpt.CheckpointManager(str(tmp_path / "run"))
  run.save(0, {"w": x})
  run.wait()
  run.fork(0, str(tmp_path / "fork"))
  step = str(tmp_path / "fork" / "0")
  assert "pieces" in rec(manifest(step), "w")
  return step


def test_a_fork_whose_parent_pieces_are_gone_says_it_refers_to_them(tmp_path):
  """With the parent's packs deleted, restoring the fork of a pieced step says the fork refers
  to a checkpoint whose data is missing, naming the parent's packs (as for stored and packed
  references), not that a chunk of the fork's own data is missing."""
  step = _pieced_fork(tmp_path)
  parent = str(tmp_path / "run" / "0")
  (packs,) = (tmp_path / "run" / "0").glob("data-*/p")
  for chunk in packs.glob("*/c/*"):
    chunk.unlink()
  with pytest.raises(DamagedError) as e:
    fnckpt.restore(step)
  assert str(e.value).startswith(
      f"Cannot restore ['w'] from {step!r}: it refers to the data "), str(e.value)
  assert (f"of the checkpoint at {parent!r}, which is missing (no data at "
          f"\"{packs} (pieces of ['w'])\": that checkpoint was deleted or moved)") in str(e.value)


def test_a_pieced_bool_with_a_byte_other_than_0_and_1_is_that_damage(tmp_path, capsys):
  """A pieced bool leaf (valid checksums and content hash) holding the byte 2: restore and
  export raise the bool check's own error naming the leaf, as for inline and packed bools (not
  'reading failed (CheckpointError: ...)'); verify reports it. (Changed after the save, the
  byte is first the run's content hash mismatch; the crafted checkpoint records its hash.)"""
  from fnckpt._io import arrays as _store
  from fnckpt.cli import main
  import tensorstore as ts
  path = str(tmp_path / "c")
  mask = jax.device_put(np.ones((8192, 1024), np.bool_),   # over a pack leaf (4 MiB)
                        NamedSharding(_mesh((8,), ("x",)), P("x")))
  fnckpt.save({"mask": mask}, path).wait()
  m = manifest(path)
  assert "pieces" in rec(m, "mask")
  (pk,) = m["packs"]
  ((k, lo),) = np.frombuffer(rec(m, "mask")["pieces"]["runs"], _runs.RUN).tolist()
  assert k == 0
  pack = _store.open_array(_store.pack_spec({"driver": "file", "path": path + "/"}, pk["dir"],
                                            pk["nbytes"], pk["chunk"], pk["inner"]),
                           ts.Context(), mode="write").result()
  pack[lo + 77:lo + 78].write(np.array([2], np.uint8)).result()
  with pytest.raises(DamagedError, match=r"the run of chunks process 0 wrote \(bytes \[0, "
                     r"8388608\) of pack 0\) does not match its recorded content hash"):
    fnckpt.restore(path)
  run = v3util.read_pack(_read.Opener(_source.open_source(path), check_hashes=False),
                         0, lo, lo + 8 * MiB)
  assert run[77] == 2

  def rehash(m):
    rec(m, "mask")["pieces"]["hashes"] = _hashes.array_digest(run)
    rec(m, "mask")["hash"] = _hashes.digest(_hashes.array_digest(run))
  _rewrite(path, rehash)
  msg = r"^\['mask'\]: a bool array holds a byte other than 0 and 1.*damaged"
  with pytest.raises(fnckpt.CheckpointError, match=msg):
    fnckpt.restore(path)
  with pytest.raises(fnckpt.CheckpointError, match=msg):
    fnckpt.export_safetensors(path, tmp_path / "m.safetensors")
  assert main(["verify", "-q", path]) == 1
  (line,) = [l for l in capsys.readouterr().out.splitlines() if l.startswith("DAMAGED")]
  assert line.startswith("DAMAGED ['mask']: a bool array holds a byte other than 0 and 1")
