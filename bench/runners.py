"""One function per library per operation, and the worker that runs one measurement.

Each measurement runs in a fresh process (so peak RSS and first-call costs are its own):

    python -m bench.runners '{"op": "save", "lib": "orbax", "state": "small", "mode": "quick",
                              "root": "/tmp/x", "n_saves": 2}'

prints one line ``BENCH_RESULT {json}`` on stdout. Operations:

* ``device_limits``: device -> host: ``jax.device_get`` of the whole state, ``np.array`` of each
  leaf, a copy of each unique shard into fresh buffers and into preallocated ones (the best of
  them is what a checkpointer must at least do before ``save`` may return); host -> device: ``jax.device_put`` of host copies onto the
  restore targets' shardings (what a restore must at least do after reading);
* ``ts_limits``: raw TensorStore: the state's arrays, copied to the host first, written as one
  plain zarr3 array per leaf (chunk = the leaf's shard on the saved mesh, whole leaf if
  replicated) until durable, then read back cold (``limits.tensorstore_rw``); best of repeats;
* ``save``: ``n_saves`` saves in one process (the 1st pays first-call costs, later ones are the
  steady state of a training loop); per save: time the caller is blocked, time to committed,
  peak RSS over the baseline, files and bytes on disk. Each save starts after ``os.sync()``
  (untimed), so none pays for the writeback of data written before it (by the other library's
  worker, or an earlier save that did not fsync: on ext4 an ``fsync`` commits the journal,
  which first writes out every file's pending data);
* ``restore``: evict the checkpoint from the page cache, restore onto mesh ``a`` (as saved) or
  ``b`` (other mesh shape and PartitionSpecs), peak RSS; then verify values by checksum.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

RESULT_MARK = "BENCH_RESULT "
LIBS = ("fnckpt", "orbax")


def setup_jax():
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  jax.config.update("jax_platforms", "cpu")
  return jax


# ----------------------------------------------------------------------------- peak host memory

def _status_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1])
  return 0


class PeakRSS:
  """Peak resident memory above the RSS at ``__enter__``: the kernel's high-water mark (reset
  through ``/proc/self/clear_refs``) and, as a fallback, a 2 ms sampling thread."""

  def __enter__(self):
    gc.collect()
    try:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
      self._hwm_ok = True
    except OSError:
      self._hwm_ok = False
    self.base = _status_kib("VmRSS")
    self._max = self.base
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.wait(0.002):
      self._max = max(self._max, _status_kib("VmRSS"))

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    peak = max(self._max, _status_kib("VmRSS"))
    if self._hwm_ok:
      peak = max(peak, _status_kib("VmHWM"))
    self.peak_over_base = (peak - self.base) * 1024
    self.base_bytes = self.base * 1024
    return False


# ----------------------------------------------------------------------------- the libraries
# A save function returns once the library lets the caller go on; it returns (wait, stats):
# wait() blocks until committed, stats() gives the library's own figures (or None).

def fnckpt_save(tree, path: str, **kwargs) -> tuple[Callable[[], Any], Callable[[], Any]]:
  import fnckpt
  h = fnckpt.save(tree, path, **kwargs)
  return h.wait, lambda: _as_dict(getattr(h, "stats", None))


def fnckpt_restore(path: str, target):
  import fnckpt
  return fnckpt.restore(path, target)


def orbax_manager(root: str):
  import orbax.checkpoint as ocp
  return ocp.CheckpointManager(root)        # default options: async, OCDBT, zarr3


def orbax_save(mngr, step: int, tree) -> tuple[Callable[[], Any], Callable[[], Any]]:
  import orbax.checkpoint as ocp
  mngr.save(step, args=ocp.args.StandardSave(tree))
  return mngr.wait_until_finished, lambda: None


def orbax_restore(root: str, step: int, target):
  import orbax.checkpoint as ocp
  mngr = ocp.CheckpointManager(root)
  try:
    return mngr.restore(step, args=ocp.args.StandardRestore(target))
  finally:
    mngr.close()


def _as_dict(stats) -> Any:
  if stats is None:
    return None
  import dataclasses
  if dataclasses.is_dataclass(stats):
    stats = dataclasses.asdict(stats)
  try:
    return {k: v for k, v in dict(stats).items() if isinstance(v, (int, float, str, bool, type(None)))}
  except (TypeError, ValueError):
    return repr(stats)


def ckpt_path(lib: str, root: str, step: int) -> str:
  """Where save ``step`` of a worker lands (orbax: the manager's step directory)."""
  return os.path.join(root, str(step))


# ----------------------------------------------------------------------------- operations

def op_device_limits(a: dict) -> dict:
  jax = setup_jax()
  import numpy as np
  from bench import states
  leaves = states.leaves_for(a["state"], a["mode"])
  tree = states.build(leaves, states.make_mesh("a"))
  nbytes = states.state_bytes(leaves)
  arrays = jax.tree.leaves(tree)

  def shards_copy(t):
    return [np.array(s.data) for x in jax.tree.leaves(t) for s in x.addressable_shards
            if s.replica_id == 0]

  out: dict[str, Any] = {"state_bytes": nbytes, "leaves": len(leaves),
                         "device_bytes": sum(s.data.nbytes for x in arrays for s in x.addressable_shards)}
  def np_array(t):
    return [np.array(x) for x in jax.tree.leaves(t)]

  # preallocated, already-touched host buffers: no page faults (what a buffer pool achieves)
  pool = [np.ones(s.data.shape, s.data.dtype) for x in arrays for s in x.addressable_shards
          if s.replica_id == 0]

  def shards_copyto(t):
    shards = [s.data for x in jax.tree.leaves(t) for s in x.addressable_shards if s.replica_id == 0]
    for buf, d in zip(pool, shards):
      np.copyto(buf, np.asarray(d))

  for name, fn in (("device_get", jax.device_get), ("np_array", np_array),
                   ("shards_copy", shards_copy), ("shards_copyto", shards_copyto)):
    times = []
    for _ in range(a.get("repeats", 3)):
      fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), tree))  # no cached host value
      gc.collect()
      t = time.perf_counter()
      r = fn(fresh)
      times.append(time.perf_counter() - t)
      del r, fresh
    out[f"{name}_s"] = min(times)
  # host -> devices: numpy arrays placed with the restore targets' shardings (what a restore
  # must at least do after reading), on the saved mesh and on the other one.
  host = jax.device_get(tree)
  del tree, arrays
  pool.clear()
  for which in ("a", "b"):
    shardings = jax.tree.map(lambda t: t.sharding,
                             states.target(leaves, states.make_mesh(which), which))
    times = []
    for _ in range(a.get("repeats", 3)):
      fresh = jax.tree.map(np.copy, host)
      gc.collect()
      t = time.perf_counter()
      r = jax.block_until_ready(jax.device_put(fresh, shardings))
      times.append(time.perf_counter() - t)
      del r, fresh
    out[f"h2d_{which}_s"] = min(times)
  return out


