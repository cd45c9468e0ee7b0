"""Child processes of ``tests/test_broadcast_mp.py`` and ``bench/broadcast.py``: one restore,
with or without ``broadcast``, measured by the kernel (``/proc/self/io``: ``rchar``, the bytes
this process's ``read``/``pread`` calls returned: file reads of the checkpoint, since Gloo's
sockets are read with ``recvmsg``, which ``rchar`` does not count; checked by a test), the
wall time, and the peak RSS above the RSS before the restore.

``python tests/bcast_worker.py '<json config>'``; config as ``mp_worker`` (``mesh``,
``leaves``, ``target``, ``path``) plus ``broadcast`` (true/false/null), ``budget_mib``,
``barrier_s``, ``die`` ({process, at: "before" | "during"}: that process exits during the
broadcast, before its first wave's barrier or once the collective is under way) and
``reshard_only`` (measure the kernel counters around a bare reshard of ``nbytes``).
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import mp_worker  # noqa: E402
from mp_worker import MiB, make_mesh, result, say, sharding_of  # noqa: E402


def io_counters() -> dict[str, int]:
  with open("/proc/self/io") as f:
    return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _install_death(cfg) -> None:
  """The victim exits (SIGKILL-like, no cleanup) at the chosen instant of the broadcast."""
  import jax
  from fnckpt._restore import reshard
  die = cfg.get("die")
  if not die or die["process"] != jax.process_index():
    return
  if die["at"] == "before":  # read its parts, then gone before the wave's barrier
    def gone(*a, **k):
      say("PHASE dying")
      os._exit(9)
    reshard.reshard = gone
  else:  # in the collective: past the wave's barrier, gone while the others wait in it
    class DyingJax:
      def __getattr__(self, name):
        return getattr(jax, name)

      def jit(self, *a, **k):
        def run(*xs):
          time.sleep(0.5)  # (the others are in the collective by now)
          say("PHASE dying")
          os._exit(9)
        return run
    reshard.jax = DyingJax()


def _target(cfg, mesh):
  target = mp_worker.target_of(cfg["leaves"], cfg["target"], mesh)
  if cfg.get("step", True):
    target["step"] = 0
  return target


def _check(cfg, got, target) -> int:
  checked = mp_worker.check_leaves(cfg["leaves"], got, cfg.get("seed", 0), target)
  assert got.get("step", 7) == 7
  return checked


def _evict(path: str) -> None:
  """Drop the page cache of every file under ``path`` (clean pages: no privilege needed)."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def _count_waves() -> list[int]:
  """Record, for each broadcast wave, the bytes of its reader arrays on this process (what
  the reshard holds on the devices besides the restored leaves: its inputs)."""
  from fnckpt._restore import reshard
  inner = reshard.reshard
  if getattr(inner, "counting", None) is not None:
    inner = inner.counting
  waves: list[int] = []

  def counted(arrays, *a, **k):
    waves.append(sum(s.data.nbytes for x in arrays for s in x.addressable_shards))
    return inner(arrays, *a, **k)

  counted.counting = inner
  reshard.reshard = counted
  return waves


def mode_restore(cfg):
  """One measured restore per entry of ``runs`` (the ``broadcast`` argument of each; default:
  ``[broadcast]``), each after a warm-up restore; a ``die`` config applies to the last."""
  import jax
  mesh = make_mesh(*cfg["mesh"])
  target = _target(cfg, mesh)
  runs = cfg.get("runs", [cfg.get("broadcast")])
  out = []
  for k, broadcast in enumerate(runs):
    out.append(_measured(cfg, target, broadcast, die=k == len(runs) - 1))
    if "error" in out[-1]:
      break
  result({"process": jax.process_index(), "runs": out})


