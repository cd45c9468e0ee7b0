"""The script that test child processes run: ``python tests/mp_worker.py '<json config>'``.

``config["mode"]`` picks what to do (the functions named ``mode_*`` below). With
``num_processes`` > 1 the child joins a ``jax.distributed`` job on 127.0.0.1 first. Results go
to stdout as one line ``RESULT <json>``; progress lines (``PHASE <name>``) let the parent act at
an exact instant. Importing this module has no side effects: the parent imports it for the
deterministic test values (:func:`expected`, :func:`make_state`).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

MiB = 1 << 20

# --- deterministic values, the same in every process and in the parent --------------------

def expected(name: str, shape, dtype: str = "float32", seed: int = 0) -> np.ndarray:
  """The value of leaf ``name`` (a pure function of its name, shape, dtype and seed)."""
  import jax.numpy as jnp  # (knows bfloat16 & co; configures no backend)
  dtype = np.dtype(jnp.dtype(dtype))
  offset = (sum(map(ord, name)) * 7919 + seed * 104729) % 100003
  size = int(np.prod(shape, dtype=np.int64))
  if dtype.kind == "b":
    return ((np.arange(size) + offset) % 3 == 0).reshape(shape)
  if dtype.kind in "iu":
    return ((np.arange(size, dtype=np.int64) + offset) % 1000).astype(dtype).reshape(shape)
  return ((np.arange(size, dtype=np.float64) + offset) * 0.5).astype(dtype).reshape(shape)


def make_state(leaves: dict[str, dict[str, Any]], mesh=None, seed: int = 0) -> dict[str, Any]:
  """A tree of global arrays. Each leaf: ``shape``, ``dtype``, ``spec`` (a PartitionSpec as a
  list; ``None`` entries unsharded; ``"replicated"`` for P()) and ``kind`` ("jax" or
  "numpy")."""
  import jax
  out = {}
  for name, leaf in leaves.items():
    value = expected(name, leaf["shape"], leaf.get("dtype", "float32"), seed)
    if leaf.get("kind", "jax") == "numpy":
      out[name] = value
      continue
    sharding = sharding_of(mesh, leaf.get("spec"))
    out[name] = jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx])
  return out


def sharding_of(mesh, spec):
  import jax
  P = jax.sharding.PartitionSpec
  if spec is None or spec == "replicated":
    return jax.sharding.NamedSharding(mesh, P())
  return jax.sharding.NamedSharding(mesh, P(*[tuple(s) if isinstance(s, list) else s
                                              for s in spec]))


def check_addressable(name: str, arr, value: np.ndarray) -> int:
  """Compare every addressable shard of ``arr`` with the expected numpy ``value``; return the
  number of shards checked (raises AssertionError on a difference)."""
  n = 0
  for shard in arr.addressable_shards:
    got = np.asarray(shard.data)
    want = value[shard.index]
    if got.shape != want.shape or got.dtype != want.dtype or got.tobytes() != want.tobytes():
      raise AssertionError(f"{name}: shard {shard.index} on {shard.device} differs")
    n += 1
  return n


# --- setup ------------------------------------------------------------------------------

def setup(cfg: dict[str, Any]) -> None:
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  jax.config.update("jax_num_cpu_devices", int(cfg.get("devices", 1)))
  if "piece_bytes" in cfg:  # 0: every sharded array a zarr array of its own (no pieces)
    from fnckpt._layout import pieces as _pieces
    _pieces.PIECE_BYTES = int(cfg["piece_bytes"])
  n = int(cfg.get("num_processes", 1))
  if n > 1:
    # gloo is jax 0.10's default CPU collectives implementation; set it explicitly so the job
    # does not depend on that default. fnckpt itself needs no collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{cfg['port']}", num_processes=n,
        process_id=int(cfg["process_id"]),
        heartbeat_timeout_seconds=int(cfg.get("heartbeat_s", 10)),
        initialization_timeout=int(cfg.get("init_timeout_s", 60)),
        shutdown_timeout_seconds=int(cfg.get("shutdown_timeout_s", 20)))


def say(line: str) -> None:
  print(line, flush=True)


def result(obj: Any) -> None:
  say("RESULT " + json.dumps(obj))


def make_mesh(shape, axes):
  import jax
  return jax.make_mesh(tuple(shape), tuple(axes), devices=jax.devices())


def install_fault(phase: str | None, action: str, after_chunks: int = 2) -> None:
  """Stop the save at ``phase``: ``kill`` (SIGKILL itself), ``hang`` (print ``PHASE name``
  then sleep until killed from outside), ``raise`` (the save fails there), ``sleep`` (delay
  the save by one second there), ``delete:<path>`` (delete the checkpoint at ``path``, e.g.
  the save's base, there). ``phase="midwrite"``: SIGKILL while staging chunk number
  ``after_chunks + 1``, once the earlier chunks are durable on storage. ``phase="marker"``:
  after the commit marker, as this process arrives at the last barrier."""
  import signal
  from fnckpt import _state
  from fnckpt._io import arrays as store_mod

  def act(name: str) -> None:
    say(f"PHASE {name}")
    if action == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    elif action == "hang":
      while True:
        time.sleep(60)
    elif action == "raise":
      raise RuntimeError(f"injected failure at {name}")
    elif action == "sleep":
      time.sleep(1.0)
    elif action.startswith("delete:"):
      import shutil
      shutil.rmtree(action[len("delete:"):])

  if phase == "midwrite":
    import concurrent.futures
    from fnckpt._io import direct as direct_mod
    real, real_direct = store_mod.write_chunk, direct_mod.write_chunk
    issued = []

    def before() -> None:
      if len(issued) == after_chunks:
        for f in list(issued):
          f.result()
        act("midwrite")

    def write_chunk(store, index, data):
      before()
      fut = real(store, index, data)
      issued.append(fut)
      return fut

    def write_direct(path, image, buf):   # (a local pack chunk, on a thread that waits)
      before()
      fut = concurrent.futures.Future()
      issued.append(fut)
      try:
        real_direct(path, image, buf)
      finally:
        fut.set_result(None)

    store_mod.write_chunk = write_chunk
    direct_mod.write_chunk = write_direct
    return
  if phase == "marker":  # (as this process arrives at the last barrier, 'committed')
    from fnckpt._io import collective as collective_mod
    real_barrier = collective_mod.Session.barrier

    def barrier(session, name):
      if name == "committed":
        collective_mod.Session.barrier = real_barrier  # (this attempt only)
        act("marker")
      return real_barrier(session, name)

    collective_mod.Session.barrier = barrier
    return

  def hook(name: str) -> None:
    if name == phase:
      act(name)

  _state.hooks.on_phase = hook


# --- modes ------------------------------------------------------------------------------

def mode_save(cfg):
  """Save ``leaves`` (on ``mesh``) to ``path``; report this process's stats. Optionally a
  fault (``fault``: {phase, action}) and ``prev``: a checkpoint saved (and committed) first."""
  import jax
  import fnckpt
  mesh = make_mesh(*cfg["mesh"])
  if cfg.get("prev"):
    prev = make_state(cfg["leaves"], mesh, seed=1)
    prev["step"] = 6
    fnckpt.save(prev, cfg["prev"], barrier_timeout_s=cfg.get("barrier_s", 60)).wait()
  state = make_state(cfg["leaves"], mesh, seed=cfg.get("seed", 0))
  state["step"] = 7
  if cfg.get("fault"):
    f = cfg["fault"]
    if f.get("process", jax.process_index()) == jax.process_index():
      install_fault(f["phase"], f["action"])
  saves = cfg.get("repeat", 1)
  stats = []
  t0 = time.monotonic()
  try:
    for _ in range(saves):
      h = fnckpt.save(state, cfg["path"], overwrite=cfg.get("overwrite", False),
                      barrier_timeout_s=cfg.get("barrier_s", 60))
      s = h.wait()
      stats.append({"bytes_written": s.bytes_written, "chunks_written": s.chunks_written,
                    "blocking_s": s.blocking_s, "total_s": s.total_s})
  except Exception as e:
    result({"process": jax.process_index(), "error": type(e).__name__, "message": str(e),
            "elapsed_s": time.monotonic() - t0})
    return
  result({"process": jax.process_index(), "stats": stats, "elapsed_s": time.monotonic() - t0})


def target_of(leaves, specs, mesh) -> dict:
  """A restore target of ``leaves``: numpy zeros for numpy leaves, else ShapeDtypeStructs on
  ``mesh`` with ``specs[name]`` (default: the leaf's own spec)."""
  import jax
  target = {}
  for name, leaf in leaves.items():
    spec = specs.get(name, leaf.get("spec"))
    if leaf.get("kind", "jax") == "numpy":
      target[name] = np.zeros(leaf["shape"], leaf.get("dtype", "float32"))
    else:
      target[name] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(
          expected("z", (1,), leaf.get("dtype", "float32")).dtype),
          sharding=sharding_of(mesh, spec))
  return target


def mode_restore(cfg):
  """Restore ``path`` onto ``mesh`` with the PartitionSpecs in ``target`` and check every
  addressable shard against the expected values."""
  import jax
  import fnckpt
  mesh = make_mesh(*cfg["mesh"])
  target = target_of(cfg["leaves"], cfg["target"], mesh)
  target["step"] = 0
  got = fnckpt.restore(cfg["path"], target)
  checked = 0
  for name, leaf in cfg["leaves"].items():
    value = expected(name, leaf["shape"], leaf.get("dtype", "float32"), cfg.get("seed", 0))
    if leaf.get("kind", "jax") == "numpy":
      assert isinstance(got[name], np.ndarray) and got[name].tobytes() == value.tobytes(), name
      checked += 1
    else:
      assert got[name].sharding == target[name].sharding, name
      checked += check_addressable(name, got[name], value)
  assert got["step"] == 7
  result({"process": jax.process_index(), "checked_shards": checked,
          "devices": [d.id for d in jax.local_devices()]})


def mode_skip_save(cfg):
  """Process ``absent`` never calls save (but stays alive, until the others are done or 60
  s); the others save with a short barrier deadline and report the error they get."""
  import jax
  release = cfg["path"] + ".done"
  if jax.process_index() == cfg["absent"]:
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
      time.sleep(0.05)
    result({"process": jax.process_index(), "absent": True})
    return
  mode_save(cfg)
  with open(release, "w"):
    pass


def mode_exit_without_wait(cfg):
  """Save and fall off the end of the script without waiting; the save is made to still be
  pending then (its commit is delayed by a second at ``written``)."""
  import fnckpt
  install_fault("written", cfg.get("action", "sleep"))
  state = {name: expected(name, leaf["shape"], leaf.get("dtype", "float32"))
           for name, leaf in cfg["leaves"].items()}
  h = fnckpt.save(state, cfg["path"])
  result({"done_when_main_returned": h.done()})


def rss(field: str = "VmRSS") -> int:
  """This process's resident set size (``field`` ``VmHWM``: its peak), bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError(field)


def mode_memory_budget(cfg):
  """Peak RSS of one save, above the RSS before it (the state already allocated)."""
  import gc
  import threading
  import jax
  import fnckpt
  from fnckpt import _state
  _state.hooks.staging = cfg.get("staging")  # "owned": copies into buffers the save owns
  mesh = make_mesh([cfg["devices"]], ["a"])
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a"))
  shape = tuple(cfg["shape"])
  if cfg.get("numpy"):  # numpy leaves are copied when staged: the budget is what bounds them
    state = {f"w{i}": np.full(shape, i + 1, np.float32) for i in range(cfg["leaves"])}
  else:  # on CPU, jax shards are staged as views of the device buffers (no host copy)
    state = {f"w{i}": jax.make_array_from_callback(
        shape, sharding, lambda idx, i=i: np.full(shape, i + 1, np.float32)[idx])
        for i in range(cfg["leaves"])}
  jax.block_until_ready(state)
  # Warm up: thread pools, the TensorStore drivers, zarr.json writing, a small save.
  warm = {"w": jax.make_array_from_callback(
      (8 * 1024, 256), sharding, lambda idx: np.ones((8 * 1024, 256), np.float32)[idx])}
  fnckpt.save(warm, cfg["path"] + "/warm").wait()
  gc.collect()
  time.sleep(0.2)
  base = rss()
  samples = []
  stop = threading.Event()

  def sample():  # also sample, in case VmHWM cannot be reset on this kernel
    while not stop.is_set():
      b = _state.saves.budget
      samples.append((rss() - base, b.held if b else 0))
      time.sleep(0.001)

  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
  hwm_reset = rss("VmHWM") - base
  t = threading.Thread(target=sample, daemon=True)
  t.start()
  budget = cfg["budget_mib"] * MiB
  h = fnckpt.save(state, cfg["path"] + "/ckpt", budget_bytes=budget)
  stats = h.wait()
  peak_hwm = rss("VmHWM") - base
  stop.set()
  t.join()
  result({"base": base, "hwm_after_reset": hwm_reset, "peak_hwm": peak_hwm,
          "peak_sampled": max(s[0] for s in samples),
          "max_held": max(s[1] for s in samples), "budget": budget,
          "peak_staged_bytes": stats.peak_staged_bytes, "bytes_written": stats.bytes_written,
          "chunks_written": stats.chunks_written, "state_bytes": sum(
              x.nbytes for x in state.values()), "blocking_s": stats.blocking_s,
          "total_s": stats.total_s})


def mode_memory_growth(cfg):
  """RSS and Python-heap samples over many consecutive async saves of the same state."""
  import gc
  import shutil
  import weakref
  import fnckpt
  mesh = make_mesh([cfg["devices"]], ["a"])
  state = make_state({
      "w": {"shape": [256, 256], "spec": ["a"]},           # 8 chunks
      "r": {"shape": [64, 256], "spec": "replicated"},     # 1 chunk, written once
      "n": {"shape": [128, 64], "kind": "numpy"},          # 1 chunk
      "b": {"shape": [16], "spec": "replicated"},          # inline
  }, mesh)
  state["step"] = 1
  root = cfg["path"]
  if cfg.get("inject") == "cache":  # (to check the test) a process-wide context with a cache
    from fnckpt._io import paths as paths_mod
    import tensorstore as ts
    shared = ts.Context({"cache_pool": {"total_bytes_limit": 1 << 30}})
    paths_mod.context = lambda *a, **k: shared
  handles = []
  refs = []

  def one(i):
    h = fnckpt.save(state, f"{root}/{i}")
    handles.append(h)
    refs.append(weakref.ref(h))
    if len(handles) > 1:  # async: wait for the previous one only, then delete it
      handles.pop(0).wait()
      shutil.rmtree(f"{root}/{i - 1}")

  def sample():  # (tracemalloc would slow every save down several times)
    gc.collect()
    return sys.getallocatedblocks(), rss()

  n_warm, n, every = cfg["warmup"], cfg["saves"], cfg["every"]
  for i in range(n_warm):
    one(i)
  samples = [sample()]
  for i in range(n_warm, n_warm + n):
    one(i)
    if (i - n_warm + 1) % every == 0:
      samples.append(sample())
  handles.pop(0).wait()
  gc.collect()
  from fnckpt import _state
  result({"blocks": [s[0] for s in samples], "rss": [s[1] for s in samples],
          "handles_alive": sum(r() is not None for r in refs), "pending": len(_state.saves.pending),
          "left": sorted(os.listdir(root))})


def mode_fill_disk(cfg):
  """(Run inside a private mount namespace whose ``path`` is a small tmpfs.) A first
  checkpoint fits; a second one does not: its error, then what a reader sees."""
  import fnckpt
  small = {"a": expected("a", (64, 1024))}
  fnckpt.save(small, cfg["path"] + "/ok").wait()
  big = {f"x{i}": expected(f"x{i}", (256, 1024)) for i in range(cfg["big_leaves"])}
  out: dict[str, Any] = {}
  try:
    fnckpt.save(big, cfg["path"] + "/big").wait()
    out["save"] = "succeeded"
  except Exception as e:
    out["save"] = type(e).__name__
    out["message"] = str(e)
  try:
    fnckpt.restore(cfg["path"] + "/big")
    out["restore_big"] = "succeeded"
  except Exception as e:
    out["restore_big"] = type(e).__name__
    out["restore_big_message"] = str(e)
  got = fnckpt.restore(cfg["path"] + "/ok")
  out["ok_intact"] = got["a"].tobytes() == small["a"].tobytes()
  out["df"] = os.statvfs(cfg["path"]).f_bavail * os.statvfs(cfg["path"]).f_frsize
  result(out)


def mode_read_only(cfg):
  """(Run where ``path`` is mounted read-only.) Saving there must fail clearly."""
  import fnckpt
  out: dict[str, Any] = {}
  try:
    h = fnckpt.save({"a": expected("a", (64, 1024)), "s": 3}, cfg["path"] + "/ckpt")
    out["returned"] = True
    h.wait()
    out["save"] = "succeeded"
  except Exception as e:
    out["save"] = type(e).__name__
    out["message"] = str(e)
  result(out)


# --- collective save attempts (tests/test_collective_mp.py) -----------------------------

def check_leaves(leaves, got, seed, target=None) -> int:
  """Every leaf of ``got`` against the values saved with ``seed``: numpy leaves whole, jax
  leaves shard by shard (with ``target``'s sharding, when given); how many were checked."""
  checked = 0
  for name, leaf in leaves.items():
    want = expected(name, leaf["shape"], leaf.get("dtype", "float32"), seed)
    if leaf.get("kind", "jax") == "numpy":
      assert np.asarray(got[name]).tobytes() == want.tobytes(), name
      checked += 1
    else:
      if target is not None:
        assert got[name].sharding == target[name].sharding, name
      checked += check_addressable(name, got[name], want)
  return checked


def _attempt_state(cfg, attempt, mesh):
  """This process's tree for one attempt: ``cfg["leaves"]`` at the attempt's ``seed`` plus
  ``step``, with this process's changes (``attempt["change"][str(process)]``): ``leaves``
  (added or replaced leaf specs), ``drop`` (names), ``reseed`` (names whose values come from
  the next seed on this process only) and ``unsupported`` (a name whose value becomes an
  ``object()``, which save refuses)."""
  import jax
  change = attempt.get("change", {}).get(str(jax.process_index()), {})
  leaves = {k: v for k, v in cfg["leaves"].items() if k not in change.get("drop", ())}
  leaves.update(change.get("leaves", {}))
  state = make_state(leaves, mesh, seed=attempt.get("seed", 0))
  for name in change.get("reseed", ()):  # this process's shards of ``name`` change
    state[name] = make_state({name: leaves[name]}, mesh, seed=attempt.get("seed", 0) + 1)[name]
  state["step"] = 7
  if change.get("unsupported"):
    state[change["unsupported"]] = object()
  return state


def _restore_and_check(cfg, attempt, mesh) -> int:
  """Restore ``attempt["path"]`` onto ``mesh`` (PartitionSpecs from ``attempt["target"]``,
  else the saved ones) and compare every addressable shard bitwise; the shards checked."""
  import jax
  import fnckpt
  target, checked = {"step": 0}, 0
  for name, leaf in cfg["leaves"].items():
    if leaf.get("kind", "jax") == "numpy":
      target[name] = np.zeros(leaf["shape"], leaf.get("dtype", "float32"))
    else:
      spec = attempt.get("target", {}).get(name, leaf.get("spec"))
      target[name] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), np.dtype(
          leaf.get("dtype", "float32")), sharding=sharding_of(mesh, spec))
  got = fnckpt.restore(attempt["path"], target)
  checked += check_leaves(cfg["leaves"], got, attempt.get("seed", 0), target)
  assert got["step"] == 7
  return checked


