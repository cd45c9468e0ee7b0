"""Several real processes under ``jax.distributed`` on 127.0.0.1 (CPU, a few virtual devices
each): each writes only its own shards, replicas once across processes, process 0 commits;
restores onto other process counts, meshes and PartitionSpecs give the same values; a
barrier that cannot complete fails with a deadline and names who is missing; a process
killed mid-save leaves no commit, an intact previous checkpoint, and survivors that fail
clearly instead of hanging.

Every child checks its addressable shards against values computed independently
(``mp_worker.expected``); the parent has a deadline on the whole group and kills it.
"""

import os
import re

import jax
import numpy as np
import pytest

import fnckpt
import helpers_proc as hp
import mp_worker

pytestmark = pytest.mark.slow

MiB = 1 << 20
LEAVES = {
    "a": {"shape": [64, 128], "spec": ["x", "y"]},                 # 8 distinct shards
    "b": {"shape": [128, 64], "dtype": "int32", "spec": ["y"]},     # replicated over x
    "c": {"shape": [1024, 4096], "spec": "replicated"},            # 16 MiB on every device
    "d": {"shape": [8], "spec": "replicated"},                      # inline
    "e": {"shape": [100, 100], "dtype": "int32", "kind": "numpy"},  # host value
    "f": {"shape": [96, 40], "dtype": "bfloat16", "spec": [None, "x"]},
}


def dtype(leaf):
  return mp_worker.expected("z", (1,), leaf.get("dtype", "float32")).dtype


def nbytes(leaf):
  return int(np.prod(leaf["shape"])) * dtype(leaf).itemsize


CHUNKED_BYTES = sum(nbytes(l) for k, l in LEAVES.items() if k != "d")
# Format 2, 2 processes x 4 devices. Pieces (docs/format.md "Pieces"; shards of at most 8 MiB of
# sharded arrays): a: 8 shards; b: 4 shards (each held by 2 devices, 1 writer); f: 2 shards
# (each held by 4 devices): each process puts the ones it writes into its pack. Zarr arrays:
# c: 16 MiB replicated (its shard is over 8 MiB) split into 2 pieces of 8 MiB. Packs: e (numpy,
# 39 KiB, > 16 KiB and <= 4 MiB) goes into process 0's pack; each pack is one chunk. d is
# inline.
N_CHUNKS = 2 + 2


def chunk_files(path):
  return [f for root, _, fs in os.walk(path) if "c" in os.path.relpath(root, path).split(os.sep)
          for f in fs if not f.endswith(".__lock")]


def check_in_parent(path, seed=0):
  """The 1-process restore: the test process itself (8 devices), host values and a
  resharded device target."""
  got = fnckpt.restore(path)
  for name, leaf in LEAVES.items():
    want = mp_worker.expected(name, leaf["shape"], leaf.get("dtype", "float32"), seed)
    assert np.asarray(got[name]).tobytes() == want.tobytes(), name
  assert got["step"] == 7
  mesh = jax.make_mesh((8,), ("z",))
  s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("z"))
  target = {k: jax.ShapeDtypeStruct(tuple(LEAVES[k]["shape"]), dtype(LEAVES[k]), sharding=s)
            for k in ("a", "b", "c")}
  got = fnckpt.restore(path, target, partial=True)
  for k in target:
    leaf = LEAVES[k]
    mp_worker.check_addressable(k, got[k], mp_worker.expected(k, leaf["shape"],
                                                              leaf.get("dtype", "float32")))


def ok(results):
  for r in results:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  return [r.result for r in results]


def test_2_processes_save_then_4_processes_and_1_restore(tmp_path):
  path = str(tmp_path / "ckpt")
  saved = ok(hp.run_group({"mode": "save", "devices": 4, "mesh": [[2, 4], ["x", "y"]],
                           "leaves": LEAVES, "path": path}, 2, timeout=180))
  stats = [s["stats"][0] for s in saved]
  # every chunk written exactly once across the processes (replicas once), by its owner
  assert sum(s["bytes_written"] for s in stats) == CHUNKED_BYTES
  assert sum(s["chunks_written"] for s in stats) == N_CHUNKS == len(chunk_files(path))
  # both wrote a share: their own shards of a, half the pieces of the replicated c
  assert all(s["bytes_written"] >= 8 * MiB for s in stats), stats
  assert os.path.exists(os.path.join(path, "COMMIT"))
  assert fnckpt.metadata(path).process_count == 2

  restored = ok(hp.run_group({
      "mode": "restore", "devices": 2, "mesh": [[4, 2], ["x", "y"]], "leaves": LEAVES,
      "path": path, "target": {"a": ["y", "x"], "b": [None, "x"], "c": [["x", "y"]],
                               "d": ["y"], "f": ["x", "y"]}}, 4, timeout=180))
  # each process checked all of its shards (5 sharded leaves x 2 devices, + the numpy one)
  assert [r["checked_shards"] for r in restored] == [11] * 4
  assert len({tuple(r["devices"]) for r in restored}) == 4
  check_in_parent(path)