def op_ts_limits(a: dict) -> dict:
  setup_jax()
  import shutil
  from bench import limits, states
  leaves = states.leaves_for(a["state"], a["mode"])
  mesh = states.make_mesh("a")
  tree = states.build(leaves, mesh)
  arrays = states.raw_arrays(leaves, tree, mesh)
  del tree
  gc.collect()
  root = a["root"]
  try:
    out = limits.tensorstore_rw(root, arrays, a.get("repeats", 3))
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return {"state_bytes": states.state_bytes(leaves), "leaves": len(leaves), **out}


def op_save(a: dict) -> dict:
  setup_jax()
  from bench import limits, states
  lib, root = a["lib"], a["root"]
  _import_lib(lib)
  leaves = states.leaves_for(a["state"], a["mode"])
  tree = states.build(leaves, states.make_mesh("a"))
  os.makedirs(root, exist_ok=True)
  mngr = orbax_manager(root) if lib == "orbax" else None
  saves = []
  n = a.get("n_saves", 1)
  try:
    for i in range(n):
      os.sync()   # (untimed: see the module docstring)
      with PeakRSS() as mem:
        prof = _profiler(a.get("profile")) if i == n - 1 else None
        c0 = _cpu_s()
        t0 = time.perf_counter()
        if lib == "orbax":
          wait, get_stats = orbax_save(mngr, i, tree)
        else:
          wait, get_stats = fnckpt_save(tree, ckpt_path(lib, root, i), **(a.get("save_kwargs") or {}))
        blocking = time.perf_counter() - t0
        if prof is not None:
          prof.stop()
        wait()
        commit = time.perf_counter() - t0
        cpu = _cpu_s() - c0
      if prof is not None:
        with open(a["profile"], "w") as f:
          f.write(f"# {lib} {a['state']} save #{i + 1}: blocked {blocking:.3f} s (profiled), "
                  f"committed {commit:.3f} s; main thread only\n")
          f.write(prof.output_text(unicode=True, color=False, show_all=False))
      stats = get_stats()
      rec = {"blocking_s": blocking, "commit_s": commit, "cpu_s": cpu,
             "rss_peak_bytes": mem.peak_over_base,
             "rss_base_bytes": mem.base_bytes, **limits.dir_stats(ckpt_path(lib, root, i))}
      if stats is not None:
        rec["lib_stats"] = stats
      saves.append(rec)
  finally:
    if mngr is not None:
      mngr.close()
  fp_file = a.get("fp_file")
  if fp_file and not os.path.exists(fp_file):
    tmp = f"{fp_file}.{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(states.fingerprint(tree), f)
    os.replace(tmp, fp_file)
  return {"state_bytes": states.state_bytes(leaves), "saves": saves,
          "path": ckpt_path(lib, root, a.get("n_saves", 1) - 1)}


