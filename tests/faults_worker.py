"""Child processes of ``tests/test_faults_mp.py`` and ``bench/faults.py``: a sequence of
collective calls (restores with ``broadcast=True``, saves) to one location, some failing on one
process, none synchronized with the others between calls (as a training job's retries are not).

``python tests/faults_worker.py '<json config>'``; config as ``mp_worker`` (``mesh``,
``leaves``, ``path``) plus ``tries``: a list of ``{"op": "restore" | "save", "fail": {"process",
"how"}, "barrier_s"}``; ``how``: ``shape`` (one leaf of the target has a wrong shape:
TreeMismatchError before any read), ``manifest`` (opening the checkpoint fails), ``read`` (its
reads fail), ``assemble`` (making a read leaf one array fails), ``kill`` (exits at its
reads, printing ``KILLED_AT <time>``), ``late`` (the call starts
``late_s`` after the others', past their ``barrier_s``), ``tree`` (a save of a different tree),
``sharding`` (one leaf of the target has another sharding: passes every local check).
Each try reports ``ok`` (shards checked) or ``error`` and ``message``, ``elapsed_s``, and
``raised_at``/``failed_at`` (``time.time()`` when the call raised and when this process's
injected fault fired): the others' delay is ``raised_at`` minus the failing one's ``failed_at``;
``agree_s``: how long each agreement (barrier 0 of a collective restore) took on this process.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mp_worker  # noqa: E402
from mp_worker import make_mesh, result  # noqa: E402

FIRED: list[float] = []


def _inject(how: str, target: dict, leaves: dict) -> list:
  """Install fault ``how`` on this process; the undo callables."""
  from fnckpt._restore import place, restore
  undo = []

  def fire(*_a, **_k):
    FIRED.append(time.time())
    if how == "kill":  # (gone without a word: the others learn of it from the service)
      print(f"KILLED_AT {FIRED[0]}", flush=True)
      os._exit(9)
    raise RuntimeError(f"injected {how} failure")

  if how == "shape":
    import jax
    name = next(k for k, l in leaves.items() if l.get("kind", "jax") != "numpy")
    t = target[name]
    target[name] = jax.ShapeDtypeStruct((t.shape[0] + 1, *t.shape[1:]), t.dtype,
                                        sharding=t.sharding)
    FIRED.append(time.time())
  if how == "sharding":  # (passes every local check: only the agreement can see it)
    import jax
    name = next(k for k, l in leaves.items() if l.get("kind", "jax") != "numpy")
    t = target[name]
    target[name] = jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=jax.sharding.NamedSharding(
        t.sharding.mesh, jax.sharding.PartitionSpec(t.sharding.mesh.axis_names[0])))
    FIRED.append(time.time())
  for how_, module, name in (("manifest", restore._source, "open_any"),
                             ("read", place, "read_arrays"),
                             ("kill", place, "read_arrays"),
                             ("assemble", restore, "_assembled")):
    if how == how_:
      real = getattr(module, name)
      setattr(module, name, fire)
      undo.append(lambda m=module, n=name, r=real: setattr(m, n, r))
  return undo


def _one(cfg, t, mesh) -> dict:
  import jax
  import fnckpt
  leaves, fail = cfg["leaves"], t.get("fail") or {}
  mine = fail.get("process") == jax.process_index()
  target = mp_worker.target_of(leaves, {}, mesh) | {"step": 0}
  FIRED.clear()
  undo = _inject(fail["how"], target, leaves) if mine else []
  if mine and fail["how"] == "late":
    time.sleep(t.get("late_s", 3))
  barrier_s = t.get("barrier_s", 600)
  start = time.monotonic()
  try:
    if t["op"] == "save":
      state = mp_worker.make_state(leaves, mesh, seed=t.get("seed", 0)) | {"step": 7}
      if mine and fail["how"] == "tree":
        state["extra"] = 1
        FIRED.append(time.time())
      fnckpt.save(state, cfg["path"], overwrite=True, barrier_timeout_s=barrier_s).wait()
      got = {"ok": 0}
    else:
      value = jax.block_until_ready(
          fnckpt.restore(cfg["path"], target, broadcast=True, barrier_timeout_s=barrier_s))
      got = {"ok": mp_worker.check_leaves(leaves, value, cfg.get("seed", 0), target)}
      assert value["step"] == 7
  except Exception as e:
    got = {"error": type(e).__name__, "message": str(e)[:3000], "raised_at": time.time(),
           "checkpoint_error": isinstance(e, fnckpt.CheckpointError)}
  finally:
    for u in undo:
      u()
  got["elapsed_s"] = time.monotonic() - start
  if FIRED:
    got["failed_at"] = FIRED[0]
  return got


def _time_agreement() -> list[float]:
  """Record how long each agreement (a collective restore's barrier 0) takes here."""
  from fnckpt._io import attempt
  real, took = attempt.agree, []

  def timed(*a, **k):
    t0 = time.perf_counter()
    try:
      return real(*a, **k)
    finally:
      took.append(time.perf_counter() - t0)

  attempt.agree = timed
  return took


def mode_tries(cfg):
  import jax
  mesh = make_mesh(*cfg["mesh"])
  took = _time_agreement()
  out = []
  for t in cfg["tries"]:
    took.clear()
    out.append(_one(cfg, t, mesh) | {"agree_s": list(took)})
  result({"process": jax.process_index(), "tries": out})


if __name__ == "__main__":
  mp_worker.main({"mode_tries": mode_tries, "mode_save": mp_worker.mode_save})
