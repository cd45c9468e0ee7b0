"""Many small leaves (docs/performance.md, small/mixed states): whole packed leaves lying one
after another in a pack are read as one byte range (``_sources.read.PackRun``), placed with one
``jax.device_put`` per sharding, and array records sharing a head are validated once; the
results, and the errors naming a leaf, are those of reading and checking each leaf alone."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._errors import CheckpointError, DamagedError
from fnckpt._io import arrays as _store

import v3util
from test_trust import _rewrite_manifest as _rewrite  # (a hostile or broken writer)


def _tree(n=40):
  """Leaves of 32 KiB (packed, not inline), distinct values, a few dtypes."""
  out = {}
  for k in range(n):
    dtype = (np.float32, np.int32, np.uint8)[k % 3]
    out[f"w{k:02d}"] = (np.arange(32 << 10, dtype=np.uint8).view(dtype) + k).astype(dtype)
  return out


def _count_reads(monkeypatch) -> list:
  """The index of every TensorStore read a restore starts (into its own buffer or not)."""
  calls = []
  for name in ("read_slice", "read_into"):
    def counted(*args, real=getattr(_store, name), **kwargs):
      calls.append(args[1])
      return real(*args, **kwargs)
    monkeypatch.setattr(_store, name, counted)
  return calls


def test_packed_leaves_read_in_runs_bitwise(tmp_path, monkeypatch):
  tree = _tree()
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  calls = _count_reads(monkeypatch)
  got = fnckpt.restore(path, {k: np.zeros_like(v) for k, v in tree.items()})
  assert 0 < len(calls) < len(tree) // 4, len(calls)   # runs, not one read per leaf
  for k, v in tree.items():
    assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k
    assert got[k].flags.writeable and got[k].flags.owndata  # each host result its own
  got["w00"][:] = 0
  assert got["w01"].tobytes() == tree["w01"].tobytes()


def test_packed_runs_onto_devices_bitwise(tmp_path):
  tree = _tree(24)
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  specs = [P(), P("x")]
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                    sharding=NamedSharding(mesh, specs[i % 2]))
            for i, (k, v) in enumerate(tree.items())}
  got = fnckpt.restore(path, target)
  for k, v in tree.items():
    assert got[k].sharding == target[k].sharding
    np.testing.assert_array_equal(np.asarray(got[k]), v)


def test_a_changed_leaf_inside_a_run_is_named(tmp_path):
  tree = _tree()
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  v3util.tamper_packed(path, "w17")
  with pytest.raises(DamagedError, match=r"Cannot restore \['w17'\] from .*does not match "
                     r"its recorded content hash"):
    fnckpt.restore(path, {k: np.zeros_like(v) for k, v in tree.items()})


def test_same_bad_head_refused_with_the_first_leaf_named(tmp_path):
  tree = _tree(6)
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()

  def change(m):
    for r in m["leaves"][2:]:
      r["sharding"] = {"type": "named", "axes": ["x"], "sizes": [2], "spec": ["y"]}
  _rewrite(path, change)
  with pytest.raises(CheckpointError, match=r"the record of \['w02'\] is invalid: "
                     r"'sharding'.spec must name each mesh axis at most once"):
    fnckpt.restore(path)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_failed_run_read_names_the_leaf_a_read_alone_names(tmp_path, monkeypatch, damage):
  """A pack chunk file truncated or gone: the error is the one reading each leaf alone gives
  (but for TensorStore's own text, in brackets: its words for a batched read differ)."""
  from fnckpt._restore import place as _place
  tree = _tree()
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
           if "/p/" in os.path.join(d, f) and not f.endswith(".json")]
  assert files
  for f in files:
    if damage == "delete":
      os.remove(f)
    else:
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
  target = {k: np.zeros_like(v) for k, v in tree.items()}
  messages = []
  for run_bytes in (_place.RUN_BYTES, 0):   # 0: every leaf read alone
    monkeypatch.setattr(_place, "RUN_BYTES", run_bytes)
    with pytest.raises(CheckpointError) as e:
      fnckpt.restore(path, target)
    messages.append(str(e.value))
  ours = [m.rsplit(" [", 1)[0] for m in messages]
  assert ours[0] == ours[1]
  assert "['w00']" in ours[0], ours[0]


