"""CheckpointManager on real storage (memory:// and local files): steps, retention, leftovers,
preemption, resuming; and a Hypothesis state machine against a plain model."""

import os
import signal
import threading
import uuid
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._io import paths as _paths
from fnckpt import _state


def state_of(step, n=5000):
  """A small tree with one array big enough for its own zarr files (not inline)."""
  return {"w": np.arange(n, dtype=np.float32) + step, "step": step, "b": np.full(3, step)}


@pytest.fixture(params=["memory", "file"])
def root(request, tmp_path):
  if request.param == "memory":
    return f"memory://test_manager/{uuid.uuid4().hex}"
  return str(tmp_path / "run")


@pytest.fixture
def phase_hook(monkeypatch):
  """Replace the core's fault-injection hook: ``hooks[step] = fn(phase)`` runs in the save
  thread of ``.../<step>`` (and in save() itself for the staging phases)."""
  hooks = {}

  def phase(name):
    thread = threading.current_thread().name
    for step, fn in list(hooks.items()):
      if thread.endswith(f"/{step}") or (thread == "MainThread" and hooks.get("main") == step):
        fn(name)

  monkeypatch.setattr(_state.hooks, "on_phase", phase)
  return hooks


def leave_uncommitted(root, step, phase_hook):
  """A real interrupted save of ``step``: its data and manifest written, no commit marker."""
  def fail(name):
    if name == "committing":
      raise RuntimeError("simulated crash before the commit")
  phase_hook[step] = fail
  handle = fnckpt.save(state_of(step), _paths.join(root, str(step)))
  with pytest.raises(fnckpt.CheckpointError, match="simulated crash"):
    handle.wait()
  del phase_hook[step]


def test_save_restore_latest(root):
  with fnckpt.CheckpointManager(root) as mgr:
    assert mgr.all_steps() == [] and mgr.latest_step() is None
    handles = [mgr.save(s, state_of(s), metrics={"loss": 1.0 / (s + 1)}) for s in (0, 5, 10)]
    assert all(isinstance(h, fnckpt.SaveHandle) for h in handles)
    mgr.wait()
    assert mgr.all_steps() == [0, 5, 10]
    assert mgr.latest_step() == 10
    latest = mgr.restore()
    np.testing.assert_array_equal(latest["w"], state_of(10)["w"])
    assert latest["step"] == 10
    assert mgr.restore(5)["step"] == 5
    assert mgr.metrics(5) == {"loss": 1 / 6}
    assert fnckpt.metadata(mgr.path(5)).user_metadata == {"step": 5, "metrics": {"loss": 1 / 6}}
  # a second manager sees the same steps (and the step directories are plain decimals)
  assert fnckpt.CheckpointManager(root).all_steps() == [0, 5, 10]
  assert sorted({k.split("/")[0] for k in _paths.list_keys(root)}) == ["0", "10", "5"]


def test_restore_without_checkpoints_names_the_directory(root):
  with pytest.raises(fnckpt.CheckpointError, match="No committed checkpoint in"):
    fnckpt.CheckpointManager(root).restore()


def test_interval_force_and_step_types(root):
  mgr = fnckpt.CheckpointManager(root, save_interval_steps=10)
  assert [s for s in range(31) if mgr.should_save(s)] == [0, 10, 20, 30]
  assert mgr.save(3, state_of(3)) is None
  assert mgr.save(np.int64(10), state_of(10)) is not None
  assert mgr.save(jnp.asarray(13), state_of(13), force=True) is not None
  mgr.wait()
  assert mgr.all_steps() == [10, 13]
  for bad in (-1, 1.5, "7", True):
    with pytest.raises(fnckpt.CheckpointError, match="non-negative int"):
      mgr.save(bad, state_of(0), force=True)


