"""Read once and broadcast, with real processes (``jax.distributed`` on 127.0.0.1, Gloo):
every storage kind (pieces, a zarr array, packs, inline) restored with ``broadcast`` False,
True and None gives the same values, bitwise (each child checks its shards); the bytes each
process reads from the checkpoint's files (``/proc/self/io`` ``rchar``: file reads only, Gloo
receives are not counted, ``test_interconnect_is_not_counted_as_reads``) halve with 2 replica
groups; host memory stays under the budget plus the restored state; a process lost during the
broadcast fails the others with a CheckpointError naming it, before the deadline.
"""

import json
import os
import sys

import numpy as np
import pytest

import fnckpt
import helpers_proc as hp
import mp_worker

pytestmark = pytest.mark.slow

MiB = 1 << 20
WORKER = os.path.join(hp.HERE, "bcast_worker.py")
LEAVES = {
    "a": {"shape": [64, 128], "spec": ["x", "y"]},                 # pieces, not replicated
    "b": {"shape": [128, 64], "dtype": "int32", "spec": ["y"]},     # pieces, replicated over x
    "c": {"shape": [1024, 4096], "spec": "replicated"},            # a zarr array, 16 MiB
    "d": {"shape": [8], "spec": "replicated"},                      # inline
    "e": {"shape": [100, 100], "dtype": "int32", "kind": "numpy"},  # a pack, host target
    "f": {"shape": [96, 40], "dtype": "bfloat16", "spec": [None, "x"]},
    "g": {"shape": [128, 64], "spec": "replicated"},                # a pack, device target
}


def group(config, n, timeout=120):
  port = hp.free_port()
  procs = [hp.start([sys.executable, WORKER, json.dumps(
      {**config, "port": port, "num_processes": n, "process_id": i})]) for i in range(n)]
  return hp.finish(procs, timeout)


def ok(results):
  for r in results:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  return [r.result for r in results]


def nbytes(leaf):
  return int(np.prod(leaf["shape"])) * mp_worker.expected(
      "z", (1,), leaf.get("dtype", "float32")).dtype.itemsize


def test_interconnect_is_not_counted_as_reads():
  """A bare 16 MiB reshard between 2 processes: Gloo's sends show in wchar, its receives
  nowhere in rchar/read_bytes, so rchar measures file reads."""
  got = ok(group({"mode": "reshard_only", "nbytes": 16 * MiB, "devices": 1}, 2))
  for r in got:
    assert r["io"]["rchar"] < 64 << 10 and r["io"]["read_bytes"] == 0, r
    assert r["io"]["wchar"] >= 8 * MiB, r


def test_2_processes_every_storage_kind_read_once(tmp_path):
  path = str(tmp_path / "ckpt")
  ok(group({"mode": "save", "devices": 2, "mesh": [[2, 2], ["x", "y"]], "leaves": LEAVES,
            "path": path}, 2))
  kinds = {r.where: fnckpt._restore.restore._storage_of(r) for r in fnckpt.metadata(path).leaves}
  assert kinds["['a']"] == "pieces" and kinds["['c']"].startswith("data-")
  assert kinds["['g']"].startswith("pack") and kinds["['d']"] == "inline"
  runs = [r["runs"] for r in ok(group({
      "mode": "restore", "devices": 2, "mesh": [[2, 2], ["x", "y"]], "leaves": LEAVES,
      "target": {}, "path": path, "runs": [False, True, None], "budget_mib": 4}, 2))]
  for p in runs:
    assert [r["checked_shards"] for r in p] == [13] * 3   # 6 device leaves x 2 + host e
  off, on = ([p[k]["io"]["rchar"] for p in runs] for k in (0, 1))
  once = sum(nbytes(l) for l in LEAVES.values())
  # without: every process reads all it holds (c, b, g, e whole; a, f: its shards)
  assert sum(off) > 1.9 * once, (off, once)
  # with: each stored byte once across the job (e, a host target, on both), half each; the
  # small pieced and packed leaves are read at the packs' inner-chunk granularity (a 32 KiB
  # piece costs a ~146 KiB read, with or without broadcast): 1 MiB of slack for them
  assert sum(on) < once + nbytes(LEAVES["e"]) + MiB, (on, once)
  assert max(on) < 0.55 * min(off), (on, off)
  # the default on CPU processes reading local files: off (docs/guides/multi-process.md)
  assert [p[2]["io"]["rchar"] > 0.9 * p[0]["io"]["rchar"] for p in runs] == [True, True]