def _measured(cfg, target, broadcast, die: bool) -> dict:
  import gc
  import jax
  import fnckpt
  kw = {"broadcast": broadcast, "barrier_timeout_s": cfg.get("barrier_s", 60), "partial": True}
  if cfg.get("budget_mib"):
    kw["budget_bytes"] = int(cfg["budget_mib"] * MiB)
  if cfg.get("warm", True):  # compile the reshard and connect Gloo: not the restore's cost
    jax.block_until_ready(fnckpt.restore(cfg["path"], target, **kw))
  if die:
    _install_death(cfg)
  waves = _count_waves()
  if cfg.get("evict"):  # cold: the checkpoint's pages out of the page cache, on every process
    _evict(cfg["path"])
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("evicted")
  gc.collect()
  _trim()
  base = mp_worker.rss()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
  peak, stop = [0], threading.Event()

  def sample():
    while not stop.is_set():
      peak[0] = max(peak[0], mp_worker.rss() - base)
      time.sleep(0.002)

  t = threading.Thread(target=sample, daemon=True)
  t.start()
  before, t0 = io_counters(), time.monotonic()
  try:
    got = jax.block_until_ready(fnckpt.restore(cfg["path"], target, **kw))
  except Exception as e:
    return {"error": type(e).__name__, "message": str(e), "elapsed_s": time.monotonic() - t0}
  finally:
    stop.set()
  elapsed, after = time.monotonic() - t0, io_counters()
  t.join()
  local = sum(s.data.nbytes for x in jax.tree_util.tree_leaves(got) if isinstance(x, jax.Array)
              for s in x.addressable_shards)
  checked = _check(cfg, got, target)
  del got
  return {"broadcast": broadcast, "checked_shards": checked, "elapsed_s": elapsed,
          "waves": len(waves), "wave_input_bytes": max(waves, default=0),
          "io": {k: after[k] - before[k] for k in after},
          "peak_rss": max(peak[0], mp_worker.rss("VmHWM") - base), "local_state_bytes": local}


def _trim():
  """Give the heap's free pages back to the kernel, so the baseline RSS does not depend on
  whether the warm-up's freed buffers stayed resident (glibc's dynamic mmap threshold keeps
  large freed blocks in the heap after the first ones are freed)."""
  import ctypes
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: the baseline is as it is
    pass


def mode_heal(cfg):
  """``CheckpointManager(root).restore(target=, broadcast=True)`` of a replicated leaf whose
  newest step has a chunk damaged where one process reads it: every process must return the
  older step (values of seed = step), with the manager's warning."""
  import warnings
  import jax
  import fnckpt
  mesh = make_mesh(*cfg["mesh"])
  target = _target(cfg, mesh)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    got = fnckpt.CheckpointManager(cfg["root"]).restore(
        target=target, broadcast=True, barrier_timeout_s=cfg.get("barrier_s", 60))
  step = int(got["step"])
  checked = mp_worker.check_leaves(cfg["leaves"], got, step, target)
  result({"process": jax.process_index(), "step": step, "checked": checked,
          "warned": [str(w.message) for w in caught if "is damaged" in str(w.message)]})


def mode_reshard_only(cfg):
  """Kernel counters around a bare cross-process reshard of ``nbytes``: what the interconnect
  adds to ``rchar``/``read_bytes`` (nothing, if they count file reads only)."""
  import jax
  n = jax.process_count()
  mesh = make_mesh([n], ["x"])
  rows = int(cfg["nbytes"]) // (4 * 256)
  src = sharding_of(mesh, ["x"])
  x = jax.make_array_from_callback((rows, 256), src,
                                   lambda idx: np.ones((rows, 256), np.float32)[idx])
  f = jax.jit(lambda a: a, out_shardings=sharding_of(mesh, "replicated"))
  f(x).block_until_ready()
  before = io_counters()
  f(x).block_until_ready()
  after = io_counters()
  result({"process": jax.process_index(), "io": {k: after[k] - before[k] for k in after}})


if __name__ == "__main__":
  mp_worker.main({"mode_restore": mode_restore, "mode_reshard_only": mode_reshard_only,
                  "mode_heal": mode_heal,
                  "mode_save": mp_worker.mode_save})
