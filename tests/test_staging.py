"""Staging into host memory fnckpt owns (``fnckpt._save.copies``; docs/concepts/async.md).

On GPU/TPU every shard a save writes is copied with ``jax.device_put`` into a host memory kind
of its device (``pinned_host``), into buffers the save allocates and drops, instead of
``np.asarray`` of the caller's shard (which caches its copy on the caller's array, outside the
budget). CPU devices have the same memory kinds, so the path is forced on here
(``_state.hooks.staging = "owned"``) and checked against CPU's default (views of the device
buffers): which bytes reach the writer, what is left cached on the caller's arrays, the order
copies are started and waited for, and the error when a copy fails.
"""

import jax
import numpy as np
import pytest

import fnckpt
from fnckpt import _state
from fnckpt._save import copies as _copies

P = jax.sharding.PartitionSpec
MiB = 1 << 20


def _sharded(shape, spec, seed):
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  value = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return jax.device_put(value, jax.sharding.NamedSharding(mesh, P(*spec)))


def make_state(seed=0):
  """One leaf of each way a jax leaf is stored: a zarr array whose 16 MiB shards are split
  into chunks ("big"), pieces ("pieced"), packed whole (sharded "packed", replicated "repl")
  and inline in the manifest (sharded "tiny"); plus a numpy leaf."""
  return {"big": _sharded((8192, 1024), ("x",), seed),
          "pieced": _sharded((2048, 1024), ("x", "y"), seed + 1),
          "packed": _sharded((512, 512), ("x",), seed + 2),
          "repl": _sharded((512, 256), (), seed + 3),
          "tiny": _sharded((16, 16), ("x",), seed + 4),
          "np": np.arange(300_000, dtype=np.float64)}


def where_stored(path):
  out = {}
  for leaf in fnckpt.metadata(path).leaves:
    out[leaf.path[0][1]] = ("inline" if leaf.inline is not None else "pieces" if leaf.pieces
                            else "packed" if leaf.packed else "stored")
  return out


def caller_buffers(state):
  """(start, end) of every device buffer of the caller's jax leaves."""
  spans = []
  for x in jax.tree.leaves(state):
    if isinstance(x, jax.Array):
      for s in x.addressable_shards:
        p = s.data.unsafe_buffer_pointer()
        spans.append((p, p + s.data.nbytes))
  return spans


def cached_on(state):
  """The caller's jax arrays (and their per-device arrays) that hold a cached host copy."""
  found = []
  for k, x in state.items():
    if isinstance(x, jax.Array):
      if x._npy_value is not None:
        found.append(k)
      found += [f"{k}@{s.device}" for s in x.addressable_shards
                if s.data._npy_value is not None]
  return found


class Recorder:
  """Records what staging hands the writer: every ``Copies.get`` result, and the host bytes
  of every owned copy once the writer takes them."""

  def __init__(self, monkeypatch):
    self.got, self.hosts, self.events = [], [], []
    get, call = _copies.Copies.get, _copies.Owned.__call__
    wait = _copies.Copies.wait

    def rec_get(copies, shard, local=None, device=None):
      out = get(copies, shard, local, device)
      self.got.append(out)
      self.events.append("start")
      return out

    def rec_call(owned):
      out = call(owned)
      self.hosts.append(out)
      self.events.append("host")
      return out

    def rec_wait(copies):
      self.events.append("wait")
      return wait(copies)
    monkeypatch.setattr(_copies.Copies, "get", rec_get)
    monkeypatch.setattr(_copies.Owned, "__call__", rec_call)
    monkeypatch.setattr(_copies.Copies, "wait", rec_wait)


def _overlaps(arrays, spans):
  """The arrays whose bytes lie (partly) in one of ``spans``."""
  return [a for a in arrays if any(a.ctypes.data < hi and lo < a.ctypes.data + a.nbytes
                                   for lo, hi in spans)]