def test_4_processes_2_replica_groups_read_half(tmp_path):
  """4 processes, 1 device each, mesh (r=2 groups, s=2): the target shards over s and
  replicates over r (2 data-parallel replica groups). Saved by one process (a zarr array
  and a pack). Without broadcast the job reads the arrays twice; with it, once."""
  path = str(tmp_path / "ckpt")
  leaves = {"c": {"shape": [1024, 2048], "spec": ["s"]}, "g": {"shape": [256, 64],
                                                                "spec": ["s"]}}
  fnckpt.save({k: mp_worker.expected(k, l["shape"]) for k, l in leaves.items()} | {"step": 7},
              path).wait()
  runs = [r["runs"] for r in ok(group({
      "mode": "restore", "devices": 1, "mesh": [[2, 2], ["r", "s"]], "leaves": leaves,
      "target": {}, "path": path, "runs": [False, True]}, 4))]
  once = sum(nbytes(l) for l in leaves.values())
  off, on = ([p[k]["io"]["rchar"] for p in runs] for k in (0, 1))
  assert 1.95 * once < sum(off) < 2 * once + (256 << 10), (off, once)
  # (g, 64 KiB in a pack, is read at the pack's chunk granularity: each reader of a
  # quarter fetches more; c's reader blocks are whole stored chunks: exact)
  assert once <= sum(on) < once + MiB, (on, once)
  assert max(on) < 0.3 * once, on    # each of 4 processes a quarter


def test_reshard_memory_is_bounded_by_the_budget(tmp_path):
  """8 replicated leaves of 8 MiB over 2 processes, budget 8 MiB: each process reads 4 MiB of
  each, so waves of 2 leaves; the reader arrays a wave holds on the devices (the reshard's
  inputs, besides the restored state) stay within the budget, counted exactly from the arrays
  each wave builds. (Peak RSS is measured in ``bench/broadcast.py``, not asserted here: on CPU
  it moves by tens of MiB with the allocator's state, as much as the bound it would check.)"""
  path = str(tmp_path / "ckpt")
  leaves = {f"w{i}": {"shape": [2048, 1024], "spec": "replicated"} for i in range(8)}
  fnckpt.save({k: mp_worker.expected(k, l["shape"]) for k, l in leaves.items()} | {"step": 7},
              path).wait()
  config = {"mode": "restore", "devices": 1, "mesh": [[2], ["x"]], "leaves": leaves,
            "target": {}, "path": path, "budget_mib": 8}
  off, on = ([r["runs"][0] for r in ok(group({**config, "runs": [b]}, 2))]
             for b in (False, True))
  for a, b in zip(off, on):
    assert b["waves"] == 4 and b["wave_input_bytes"] == 8 * MiB, b
    assert a["waves"] == 0
    assert b["io"]["rchar"] < 0.51 * a["io"]["rchar"], (a, b)


def test_orbax_checkpoint_read_once(tmp_path):
  """An Orbax PyTree checkpoint (StandardCheckpointer: OCDBT, zarr3, zstd; saved over 8
  devices: chunks of 128 rows) restored by 2 processes onto a target replicated over both:
  with broadcast, each reads about half of it."""
  ocp = pytest.importorskip("orbax.checkpoint")
  import jax
  path = str(tmp_path / "orbax")
  value = mp_worker.expected("c", (1024, 1024))
  s = jax.sharding.NamedSharding(jax.make_mesh((8,), ("z",)), jax.sharding.PartitionSpec("z"))
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, {"c": jax.device_put(value, s)})
  ckpt.wait_until_finished()
  runs = [r["runs"] for r in ok(group({
      "mode": "restore", "devices": 1, "mesh": [[2], ["x"]], "step": False,
      "leaves": {"c": {"shape": [1024, 1024], "spec": "replicated"}}, "target": {},
      "path": path, "runs": [False, True]}, 2))]
  off, on = ([p[k]["io"]["rchar"] for p in runs] for k in (0, 1))
  assert min(off) > value.nbytes // 2, off   # (Orbax compresses: zstd)
  assert max(on) < 0.6 * min(off), (on, off)


@pytest.mark.parametrize("at", ["before", "during"])
def test_process_lost_during_broadcast_fails_every_survivor(tmp_path, at):
  """Process 1 dies after reading its parts, before its wave's barrier (``before``) or once
  the collective is under way (``during``, Gloo sees the connection close). Process 0 raises
  a CheckpointError naming process 1 within the 4 s deadline (the heartbeat timeout, 30 s,
  would end it much later)."""
  path = str(tmp_path / "ckpt")
  fnckpt.save({"c": mp_worker.expected("c", (1024, 1024)), "step": 7}, path).wait()
  results = group({"mode": "restore", "devices": 1, "mesh": [[2], ["x"]],
                   "leaves": {"c": {"shape": [1024, 1024], "spec": "replicated"}},
                   "target": {}, "path": path, "runs": [True], "barrier_s": 4,
                   "heartbeat_s": 30, "shutdown_timeout_s": 3,
                   "die": {"process": 1, "at": at}}, 2, timeout=90)
  assert results[1].returncode == 9 and "PHASE dying" in results[1].stdout, \
      results[1].describe()
  r0 = results[0].result
  assert not results[0].timed_out and r0, results[0].describe()
  (run,) = r0["runs"]
  assert run["elapsed_s"] < 10, run
  assert run["error"] in ("BarrierTimeoutError", "CheckpointError"), run
  assert issubclass(getattr(fnckpt, run["error"]), fnckpt.CheckpointError)
  assert "process(es) 1 did not arrive" in run["message"], run
  assert "broadcast-wave-0" in run["message"], run
  if at == "before":
    assert "process 1 last reported phase 'broadcast-wave-0: reading'" in run["message"], run
  else:
    assert "['c']" in run["message"] and "lost during the broadcast" in run["message"], run