def test_refuses_committed_and_older_steps_unless_forced(root):
  mgr = fnckpt.CheckpointManager(root)
  mgr.save(4, state_of(4)).wait()
  mgr.save(8, state_of(8)).wait()
  with pytest.raises(fnckpt.CheckpointError, match="Step 8 is already committed"):
    mgr.save(8, state_of(80))
  with pytest.raises(fnckpt.CheckpointError, match="Step 6 is older than step 8"):
    mgr.save(6, state_of(6))
  mgr.save(8, state_of(80), force=True).wait()
  assert mgr.restore(8)["step"] == 80
  mgr.save(6, state_of(6), force=True).wait()
  mgr.delete(8)
  assert mgr.all_steps() == [4, 6]
  mgr.save(7, state_of(7)).wait()  # after deleting newer steps, the run may go on from 6
  with pytest.raises(fnckpt.CheckpointError, match="no step 99"):
    mgr.delete(99)


def test_retention_last_every_best_across_restarts(root):
  kw = dict(max_to_keep=2, keep_every=4, best_n=1, best_metric="loss", best_mode="min")
  losses = {0: 5.0, 1: 0.5, 2: 3.0, 3: 4.0, 4: 6.0, 5: 7.0, 6: 8.0}
  mgr = fnckpt.CheckpointManager(root, **kw)
  for s in range(4):
    mgr.save(s, state_of(s), metrics={"loss": np.float32(losses[s])})
  mgr.close()
  assert mgr.all_steps() == [0, 1, 2, 3]  # 0 every-4th, 1 best, 2-3 newest
  # a new manager ranks the old steps by the metrics stored in their manifests
  mgr = fnckpt.CheckpointManager(root, **kw)
  for s in range(4, 7):
    mgr.save(s, state_of(s), metrics={"loss": losses[s]})
  mgr.close()
  assert mgr.all_steps() == [0, 1, 4, 5, 6]
  assert fnckpt.CheckpointManager(root).restore(1)["step"] == 1


def test_deletes_only_after_the_triggering_save_committed(root, phase_hook):
  mgr = fnckpt.CheckpointManager(root, max_to_keep=1)
  mgr.save(1, state_of(1)).wait()
  release = threading.Event()
  phase_hook[2] = lambda name: name == "committing" and release.wait(30)
  handle = mgr.save(2, state_of(2))
  assert not handle.done()
  assert mgr.all_steps() == [1]          # still the only checkpoint: kept
  assert mgr.uncommitted_steps() == []   # a save in flight is not a leftover
  assert mgr.cleanup() == []             # ... and cleanup leaves it alone
  release.set()
  mgr.wait()
  assert mgr.all_steps() == [2]
  assert mgr.restore()["step"] == 2


def test_retention_spares_a_step_being_restored(root, monkeypatch):
  from fnckpt._restore import restore as _restore
  reading, release = threading.Event(), threading.Event()
  real = _restore._read_all

  def slow_read(location, *args, **kwargs):
    reading.set()
    assert release.wait(30)
    return real(location, *args, **kwargs)

  mgr = fnckpt.CheckpointManager(root, max_to_keep=1)
  mgr.save(1, state_of(1)).wait()
  monkeypatch.setattr(_restore, "_read_all", slow_read)
  result = {}
  reader = threading.Thread(target=lambda: result.update(value=mgr.restore(1)))
  reader.start()
  assert reading.wait(30)
  mgr.save(2, state_of(2)).wait()
  mgr.wait()
  assert mgr.all_steps() == [1, 2]  # step 1 is beyond max_to_keep, but being read
  release.set()
  reader.join(30)
  assert result["value"]["step"] == 1
  monkeypatch.setattr(_restore, "_read_all", real)
  mgr.save(3, state_of(3)).wait()
  mgr.wait()
  assert mgr.all_steps() == [3]