@pytest.mark.parametrize("staging", [None, "owned"], ids=["default", "owned"])
def test_owned_staging_copies_every_shard_and_caches_nothing_on_the_caller(
    tmp_path, monkeypatch, staging):
  """Forced "owned" on CPU: every device shard a save stages (zarr chunks, split shards,
  pieces, packed and inline leaves, and with ``base=`` the leaves compared with the base's)
  is an owned copy whose host bytes lie outside every device buffer of the caller. CPU's
  default (the control) stages views inside them. Either way no host copy is left cached on
  the caller's arrays (``_npy_value``, on the array or any of its per-device arrays)."""
  monkeypatch.setattr(_state.hooks, "staging", staging)
  rec = Recorder(monkeypatch)
  state = make_state()
  spans = caller_buffers(state)
  fnckpt.save(state, str(tmp_path / "a")).wait()
  base_got = len(rec.got)
  state2 = {**make_state(), "big": _sharded((8192, 1024), ("x",), 9)}
  fnckpt.save(state2, str(tmp_path / "b"), base=str(tmp_path / "a")).wait()
  assert where_stored(tmp_path / "a") == {"big": "stored", "pieced": "pieces",
                                          "packed": "packed", "repl": "packed",
                                          "tiny": "inline", "np": "packed"}
  assert cached_on(state) == [] and cached_on(state2) == []
  assert 0 < base_got < len(rec.got)
  if staging == "owned":
    assert all(isinstance(g, _copies.Owned) for g in rec.got), rec.got
    assert len(rec.hosts) == len(rec.got)
    assert _overlaps(rec.hosts, spans + caller_buffers(state2)) == []
  else:
    assert not any(isinstance(g, _copies.Owned) for g in rec.got)
    assert len(_overlaps(rec.got, spans)) == base_got   # views of the device buffers
  for path, want in ((tmp_path / "a", state), (tmp_path / "b", state2)):
    got = fnckpt.restore(str(path))
    for k, v in want.items():
      assert np.array_equal(np.asarray(got[k]), np.asarray(v)), (path, k)


def test_owned_copies_start_before_any_is_waited_for(tmp_path, monkeypatch):
  """With a budget larger than the save, every copy is started before the caller waits for
  any, and the writer takes none before: once for the inline leaves (while planning), once
  for the rest (one wait, at the end of staging)."""
  monkeypatch.setattr(_state.hooks, "staging", "owned")
  rec = Recorder(monkeypatch)
  fnckpt.save(make_state(), str(tmp_path / "c"), budget_bytes=1 << 30).wait()
  runs = [e for k, e in enumerate(rec.events) if k == 0 or rec.events[k - 1] != e]
  assert runs == ["start", "wait", "host", "start", "wait", "host"], rec.events


def test_owned_copies_stream_when_the_save_is_larger_than_the_budget(tmp_path, monkeypatch):
  """A save of 44 MiB (charged twice: 88 MiB) with a budget of 32 MiB: copies are started
  while the writer takes earlier ones (copy, write, release, next), and what is staged never
  exceeds the budget."""
  monkeypatch.setattr(_state.hooks, "staging", "owned")
  rec = Recorder(monkeypatch)
  h = fnckpt.save(make_state(), str(tmp_path / "c"), budget_bytes=32 * MiB)
  stats = h.wait()
  assert stats.bytes_written > 40 * MiB and stats.peak_staged_bytes <= 32 * MiB
  last_start = len(rec.events) - 1 - rec.events[::-1].index("start")
  assert "host" in rec.events[:last_start], rec.events


def test_a_failed_copy_names_the_leaf_and_the_fix(tmp_path, monkeypatch):
  monkeypatch.setattr(_state.hooks, "staging", "owned")
  real = jax.device_put

  def failing(x, device=None, **kw):  # (copies are started in batches: lists)
    pairs = zip(x, device) if isinstance(x, list) else [(x, device)]
    if any(getattr(d, "memory_kind", None) == "pinned_host" and a.shape == (2048, 1024)
           for a, d in pairs):
      raise RuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")
    return real(x, device, **kw)
  monkeypatch.setattr(jax, "device_put", failing)
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"Staging \['big'\] failed: RuntimeError: copying 8388608 bytes "
                           r"from .* into its pinned_host memory failed .*RESOURCE_EXHAUSTED"
                           r".*save with a smaller budget_bytes="):
    fnckpt.save({"big": _sharded((8192, 1024), ("x",), 0)}, str(tmp_path / "c"))
  assert not (tmp_path / "c" / "COMMIT").exists()