def test_4_processes_save_twice_to_one_location_then_2_restore(tmp_path):
  """The second save (overwrite) to the same location is a new attempt: its own random id
  (agreed through process 0), barrier ids and data directory; the first one's data is
  cleared, so the chunk files are exactly the second save's."""
  path = str(tmp_path / "ckpt")
  saved = ok(hp.run_group({"mode": "save", "devices": 2, "mesh": [[4, 2], ["x", "y"]],
                           "leaves": LEAVES, "path": path, "repeat": 2, "overwrite": True},
                          4, timeout=180))
  for run in range(2):
    stats = [s["stats"][run] for s in saved]
    assert sum(s["bytes_written"] for s in stats) == CHUNKED_BYTES
  assert len(chunk_files(path)) == sum(s["stats"][1]["chunks_written"] for s in saved)
  ok(hp.run_group({"mode": "restore", "devices": 4, "mesh": [[2, 4], ["x", "y"]],
                   "leaves": LEAVES, "path": path,
                   "target": {"a": [None, ["x", "y"]], "c": ["x", "y"], "f": [None, "y"]}},
                  2, timeout=180))
  check_in_parent(path)


def test_barrier_timeout_names_the_missing_process(tmp_path):
  """Process 1 never calls save (but is alive): process 0 gets BarrierTimeoutError at the
  deadline, naming process 1, the phase, and where process 1 was."""
  path = str(tmp_path / "ckpt")
  results = hp.run_group({"mode": "skip_save", "devices": 2, "mesh": [[2, 2], ["x", "y"]],
                          "leaves": {"a": LEAVES["a"]}, "path": path, "absent": 1,
                          "barrier_s": 3}, 2, timeout=120)
  r0 = results[0].result
  assert r0 and r0["error"] == "BarrierTimeoutError", results[0].describe()
  msg = r0["message"]
  assert "Barrier 'agreed'" in msg and path in msg and "deadline 3s" in msg
  assert "process(es) 1 did not arrive" in msg and "process 1 has not started this save" in msg
  # the deadline ended the wait (process 1 waits up to 60 s for process 0 to finish)
  assert 3 <= r0["elapsed_s"] < 45
  assert not os.path.exists(path) or not os.listdir(path)


def _kill_config(tmp_path, victim, phase, barrier_s, heartbeat_s):
  return {"mode": "save", "devices": 2, "mesh": [[2, 2], ["x", "y"]],
          "leaves": {"a": LEAVES["a"], "c": LEAVES["c"], "e": LEAVES["e"]},
          "prev": str(tmp_path / "prev"), "path": str(tmp_path / "new"),
          "barrier_s": barrier_s, "heartbeat_s": heartbeat_s, "shutdown_timeout_s": 3,
          "piece_bytes": 0,  # a's shards in zarr chunks: the kill lands between chunk writes
          "fault": {"process": victim, "phase": phase, "action": "kill"}}


def _check_prev_intact_and_new_not_committed(tmp_path):
  got = fnckpt.restore(str(tmp_path / "prev"))
  for k in ("a", "c", "e"):
    leaf = LEAVES[k]
    want = mp_worker.expected(k, leaf["shape"], leaf.get("dtype", "float32"), seed=1)
    assert np.asarray(got[k]).tobytes() == want.tobytes(), k
  assert got["step"] == 6
  new = str(tmp_path / "new")
  assert not os.path.exists(os.path.join(new, "COMMIT"))
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.restore(new)


