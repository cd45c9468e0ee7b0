"""Collective saves with 2 real processes (``jax.distributed`` on 127.0.0.1, 2 CPU devices
each, ``mp_worker.mode_attempts``): different trees, or a failure on one process, fail every
process with an error naming the real cause (never the barrier deadline, which is 120 s here)
and commit nothing; a retry of the same save then succeeds; consecutive saves; medium arrays
packed across processes.

"Fast" is asserted through the error's text, not a clock: with a 120 s deadline a process that
waited for it would raise ``BarrierTimeoutError``; here each one raises its own error or a
``PeerFailedError`` naming the failed process and what it reported. Each test is one process
group (a few seconds); the group's own kill deadline is only a safety net.
"""

import os

import msgpack
import numpy as np
import pytest

import fnckpt
import helpers_proc as hp
import mp_worker

MESH = [[2, 2], ["x", "y"]]
LEAVES = {
    "a": {"shape": [64, 128], "spec": ["x", "y"]},                  # sharded across processes
    "b": {"shape": [128, 64], "spec": "replicated"},                 # 32 KiB: packed
    "e": {"shape": [100, 100], "dtype": "int32", "kind": "numpy"},   # 39 KiB: process 0's pack
    "f": {"shape": [8], "spec": "replicated"},                       # inline
}
NOTHING_COMMITTED = "Nothing was committed; earlier checkpoints are intact."
GROUP_KILL_S = 400  # a hang shows as BarrierTimeoutError at 120 s first


def run(tmp_path, attempts, leaves=LEAVES, barrier_s=120, processes=2, plans=None, **more):
  """Run ``attempts`` on 2 processes of 2 devices (or 4 of 1: the same 2x2 mesh); per
  process, its list of outcomes. ``more``: more worker settings (``piece_bytes``).
  ``plans``: a list that gets each process's save plan counts (reused, made)."""
  for a in attempts:
    a["path"] = str(tmp_path / a["path"])
  results = hp.run_group({"mode": "attempts", "devices": 4 // processes, "mesh": MESH,
                          "leaves": leaves, "attempts": attempts, "barrier_s": barrier_s,
                          **more}, processes, timeout=GROUP_KILL_S)
  for r in results:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  if plans is not None:
    plans.extend(r.result["plans"] for r in results)
  return [r.result["outcomes"] for r in results]


def check_restores(path, leaves=LEAVES, seed=0):
  """The 1-process restore (this test process, 8 devices): host values, bitwise."""
  got = fnckpt.restore(path)
  for name, leaf in leaves.items():
    want = mp_worker.expected(name, leaf["shape"], leaf.get("dtype", "float32"), seed)
    assert np.asarray(got[name]).tobytes() == want.tobytes(), name
  assert got["step"] == 7


def failed(outcome, error, *texts, committed="any"):
  """``outcome`` is ``error`` with each of ``texts``, said once, and (unless "any") its
  ``outcome.committed`` is ``committed``."""
  assert outcome.get("error") == error, outcome
  for text in texts:
    assert text in outcome["message"], (text, outcome["message"])
  for sentence in ("Nothing was committed", "is committed", "may have committed"):
    assert outcome["message"].count(sentence) <= 1, outcome["message"]
  if committed != "any":
    assert outcome["committed"] is committed, outcome


def manifest(path):
  with open(os.path.join(path, "manifest.msgpack"), "rb") as f:
    return msgpack.unpackb(f.read())