def test_collector_paused_in_save_and_restore_then_as_the_caller_left_it(tmp_path,
                                                                          monkeypatch):
  import gc
  from fnckpt import _state
  seen = []
  real = _state._Collector.paused

  def paused(self):
    seen.append(gc.isenabled())
    return real(self)
  monkeypatch.setattr(_state._Collector, "paused", paused)
  path = str(tmp_path / "c")
  tree = _tree(8)
  assert gc.isenabled()
  fnckpt.save(tree, path).wait()
  got = fnckpt.restore(path)
  assert gc.isenabled() and _state.collector.depth == 0 and seen
  assert all(got[k].tobytes() == v.tobytes() for k, v in tree.items())
  with pytest.raises(CheckpointError):
    fnckpt.restore(str(tmp_path / "missing"))
  assert gc.isenabled() and _state.collector.depth == 0
  gc.disable()   # the caller's choice is kept
  try:
    fnckpt.restore(path)
    with _state.collector.paused():
      with _state.collector.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
  finally:
    gc.enable()


def _pack_chunk_files(path) -> dict:
  """The bytes of every pack chunk file of the checkpoint at ``path`` (by path inside its
  data directory: the directory's name differs per save)."""
  out = {}
  for root, _, files in os.walk(path):
    rel = os.path.relpath(root, path).split(os.sep)
    if len(rel) >= 3 and rel[1] == "p" and "c" in rel:
      for f in files:
        with open(os.path.join(root, f), "rb") as fh:
          out["/".join(rel[1:] + [f])] = fh.read()
  return out


def test_reused_pack_buffers_write_the_bytes_fresh_zeroed_ones_write(tmp_path, monkeypatch):
  """Pack chunks are assembled in buffers kept from earlier saves (``_save.buffers``): a
  buffer full of an earlier chunk's bytes (here 0xFF) must write exactly what a zeroed one
  writes: pieces of sharded leaves and packed leaves of mixed dtypes."""
  from fnckpt import _state
  from fnckpt._save import buffers as _buffers
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  tree = {k: jax.device_put(v, NamedSharding(mesh, P("x") if i % 2 else P()))
          for i, (k, v) in enumerate(_tree(30).items())}
  tree["odd"] = np.arange(20003, dtype=np.int16)   # packed, not a multiple of 8 bytes
  monkeypatch.setattr(_state, "buffers", _state._Buffers())   # this test's own pool
  real_take = _buffers.take
  monkeypatch.setattr(_buffers, "take", lambda n: np.zeros(n, np.uint8))
  fnckpt.save(tree, str(tmp_path / "zeroed")).wait()
  monkeypatch.setattr(_buffers, "take", real_take)
  monkeypatch.setattr(_state, "buffers", _state._Buffers())   # (not the zeroed one: unaligned)
  fnckpt.save(tree, str(tmp_path / "first")).wait()   # fills the pool
  assert _state.buffers.free
  for b in _state.buffers.free:
    b[:] = 0xFF
  fnckpt.save(tree, str(tmp_path / "reused")).wait()
  assert not any(b.nbytes and b[-b.ctypes.data % _buffers.ALIGN] == 0xFF   # they were used
                 for b in _state.buffers.free)   # (from their first aligned byte)
  want = _pack_chunk_files(str(tmp_path / "zeroed"))
  assert want and _pack_chunk_files(str(tmp_path / "reused")) == want
  assert _pack_chunk_files(str(tmp_path / "first")) == want
  got = fnckpt.restore(str(tmp_path / "reused"), jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
      if isinstance(x, jax.Array) else np.zeros_like(x), tree))
  for k, v in tree.items():
    assert np.asarray(got[k]).tobytes() == np.asarray(v).tobytes(), k


def test_buffer_pool_keeps_at_most_its_bytes(monkeypatch):
  from fnckpt import _state
  from fnckpt._save import buffers as _buffers
  monkeypatch.setattr(_state, "buffers", _state._Buffers())
  room = 60 + _buffers.ALIGN    # a buffer taken for 60 bytes (room to align its start)
  monkeypatch.setattr(_buffers, "KEEP_BYTES", room + 40)
  a, b = _buffers.take(60), _buffers.take(60)
  assert a.ctypes.data % _buffers.ALIGN == 0 and a.nbytes == 60
  _buffers.give(a)
  _buffers.give(b)   # over the limit: dropped
  _buffers.give(a)   # already kept: once
  assert [x.nbytes for x in _state.buffers.free] == [room] and _state.buffers.kept == room
  assert _buffers.take(10).base is not a.base   # 60 bytes for 10: more than twice (uncharged)
  c = _buffers.take(40)
  assert c.nbytes == 40 and c.base is a.base and _state.buffers.kept == 0
  assert c.ctypes.data % _buffers.ALIGN == 0