def test_process_killed_mid_write_survivor_gets_barrier_timeout(tmp_path):
  """Process 1 dies with 2 of its chunks durable; process 0 finishes its writes and waits at
  the 'hashed' barrier: its deadline (4 s, shorter than the heartbeat timeout) ends that
  with an error naming process 1 and its last phase."""
  results = hp.run_group(_kill_config(tmp_path, 1, "midwrite", 4, 30), 2, timeout=120)
  assert results[1].returncode == -9 and "PHASE midwrite" in results[1].stdout
  r0 = results[0].result
  assert not results[0].timed_out and r0, results[0].describe()
  assert r0["error"] == "BarrierTimeoutError", r0
  # ('hashed': the first barrier after the writes, where the processes share content hashes)
  assert "Barrier 'hashed'" in r0["message"] and "process(es) 1 did not arrive" in r0["message"]
  assert re.search(r"process 1 last reported phase '(staging|staged)'", r0["message"]), r0
  assert len(chunk_files(str(tmp_path / "new"))) >= 2  # partial data is there, not visible
  _check_prev_intact_and_new_not_committed(tmp_path)


def test_coordinator_killed_before_commit_survivor_fails_fast(tmp_path):
  """Process 0 (which runs the coordination service and writes the marker) dies just before
  the marker. Process 1 cannot get past the last barrier; the coordination service's
  error ends it (long before the 60 s barrier deadline) instead of leaving it hanging."""
  results = hp.run_group(_kill_config(tmp_path, 0, "committing", 60, 5), 2, timeout=120)
  assert results[0].returncode == -9 and "PHASE committing" in results[0].stdout
  r1 = results[1]
  assert not r1.timed_out and r1.returncode != 0, r1.describe()
  if r1.result:  # a Python error reached the save (e.g. the barrier RPC failed)...
    assert r1.result["error"] in ("BarrierTimeoutError", "CheckpointError"), r1.result
    assert r1.result["elapsed_s"] < 50
  else:  # ... or the JAX client terminated the process, saying why
    assert "JAX distributed service" in r1.stderr or "coordination service" in r1.stderr, \
        r1.describe()
  _check_prev_intact_and_new_not_committed(tmp_path)


def test_2_processes_save_pieces_then_2_restore_onto_another_mesh(tmp_path):
  """Pieces across processes: a, b and f are pieces; each process writes the chunks the
  layout gives it into its own pack (b's replicas spread over both). Restores onto a (4, 2)
  mesh with other PartitionSpecs on 2 processes, then on 1 (this process) and verify."""
  path = str(tmp_path / "ckpt")
  ok(hp.run_group({"mode": "save", "devices": 4, "mesh": [[2, 4], ["x", "y"]],
                   "leaves": LEAVES, "path": path}, 2, timeout=180))
  m = fnckpt.metadata(path)
  pieced = {r.where for r in m.leaves if r.pieces is not None}
  assert pieced == {"['a']", "['b']", "['f']"}
  from fnckpt._sources import source as _source
  manifest = _source.open_source(path).manifest
  # format 3: each pieced leaf records one run per writing process (both write chunks of
  # each); every run of process p lies in p's own pack (p/<p>), the 2 packs distinct
  from fnckpt._format import runs as _runs
  packs_of = {0: set(), 1: set()}
  for leaf in manifest.leaves:
    if leaf.pieces is not None:
      runs = _runs.writer_runs(manifest, leaf)
      assert [r.process for r in runs] == [0, 1], leaf.path
      for r in runs:
        assert 0 <= r.lo < r.hi <= manifest.packs[r.pack].nbytes, (leaf.path, r)
        packs_of[r.process].add(r.pack)
  assert [len(v) for v in packs_of.values()] == [1, 1] and len(manifest.packs) == 2
  assert packs_of[0] != packs_of[1]
  for p, (k,) in packs_of.items():
    assert manifest.packs[k].dir == f"{manifest.data}/p/{p}" and manifest.packs[k].base is None
  assert [len(x) for x in manifest.meshes] == [8]
  restored = ok(hp.run_group({
      "mode": "restore", "devices": 4, "mesh": [[4, 2], ["x", "y"]], "leaves": LEAVES,
      "path": path, "target": {"a": ["y", "x"], "b": ["x"], "f": [["x", "y"]]}}, 2,
      timeout=180))
  assert [r["checked_shards"] for r in restored] == [4 * 5 + 1] * 2
  check_in_parent(path)
  from fnckpt.cli import main
  assert main(["verify", "-q", path]) == 0
