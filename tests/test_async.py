"""Async save: save() returns once the bytes are off the devices (a real copy: the caller may
donate, delete or mutate right away), writing and commit go on in the background, wait()
reports errors, pending saves survive interpreter exit, host memory stays under the budget,
and nothing grows across saves.

Deterministic gates (a replaced ``fnckpt._state.hooks.on_phase`` hook,
``fnckpt._io.arrays.write_chunk``, ``fnckpt._io.direct.write_chunk`` or the writer's pack
assembly) hold the background writer at a
chosen point, so each test knows which side of the race it is on; no test depends on timing
thresholds.
"""

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import fnckpt
from fnckpt._layout import packing as _packing
from fnckpt._io import arrays as _store, direct as _direct
from fnckpt import _state
from fnckpt._save import staging as _staging
import helpers_proc as hp
import mp_worker

P = jax.sharding.PartitionSpec


def sharded(value, spec):
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  s = jax.sharding.NamedSharding(mesh, P(*spec))
  return jax.make_array_from_callback(value.shape, s, lambda idx: value[idx])


def values(seed=0):
  e = mp_worker.expected
  return {"w": e("w", (256, 512), "float32", seed),        # P(x, y): 8 chunks of 64 KiB
          "r": e("r", (1024, 1024), "float32", seed),      # replicated: 1 chunk of 4 MiB
          "n": e("n", (100, 300), "float64", seed),        # numpy: 1 chunk
          "s": e("s", (4,), "float32", seed)}              # inline in the manifest


def make_state(seed=0):
  v = values(seed)
  return {"w": sharded(v["w"], ("x", "y")), "r": sharded(v["r"], ()), "n": v["n"].copy(),
          "s": jnp.asarray(v["s"]), "step": 10 + seed}