def _cpu_s() -> float:
  """CPU seconds of this process, all threads (robust to other load on the machine)."""
  t = os.times()
  return t.user + t.system


def _profiler(path: str | None):
  """A started pyinstrument profiler when ``path`` is set (``pip install pyinstrument``)."""
  if not path:
    return None
  import pyinstrument
  p = pyinstrument.Profiler(interval=0.0005)
  p.start()
  return p


def op_restore(a: dict) -> dict:
  jax = setup_jax()
  from bench import limits, states
  lib, root, step = a["lib"], a["root"], a["step"]
  _import_lib(lib)
  leaves = states.leaves_for(a["state"], a["mode"])
  target = states.target(leaves, states.make_mesh(a["mesh"]), a["mesh"])
  path = ckpt_path(lib, root, step)
  limits.evict(path)
  read0 = _ts_bytes_read()
  with PeakRSS() as mem:
    prof = _profiler(a.get("profile"))
    c0 = _cpu_s()
    t0 = time.perf_counter()
    if lib == "orbax":
      restored = orbax_restore(root, step, target)
    else:
      restored = fnckpt_restore(path, target)
    jax.block_until_ready(restored)
    dt = time.perf_counter() - t0
    cpu = _cpu_s() - c0
  if prof is not None:
    prof.stop()
    with open(a["profile"], "w") as f:
      f.write(f"# {lib} {a['state']} restore onto mesh {a['mesh']}: {dt:.3f} s (profiled); "
              "main thread only\n")
      f.write(prof.output_text(unicode=True, color=False, show_all=False))
  # On CPU "devices" live in host RAM: the restored arrays (replicas included) are part of the
  # peak; rss_extra_bytes is what the restore needed beyond its result.
  # (distinct buffers: on CPU, replicas restored by fnckpt share one)
  result_bytes = sum({s.data.unsafe_buffer_pointer(): s.data.nbytes for x in jax.tree.leaves(
      restored) for s in x.addressable_shards}.values())
  out: dict[str, Any] = {"restore_s": dt, "cpu_s": cpu, "read_bytes": _ts_bytes_read() - read0,
                         "rss_peak_bytes": mem.peak_over_base,
                         "rss_base_bytes": mem.base_bytes, "result_device_bytes": result_bytes,
                         "rss_extra_bytes": mem.peak_over_base - result_bytes}
  fp_file = a.get("fp_file")
  if a.get("verify", True) and fp_file and os.path.exists(fp_file):
    with open(fp_file) as f:
      want = json.load(f)
    got = states.fingerprint(restored)
    bad = [k for k in want if got.get(k) != want[k]] + [k for k in got if k not in want]
    shard_bad = [jax.tree_util.keystr(p) for p, x, t in _zip_paths(restored, target)
                 if x.sharding != t.sharding and not x.sharding.is_equivalent_to(t.sharding, x.ndim)]
    out["verified"] = not bad and not shard_bad
    if bad or shard_bad:
      out["verify_errors"] = (bad + [f"sharding {k}" for k in shard_bad])[:10]
  return out


def _ts_bytes_read() -> int:
  """Bytes TensorStore's file kvstore has read in this process so far (its own metric: both
  libraries read through it)."""
  import tensorstore as ts
  got = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
  return sum(int(v.get("value", 0)) for m in got for v in m.get("values", []))


def _zip_paths(tree, target):
  import jax
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  tflat = jax.tree.leaves(target)
  return [(p, x, t) for (p, x), t in zip(flat, tflat)]


def _import_lib(lib: str):
  if lib == "fnckpt":
    import fnckpt  # noqa: F401  (import cost outside the timed region)
  elif lib == "orbax":
    import logging
    import orbax.checkpoint  # noqa: F401
    logging.getLogger("absl").setLevel(logging.WARNING)
  else:
    raise ValueError(f"unknown library {lib!r}; one of {LIBS}")


OPS: dict[str, Callable[[dict], dict]] = {
    "device_limits": op_device_limits, "ts_limits": op_ts_limits, "save": op_save,
    "restore": op_restore}


def main(argv: list[str]) -> int:
  a = json.loads(argv[1])
  try:
    out = {"ok": True, **OPS[a["op"]](a)}
  except BaseException as e:  # noqa: BLE001  (reported to the orchestrator, never a crash there)
    traceback.print_exc()
    out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
  sys.stdout.write(RESULT_MARK + json.dumps(out) + "\n")
  sys.stdout.flush()
  return 0 if out["ok"] else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))