def test_uncommitted_leftovers_ignored_reported_replaced_cleaned(root, phase_hook):
  mgr = fnckpt.CheckpointManager(root)
  mgr.save(1, state_of(1)).wait()
  leave_uncommitted(root, 2, phase_hook)
  leave_uncommitted(root, 3, phase_hook)
  with pytest.warns(UserWarning, match=r"uncommitted steps \[2, 3\]"):
    mgr = fnckpt.CheckpointManager(root)
  assert mgr.all_steps() == [1] and mgr.latest_step() == 1
  assert mgr.uncommitted_steps() == [2, 3]
  assert mgr.restore()["step"] == 1
  with pytest.raises(fnckpt.NotCommittedError):
    mgr.restore(2)
  mgr.save(2, state_of(20)).wait()       # replaces the leftover, no force needed
  assert mgr.all_steps() == [1, 2] and mgr.restore(2)["step"] == 20
  assert mgr.uncommitted_steps() == [3]
  assert mgr.cleanup() == [3]
  assert mgr.uncommitted_steps() == []
  assert not any(k.startswith("3/") for k in _paths.list_keys(root))
  if "://" not in root:
    assert sorted(os.listdir(root)) == ["1", "2"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fnckpt.CheckpointManager(root)      # nothing left to warn about


def test_background_error_is_raised_once(root, phase_hook):
  mgr = fnckpt.CheckpointManager(root, max_to_keep=1)
  mgr.save(1, state_of(1)).wait()

  def fail(name):
    if name == "written":
      raise OSError("disk full (simulated)")
  phase_hook[2] = fail
  mgr.save(2, state_of(2))
  with pytest.raises(fnckpt.CheckpointError, match="disk full"):
    mgr.wait()
  mgr.wait()  # reported once
  assert mgr.all_steps() == [1]  # retention did not run for the failed save
  del phase_hook[2]
  mgr.save(2, state_of(2)).wait()
  mgr.wait()
  assert mgr.all_steps() == [2]


def test_preemption_saves_at_next_boundary_and_waits_for_commit(root):
  previous = signal.getsignal(signal.SIGTERM)
  mgr = fnckpt.CheckpointManager(root, save_interval_steps=1000, handle_preemption=True)
  assert signal.getsignal(signal.SIGTERM) != previous
  saved = []
  for step in range(1, 100):
    assert mgr.preemption_requested == (step > 7)
    if mgr.should_save(step):
      saved.append(mgr.save(step, state_of(step)))
    if mgr.reached_preemption(step):
      break
    if step == 7:
      os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, after step 7's boundary
  assert step == 8 and len(saved) == 1
  assert saved[0].done()                 # committed before reached_preemption returned
  assert mgr.all_steps() == [8]
  mgr.close()
  assert signal.getsignal(signal.SIGTERM) == previous


def test_preemption_without_save_warns(root):
  mgr = fnckpt.CheckpointManager(root)
  mgr.install_preemption_handler()
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    assert mgr.should_save(3)
    with pytest.warns(UserWarning, match="step 3 was not saved"):
      assert mgr.reached_preemption(3)
  finally:
    mgr.close()


def test_restore_or_init_onto_another_mesh(root):
  mesh8 = jax.make_mesh((2, 4), ("data", "model"))
  sharding = NamedSharding(mesh8, P("data", "model"))

  def init():
    return {"w": jax.device_put(jnp.zeros((8, 16)), sharding), "step": 0,
            "key": jax.random.key(0), "data": np.random.default_rng(0)}

  mgr = fnckpt.CheckpointManager(root, max_to_keep=2)
  state, step = mgr.restore_or_init(init)
  assert step is None and state["step"] == 0
  state["w"] = state["w"] + jnp.arange(8 * 16.0).reshape(8, 16)
  state["step"] = 3
  state["data"].normal(size=10)  # advance the data position
  mgr.save(3, state)
  mgr.close()

  mesh4 = jax.make_mesh((4,), ("x",), devices=jax.devices()[4:])
  target = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32,
                                      sharding=NamedSharding(mesh4, P(None, "x"))),
            "step": 0, "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype,
                                                   sharding=NamedSharding(mesh4, P())),
            "data": np.random.default_rng()}
  mgr = fnckpt.CheckpointManager(root)
  restored, step = mgr.restore_or_init(init, target=target)
  assert step == 3 and restored["step"] == 3
  assert restored["w"].sharding == target["w"].sharding
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert restored["data"].normal() == state["data"].normal()
  assert jax.random.key_data(restored["key"]).tolist() == jax.random.key_data(
      state["key"]).tolist()
  # an initialized state works as init and as its own target
  again, step = mgr.restore_or_init(init())
  assert step == 3 and again["w"].sharding == sharding