def test_buffer_pool_keeps_at_most_a_quarter_of_the_budget(monkeypatch):
  from fnckpt import _state
  from fnckpt._io.arrays import ByteBudget
  from fnckpt._save import buffers as _buffers
  monkeypatch.setattr(_state, "buffers", _state._Buffers())
  room = 60 + _buffers.ALIGN
  monkeypatch.setattr(_state.saves, "budget", ByteBudget(4 * room + 100))
  a, b = _buffers.take(60), _buffers.take(60)
  _buffers.give(a)
  _buffers.give(b)   # 2 * room > budget / 4: dropped
  assert _state.buffers.kept == room


def test_assemble_zeroes_what_no_piece_covers_in_a_reused_buffer(monkeypatch):
  """(A save's chunks are covered by their pieces today; a gap would be zeros, as it was
  with a fresh zeroed buffer, never an earlier chunk's bytes.)"""
  from fnckpt import _state
  from fnckpt._save import buffers as _buffers
  from fnckpt._save.staged_leaf import Staged
  from fnckpt._save.staging import Assemble
  monkeypatch.setattr(_state, "buffers", _state._Buffers())
  poisoned = np.full(32 + _buffers.ALIGN, 0xFF, np.uint8)   # (room for 32: reused for 20)
  _buffers.give(poisoned)
  leaf = Staged((8,), np.dtype(np.uint8), [((slice(0, 8),), np.arange(1, 9, dtype=np.uint8))])
  a = Assemble(20, [(2, leaf, 0, 8, 0), (12, leaf, 2, 6, 1)])
  buf = a()
  assert buf.base is poisoned
  assert buf.tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 3, 4, 5, 6, 0, 0, 0, 0]
  assert a.spans == [(0, 2, 8), (1, 12, 4)]


def _inline_tree():
  """Inline leaves (at most 16 KiB) of several dtypes, one a bool array."""
  return {"f32": np.arange(1024, dtype=np.float32) / 7, "i8": np.arange(64, dtype=np.int8),
          "bf16": np.arange(512, dtype=np.float32).astype(jax.numpy.bfloat16),
          "mask": np.arange(128) % 3 == 0, "odd": np.arange(24, dtype=np.int16)}


def test_inline_leaves_onto_cpu_devices_share_one_aligned_buffer_bitwise(tmp_path):
  tree = _inline_tree()
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  for spec in (P(), P("x")):
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        mesh, spec if v.shape[0] % len(devices) == 0 else P())) for k, v in tree.items()}
    got = fnckpt.restore(path, target)
    for k, v in tree.items():
      assert got[k].sharding == target[k].sharding and got[k].dtype == v.dtype
      assert np.asarray(got[k]).tobytes() == v.tobytes(), (k, spec)
      for s in got[k].addressable_shards:
        assert np.asarray(s.data).tobytes() == v[s.index].tobytes(), (k, spec)
    if spec == P():   # replicated: every device adopted the one buffer
      for k in tree:
        assert len({s.data.unsafe_buffer_pointer() for s in got[k].addressable_shards}) == 1
  host = fnckpt.restore(path, {k: np.zeros_like(v) for k, v in tree.items()})
  assert all(host[k].tobytes() == v.tobytes() and host[k].flags.owndata
             for k, v in tree.items())


def test_a_damaged_inline_bool_onto_devices_is_named(tmp_path):
  tree = _inline_tree()
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()

  def change(m):
    rec = next(r for r in m["leaves"] if r["path"][-1][1] == "mask")
    rec["inline"] = b"\x02" + rec["inline"][1:]
  _rewrite(path, change)
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
            for k, v in tree.items()}
  message = r"\['mask'\]: a bool array holds a byte other than 0 and 1"
  with pytest.raises(CheckpointError, match=message):
    fnckpt.restore(path, target)
  with pytest.raises(CheckpointError, match=message):   # as onto the host
    fnckpt.restore(path, {k: np.zeros_like(v) for k, v in tree.items()})


def _pointer(arr) -> int:
  return arr.addressable_shards[0].data.unsafe_buffer_pointer()


