"""The script the manager's multi-process tests run: ``python tests/mp_manager_worker.py '<json>'``.

``config["mode"]`` picks a ``mode_*`` function. Every child joins a ``jax.distributed`` job on
127.0.0.1 (``mp_worker.setup``), with 2 CPU devices, and reports one line ``RESULT <json>``.
Importing this module has no side effects.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import warnings
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mp_worker  # noqa: E402  (setup, expected values; no side effects)
from mp_worker import result, say  # noqa: E402

LEAVES = {"w": {"shape": [8, 16], "spec": ["x", "y"]},
          "b": {"shape": [16], "spec": "replicated"},
          "e": {"shape": [4, 4], "kind": "numpy"}}
LOSS = {0: 9.0, 2: 1.0, 4: 8.0, 6: 7.0, 8: 6.0, 10: 5.0}


def mesh_and_target():
  import jax
  n = jax.process_count()
  mesh = mp_worker.make_mesh([n, 2], ["x", "y"])
  target = {k: (np.zeros(v["shape"], np.float32) if v.get("kind") == "numpy" else
                jax.ShapeDtypeStruct(tuple(v["shape"]), np.float32,
                                     sharding=mp_worker.sharding_of(mesh, v.get("spec"))))
            for k, v in LEAVES.items()}
  target["step"] = 0
  return mesh, target


def state_at(mesh, step: int) -> dict[str, Any]:
  state = mp_worker.make_state(LEAVES, mesh, seed=step)
  state["step"] = step
  return state


def check_state(got, step: int) -> int:
  """Compare every addressable shard with the values saved at ``step``; return how many."""
  assert got["step"] == step, got["step"]
  return mp_worker.check_leaves(LEAVES, got, step)


def error_of(fn) -> dict[str, str] | None:
  try:
    fn()
  except Exception as e:
    return {"type": type(e).__name__, "message": str(e)}
  return None


def mode_lifecycle(cfg):
  """Save on an interval with retention (newest 2, every 4th, best loss), latest_step after
  each save, restore_or_init in a new manager, an unsharded target, a collective delete."""
  import jax
  import fnckpt
  mesh, target = mesh_and_target()
  opts = {"barrier_timeout_s": cfg["barrier_s"]}
  kw = dict(max_to_keep=2, keep_every=4, best_n=1, best_metric="loss", save_interval_steps=2,
            save_options=opts)
  out: dict[str, Any] = {"process": jax.process_index()}
  mgr = fnckpt.CheckpointManager(cfg["root"], **kw)
  state, step = mgr.restore_or_init(lambda: state_at(mesh, 0), target=target)
  out["fresh_step"] = step
  out["latest_after_save"] = []
  for step in range(11):
    if mgr.should_save(step):
      mgr.save(step, state_at(mesh, step), metrics={"loss": LOSS[step]})
      out["latest_after_save"].append(mgr.latest_step())
  mgr.wait()
  out["all_steps"] = mgr.all_steps()
  out["metrics_2"] = mgr.metrics(2)
  mgr.close()

  mgr = fnckpt.CheckpointManager(cfg["root"], **kw)
  state, step = mgr.restore_or_init(lambda: state_at(mesh, 0), target=target)
  out["restored_step"], out["checked"] = step, check_state(state, step)
  unsharded = dict(target, w=jax.ShapeDtypeStruct((8, 16), np.float32))
  out["unsharded"] = error_of(lambda: mgr.restore_or_init(lambda: state, target=unsharded))
  mgr.delete(10)
  out["latest_after_delete"] = mgr.latest_step()
  out["restore_latest_step"] = int(mgr.restore(target=target)["step"])
  out["all_steps_end"] = mgr.all_steps()
  mgr.close()
  result(out)


def make_undeletable(path: str) -> str:
  """Make deleting the files under ``path`` fail for real: a read-only directory, or (root
  ignores modes) the immutable attribute. Returns how, for undo."""
  if os.geteuid() != 0:
    os.chmod(path, 0o555)
    return "chmod"
  if shutil.which("chattr") and subprocess.run(["chattr", "+i", path],
                                               capture_output=True).returncode == 0:
    return "chattr"
  # No way to make the file system refuse: fail the delete in fnckpt's own call instead.
  from fnckpt._manager import steps as steps_mod
  real = steps_mod._paths.delete_prefix

  def refuse(where, *args, **kwargs):
    if os.path.abspath(where) == os.path.abspath(path):
      raise OSError(f"Permission denied (injected): {where}")
    return real(where, *args, **kwargs)
  steps_mod._paths.delete_prefix = refuse
  steps_mod._real_delete_prefix = real
  return "hook"


def undo_undeletable(path: str, how: str) -> None:
  if how == "chmod":
    os.chmod(path, 0o755)
  elif how == "chattr":
    subprocess.run(["chattr", "-i", path], check=True)
  else:
    from fnckpt._manager import steps as steps_mod
    steps_mod._paths.delete_prefix = steps_mod._real_delete_prefix


def mode_retention_failure(cfg):
  """Process 0 cannot delete step 0: its retention error is raised by wait() on every
  process (not by save() on process 0), once; once fixed, the next retention deletes it."""
  import jax
  import fnckpt
  mesh, _ = mesh_and_target()
  me = jax.process_index()
  out: dict[str, Any] = {"process": me}
  mgr = fnckpt.CheckpointManager(cfg["root"], max_to_keep=1,
                                 save_options={"barrier_timeout_s": cfg["barrier_s"]})
  mgr.save(0, state_at(mesh, 0)).wait()
  how = make_undeletable(os.path.join(cfg["root"], "0")) if me == 0 else None
  out["how"] = how
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mgr.save(1, state_at(mesh, 1)).wait()
    if me == 0:
      mgr._background.join()  # (test only) process 0's retention of step 1 has failed now
    out["save_after_failure"] = error_of(lambda: mgr.save(2, state_at(mesh, 2)))
    t0 = time.monotonic()
    out["wait"] = error_of(mgr.wait)
    out["wait_s"] = time.monotonic() - t0
  out["warned"] = [str(w.message) for w in caught if "Retention" in str(w.message)]
  out["wait_again"] = error_of(mgr.wait)
  if me == 0:
    undo_undeletable(os.path.join(cfg["root"], "0"), how)
  mgr.save(3, state_at(mesh, 3))
  out["close"] = error_of(mgr.close)
  out["all_steps"] = mgr.all_steps()
  result(out)


def mode_preempt(cfg):
  """Train until preempted: SIGTERM comes from outside (to every process) after process 0
  prints READY; should_save names the step to save (JAX's sync point)."""
  import jax
  import fnckpt
  mesh, target = mesh_and_target()
  me = jax.process_index()
  mgr = fnckpt.CheckpointManager(cfg["root"], save_interval_steps=1000, handle_preemption=True,
                                 save_options={"barrier_timeout_s": cfg["barrier_s"]})
  state, start = mgr.restore_or_init(lambda: state_at(mesh, 0), target=target)
  saves, requested_at, step = [], None, 0
  for step in range(0 if start is None else start + 1, cfg["max_steps"]):
    time.sleep(cfg["step_s"])  # a training step
    if mgr.should_save(step):
      mgr.save(step, state_at(mesh, step))
      saves.append(step)
    if requested_at is None and mgr.preemption_requested:
      requested_at = step
    if mgr.reached_preemption(step):
      break
    if me == 0 and step == cfg["ready_at"]:
      say("READY")
  result({"process": me, "stopped_at": step, "saves": saves, "requested_at": requested_at,
          "all_steps": mgr.all_steps()})
  mgr.close()


def mode_damage(cfg):
  """Steps 1 and 2 saved; then process ``cfg["damager"]`` flips a byte in a chunk of step 2
  that only it reads (or truncates step 2's manifest, seen by all): every process must fall
  back to step 1 together, warn, and agree that step 2 is marked damaged."""
  import glob
  import jax
  import fnckpt
  from fnckpt._io import commit as _commit
  mesh, target = mesh_and_target()
  me = jax.process_index()
  opts = {"barrier_timeout_s": cfg["barrier_s"]}
  mgr = fnckpt.CheckpointManager(cfg["root"], save_options=opts)
  for step in (1, 2):
    mgr.save(step, state_at(mesh, step))
  mgr.wait()
  step_dir = os.path.join(cfg["root"], "2")
  if me == cfg["damager"]:
    if cfg["how"] == "chunk":  # w is (8, 16) over x = processes: rows 4-7 are process 1's
      # (its shards are pieces: in process 1's pack, which holds nothing else; with pieces off,
      # the chunks of w's zarr array)
      chunks = sorted(glob.glob(os.path.join(step_dir, "data-*", "a", "*", "c", str(me), "*"))
                      + glob.glob(os.path.join(step_dir, "data-*", "p", str(me), "c", "*")))
      assert chunks, os.listdir(step_dir)
      for path in chunks:
        with open(path, "r+b") as f:
          f.seek(os.path.getsize(path) // 3)
          byte = f.read(1)
          f.seek(-1, os.SEEK_CUR)
          f.write(bytes([byte[0] ^ 0xFF]))
    else:
      path = os.path.join(step_dir, "manifest.msgpack")
      os.truncate(path, os.path.getsize(path) // 2)
  _commit.barrier(cfg["root"], "test-damaged", cfg["barrier_s"])
  mgr = fnckpt.CheckpointManager(cfg["root"], save_options=opts)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state, step = mgr.restore_or_init(lambda: state_at(mesh, 0), target=target)
  out = {"process": me, "restored": step, "checked": check_state(state, step),
         "warned": [str(w.message) for w in caught if "is damaged" in str(w.message)],
         "latest": mgr.latest_step(), "all_steps": mgr.all_steps(),
         "explicit": error_of(lambda: mgr.restore(2, target))}
  mgr.save(2, state_at(mesh, 2)).wait()   # the run goes on: step 2 saved again, valid
  out["after_resave"] = int(mgr.restore(target=target)["step"])
  mgr.close()
  result(out)


def mode_tiers(cfg):
  """``cfg["phase"]`` "save": steps 0-5, the odd ones to the local tier (the newest 2 kept),
  the even ones (durable, every 2nd) saved to the durable directory by every process.
  "recover": restore_or_init with this process's ``cfg["local"]`` (a wiped or replaced host's
  is empty; a list: one per process, e.g. per-host paths)."""
  import jax
  import fnckpt
  mesh, target = mesh_and_target()
  opts = {"barrier_timeout_s": cfg["barrier_s"]}
  local = cfg["local"] if isinstance(cfg["local"], str) else cfg["local"][jax.process_index()]
  mgr = fnckpt.CheckpointManager(cfg["root"], local_directory=local,
                                 local_save_interval_steps=1, save_interval_steps=2,
                                 save_options=opts, incremental=cfg.get("incremental", False))
  out: dict[str, Any] = {"process": jax.process_index()}
  if cfg["phase"] == "save":
    for step in range(6):
      mgr.save(step, state_at(mesh, step))
    mgr.wait()
  else:
    state, step = mgr.restore_or_init(lambda: state_at(mesh, 0), target=target)
    out["restored"], out["checked"] = step, check_state(state, step)
  out["all_steps"] = mgr.all_steps()
  from fnckpt._io import paths as _paths
  out["local_dirs"] = sorted({int(k.split("/")[0]) for k in _paths.list_keys(local)
                              if k.split("/")[0].isdigit()})  # this process's own local tier
  mgr.close()
  result(out)


def mode_auto(cfg):
  """save_interval_steps="auto" with 2 processes: the same steps saved (and skipped) on
  every process, whatever each one measures."""
  import jax
  import fnckpt
  mesh, _ = mesh_and_target()
  mgr = fnckpt.CheckpointManager(cfg["root"], save_interval_steps="auto", mtbf_s=cfg["mtbf_s"],
                                 save_options={"barrier_timeout_s": cfg["barrier_s"]})
  saved, asked = [], []
  for step in range(cfg["steps"]):
    time.sleep(cfg["step_s"] * (1 + jax.process_index()))  # the processes measure differently
    if mgr.should_save(step):
      asked.append(step)
      if mgr.save(step, state_at(mesh, step)) is not None:
        saved.append(step)
  mgr.wait()
  s = mgr.schedule
  result({"process": jax.process_index(), "asked": asked, "saved": saved,
          "all_steps": mgr.all_steps(), "interval_steps": s.interval_steps,
          "saves": s.saves, "skipped": s.skipped, "cost": s.save_cost_s})
  mgr.close()


def mode_incremental(cfg):
  """An incremental manager (newest 2 kept): "w" never changes, "b" and "e" change at every
  step; then a fork of the newest step saves on. Every kept step is restored and checked."""
  import jax
  import fnckpt
  mesh, target = mesh_and_target()

  def state(step):
    out = state_at(mesh, step)
    out["w"] = state_at(mesh, 0)["w"]
    return out

  mgr = fnckpt.CheckpointManager(cfg["root"], max_to_keep=2, incremental=True,
                                 save_options={"barrier_timeout_s": cfg["barrier_s"]})
  for step in range(5):
    mgr.save(step, state(step))
    mgr.wait()
  child = mgr.fork(4, cfg["fork"])
  child.save(5, state(5))
  mgr.save(6, state(6))
  mgr.wait()
  child.wait()
  checked = {}
  for m, name in ((mgr, "parent"), (child, "fork")):
    for step in m.all_steps():
      got = m.restore(step, target)
      w0 = mp_worker.expected("w", LEAVES["w"]["shape"], "float32", seed=0)
      checked[f"{name}/{step}"] = mp_worker.check_addressable("w", got["w"], w0) + \
          mp_worker.check_addressable("b", got["b"], mp_worker.expected(
              "b", LEAVES["b"]["shape"], "float32", seed=step))
  meta = fnckpt.metadata(mgr.path(6))
  result({"process": jax.process_index(), "parent": mgr.all_steps(),
          "fork": child.all_steps(), "checked": checked,
          "w_reused": next(l for l in meta.leaves if l.where == "['w']").stored.base
          is not None if any(l.stored for l in meta.leaves if l.where == "['w']") else "packed"})
  mgr.close()
  child.close()


OVERLAP_LEAVES = {"w": {"shape": [64, 1024], "spec": ["x", "y"]},   # stored, on both
                  "r": {"shape": [128, 64], "spec": "replicated"}}   # packed


def mode_overlap(cfg):
  """An incremental manager saving 5 steps without waiting, each save's writer held at
  "written" until the next save has started (on every process): overlapping saves chain.
  "w" and "r" never change; "e" (numpy) changes at every step."""
  import threading
  import jax
  import fnckpt
  from fnckpt import _state
  mesh = mp_worker.make_mesh([jax.process_count(), 2], ["x", "y"])
  frozen = mp_worker.make_state(OVERLAP_LEAVES, mesh, seed=0)
  gates: dict[str, threading.Event] = {}

  def hook(phase):
    me = threading.current_thread().name.rsplit("/", 1)[-1]
    if phase == "written" and me in gates:
      gates[me].wait(60)

  _state.hooks.on_phase = hook
  mgr = fnckpt.CheckpointManager(cfg["root"], incremental=True,
                                 save_options={"barrier_timeout_s": cfg["barrier_s"]})
  handles = []
  for step in range(5):
    gates[str(step)] = threading.Event()
    handles.append(mgr.save(step, {**frozen, "e": np.full((4096,), step, np.float32),
                                   "step": step}))
    if step:
      assert not handles[step - 1].done()
      gates[str(step - 1)].set()
  gates["4"].set()
  mgr.wait()
  result({"process": jax.process_index(), "steps": mgr.all_steps(),
          "reused": [h.stats.bytes_reused for h in handles],
          "written": [h.stats.bytes_written for h in handles]})
  mgr.close()


def _io_counts() -> dict[str, int]:
  with open("/proc/self/io") as f:
    return {k: int(v) for k, v in (line.split(": ") for line in f)}


def mode_peers(cfg):
  """Recovery from peers: mesh ``(R, n*2/R)`` ``("r", "s")``, ``cfg["spec"]`` for "w" (e.g.
  ``[null, "s"]``: replicated over "r"; ``["r", "s"]``: no replicas). "save": steps 0-5 (0 to
  ``cfg["steps"] - 1``), every step to the local tier, every 2nd (``cfg["every"]``-th) to
  durable storage (so 5 is local-only, 4 durable).
  "recover": ``cfg["wipe"]`` processes delete their local tier first, then restore().
  ``cfg["s"]``: the size of "s" (default ``2n/R``: 2 devices a process; another process count
  over the same global mesh sets it and ``devices``)."""
  import jax
  import fnckpt
  n, groups = jax.process_count(), cfg.get("groups", 2)
  mesh = mp_worker.make_mesh([groups, cfg.get("s", 2 * n // groups)], ["r", "s"])
  leaves = {"w": {"shape": [8, 16], "spec": cfg["spec"]}, "b": {"shape": [16], "spec": ["s"]},
            "e": {"shape": [4, 4], "kind": "numpy"}}
  local = cfg["local"][jax.process_index()]
  if cfg["phase"] == "recover" and jax.process_index() in cfg.get("wipe", []):
    shutil.rmtree(local, ignore_errors=True)
  mgr = fnckpt.CheckpointManager(cfg["root"], local_directory=local, local_save_interval_steps=1,
                                 save_interval_steps=cfg.get("every", 2), local_max_to_keep=2,
                                 save_options={"barrier_timeout_s": cfg["barrier_s"]})
  out: dict[str, Any] = {"process": jax.process_index()}
  if cfg["phase"] == "save":
    for step in range(cfg.get("steps", 6)):
      state = mp_worker.make_state(leaves, mesh, seed=step)
      state["step"] = step
      mgr.save(step, state)
    mgr.wait()
  else:
    target = {k: (np.zeros(v["shape"], np.float32) if v.get("kind") == "numpy" else
                  jax.ShapeDtypeStruct(tuple(v["shape"]), np.float32,
                                       sharding=mp_worker.sharding_of(mesh, v["spec"])))
              for k, v in leaves.items()}
    target["step"] = 0
    out["latest"] = mgr.latest_step()
    before = _io_counts()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      got = mgr.restore(target=target)
    out["restore_s"] = time.perf_counter() - start
    after = _io_counts()
    out["rchar"], out["wchar"] = (after["rchar"] - before["rchar"],
                                  after["wchar"] - before["wchar"])
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    step = int(got["step"])
    out["restored"] = step
    out["checked"] = mp_worker.check_leaves(leaves, got, step, target)
  mgr.close()
  result(out)


if __name__ == "__main__":
  mp_worker.main(globals(), devices=2)