def _listing(path: str) -> list[str] | None:
  """What a local checkpoint directory holds now (None: it does not exist)."""
  return sorted(os.listdir(path)) if os.path.isdir(path) else None


def _outcome(fn) -> dict[str, Any]:
  try:
    return {"ok": fn()}
  except Exception as e:
    outcome = getattr(e, "outcome", None)  # (fnckpt._errors.SaveOutcome: what the save left)
    return {"error": type(e).__name__, "message": str(e),
            "committed": outcome.committed if outcome is not None else "n/a",
            "replaced": outcome.replaced if outcome is not None else "n/a"}


def mode_attempts(cfg):
  """Save attempts in order, each (``cfg["attempts"]``): ``path``, ``overwrite``,
  ``pack_bytes``, ``barrier_s``, ``seed``, ``change`` (see :func:`_attempt_state`), ``fault``
  ({process, phase, action}: :func:`install_fault` for this attempt only), ``delay_s``
  ({process: seconds} to sleep before calling save), ``wait`` (False: leave it pending,
  waited for after the last attempt) and ``restore`` (restore it on every process and check
  the shards). Reports one outcome per attempt: ``ok`` (stats) or ``error``, and on process 0
  for waited attempts ``left``: the directory's entries right after the attempt."""
  import jax
  import fnckpt
  from fnckpt import _state
  mesh = make_mesh(*cfg["mesh"])
  outcomes: list[Any] = []
  pending: list[tuple[int, Any]] = []

  def stats_of(h):
    s = h.wait()
    return {"bytes_written": s.bytes_written, "chunks_written": s.chunks_written,
            "bytes_reused": s.bytes_reused}

  for i, attempt in enumerate(cfg["attempts"]):
    state = _attempt_state(cfg, attempt, mesh)
    real_phase, fault = _state.hooks.on_phase, attempt.get("fault")
    if fault and fault["process"] == jax.process_index():
      install_fault(fault["phase"], fault["action"])
    kwargs = {k: attempt[k] for k in ("overwrite", "pack_bytes", "base") if k in attempt}
    save_fn = fnckpt.save
    time.sleep(attempt.get("delay_s", {}).get(str(jax.process_index()), 0))
    barrier_s = attempt.get("barrier_s", cfg.get("barrier_s", 120))
    started = _outcome(lambda: save_fn(state, attempt["path"], barrier_timeout_s=barrier_s,
                                       **kwargs))
    if "ok" in started and not attempt.get("wait", True):  # (faults: waited attempts only)
      pending.append((i, started["ok"]))
      outcomes.append(None)
    else:
      outcomes.append(_outcome(lambda: stats_of(started["ok"])) if "ok" in started else started)
    _state.hooks.on_phase = real_phase
    if outcomes[-1] is not None and jax.process_index() == 0:
      outcomes[-1]["left"] = _listing(attempt["path"])
  for i, h in pending:
    outcomes[i] = _outcome(lambda: stats_of(h))
  for attempt, outcome in zip(cfg["attempts"], outcomes):
    if attempt.get("restore") and "ok" in outcome:
      outcome["checked_shards"] = _restore_and_check(cfg, attempt, mesh)
  result({"process": jax.process_index(), "outcomes": outcomes,
          "plans": dict(_state.plans.hits["saves"] and {"reused": _state.plans.hits["saves"]}
                        or {"reused": 0}, made=_state.plans.misses["saves"])})


def main(modes: dict[str, Any] | None = None, devices: int | None = None) -> None:
  """Run ``mode_<cfg["mode"]>`` from ``modes`` (default: this module's); any failure exits 3
  with its traceback (``devices``: the default device count)."""
  cfg = json.loads(sys.argv[1])
  if devices is not None:
    cfg.setdefault("devices", devices)
  setup(cfg)
  try:
    (modes or globals())["mode_" + cfg["mode"]](cfg)
  except BaseException:
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3)


if __name__ == "__main__":
  main()