def test_a_run_of_packed_leaves_is_read_into_one_buffer_the_cpu_devices_adopt(tmp_path):
  """A run of whole packed leaves is read straight into one aligned buffer; bound for several
  CPU devices, each leaf is its view there, adopted by every device (no copy per leaf, none
  per device). Donating such leaves in a jitted step computes right and leaves the others
  (sharing the buffer) as restored."""
  tree = _tree(12)
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  offsets = {k: fnckpt.metadata(path).leaves[i].packed.offset for i, k in enumerate(tree)}
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  replicated = NamedSharding(mesh, P())
  got = fnckpt.restore(path, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated)
                              for k, v in tree.items()})
  first = next(iter(tree))
  for k, v in tree.items():
    assert np.asarray(got[k]).tobytes() == v.tobytes(), k
    assert len({s.data.unsafe_buffer_pointer() for s in got[k].addressable_shards}) == 1, k
    assert _pointer(got[k]) - _pointer(got[first]) == offsets[k] - offsets[first], k
  fn = lambda x: x * 3 + 1   # noqa: E731
  step, plain = jax.jit(fn, donate_argnums=0), jax.jit(fn)
  stepped = {k: got.pop(k) for k in list(got)[::2]}
  for _ in range(3):
    stepped = {k: step(x) for k, x in stepped.items()}
  for k, x in stepped.items():
    want = plain(plain(plain(jax.device_put(tree[k], replicated))))
    assert np.asarray(x).tobytes() == np.asarray(want).tobytes(), k
  for k, x in got.items():
    assert np.asarray(x).tobytes() == tree[k].tobytes(), k


def test_inline_leaves_onto_cpu_devices_share_aligned_blocks(tmp_path, monkeypatch):
  """Inline leaves bound for several CPU devices are copied into shared aligned blocks of at
  most RUN_BYTES, each at an aligned offset, in the order of the manifest."""
  from fnckpt._io import arrays as _arrays
  from fnckpt._restore import place as _place
  tree = _inline_tree()
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
            for k, v in tree.items()}
  names = [r.path[-1][1] for r in fnckpt.metadata(path).leaves]
  for limit, blocks in ((1 << 20, ["bf16"]), (4096, ["bf16", "f32", "i8"])):   # (sorted)
    monkeypatch.setattr(_place, "RUN_BYTES", limit)
    got = fnckpt.restore(path, target)
    starts, end, seen = [], None, 0
    for k in names:
      assert np.asarray(got[k]).tobytes() == tree[k].tobytes(), k
      p = _pointer(got[k])
      assert p % _arrays.ALIGN == 0, k
      if end is None or p != -(-end // _arrays.ALIGN) * _arrays.ALIGN:
        starts.append(k)
      end = p + tree[k].nbytes
    assert starts == blocks, (limit, starts)


def test_int64_leaves_that_fit_onto_devices_with_x64_off_become_int32_silently(tmp_path):
  """Whole leaves are placed by jax.make_array_from_callback: as jax.device_put did, an int64
  array whose values fit becomes int32 when x64 is off, with no warning (an explicit dtype
  would warn); values that do not fit are refused (the test below)."""
  import warnings
  if jax.config.jax_enable_x64:
    pytest.skip("x64 on")
  tree = {"small": np.arange(16, dtype=np.int64) - 5, "packed": np.arange(40000, dtype=np.int64),
          "scalar": np.int64(7) * np.ones((), np.int64)}
  path = str(tmp_path / "c")
  fnckpt.save(tree, path).wait()
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",), devices=devices)
  target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
      mesh, P("x") if v.ndim else P())) for k, v in tree.items()}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    got = fnckpt.restore(path, target)
  for k, v in tree.items():
    assert got[k].dtype == np.int32 and got[k].sharding == target[k].sharding, k
    np.testing.assert_array_equal(np.asarray(got[k]), v.astype(np.int32), err_msg=k)


@pytest.mark.parametrize("n", [16, 40_000, 2_500_000], ids=["inline", "packed", "stored"])
def test_int64_values_beyond_int32_with_x64_off_are_refused_not_wrapped(tmp_path, n):
  """With x64 off JAX would hold int64 as int32 and wrap 2**40 to 0: restoring such values
  onto devices is an error naming the leaf and the fix; onto a numpy target they come back
  whole; values that fit are restored (the test above)."""
  if jax.config.jax_enable_x64:
    pytest.skip("x64 on")
  big = np.arange(n, dtype=np.int64) + (1 << 40)
  path = str(tmp_path / "c")
  fnckpt.save({"w": big}, path).wait()
  mesh = jax.make_mesh((len(jax.devices()),), ("x",))
  target = {"w": jax.ShapeDtypeStruct(big.shape, big.dtype, sharding=NamedSharding(mesh, P()))}
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"\['w'\]: the checkpoint holds int64 values from 1099511627776 to "
                           r"\d+, beyond int32, and jax_enable_x64 is off.*Turn x64 on"):
    fnckpt.restore(path, target)
  got = fnckpt.restore(path, {"w": np.zeros_like(big)})
  np.testing.assert_array_equal(got["w"], big)