def test_different_trees_fail_every_process_naming_the_first_differing_key_path(tmp_path):
  """A different key, shape or dtype on process 1: process 1 raises the disagreement (key
  path, what it has, what process 0 has), process 0 a PeerFailedError carrying it; nothing is
  written. The same save with equal trees then succeeds at that path."""
  b = LEAVES["b"]
  changes = {
      "key": {"drop": ["b"], "leaves": {"bb": b}},
      "shape": {"leaves": {"b": {**b, "shape": [128, 32]}}},
      "dtype": {"leaves": {"b": {**b, "dtype": "int32"}}},
  }
  attempts = [{"path": name, "change": {"1": change}} for name, change in changes.items()]
  attempts.append({"path": "key", "restore": True})
  p0, p1 = run(tmp_path, attempts)
  found = {
      "key": ("process 0 has a leaf at ['b'] (jax float32[128, 64]", "that process 1 lacks",
              "(it has ['bb'] there)"),
      "shape": ("the leaf at ['b'] is jax float32[128, 32]", "but jax float32[128, 64]"),
      "dtype": ("the leaf at ['b'] is jax int32[128, 64]", "but jax float32[128, 64]"),
  }
  for i, (name, texts) in enumerate(found.items()):
    path = str(tmp_path / name)
    failed(p1[i], "CheckpointError", f"Saving to {path!r}: processes 1 and 0 passed "
           "different trees", *texts)
    failed(p0[i], "PeerFailedError", f"Saving to {path!r} failed on process 1 (process 0 "
           "learned of it at barrier 'agreed')", *texts,
           "Nothing was written. " + NOTHING_COMMITTED)
    assert not p0[i]["left"], p0[i]  # nothing written, not even a directory entry
  assert "ok" in p0[3] and "ok" in p1[3], (p0[3], p1[3])
  assert p0[3]["checked_shards"] == p1[3]["checked_shards"] == 1 + 2 + 2 + 2  # e, a, b, f
  check_restores(str(tmp_path / "key"))


def test_a_failing_process_fails_every_process_and_a_retry_succeeds(tmp_path):
  """Failures on one process: an unsupported leaf (planning), an error while staging
  (process 1), an error writing the manifest (process 0, in the background), an unsupported
  leaf on process 0 (before it shares its tree). Every process raises naming the failed
  process and its error; nothing is committed. Retries (overwrite=True where the failed
  attempt left data) succeed and restore bitwise: the retry's nonce gives it its own data
  directory and barriers. A process that fails after every process's data is durable leaves a
  committed checkpoint, and every process says so."""
  p0, p1 = run(tmp_path, [
      {"path": "x", "change": {"1": {"unsupported": "e"}}},
      {"path": "y", "fault": {"process": 1, "phase": "staging", "action": "raise"}},
      {"path": "z", "fault": {"process": 0, "phase": "manifest", "action": "raise"}},
      {"path": "y", "overwrite": True, "restore": True},
      {"path": "x", "restore": True},
      {"path": "w", "fault": {"process": 1, "phase": "committing", "action": "raise"}},
      {"path": "v", "change": {"0": {"unsupported": "e"}}},
  ])
  x, y, z = (str(tmp_path / n) for n in "xyz")
  unsupported = "Unsupported leaf at ['e']: builtins.object"
  failed(p1[0], "CheckpointError", unsupported, committed=False)
  failed(p0[0], "PeerFailedError", f"Saving to {x!r} failed on process 1", unsupported,
         NOTHING_COMMITTED, committed=False)
  assert not p0[0]["left"], p0[0]

  staging = "RuntimeError: injected failure at staging"
  failed(p1[1], "CheckpointError", staging, NOTHING_COMMITTED, committed=False)
  failed(p0[1], "PeerFailedError", f"Saving to {y!r} failed on process 1 (process 0 learned "
         "of it at barrier 'hashed')", staging, NOTHING_COMMITTED, committed=False)
  assert "COMMIT" not in p0[1]["left"], p0[1]
  failed_data = [d for d in p0[1]["left"] if d.startswith("data-")]
  assert len(failed_data) == 1, p0[1]  # process 0 wrote its share before learning

  manifest_error = "RuntimeError: injected failure at manifest"
  failed(p0[2], "CheckpointError", manifest_error, NOTHING_COMMITTED, committed=False)
  failed(p1[2], "PeerFailedError", f"Saving to {z!r} failed on process 0", manifest_error,
         NOTHING_COMMITTED, committed=False)
  assert "COMMIT" not in p0[2]["left"], p0[2]
  with pytest.raises(fnckpt.NotCommittedError):
    fnckpt.restore(z)

  for i in (3, 4):
    assert "ok" in p0[i] and "ok" in p1[i], (i, p0[i], p1[i])
    assert p0[i]["checked_shards"] == p1[i]["checked_shards"] == 7
  # the retry wrote to its own directory and the failed attempt's data is gone
  assert [d for d in p0[3]["left"] if d.startswith("data-")] == [manifest(y)["data"]]
  assert manifest(y)["data"] != failed_data[0]
  check_restores(y)
  check_restores(x)

  w = str(tmp_path / "w")
  # process 1 failed past 'written': process 0 may have written the marker (it did), so
  # process 1 cannot say "nothing was committed"; process 0 knows
  failed(p1[5], "CheckpointError", "injected failure at committing",
         "Process 0 may have committed the checkpoint", committed=None)
  failed(p0[5], "PeerFailedError", f"Saving to {w!r} failed on process 1",
         "The checkpoint itself is committed", committed=True)
  check_restores(w)

  # process 0 fails before sharing its tree: process 1 is not left waiting for it
  v = str(tmp_path / "v")
  failed(p0[6], "CheckpointError", unsupported, committed=False)
  failed(p1[6], "PeerFailedError", f"Saving to {v!r} failed on process 0 (process 1 learned of "
         "it while waiting for process 0's 'tree')", unsupported, NOTHING_COMMITTED,
         committed=False)
  assert not p0[6]["left"], p0[6]


