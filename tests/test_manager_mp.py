"""CheckpointManager under 2 and 4 real ``jax.distributed`` processes on 127.0.0.1 (2 CPU
devices each; the children run ``tests/mp_manager_worker.py``): saves with retention and
restores, ``latest_step`` agreeing on every process, preemption through JAX's sync point with
SIGTERM sent from outside to every process, and a retention failure on process 0 raised by
``wait()`` on every process instead of hanging anyone. Barrier deadlines are short (20 s) so
a mistake fails fast; the parent has a deadline on the whole group and kills it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import fnckpt
from fnckpt._format import manifest as _manifest
import helpers_proc as hp

pytestmark = pytest.mark.slow

WORKER = os.path.join(hp.HERE, "mp_manager_worker.py")
BARRIER_S = 20


def launch(cfg: dict, n: int) -> list[subprocess.Popen]:
  port = hp.free_port()
  return [hp.start([sys.executable, WORKER, json.dumps({**cfg, "port": port,
                                                         "num_processes": n, "process_id": i})],
                   hp.child_env()) for i in range(n)]


def results_of(runs: list[hp.Result]) -> list[dict]:
  for r in runs:
    assert r.returncode == 0 and not r.timed_out and r.result, r.describe()
  return [r.result for r in runs]


@pytest.mark.parametrize("n", [2, 4])
def test_save_retention_restore_and_latest_step_agree(tmp_path, n):
  root = str(tmp_path / "run")
  out = results_of(hp.finish(launch({"mode": "lifecycle", "root": root,
                                     "barrier_s": BARRIER_S}, n), timeout=150))
  for r in out:
    assert r["fresh_step"] is None
    # latest_step right after each (async) save: that save, on every process
    assert r["latest_after_save"] == [0, 2, 4, 6, 8, 10]
    # newest 2 (8, 10), every 4th (0, 4, 8), best loss (2): 6 went
    assert r["all_steps"] == [0, 2, 4, 8, 10]
    assert r["metrics_2"] == {"loss": 1.0}
    assert r["restored_step"] == 10 and r["checked"] == 2 + 2 + 1  # shards of w, b; e
    assert r["unsharded"]["type"] == "CheckpointError"
    assert "no sharding at ['w']" in r["unsharded"]["message"]
    assert "NamedSharding" in r["unsharded"]["message"]
    assert r["latest_after_delete"] == 8 and r["restore_latest_step"] == 8
    assert r["all_steps_end"] == [0, 2, 4, 8]
  assert sorted(os.listdir(root), key=int) == ["0", "2", "4", "8"]
  assert fnckpt.CheckpointManager(root).metrics(8) == {"loss": 6.0}
  assert fnckpt.metadata(os.path.join(root, "8")).process_count == n


def test_retention_failure_is_raised_by_wait_on_every_process(tmp_path):
  root = str(tmp_path / "run")
  try:
    out = results_of(hp.finish(launch({"mode": "retention_failure", "root": root,
                                       "barrier_s": BARRIER_S}, 2), timeout=120))
  finally:
    if os.path.isdir(os.path.join(root, "0")):  # a failed run may leave it immutable
      subprocess.run(["chattr", "-i", os.path.join(root, "0")], capture_output=True)
  for r in out:
    assert r["save_after_failure"] is None  # never raised from save() (a collective call)
    assert r["wait"]["type"] == "RetentionError", r
    msg = r["wait"]["message"]
    assert "Retention could not delete step 0 of" in msg and root in msg, msg
    assert "manager.delete(step) for step 0" in msg  # the fix
    if r["process"] != 0:
      assert msg.startswith("On process 0: ")
    assert r["wait_again"] is None  # raised once
    assert r["close"] is None and r["all_steps"] == [3]
  assert out[0]["warned"] and not out[1]["warned"]  # process 0 warned when it happened
  assert os.listdir(root) == ["3"]


def run_and_signal(cfg: dict, n: int, marker: str, timeout: float) -> list[hp.Result]:
  """Run ``n`` processes; when process 0 prints ``marker``, send SIGTERM to every process."""
  procs = launch(cfg, n)
  lines: list[str] = []

  def watch() -> None:
    for line in procs[0].stdout:
      lines.append(line)
      if line.startswith(marker):
        for p in procs:
          p.send_signal(signal.SIGTERM)

  outs: dict[int, tuple[str, str]] = {}
  threads = [threading.Thread(target=watch, daemon=True)]
  threads.append(threading.Thread(target=lambda: outs.update({0: ("", procs[0].stderr.read())}),
                                  daemon=True))
  for i, p in enumerate(procs[1:], 1):
    threads.append(threading.Thread(target=lambda i=i, p=p: outs.update({i: p.communicate()}),
                                    daemon=True))
  for t in threads:
    t.start()
  deadline = time.monotonic() + timeout
  timed_out = []
  for p in procs:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
      timed_out.append(False)
    except subprocess.TimeoutExpired:
      timed_out.append(True)
      hp._kill_group(p)
      p.wait()
  for t in threads:
    t.join(10)
  outs[0] = ("".join(lines), outs.get(0, ("", ""))[1])
  return [hp.Result(p.returncode, *outs.get(i, ("", "")), timed_out[i])
          for i, p in enumerate(procs)]


@pytest.mark.parametrize("n", [2, 4])
def test_preemption_saves_the_same_step_on_every_process(tmp_path, n):
  root = str(tmp_path / "run")
  out = results_of(run_and_signal({"mode": "preempt", "root": root, "barrier_s": BARRIER_S,
                                   "ready_at": 5, "max_steps": 1500, "step_s": 0.02},
                                  n, "READY", timeout=150))
  stops = {r["stopped_at"] for r in out}
  assert len(stops) == 1, out  # every process stopped at the same step ...
  step = stops.pop()
  assert step > 5
  for r in out:
    assert r["saves"] == [0, step], r  # ... and saved exactly that step (and the first)
    assert r["requested_at"] is not None and r["requested_at"] <= step
    assert r["all_steps"] == [0, step]
  assert fnckpt.CheckpointManager(root).latest_step() == step
  assert fnckpt.restore(os.path.join(root, str(step)))["step"] == step


@pytest.mark.parametrize("how, damager", [("chunk", 1), ("manifest", 0)])
def test_damage_seen_by_one_process_falls_back_on_every_process(tmp_path, how, damager):
  root = str(tmp_path / "run")
  out = results_of(hp.finish(launch({"mode": "damage", "root": root, "barrier_s": BARRIER_S,
                                     "how": how, "damager": damager}, 2), timeout=120))
  for r in out:
    assert r["restored"] == 1 and r["checked"] == 2 + 2 + 1
    assert len(r["warned"]) == 1, r
    text = "checksum mismatch" if how == "chunk" else "does not match its commit marker"
    assert r["warned"][0].startswith(f"Step 2 of '{root}' is damaged"), r
    assert text in r["warned"][0], r
    if how == "chunk":
      assert "(found by process 1)" in r["warned"][0], r
    assert r["latest"] == 1 and r["all_steps"] == [1]
    assert r["explicit"]["type"] == "CheckpointError"
    message = r["explicit"]["message"]
    assert "Step 2 of" in message and "is marked damaged" in message
    assert r["after_resave"] == 2


def test_two_tiers_recover_the_newest_step_every_process_can_restore(tmp_path):
  root, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
  cfg = {"mode": "tiers", "root": root, "local": fast, "barrier_s": BARRIER_S}
  out = results_of(hp.finish(launch({**cfg, "phase": "save"}, 2), timeout=120))
  assert [r["all_steps"] for r in out] == [[0, 2, 3, 4, 5]] * 2
  assert sorted(os.listdir(fast), key=int) == ["3", "5"]   # durable steps go to `root` only
  assert fnckpt.CheckpointManager(root).all_steps() == [0, 2, 4]

  def recover(local_of):
    port = hp.free_port()
    procs = [hp.start([sys.executable, WORKER, json.dumps(
        {**cfg, "phase": "recover", "local": local_of(i), "port": port, "num_processes": 2,
         "process_id": i})], hp.child_env()) for i in range(2)]
    return results_of(hp.finish(procs, timeout=120))

  # both hosts hold step 5 locally: the fast tier
  assert [r["restored"] for r in recover(lambda i: fast)] == [5, 5]
  # process 1's host was replaced (its local tier is empty): the newest durable step
  fresh = str(tmp_path / "fresh")
  out = recover(lambda i: fast if i == 0 else fresh)
  assert [(r["restored"], r["checked"]) for r in out] == [(4, 5), (4, 5)]
  # both local tiers wiped
  shutil.rmtree(fast)
  assert [r["restored"] for r in recover(lambda i: fast)] == [4, 4]


@pytest.mark.parametrize("local", ["per-host paths", "memory"])
def test_one_local_tier_per_host_keeps_durable_steps_complete(tmp_path, local):
  """Each process has its own local tier (per-host path strings, or memory://fast: separate
  storage per process). Durable steps are saved to `root` by every process (complete);
  each process's retention trims its own local tier; recovery reads the newest local step
  from the per-host tiers' held shards (they survive the restart), or `root` (memory://)."""
  root = str(tmp_path / "durable")
  fast = ([str(tmp_path / f"fast-host{i}") for i in range(2)] if local == "per-host paths"
          else "memory://fast")
  cfg = {"mode": "tiers", "root": root, "local": fast, "barrier_s": BARRIER_S}
  out = results_of(hp.finish(launch({**cfg, "phase": "save"}, 2), timeout=120))
  assert [r["local_dirs"] for r in out] == [[3, 5], [3, 5]]      # retention on every process
  assert fnckpt.CheckpointManager(root).all_steps() == [0, 2, 4]
  from fnckpt import cli
  for step in (0, 2, 4):                                          # every chunk is there
    assert cli.main(["verify", os.path.join(root, str(step))]) == 0
  out = results_of(hp.finish(launch({**cfg, "phase": "recover"}, 2), timeout=120))
  # per-host paths survive the restart: together the processes' held shards cover local step
  # 5 (each reads its own); memory://fast is gone with its processes: durable step 4
  want = 5 if local == "per-host paths" else 4
  assert [(r["restored"], r["checked"]) for r in out] == [(want, 5), (want, 5)]