def test_manager_arguments_are_checked():
  with pytest.raises(ValueError, match="best_n needs best_metric"):
    fnckpt.CheckpointManager("memory://x", best_n=2)
  with pytest.raises(ValueError, match="save_interval_steps"):
    fnckpt.CheckpointManager("memory://x", save_interval_steps=0)
  with pytest.raises(ValueError, match="may not set 'overwrite'"):
    fnckpt.CheckpointManager("memory://x", save_options={"overwrite": True})
  with pytest.raises(TypeError, match=r"save_options \['budget', 'zst'\]: not options of "
                     r"fnckpt.save; it takes \['barrier_timeout_s', 'budget_bytes', "):
    fnckpt.CheckpointManager("memory://x", save_options={"zst": 3, "budget": 1, "zstd": 3})
  with pytest.raises(fnckpt.CheckpointError, match=r"save\(pack_bytes=-1\): expected an int"):
    fnckpt.CheckpointManager("memory://x", save_options={"pack_bytes": -1})
  mgr = fnckpt.CheckpointManager("memory://x")
  mgr.close()
  with pytest.raises(fnckpt.CheckpointError, match="is closed"):
    mgr.save(0, {})


# --- the state machine -------------------------------------------------------------------------

class ManagerMachine(RuleBasedStateMachine):
  """save / delete / wait / restart / leftovers / cleanup against a dict of committed steps.

  The model applies its own (independent, simple) reading of the retention rules after every
  successful save: keep the newest ``k`` steps, every step divisible by ``m``, the newest."""

  root_kind = "memory"

  def __init__(self):
    super().__init__()
    self.model = {}          # committed step -> value
    self.leftovers = set()
    self.counter = 0

  @initialize(k=st.none() | st.integers(1, 3), m=st.none() | st.integers(2, 4))
  def start(self, k, m):
    if self.root_kind == "memory":
      self.root = f"memory://machine/{uuid.uuid4().hex}"
    else:
      import tempfile
      self.root = tempfile.mkdtemp(prefix="fnckpt-machine-")
    self.k, self.m = k, m
    self.mgr = fnckpt.CheckpointManager(self.root, max_to_keep=k, keep_every=m)

  def retain(self):
    if self.k is None and self.m is None:
      return
    steps = sorted(self.model)
    keep = set(steps[-(self.k or 0):]) if self.k else set()
    keep |= {s for s in steps if self.m and s % self.m == 0}
    keep |= set(steps[-1:])
    self.model = {s: v for s, v in self.model.items() if s in keep}

  @rule(step=st.integers(0, 12), force=st.booleans())
  def save(self, step, force):
    self.counter += 1
    value = self.counter
    newest = max(self.model, default=-1)
    if not force and (step in self.model or step < newest):
      with pytest.raises(fnckpt.CheckpointError, match="already committed|older than"):
        self.mgr.save(step, state_of(value, n=300 + step))
      return
    self.mgr.save(step, state_of(value, n=300 + step), force=force)
    self.model[step] = value
    self.leftovers.discard(step)
    self.retain()

  @precondition(lambda self: self.model)
  @rule(data=st.data())
  def delete(self, data):
    step = data.draw(st.sampled_from(sorted(self.model)))
    self.mgr.delete(step)
    del self.model[step]

  @rule(step=st.integers(0, 12))
  def crash_leaves_uncommitted(self, step):
    """What a killed save leaves: data and manifest but no marker (only where no step is)."""
    if step in self.model:
      return
    self.mgr.wait()
    location = _paths.join(self.root, str(step))
    kv = _paths.open_kvstore(location)
    kv.write("manifest.msgpack", b"half written").result()
    kv.write("d/0/c/0", b"junk").result()
    self.leftovers.add(step)

  @rule()
  def cleanup(self):
    self.mgr.wait()
    assert sorted(self.mgr.cleanup()) == sorted(self.leftovers)
    self.leftovers.clear()

  @rule()
  def restart(self):
    self.mgr.close()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      self.mgr = fnckpt.CheckpointManager(self.root, max_to_keep=self.k, keep_every=self.m)
    warned = [w for w in caught if "uncommitted steps" in str(w.message)]
    assert bool(warned) == bool(self.leftovers)

  @rule()
  def check_latest_and_contents(self):
    self.mgr.wait()
    assert self.mgr.latest_step() == max(self.model, default=None)
    if self.model:
      step = max(self.model)
      restored = self.mgr.restore()
      assert restored["step"] == self.model[step]
      np.testing.assert_array_equal(restored["w"], state_of(self.model[step], 300 + step)["w"])

  @invariant()
  def steps_match_model(self):
    if not hasattr(self, "mgr"):
      return
    self.mgr.wait()
    assert self.mgr.all_steps() == sorted(self.model)
    assert self.mgr.uncommitted_steps() == sorted(self.leftovers)

  def teardown(self):
    if hasattr(self, "mgr"):
      self.mgr.close()
    if self.root_kind == "file" and hasattr(self, "root"):
      import shutil
      shutil.rmtree(self.root, ignore_errors=True)