def test_what_a_failed_save_left_is_said_once_on_every_process(tmp_path):
  """Process 0 fails right after writing the commit marker: both processes say the checkpoint
  is committed (process 1 used to add "Nothing was committed" to process 0's word). A base
  deleted (on process 0) during save(base=, overwrite=True): both processes say, once, that
  nothing was committed and that the checkpoint at the path was removed first (the base check
  said "Earlier checkpoints are intact.", and process 1 added its own sentence)."""
  base, marker = str(tmp_path / "b0"), "injected failure at marker"
  p0, p1 = run(tmp_path, [
      {"path": "m", "fault": {"process": 0, "phase": "marker", "action": "raise"}},
      {"path": "b0"},
      {"path": "b1"},
      {"path": "b1", "base": base, "overwrite": True,
       "fault": {"process": 0, "phase": "staging", "action": f"delete:{base}"}},
  ])
  m = str(tmp_path / "m")
  committed = "The checkpoint itself is committed (its marker was written); only this last step"
  failed(p0[0], "CheckpointError", f"Saving to {m!r} failed while waiting for the commit",
         marker, committed, committed=True)
  failed(p1[0], "PeerFailedError", f"Saving to {m!r} failed on process 0 (process 1 learned "
         "of it at barrier 'committed')", marker, committed, committed=True)
  for p in (p0[0], p1[0]):
    assert "Nothing was committed" not in p["message"], p["message"]
  check_restores(m)

  removed = ("Save again (with a committed base, or without base=). Nothing was committed; the "
             "checkpoint that was at this path was removed first (overwrite=True); other "
             "checkpoints are intact.")
  failed(p0[3], "CheckpointError", "was deleted or replaced while this save", removed,
         committed=False)
  failed(p1[3], "PeerFailedError", f"Saving to {str(tmp_path / 'b1')!r} failed on process 0",
         removed, committed=False)
  for p in (p0[3], p1[3]):
    assert p["message"].endswith(removed) and p["replaced"] is True, p
    assert "earlier checkpoints are intact" not in p["message"].lower(), p["message"]


@pytest.mark.slow
def test_a_process_late_past_the_deadline_learns_why_and_a_retry_succeeds(tmp_path):
  """Process 1 calls save 5 s late with a 1 s barrier deadline: process 0 times out at the
  first barrier naming process 1; process 1, arriving at that failed barrier, raises process
  0's published error (not a bare "not every process arrived"). The retry pairs up again."""
  p0, p1 = run(tmp_path, [
      {"path": "late", "delay_s": {"1": 5}, "barrier_s": 1},
      {"path": "late", "overwrite": True, "restore": True}])  # (120 s: process 1 is behind)
  late = str(tmp_path / "late")
  failed(p0[0], "BarrierTimeoutError", f"Barrier 'agreed' for {late!r}",
         "process(es) 1 did not arrive")
  failed(p1[0], "PeerFailedError", f"Saving to {late!r} failed on process 0 (process 1 learned "
         "of it at barrier 'agreed', which failed)", "process(es) 1 did not arrive")
  assert "ok" in p0[1] and "ok" in p1[1], (p0[1], p1[1])
  check_restores(late)