# What a save of make_state() writes, from the format's rules (docs/format.md).
# "w", "r" and "n" are over inline_bytes; "s" is inline.
ARRAY_BYTES = 256 * 512 * 4 + 1024 * 1024 * 4 + 100 * 300 * 8
# Default: all three are at most pack_bytes (4 MiB) and this (only) process sees them whole,
# so they lie end to end in its pack, padded to whole inner chunks (1 MiB here, as the pack
# is larger) and written in chunks of at most PACK_CHUNK_BYTES.
PACK_NBYTES = -(-ARRAY_BYTES // _packing.PACK_INNER_BYTES) * _packing.PACK_INNER_BYTES
# pack_bytes=0: each its own zarr array, in chunks of its saved shard shape: "w" (P(x, y) on
# the 2x4 mesh) in 8, "r" (replicated, not split: 4 MiB) and "n" (numpy) in 1 each.
LAYOUTS = {
    "packed": {"kwargs": {}, "where": "packed", "bytes": PACK_NBYTES,
               "chunks": -(-PACK_NBYTES // _packing.PACK_CHUNK_BYTES)},
    "per-array": {"kwargs": {"pack_bytes": 0}, "where": "stored", "bytes": ARRAY_BYTES,
                  "chunks": 8 + 1 + 1},
}


def assert_layout(path, layout):
  """The leaves are stored as LAYOUTS[layout] assumes (so its counts are the right ones)."""
  recs = {l.path[0][1]: l for l in fnckpt.metadata(path).leaves if l.is_array}
  where = {k: "inline" if l.inline is not None else "packed" if l.packed else "stored"
           for k, l in recs.items()}
  big = LAYOUTS[layout]["where"]
  assert where == {"w": big, "r": big, "n": big, "s": "inline"}, where


def assert_restores(path, seed=0):
  got = fnckpt.restore(path)
  for k, want in values(seed).items():
    assert np.asarray(got[k]).tobytes() == want.tobytes(), k
  assert got["step"] == 10 + seed


class GatedWrites:
  """Replaces ``_store.write_chunk`` (and ``_direct.write_chunk``): each chunk is handed to TensorStore only once ``gate``
  is set (``hold_issue``), or is issued at once but reported durable only then.

  With ``hold_issue`` the writer thread's assembly of pack chunks from their staged pieces
  (``_staging.Assemble``, which runs before ``write_chunk``) waits for the gate too: until
  then the background writer has read no byte of any leaf."""

  def __init__(self, monkeypatch, hold_issue: bool):
    self.gate = threading.Event()
    self.issued = []
    self.assembled = []
    self.hold_issue = hold_issue
    self.real = _store.write_chunk
    monkeypatch.setattr(_store, "write_chunk", self)
    self.real_direct = _direct.write_chunk
    monkeypatch.setattr(_direct, "write_chunk", self.direct)
    if hold_issue:
      assemble = _staging.Assemble.__call__

      def gated_assemble(chunk):
        assert self.gate.wait(60)
        self.assembled.append(chunk.nbytes)
        return assemble(chunk)
      monkeypatch.setattr(_staging.Assemble, "__call__", gated_assemble)

  def __call__(self, store, index, data):
    if self.hold_issue:
      assert self.gate.wait(60)
      self.issued.append(index)
      return self.real(store, index, data)
    fut = self.real(store, index, data)
    promise, out = ts.Promise.new()

    def forward():
      self.gate.wait(60)
      try:
        promise.set_result(fut.result())
      except Exception as e:
        promise.set_exception(e)

    threading.Thread(target=forward, daemon=True).start()
    self.issued.append(index)
    return out

  def direct(self, path, image, buf):
    """The same for a local pack chunk (``_io.direct``, on a thread that waits for it)."""
    if self.hold_issue:
      assert self.gate.wait(60)
    self.issued.append(path)
    self.real_direct(path, image, buf)
    assert self.gate.wait(60)


@pytest.fixture(autouse=True)
def _no_leftover_saves():
  yield
  try:
    fnckpt.wait()
  except fnckpt.CheckpointError:
    pass


# --- donation safety -------------------------------------------------------------------------

@pytest.mark.parametrize("staging", [None, "owned"], ids=["default", "owned"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("how", ["donate", "delete", "mutate_numpy"])
def test_caller_may_reuse_its_arrays_once_save_returns(tmp_path, monkeypatch, how, layout,
                                                       staging):
  """No chunk reaches TensorStore, and no pack chunk is assembled from its staged pieces,
  before the caller has destroyed its arrays (the writer is gated), so the checkpoint can
  only hold the old values if save() staged bytes the caller cannot touch: for chunks of
  their own zarr arrays and for packed leaves alike; with CPU's default staging (views of
  the device buffers) and with copies into buffers the save owns (the accelerators')."""
  monkeypatch.setattr(_state.hooks, "staging", staging)
  gated = GatedWrites(monkeypatch, hold_issue=True)
  state = make_state()
  path = str(tmp_path / "c")
  h = fnckpt.save(state, path, **LAYOUTS[layout]["kwargs"])
  assert gated.issued == [] and gated.assembled == [] and not h.done()

  if how == "donate":
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
    arrays = {k: state[k] for k in ("w", "r", "s")}
    new = step(arrays)
    for _ in range(3):  # the donated buffers are reused and overwritten again and again
      new = step(new)
    jax.block_until_ready(new)
    # (on CPU, jax 0.10 really donates; where it does not, the test still checks the values)
    print("donated:", {k: a.is_deleted() for k, a in arrays.items()})
    del arrays, new
  elif how == "delete":
    for k in ("w", "r", "s"):
      state[k].delete()
    filler = [jnp.full((1024, 1024), -7.0) for _ in range(4)]  # reuse the freed memory
    jax.block_until_ready(filler)
  else:
    state["n"][...] = -5.0
  gated.gate.set()
  h.wait()
  want = LAYOUTS[layout]
  assert len(gated.issued) == want["chunks"]
  assert len(gated.assembled) == (want["chunks"] if want["where"] == "packed" else 0)
  assert_layout(path, layout)
  assert_restores(path)


def test_save_refuses_already_donated_arrays(tmp_path):
  state = make_state()
  state["w"].delete()
  with pytest.raises(fnckpt.CheckpointError, match=r"deleted \(or donated\) before save"):
    fnckpt.save(state, str(tmp_path / "c"))


# --- background commit, wait(), errors --------------------------------------------------------

def _hook(monkeypatch, at, action):
  """Replace the phase hook: ``action(name, location)`` runs at phase ``at``."""
  def hook(name):
    if name == at:
      action(name, threading.current_thread().name.removeprefix("fnckpt-save:"))
  monkeypatch.setattr(_state.hooks, "on_phase", hook)


def test_not_visible_until_committed_and_wait_blocks(tmp_path, monkeypatch):
  reached, gate = threading.Event(), threading.Event()
  _hook(monkeypatch, "committing", lambda *_: (reached.set(), gate.wait(60)))
  path = str(tmp_path / "5")
  mgr = fnckpt.CheckpointManager(str(tmp_path))
  h = fnckpt.save(make_state(), path)
  assert reached.wait(60)
  # every chunk and the manifest are on storage; only the marker is missing
  assert os.path.exists(os.path.join(path, "manifest.msgpack"))
  assert not h.done()
  with pytest.raises(TimeoutError, match="still running"):
    h.wait(timeout=0.05)
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.restore(path)
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.metadata(path)
  assert mgr.all_steps() == [] and mgr.latest_step() is None  # not listed either
  gate.set()
  h.wait()
  assert h.done()
  assert mgr.all_steps() == [5]
  assert_restores(path)
  assert fnckpt.metadata(path).tree["w"].shape == (256, 512)


def test_background_error_is_raised_by_wait(tmp_path, monkeypatch):
  def fail(name, _):
    raise OSError(f"injected failure at {name}")
  _hook(monkeypatch, "written", fail)
  path = str(tmp_path / "c")
  h = fnckpt.save(make_state(), path)  # returns: the failure happens in the background
  with pytest.raises(fnckpt.CheckpointError) as e:
    h.wait()
  msg = str(e.value)
  assert path in msg and "injected failure at written" in msg and "Nothing was committed" in msg
  with pytest.raises(fnckpt.CheckpointError, match="injected"):
    h.wait()  # again: the same error
  fnckpt.wait()  # already reported through the handle: not raised a second time
  assert not os.path.exists(os.path.join(path, "COMMIT"))
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.restore(path)


def test_module_wait_waits_for_all_and_raises_unseen_failures(tmp_path, monkeypatch):
  gate = threading.Event()
  paths = [str(tmp_path / f"c{i}") for i in range(3)]

  def hold(name, location):
    gate.wait(60)
    if location == paths[1]:
      raise OSError("injected failure of the second save")
  _hook(monkeypatch, "written", hold)
  handles = [fnckpt.save(make_state(i), p) for i, p in enumerate(paths)]
  assert not any(h.done() for h in handles)
  gate.set()
  handles[1]._event.wait(60)  # it has failed before anyone waits: still reported below
  with pytest.raises(fnckpt.CheckpointError, match="injected failure of the second save"):
    fnckpt.wait()
  assert all(h.done() for h in handles)
  assert_restores(paths[0], 0)
  assert_restores(paths[2], 2)
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.restore(paths[1])
  fnckpt.wait()  # nothing pending any more


def test_second_save_to_same_location_waits_for_the_first(tmp_path, monkeypatch):
  reached, gate = threading.Event(), threading.Event()
  _hook(monkeypatch, "committing",
        lambda *_: None if reached.is_set() else (reached.set(), gate.wait(60)))
  path = str(tmp_path / "c")
  h1 = fnckpt.save(make_state(0), path)
  assert reached.wait(60)
  second = {}
  t = threading.Thread(target=lambda: second.setdefault(
      "h", fnckpt.save(make_state(1), path, overwrite=True)))
  t.start()
  t.join(0.5)
  assert t.is_alive()  # it does not clear the directory under the first save's feet
  gate.set()
  t.join(60)
  h1.wait()
  second["h"].wait()
  assert_restores(path, 1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stats(tmp_path, layout):
  """Bytes and chunks as the layout's rules give them (a pack's bytes include its padding:
  they are written too)."""
  want = LAYOUTS[layout]
  h = fnckpt.save(make_state(), str(tmp_path / "c"), **want["kwargs"])
  s = h.wait()
  assert_layout(str(tmp_path / "c"), layout)
  assert s is h.stats
  assert s.bytes_written == want["bytes"]
  assert s.chunks_written == want["chunks"]
  assert s.blocking_s > 0 and s.write_s > 0 and s.commit_s > 0
  assert s.total_s >= max(s.blocking_s, s.write_s, s.commit_s)
  assert 0 < s.peak_staged_bytes <= _staging.CHUNK_COST * want["bytes"]


def test_save_waits_for_the_writer_when_the_budget_is_full(tmp_path, monkeypatch):
  """With room for 3 chunks and no chunk ever becoming durable (gated), save() stages 3 and
  then waits; once writes complete it goes on. Held bytes never exceed the budget."""
  gated = GatedWrites(monkeypatch, hold_issue=False)
  v = mp_worker.expected("w", (512, 1024))
  state = {"w": sharded(v, ("x", "y"))}  # 8 chunks of 128 KiB (pack_bytes=0: not packed)
  cost = _staging.CHUNK_COST * v.nbytes // 8
  budget = 3 * cost
  out = {}
  t = threading.Thread(target=lambda: out.setdefault(
      "h", fnckpt.save(state, str(tmp_path / "c"), budget_bytes=budget, pack_bytes=0)))
  t.start()
  deadline = time.monotonic() + 60
  while len(gated.issued) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
  t.join(0.5)
  assert t.is_alive(), "save() went on staging with the budget full"
  assert len(gated.issued) == 3
  assert _state.saves.budget.held == budget
  gated.gate.set()
  t.join(60)
  s = out["h"].wait()
  assert s.chunks_written == 8 and s.peak_staged_bytes == budget
  np.testing.assert_array_equal(fnckpt.restore(str(tmp_path / "c"))["w"], v)


# --- interpreter exit (child processes) -------------------------------------------------------

EXIT_LEAVES = {"a": {"shape": [1024, 1024]}, "b": {"shape": [512, 256], "dtype": "int32"}}


@pytest.mark.slow
def test_pending_save_is_finished_at_interpreter_exit(tmp_path):
  path = str(tmp_path / "c")
  r = hp.run_worker({"mode": "exit_without_wait", "path": path, "leaves": EXIT_LEAVES})
  assert r.returncode == 0, r.describe()
  assert r.result == {"done_when_main_returned": False}  # it really was pending at exit
  assert "fnckpt:" not in r.stderr
  got = fnckpt.restore(path)
  for k, leaf in EXIT_LEAVES.items():
    np.testing.assert_array_equal(got[k], mp_worker.expected(k, leaf["shape"],
                                                             leaf.get("dtype", "float32")))


@pytest.mark.slow
def test_failed_save_nobody_waited_for_is_reported_at_exit(tmp_path):
  path = str(tmp_path / "c")
  r = hp.run_worker({"mode": "exit_without_wait", "path": path, "leaves": EXIT_LEAVES,
                     "action": "raise"})
  assert r.result == {"done_when_main_returned": False}, r.describe()
  assert f"fnckpt: at interpreter exit: the save to {path!r} failed" in r.stderr, r.describe()
  assert "injected failure at written" in r.stderr
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.restore(path)


# --- memory (child processes: RSS is per process) ------------------------------------------

MiB = 1 << 20
# glibc's dynamic mmap threshold keeps freed chunk-sized buffers in per-thread malloc arenas,
# so RSS would show free-but-retained memory (measured: +20..35 MiB on top of the figures
# below, varying run to run). Pinning the threshold makes large blocks go back to the OS when
# freed, so RSS measures the bytes actually held.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# Python objects, TensorStore's chunk index and crc buffers, thread stacks, page-granular
# accounting, and TensorStore's encode/write buffers, which it frees shortly *after* the
# commit callback has returned a chunk's bytes to the budget: measured 1-26 MiB above the
# bytes charged (numpy leaves, 8 MiB chunks, 32 MiB budget; 10 runs on 2 cores).
TOLERANCE = 24 * MiB


def _memory_run(tmp_path, budget_mib, *, numpy=False, shape=None, leaves=None, staging=None):
  if shape is None:
    shape, leaves = ([1024, 2048], 32) if numpy else ([8 * 1024, 2048], 4)
  r = hp.run_worker({"mode": "memory_budget", "devices": 8, "path": str(tmp_path),
                     "shape": shape, "leaves": leaves, "budget_mib": budget_mib,
                     "numpy": numpy, "staging": staging}, env=MALLOC_ENV, timeout=180)
  assert r.returncode == 0 and r.result, r.describe()
  out = r.result
  # VmHWM reset by /proc/self/clear_refs; else fall back on the sampled RSS
  peak = out["peak_sampled"] if out["hwm_after_reset"] > 4 * MiB else max(
      out["peak_hwm"], out["peak_sampled"])
  print({k: (v / MiB if isinstance(v, int) else v) for k, v in out.items()})
  return out, peak


@pytest.mark.slow
@pytest.mark.parametrize("numpy", [True, False], ids=["numpy-leaves", "jax-leaves"])
def test_host_memory_stays_under_budget(tmp_path, numpy):
  """256 MiB of arrays in chunks of 8 MiB, a budget of 32 MiB: the save's peak RSS above the
  RSS before it stays under budget + one chunk (+ TOLERANCE). numpy leaves are copied when
  staged, so the same save with a budget larger than the state is the control: there the
  peak is far above (the measurement sees staging memory). jax leaves on CPU are staged as
  views of their device buffers, so their save adds even less."""
  chunk = 8 * MiB
  out, peak = _memory_run(tmp_path / "small", 32, numpy=numpy)
  assert out["bytes_written"] == out["state_bytes"] == 256 * MiB
  assert out["peak_staged_bytes"] <= out["budget"]
  assert peak <= out["budget"] + chunk + TOLERANCE, (peak / MiB, out)
  if numpy:
    control, control_peak = _memory_run(tmp_path / "large", 1024, numpy=True)
    assert control_peak > 2 * (out["budget"] + chunk + TOLERANCE), (control_peak / MiB, control)


@pytest.mark.slow
def test_owned_copies_stay_under_budget(tmp_path):
  """The same 256 MiB of jax leaves staged as the accelerators stage them (copies into host
  memory the save owns, forced on CPU): unlike CPU's views, every chunk is a real host copy,
  so only the budget bounds them. A save larger than the budget streams (copy, write,
  release, next): the peak stays under budget + one chunk (+ TOLERANCE), and far below the
  state's bytes."""
  chunk = 8 * MiB
  out, peak = _memory_run(tmp_path, 32, staging="owned")
  assert out["bytes_written"] == out["state_bytes"] == 256 * MiB
  assert out["peak_staged_bytes"] <= out["budget"]
  assert peak <= out["budget"] + chunk + TOLERANCE, (peak / MiB, out)


@pytest.mark.slow
@pytest.mark.parametrize("numpy", [True, False], ids=["numpy-leaves", "jax-leaves"])
def test_pack_chunks_stay_under_budget(tmp_path, numpy):
  """64 leaves of 4 MiB (numpy, or jax sharded over the 8 devices: both staged as copies)
  are packed: 256 MiB of pack in chunks of PACK_CHUNK_BYTES. With a budget of one pack
  chunk's charge, one chunk is in flight at a time, and what it holds (its staged pieces,
  then the chunk the writer assembles from them, then TensorStore's copy) is what it is
  charged for: the peak stays within the budget (+ TOLERANCE), not a chunk above it.
  (Measured: 129 MiB; 193 MiB while the staged pieces lived on as the chunk was written.)"""
  pack_chunk = _packing.PACK_CHUNK_BYTES
  out, peak = _memory_run(tmp_path, _staging.CHUNK_COST * pack_chunk // MiB, numpy=numpy,
                          shape=[1024, 1024], leaves=64)
  assert out["bytes_written"] == out["state_bytes"] == 256 * MiB
  assert out["chunks_written"] == 256 * MiB // pack_chunk
  assert out["peak_staged_bytes"] <= out["budget"]
  assert peak <= out["budget"] + TOLERANCE, (peak / MiB, out)


@pytest.mark.slow
def test_no_growth_across_200_async_saves(tmp_path):
  """200 consecutive async saves (each waited only when the next is issued, then deleted),
  sampled every 20 after a warm-up of 40: RSS, and Python's count of allocated small-object
  blocks (``sys.getallocatedblocks``; tracemalloc would slow each save several times).

  A leak grows every interval alike, so the median growth per interval is what is bounded:
  >= 15 blocks (a leaked SaveHandle with its thread is ~55 blocks, ~6 KiB) or >= 16 KiB of
  RSS per save fails. (Checked: a process-wide TensorStore context with a chunk cache grows
  RSS by 8.4 MiB per 20 saves here.) The totals are bounded loosely: once per run
  TensorStore's Python binding makes one ~1.9 MiB allocation that then stays flat (measured
  over 1500 saves: +11 KiB after it)."""
  r = hp.run_worker({"mode": "memory_growth", "devices": 8, "path": str(tmp_path),
                     "warmup": 40, "saves": 200, "every": 20}, env=MALLOC_ENV, timeout=180)
  assert r.returncode == 0 and r.result, r.describe()
  out = r.result
  blocks, rss = out["blocks"], out["rss"]
  block_steps = [b - a for a, b in zip(blocks, blocks[1:])]
  rss_steps = [b - a for a, b in zip(rss, rss[1:])]
  print("allocated blocks:", blocks, "rss MiB:", [x / MiB for x in rss])
  assert len(block_steps) == 10
  assert np.median(block_steps) < 20 * 15, block_steps
  assert np.median(rss_steps) < 20 * 16 * 1024, rss_steps
  assert blocks[-1] - blocks[0] < 20_000 and rss[-1] - rss[0] < 6 * MiB, (blocks, rss)
  assert out["handles_alive"] == 0 and out["pending"] == 0
  assert out["left"] == ["239"]