class FileManagerMachine(ManagerMachine):
  root_kind = "file"


_machine_settings = settings(max_examples=75, stateful_step_count=20, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = _machine_settings
TestFileManagerMachine = FileManagerMachine.TestCase
TestFileManagerMachine.settings = settings(_machine_settings, max_examples=25)


# --- listing, metrics, targets, errors (the parts the manager is made of) ----------------------

class CountingKv:
  """The real kvstore of a StepIndex, with its list calls counted (keys returned per call)."""

  def __init__(self, kv):
    self.kv, self.listed = kv, []

  def list(self, range=None):
    future = self.kv.list(range=range)
    self.listed.append(len(future.result()))
    return future

  def read(self, key):
    return self.kv.read(key)


def test_listing_skips_the_data_of_known_steps_and_finds_every_change():
  from fnckpt._manager import steps as _steps
  root = f"memory://test_manager/{uuid.uuid4().hex}"
  big = {"w": np.zeros((64, 64), np.float32)}
  for step in (1, 2, 10):  # many chunk files per step: the data that must not be listed
    fnckpt.save(big, _paths.join(root, str(step)), budget_bytes=1 << 20).wait()
  keys_per_step = len([k for k in _paths.list_keys(root) if k.startswith("1/")])
  index = _steps.StepIndex(root)
  index._kv = counting = CountingKv(index._kv)
  assert index.list().steps == [1, 2, 10]          # first look: every key, once
  assert sum(counting.listed) == 3 * keys_per_step
  counting.listed.clear()
  assert index.list().steps == [1, 2, 10]          # then only the (empty) gaps between steps
  assert counting.listed == [0, 0, 0, 0]
  # another writer adds a step, leaves a crashed one, re-commits one and deletes one
  fnckpt.save(big, _paths.join(root, "5")).wait()
  _paths.open_kvstore(_paths.join(root, "7")).write("manifest.msgpack", b"half").result()
  fnckpt.save({"w": np.ones(3)}, _paths.join(root, "2"), overwrite=True).wait()
  _paths.delete_prefix(_paths.join(root, "10"), first=(_steps.MARKER,))
  counting.listed.clear()
  listing = index.list()
  assert listing.steps == [1, 2, 5] and listing.uncommitted == [7]
  # the gaps held only the new steps' keys; the deleted step's own range was probed (empty)
  assert sum(counting.listed) == keys_per_step + 1
  assert index.list().steps == [1, 2, 5]


def test_local_listing_reads_step_names_and_markers_only(tmp_path):
  from fnckpt._manager import steps as _steps
  root = tmp_path / "run"
  fnckpt.save({"w": np.zeros(5000)}, str(root / "3")).wait()
  (root / "4").mkdir()                       # an empty directory is no step
  (root / "6" / "d").mkdir(parents=True)
  (root / "6" / "d" / "x").write_bytes(b"")  # data without a marker: a leftover
  (root / "notes").mkdir()
  (root / "9").write_bytes(b"")              # a file, not a step directory
  listing = _steps.StepIndex(str(root)).list()
  assert listing.steps == [3] and listing.uncommitted == [6]
  assert _steps.scan(str(tmp_path / "nothing")) == ([], [])


def test_marker_is_what_the_core_commits(root):
  """The index reads <step>/MARKER without parsing it; it must be the core's marker."""
  from fnckpt._io import commit as _commit
  from fnckpt._manager import steps as _steps
  path = _paths.join(root, "1")
  fnckpt.save({"x": np.zeros(2)}, path).wait()
  assert f"1/{_steps.MARKER}" in _paths.list_keys(root)
  kv = _paths.open_kvstore(path)
  kv.delete_range(__import__("tensorstore").KvStore.KeyRange(_steps.MARKER,
                                                             _steps.MARKER + "\0")).result()
  assert not _commit.is_committed(kv)
  assert _steps.scan(root) == ([], [1])


def test_best_n_ranks_a_recommitted_step_by_its_new_metric(root):
  """Metrics are cached per commit of a step: a step re-saved by another manager is re-read."""
  mgr = fnckpt.CheckpointManager(root, max_to_keep=1, best_n=1, best_metric="loss")
  for step, loss in ((1, 0.1), (2, 0.5), (3, 0.9)):
    mgr.save(step, state_of(step), metrics={"loss": loss})
  mgr.wait()
  assert mgr.all_steps() == [1, 3]  # 1 is the best
  other = fnckpt.CheckpointManager(root)
  other.save(1, state_of(1), metrics={"loss": 5.0}, force=True).wait()
  mgr.save(4, state_of(4), metrics={"loss": 0.8})
  mgr.wait()
  assert mgr.all_steps() == [4]  # 1 is no longer the best (and 4 is the newest)
  assert mgr.metrics(4) == {"loss": 0.8}


def test_restore_or_init_warns_about_a_target_without_shardings(root):
  mgr = fnckpt.CheckpointManager(root)
  mgr.save(2, {"w": np.arange(4.0, dtype=np.float32), "step": 2}).wait()
  target = {"w": jax.ShapeDtypeStruct((4,), jnp.float32), "step": 0}
  with pytest.warns(UserWarning, match=r"no sharding at \['w'\].*one device.*NamedSharding"):
    state, step = mgr.restore_or_init(lambda: None, target=target)
  assert step == 2 and len(state["w"].devices()) == 1
  with pytest.warns(UserWarning, match=r"no sharding at \['step'\], \['w'\]"):  # eval_shape(init)
    mgr.restore_or_init(lambda: {"w": jnp.zeros(4), "step": 0})
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    placed = NamedSharding(jax.make_mesh((8,), ("x",)), P())
    mgr.restore_or_init(None, target={"w": jax.ShapeDtypeStruct((4,), jnp.float32,
                                                                sharding=placed), "step": 0})


def test_wait_raises_every_error_once(root, phase_hook):
  mgr = fnckpt.CheckpointManager(root)
  both_started = threading.Event()  # neither fails before both saves were called

  def fail(name):
    if name == "written":
      assert both_started.wait(60)
      raise OSError("disk full (simulated)")
  phase_hook[1] = phase_hook[2] = fail
  mgr.save(1, state_of(1))
  mgr.save(2, state_of(2))
  both_started.set()
  with pytest.raises(fnckpt.CheckpointError, match="disk full") as info:
    mgr.wait()
  assert any("also:" in note and "disk full" in note for note in info.value.__notes__)
  mgr.wait()


def test_retention_error_is_warned_then_raised_by_the_next_call(tmp_path):
  """One process: a retention failure is warned about at once and raised (once) by the next
  save() or wait(); the next pass deletes the step once the cause is gone."""
  from mp_manager_worker import make_undeletable, undo_undeletable
  root = str(tmp_path / "run")
  mgr = fnckpt.CheckpointManager(root, max_to_keep=1)
  mgr.save(0, state_of(0)).wait()
  how = make_undeletable(os.path.join(root, "0"))
  try:
    with pytest.warns(RuntimeWarning, match="Retention could not delete step 0"):
      mgr.save(1, state_of(1)).wait()
      mgr._background.join()
    with pytest.raises(fnckpt.CheckpointError, match=r"manager.delete\(step\) for step 0"):
      mgr.save(2, state_of(2))
  finally:
    undo_undeletable(os.path.join(root, "0"), how)
  mgr.save(2, state_of(2))
  mgr.close()
  assert mgr.all_steps() == [2] and os.listdir(root) == ["2"]