def test_consecutive_saves_to_two_paths_and_overwriting_one(tmp_path):
  """Without waiting in between: a to A, b to B, then A again twice (overwrite), each save's
  own nonce; every process waits at the end. A holds the last save only; both restore on 2
  processes and on 1, bitwise."""
  p0, p1 = run(tmp_path, [
      {"path": "A", "seed": 0, "wait": False},
      {"path": "B", "seed": 1, "wait": False, "restore": True},
      {"path": "A", "seed": 2, "overwrite": True, "wait": False},
      {"path": "A", "seed": 3, "overwrite": True, "restore": True},
  ])
  for i in range(4):
    assert "ok" in p0[i] and "ok" in p1[i], (i, p0[i], p1[i])
  assert p0[1]["checked_shards"] == p1[1]["checked_shards"] == 7
  assert p0[3]["checked_shards"] == p1[3]["checked_shards"] == 7
  a, b = str(tmp_path / "A"), str(tmp_path / "B")
  check_restores(a, seed=3)
  check_restores(b, seed=1)
  assert [d for d in os.listdir(a) if d.startswith("data-")] == [manifest(a)["data"]]
  assert manifest(a)["data"] != manifest(b)["data"]


KiB, MiB = 1 << 10, 1 << 20
PACKED = {  # replicated on both processes: either may pack them
    "r0": {"shape": [256, 1024], "spec": "replicated"},                      # 1 MiB
    "r1": {"shape": [256, 1024], "spec": "replicated"},                      # 1 MiB
    "r2": {"shape": [512, 1024], "spec": "replicated"},                      # 2 MiB
    "r3": {"shape": [128, 1024], "spec": "replicated"},                      # 512 KiB
    "r4": {"shape": [1024, 1024], "dtype": "bfloat16", "spec": "replicated"},  # 2 MiB
    "r5": {"shape": [100, 100], "spec": "replicated"},                       # 40000 B
    "r6": {"shape": [1024, 1024], "spec": "replicated"},                     # 4 MiB: packed
}
PACK_LEAVES = {
    **PACKED,
    "n": {"shape": [200, 100], "kind": "numpy"},              # 80000 B, process 0 packs it
    "s": {"shape": [64, 64], "spec": "replicated"},           # 16 KiB: inline
    "big": {"shape": [1024, 1025], "spec": "replicated"},     # just over 4 MiB: own array
    "sh": {"shape": [256, 256], "spec": ["x"]},               # sharded across processes
}


def test_replicated_medium_arrays_are_packed_once_balanced_and_restore(tmp_path):
  """Medium arrays (16 KiB < size <= 4 MiB) that every process sees whole go into packs: each
  leaf into exactly one process's pack (numpy leaves into process 0's), replicated ones largest
  first onto the less loaded process, so both packs carry about the same bytes. Restored on 2
  processes (other shardings) and on 1, bitwise."""
  p0, p1 = run(tmp_path, [{"path": "ckpt", "restore": True, "target": {
      "r0": ["x"], "r2": [None, ["x", "y"]], "r6": ["y", "x"], "big": ["x"], "sh": [None, "y"]}}],
      leaves=PACK_LEAVES, piece_bytes=0)  # (big and sh in arrays of their own, not pieces)
  assert "ok" in p0[0] and "ok" in p1[0], (p0, p1)
  path = str(tmp_path / "ckpt")
  m = manifest(path)
  records = {r["path"][0][1]: r for r in m["leaves"]}
  assert [p["dir"] for p in m["packs"]] == [f"{m['data']}/p/0", f"{m['data']}/p/1"]
  assert "inline" in records["s"] and "store" in records["big"] and "store" in records["sh"]
  owner, ranges = {}, {0: [], 1: []}
  for name in [*PACKED, "n"]:
    pack = records[name]["pack"]
    size = int(np.prod(PACK_LEAVES[name]["shape"])) * mp_worker.expected(
        name, [1], PACK_LEAVES[name].get("dtype", "float32")).dtype.itemsize
    owner[name] = pack["index"]
    ranges[pack["index"]].append((pack["offset"], pack["offset"] + size))
  # The rule (README, Packs): fixed writers first (n: 80000 B on 0), then replicated leaves
  # largest first (ties: leaf order) onto the less loaded process (ties: the lower):
  # r6 4 MiB -> 1; r2 2 MiB -> 0; r4 2 MiB -> 0 (2 MiB + 80000 < 4 MiB); r0 1 MiB -> 1;
  # r1 1 MiB -> 0; r3 512 KiB -> 1; r5 40000 B -> 0.
  assert owner == {"n": 0, "r6": 1, "r2": 0, "r4": 0, "r0": 1, "r1": 0, "r3": 1, "r5": 0}
  loads = {p: sum(b - a for a, b in r) for p, r in ranges.items()}
  assert loads == {0: 80000 + 5 * MiB + 40000, 1: 5 * MiB + 512 * KiB}  # balanced
  for p, r in ranges.items():  # each leaf's bytes exactly once, in its pack's bounds
    r.sort()
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(r, r[1:])), r
    assert r[-1][1] <= m["packs"][p]["nbytes"]
  # each process wrote its own pack (plus its zarr chunks), and the packs are on disk
  for p in (0, 1):
    assert os.listdir(os.path.join(path, m["data"], "p", str(p), "c"))
  written = p0[0]["ok"]["bytes_written"] + p1[0]["ok"]["bytes_written"]
  zarr = (1024 * 1025 + 256 * 256) * 4
  assert written == sum(p["nbytes"] for p in m["packs"]) + zarr
  assert p0[0]["checked_shards"] == p1[0]["checked_shards"] == 10 * 2 + 1
  check_restores(path, PACK_LEAVES)


