"""Child processes of ``tests/test_manager_faults_mp.py`` and ``bench/manager_faults.py``: a
sequence of CheckpointManager calls on every process, some failing on one process between
the manager's collective calls, none synchronized with the others between calls.

``python tests/manager_faults_worker.py '<json config>'``; config: ``root`` (the durable
directory; each process's fast tier is ``<root>-local<process>``), ``barrier_s`` (default
600, fnckpt's), ``tries``: a list of ``{"op": "restore" | "restore_or_init" | "latest" |
"save", "step" (save), "kwargs" (restore's, e.g. ``{"broadcast": true}``), "fail": {"process",
"how"}}``; ``how``: ``listing`` (the second
listing of this process's fast tier in the call fails with a PermissionError, as an
unreadable directory does: after the manager's first collective call), ``internal`` (the
manager's exchange of local steps raises on this process: between its collective calls),
``stage`` (a save's copy of the held shards fails on this process, after process 0's
decision), ``wait_saved`` and ``restore_listing`` (inside the restore of the chosen step, after
process 0's choice and before the restore's agreement: its wait for the step's save, its
fast tier's listing raise), ``after_restore`` (the manager's restore of the chosen step
raises once it has restored it). Each try reports ``ok`` (the step, and shards checked) or ``error``, ``message``,
``raised_at``, ``failed_at`` (``time.time()`` when the call raised, when this process's fault
fired) and ``elapsed_s``. ``repeat``: run the tries that many times (timings: ``times``).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mp_worker  # noqa: E402
from mp_manager_worker import check_state, mesh_and_target, state_at  # noqa: E402
from mp_worker import result  # noqa: E402

FIRED: list[float] = []


def _inject(how: str, mgr) -> list:
  """Install fault ``how`` on this process's manager; the undo callables."""
  from fnckpt._manager import held, recovery

  def fire(error: BaseException):
    FIRED.append(time.time())
    raise error

  if how == "listing":
    index, calls = mgr._local.index, [0]
    real = index.list

    def listing(*a, **k):
      calls[0] += 1
      if calls[0] == 2:
        fire(PermissionError(13, "Permission denied (injected)", index.root))
      return real(*a, **k)

    index.list = listing
    return [lambda: delattr(index, "list")]
  if how == "restore_listing":  # (Recovery.restore lists the fast tier with no arguments)
    index, real = mgr._local.index, mgr._local.index.list

    def bare_listing(*a, **k):
      if not a and not k:
        fire(PermissionError(13, "Permission denied (injected)", index.root))
      return real(*a, **k)

    index.list = bare_listing
    return [lambda: delattr(index, "list")]
  if how == "wait_saved":  # (with a step: the restore of that step waits for its save)
    claims = mgr._claims
    real_wait = claims.wait_saved

    def wait_saved(step=None):
      if step is not None:
        fire(RuntimeError("injected wait_saved failure"))
      return real_wait(step)

    claims.wait_saved = wait_saved
    return [lambda: delattr(claims, "wait_saved")]
  if how == "after_restore":  # (the step restored, its restore's last barrier passed)
    real_restore = recovery.Recovery.restore

    def restore_then_fail(*a, **k):
      real_restore(*a, **k)
      fire(RuntimeError("injected failure after the restore"))

    recovery.Recovery.restore = restore_then_fail
    return [lambda: setattr(recovery.Recovery, "restore", real_restore)]
  module, name = {"internal": (recovery.Recovery, "_local_steps"),
                  "stage": (held, "stage")}[how]
  real = getattr(module, name)
  setattr(module, name, lambda *a, **k: fire(RuntimeError(f"injected {how} failure")))
  return [lambda: setattr(module, name, real)]


def _one(mgr, t, mesh, target) -> dict:
  import jax
  fail = t.get("fail") or {}
  mine = fail.get("process") == jax.process_index()
  FIRED.clear()
  undo = _inject(fail["how"], mgr) if mine else []
  start = time.monotonic()
  try:
    if t["op"] == "save":
      mgr.save(t["step"], state_at(mesh, t["step"]))
      mgr.wait()
      got = {"ok": t["step"]}
    elif t["op"] == "latest":
      got = {"ok": mgr.latest_step()}
    else:
      if t["op"] == "restore":
        value = mgr.restore(target=target, **t.get("kwargs", {}))
        step = int(value["step"])
      else:
        value, step = mgr.restore_or_init(lambda: state_at(mesh, 0), target=target,
                                          **t.get("kwargs", {}))
      got = {"ok": step, "checked": check_state(jax.block_until_ready(value), step)}
  except Exception as e:
    import fnckpt
    got = {"error": type(e).__name__, "message": str(e)[:3000], "raised_at": time.time(),
           "checkpoint_error": isinstance(e, fnckpt.CheckpointError)}
  finally:
    for u in undo:
      u()
  got["elapsed_s"] = time.monotonic() - start
  if FIRED:
    got["failed_at"] = FIRED[0]
  return got


def mode_tries(cfg):
  import jax

  import fnckpt
  mesh, target = mesh_and_target()
  me = jax.process_index()
  mgr = fnckpt.CheckpointManager(
      cfg["root"], local_directory=f"{cfg['root']}-local{me}", local_save_interval_steps=1,
      save_interval_steps=2, save_options={"barrier_timeout_s": cfg.get("barrier_s", 600)})
  for step in (1, 2):  # 1: in the fast tiers (with the held shards), 2: durable
    mgr.save(step, state_at(mesh, step))
  mgr.wait()
  out, times = [], {}
  for _ in range(cfg.get("repeat", 1)):
    for t in cfg["tries"]:
      got = _one(mgr, t, mesh, target)
      times.setdefault(t["op"], []).append(got["elapsed_s"])
      out.append(got)
  result({"process": me, "tries": out[:len(cfg["tries"])], "times": times})
  mgr.close()


if __name__ == "__main__":
  mp_worker.main({"mode_tries": mode_tries}, devices=2)