def damage_half(path):
  """Flip a byte inside the last inner chunk (rows 512-1023) of the 8 MiB leaf saved at
  ``path``: with broadcast, or sharded by rows over 2 processes, only the process reading
  that half sees it."""
  (chunk,) = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
              if os.path.basename(d) == "0" and f == "0"
              and os.path.getsize(os.path.join(d, f)) > 8 * MiB]   # the 8 MiB leaf's shard
  with open(chunk, "r+b") as f:
    f.seek(8 * MiB - 4096)
    b = f.read(1)
    f.seek(8 * MiB - 4096)
    f.write(bytes([b[0] ^ 0xFF]))


def test_a_read_failure_fails_every_process_at_once(tmp_path):
  """A stored chunk damaged where only one process reads it (each reads half of the rows):
  that process raises its DamagedError; the other learns of it at the wave's barrier and
  raises a DamagedError naming that process and the damage (not a BarrierTimeoutError at the
  60 s deadline, as when the failed process simply never arrived)."""
  path = str(tmp_path / "ckpt")
  fnckpt.save({"c": mp_worker.expected("c", (1024, 2048)), "step": 7}, path).wait()
  damage_half(path)
  results = ok(group({"mode": "restore", "devices": 1, "mesh": [[2], ["x"]], "warm": False,
                      "leaves": {"c": {"shape": [1024, 2048], "spec": "replicated"}},
                      "target": {}, "path": path, "runs": [True], "barrier_s": 60}, 2))
  errors = {r["process"]: r["runs"][0] for r in results}
  assert all(e.get("error") == "DamagedError" for e in errors.values()), errors
  told = [p for p, e in errors.items() if "could not read its parts" in e["message"]]
  assert len(told) == 1, errors
  (other,) = told
  (damaged,) = set(errors) - {other}
  message = errors[other]["message"]
  assert (f"failed in broadcast-wave-0 (['c']): process {damaged} could not read its parts "
          "(DamagedError: ") in message, message
  assert f"This process (process {other}) stops at the same wave." in message, message
  assert "falls back to an older step" in message, message


def test_a_failure_before_the_waves_is_published_at_the_first(tmp_path):
  """The damaged leaf is read without broadcast (sharded over the processes: each reads its
  own half), before the waves of the replicated one: the process that reads it still fails
  every process at the first wave's barrier (before: the other waited there until the
  deadline; this test's processes are stopped at 120 s, the deadline is 600 s)."""
  path = str(tmp_path / "ckpt")
  fnckpt.save({"c": mp_worker.expected("c", (1024, 2048)),
               "r": mp_worker.expected("r", (512, 1024)), "step": 7}, path).wait()
  damage_half(path)
  leaves = {"c": {"shape": [1024, 2048], "spec": ["x"]},
            "r": {"shape": [512, 1024], "spec": "replicated"}}
  results = ok(group({"mode": "restore", "devices": 1, "mesh": [[2], ["x"]], "warm": False,
                      "leaves": leaves, "target": {}, "path": path, "runs": [True],
                      "barrier_s": 600}, 2, timeout=120))
  errors = {r["process"]: r["runs"][0] for r in results}
  assert all(e.get("error") == "DamagedError" for e in errors.values()), errors
  assert sum("could not read its parts" in e["message"] for e in errors.values()) == 1, errors


def test_the_manager_heals_around_damage_one_process_reads(tmp_path):
  """Steps 1 and 2 of a replicated leaf; step 2 damaged where one process reads it with
  broadcast: the manager's restore returns step 1 on both processes (values checked), each
  warning that step 2 is damaged, long before the default 600 s deadline (before the fix, the
  others waited for it at the wave's barrier; this test's processes are stopped at 120 s)."""
  root = str(tmp_path / "run")
  mgr = fnckpt.CheckpointManager(root)
  for step in (1, 2):
    mgr.save(step, {"c": mp_worker.expected("c", (1024, 2048), seed=step), "step": step})
  mgr.close()
  damage_half(os.path.join(root, "2"))
  results = ok(group({"mode": "heal", "devices": 1, "mesh": [[2], ["x"]], "root": root,
                      "leaves": {"c": {"shape": [1024, 2048], "spec": "replicated"}},
                      "target": {}, "barrier_s": 600}, 2, timeout=120))
  for r in results:
    assert r["step"] == 1 and r["checked"] == 1, r
    assert len(r["warned"]) == 1, r
    assert r["warned"][0].startswith(f"Step 2 of '{root}' is damaged"), r