def test_four_processes_disagree_or_fail_and_all_learn_it_then_retry(tmp_path):
  """4 processes of 1 device (same 2x2 mesh): process 2 passes another dtype, then process 3
  fails while staging; every process raises naming the failing process, nothing is
  committed; the retry (overwrite=True) commits and restores bitwise on all 4 and here."""
  b = LEAVES["b"]
  outcomes = run(tmp_path, [
      {"path": "d", "change": {"2": {"leaves": {"b": {**b, "dtype": "int32"}}}}},
      {"path": "s", "fault": {"process": 3, "phase": "staging", "action": "raise"}},
      {"path": "s", "overwrite": True, "restore": True},
  ], processes=4)
  d, s = str(tmp_path / "d"), str(tmp_path / "s")
  failed(outcomes[2][0], "CheckpointError", f"Saving to {d!r}: processes 2 and 0 passed "
         "different trees", "the leaf at ['b'] is jax int32[128, 64]")
  for p in (0, 1, 3):
    failed(outcomes[p][0], "PeerFailedError", f"Saving to {d!r} failed on process 2",
           "the leaf at ['b'] is jax int32[128, 64]")
  staging = "RuntimeError: injected failure at staging"
  failed(outcomes[3][1], "CheckpointError", staging, NOTHING_COMMITTED)
  for p in (0, 1, 2):
    failed(outcomes[p][1], "PeerFailedError", f"Saving to {s!r} failed on process 3",
           staging, NOTHING_COMMITTED)
  assert all("ok" in o[2] for o in outcomes), [o[2] for o in outcomes]
  assert sum(o[2]["checked_shards"] for o in outcomes) == 4 * 4  # e, a, b, f on each device
  check_restores(s)


def test_a_kept_plan_agrees_by_digest_and_a_changed_tree_is_still_named(tmp_path):
  """2 processes save one structure three times (the 2nd and 4th reuse the 1st's plan: the
  processes compare a digest); on the 3rd, process 1 passes another dtype for ['b']: both
  processes fail naming it (process 0 under its kept plan, process 1 with a new one); every
  other save restores bitwise."""
  b, plans = LEAVES["b"], []
  outcomes = run(tmp_path, [
      {"path": "s0", "restore": True},
      {"path": "s1", "seed": 1, "restore": True},
      {"path": "d", "change": {"1": {"leaves": {"b": {**b, "dtype": "int32"}}}}},
      {"path": "s2", "seed": 2, "restore": True},
  ], plans=plans)
  d = str(tmp_path / "d")
  failed(outcomes[1][2], "CheckpointError", f"Saving to {d!r}: processes 1 and 0 passed "
         "different trees", "the leaf at ['b'] is jax int32[128, 64] P() on mesh {'x': 2, "
         "'y': 2} (on every process) on process 1 but jax float32[128, 64]", NOTHING_COMMITTED)
  failed(outcomes[0][2], "PeerFailedError", f"Saving to {d!r} failed on process 1",
         "the leaf at ['b'] is jax int32[128, 64]")
  for k in (0, 1, 3):
    assert all("ok" in o[k] for o in outcomes), [o[k] for o in outcomes]
  assert plans[0] == {"reused": 3, "made": 1}  # process 0: one plan for all four
  assert plans[1] == {"reused": 2, "made": 2}  # process 1: and one for its other tree
  for k, seed in (("s0", 0), ("s1", 1), ("s2", 2)):
    check_restores(str(tmp_path / k), seed=seed)