def test_the_mode_per_platform_and_its_override(monkeypatch):
  """CPU stages views by default; other platforms own their copies; the override wins and
  is checked."""
  cpu = jax.devices()[0]

  class Gpu:
    platform = "gpu"
  assert _copies.mode(cpu) == "asarray" and _copies.mode(Gpu()) == "owned"
  assert _copies.host(cpu) == "pinned_host"
  monkeypatch.setattr(_state.hooks, "staging", "owned")
  assert _copies.mode(cpu) == "owned"
  monkeypatch.setattr(_state.hooks, "staging", "pinned")
  with pytest.raises(ValueError, match=r"hooks.staging is 'pinned'; use one of \('owned', "
                                       r"'asarray'\) or None"):
    _copies.mode(cpu)


def _many_small(n=300):
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  rng = np.random.default_rng(5)
  return {f"w{i:03d}": jax.device_put(rng.standard_normal((8, 64)).astype(np.float32),
                                      jax.sharding.NamedSharding(mesh, P("x")))
          for i in range(n)}


def test_owned_copies_are_started_in_batches(tmp_path, monkeypatch):
  """300 small leaves on 8 devices (600 distinct shards, inline and packed): the copies are
  started by a few ``jax.device_put`` calls of many shards each, not one call per shard,
  and the checkpoint restores bitwise."""
  monkeypatch.setattr(_state.hooks, "staging", "owned")
  real, calls = jax.device_put, []

  def counting(x, device=None, **kw):
    if isinstance(x, list) and getattr(device[0], "memory_kind", None) == "pinned_host":
      calls.append(len(x))
    elif getattr(device, "memory_kind", None) == "pinned_host":
      calls.append(1)
    return real(x, device, **kw)
  monkeypatch.setattr(jax, "device_put", counting)
  state = _many_small()
  fnckpt.save(state, str(tmp_path / "c")).wait()
  monkeypatch.setattr(jax, "device_put", real)
  assert sum(calls) == 600 and len(calls) <= 6, calls
  got = fnckpt.restore(str(tmp_path / "c"))
  assert all(np.array_equal(np.asarray(got[k]), np.asarray(v)) for k, v in state.items())


def test_a_failed_copy_in_a_batch_names_its_own_leaf(tmp_path, monkeypatch):
  """A batch of many leaves' copies fails: each is copied alone to find the one that fails,
  and the error names that leaf, not the one being staged when the batch started."""
  monkeypatch.setattr(_state.hooks, "staging", "owned")
  real = jax.device_put
  state = _many_small(40)
  bad = state["w029"].addressable_shards[0].data

  def failing(x, device=None, **kw):
    xs = x if isinstance(x, list) else [x]
    if any(a is bad for a in xs) and "pinned_host" in str(device):
      raise RuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")
    return real(x, device, **kw)
  monkeypatch.setattr(jax, "device_put", failing)
  with pytest.raises(fnckpt.CheckpointError,
                     match=r"Staging \['w029'\] failed: RuntimeError: copying 1024 bytes "
                           r"from .* into its pinned_host memory failed .*RESOURCE_EXHAUSTED"):
    fnckpt.save(state, str(tmp_path / "c"))
  assert not (tmp_path / "c" / "COMMIT").exists()


def test_a_failed_batch_leaves_every_copy_with_its_bytes_or_its_error(monkeypatch):
  """One copy of a batch fails: the others still land; the failed one raises its own error
  (naming its leaf) wherever it is used; none gives ``None`` for bytes."""
  monkeypatch.setattr(_state.hooks, "staging", "owned")
  xs = [jax.device_put(np.full((4,), i, np.float32), jax.devices()[0]) for i in range(5)]
  real = jax.device_put

  def failing(x, device=None, **kw):
    if any(a is xs[2] for a in (x if isinstance(x, list) else [x])):
      raise RuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")
    return real(x, device, **kw)
  monkeypatch.setattr(jax, "device_put", failing)
  copies = _copies.Copies()
  owned = [copies.at((("dict", f"w{i}"),)).get(x) for i, x in enumerate(xs)]
  with pytest.raises(fnckpt.CheckpointError, match=r"Staging \['w2'\] failed"):
    copies.wait()
  for i, o in enumerate(owned):
    if i == 2:
      with pytest.raises(fnckpt.CheckpointError, match=r"Staging \['w2'\] failed"):
        o()
    else:
      assert np.array_equal(o(), np.full((4,), i, np.float32))