def test_incremental_manager_with_two_tiers_on_two_processes(tmp_path):
  """An incremental manager with a fast tier and 2 processes saves full (hashes recorded: a
  host's fast directory may hold only its chunks, so no base there) and recovers from the
  durable tier alone once both fast tiers are wiped."""
  root, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
  cfg = {"mode": "tiers", "root": root, "local": fast, "barrier_s": BARRIER_S,
         "incremental": True}
  out = results_of(hp.finish(launch({**cfg, "phase": "save"}, 2), timeout=120))
  # durable 0, 2, 4 (saved there by both processes); local 3, 5 (the newest 2 local steps)
  assert [r["all_steps"] for r in out] == [[0, 2, 3, 4, 5]] * 2
  with open(os.path.join(root, "4", "manifest.msgpack"), "rb") as f:
    m = _manifest.decode(f.read(), root)
  assert not m.bases and any(l.hash is not None for l in m.leaves)
  shutil.rmtree(fast)
  port = hp.free_port()
  procs = [hp.start([sys.executable, WORKER, json.dumps(
      {**cfg, "phase": "recover", "port": port, "num_processes": 2, "process_id": i})],
      hp.child_env()) for i in range(2)]
  assert [(r["restored"], r["checked"]) for r in results_of(hp.finish(procs, timeout=120))] \
      == [(4, 5), (4, 5)]


def test_auto_interval_is_the_same_on_every_process(tmp_path):
  out = results_of(hp.finish(launch({"mode": "auto", "root": str(tmp_path / "run"),
                                     "barrier_s": BARRIER_S, "mtbf_s": 5.0, "steps": 40,
                                     "step_s": 0.01}, 2), timeout=120))
  assert out[0]["asked"] == out[1]["asked"] and out[0]["saved"] == out[1]["saved"], out
  assert out[0]["all_steps"] == out[1]["all_steps"] == out[0]["saved"]
  assert out[0]["interval_steps"] == out[1]["interval_steps"]
  assert (out[0]["saves"], out[0]["skipped"]) == (out[1]["saves"], out[1]["skipped"])
  assert out[0]["saves"] == len(out[0]["saved"]) >= 2
  assert out[0]["saves"] + out[0]["skipped"] == len(out[0]["asked"])
