"""Launching child Python processes for tests, always with a parent-side deadline.

Every child runs in its own session (process group); on a timeout the whole group is killed
with SIGKILL, so a hung child (or a grandchild it started) never outlives the test. The
children run ``tests/mp_worker.py`` with a JSON configuration; they report results on stdout
as one line ``RESULT <json>``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass
class Result:
  """What one child did: exit status (negative: killed by that signal), output, and the
  parsed ``RESULT`` line (None if it printed none)."""
  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool = False

  @property
  def result(self) -> Any:
    for line in reversed(self.stdout.splitlines()):
      # (Gloo prints to stdout from C++ without a newline: its text may share the line.)
      at = line.find("RESULT ")
      if at >= 0:
        return json.JSONDecoder().raw_decode(line, at + len("RESULT "))[0]
    return None

  def describe(self) -> str:
    return (f"returncode={self.returncode} timed_out={self.timed_out}\n--- stdout ---\n"
            f"{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}")


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env.pop("XLA_FLAGS", None)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  env.update(extra or {})
  return env


def worker_cmd(config: dict[str, Any], prefix: Sequence[str] = ()) -> list[str]:
  return [*prefix, sys.executable, WORKER, json.dumps(config)]


def _kill_group(p: subprocess.Popen) -> None:
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass


def start(cmd: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen:
  return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env or child_env(), start_new_session=True, cwd=ROOT)


def finish(procs: Sequence[subprocess.Popen], timeout: float) -> list[Result]:
  """Wait for every process until one shared deadline; kill the groups of those still running
  then (their results say ``timed_out``). Output is drained concurrently so no pipe fills."""
  import threading
  outs: dict[int, tuple[str, str]] = {}

  def drain(i: int, p: subprocess.Popen) -> None:
    outs[i] = p.communicate()

  threads = [threading.Thread(target=drain, args=(i, p), daemon=True)
             for i, p in enumerate(procs)]
  for t in threads:
    t.start()
  deadline = time.monotonic() + timeout
  timed_out = set()
  for i, (t, p) in enumerate(zip(threads, procs)):
    t.join(max(0.0, deadline - time.monotonic()))
    if t.is_alive():
      timed_out.add(i)
  for i in timed_out:
    _kill_group(procs[i])
  for i in timed_out:
    threads[i].join(30)
  results = []
  for i, p in enumerate(procs):
    out, err = outs.get(i, ("", ""))
    results.append(Result(p.returncode, out or "", err or "", i in timed_out))
    _kill_group(p)  # grandchildren, if any, never outlive the test
  return results


def run_worker(config: dict[str, Any], timeout: float = 120, prefix: Sequence[str] = (),
               env: dict[str, str] | None = None) -> Result:
  """Run one child ``mp_worker.py config`` to completion (or kill it at ``timeout``)."""
  return finish([start(worker_cmd(config, prefix), child_env(env))], timeout)[0]


def run_and_kill_at(config: dict[str, Any], marker: str, timeout: float = 120,
                    sig: int = signal.SIGKILL) -> Result:
  """Run one child; the moment it prints a line starting with ``marker``, send ``sig`` to its
  process group (like a preemption or the OOM killer, from outside). Killed at ``timeout``
  if the line never comes (``timed_out``)."""
  import threading
  p = start(worker_cmd(config), child_env())
  lines: list[str] = []
  seen = threading.Event()

  def read_stdout() -> None:
    for line in p.stdout:
      lines.append(line)
      if line.startswith(marker) and not seen.is_set():
        seen.set()
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass

  err: list[str] = []
  t_out = threading.Thread(target=read_stdout, daemon=True)
  t_err = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)
  t_out.start()
  t_err.start()
  try:
    p.wait(timeout)
    timed_out = False
  except subprocess.TimeoutExpired:
    timed_out = True
  _kill_group(p)
  p.wait()
  t_out.join(10)
  t_err.join(10)
  return Result(p.returncode, "".join(lines), "".join(err), timed_out)


def run_group(config: dict[str, Any], num_processes: int, timeout: float = 180,
              per_process: dict[int, dict[str, Any]] | None = None) -> list[Result]:
  """Run ``num_processes`` children forming one ``jax.distributed`` job on 127.0.0.1.

  Each gets ``config`` plus ``port``, ``num_processes``, ``process_id`` (and any
  ``per_process[i]`` overrides)."""
  port = free_port()
  procs = []
  for i in range(num_processes):
    cfg = {**config, "port": port, "num_processes": num_processes, "process_id": i,
           **(per_process or {}).get(i, {})}
    procs.append(start(worker_cmd(cfg), child_env()))
  return finish(procs, timeout)
