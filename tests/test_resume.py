"""Exact resume: a run killed with SIGKILL (and one preempted with SIGTERM) and resumed from
its newest committed checkpoint ends with bitwise the same parameters as an uninterrupted run.
Training runs in subprocesses (examples/train.py); the model is tiny."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
ARGS = ["--steps", "40", "--save-every", "5", "--keep", "2", "--devices", "8", "--mesh", "2,4"]


def train(directory, *extra):
  r = subprocess.run([sys.executable, str(TRAIN), "--dir", str(directory), *ARGS, *extra],
                     capture_output=True, text=True, env=ENV, timeout=300)
  lines = r.stdout.strip().splitlines()
  summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
  return r.returncode, summary, r.stdout + r.stderr


def test_killed_and_preempted_run_resumes_bitwise(tmp_path):
  rc, straight, log = train(tmp_path / "straight")
  assert rc == 0, log
  assert straight["step"] == 40 and straight["resumed_from"] is None

  run = tmp_path / "interrupted"
  rc, summary, log = train(run, "--kill-at-step", "20")
  assert rc == -signal.SIGKILL, log           # really killed, mid-save or just after
  assert summary is None

  rc, summary, log = train(run, "--preempt-at-step", "27")
  assert rc == 0, log
  # it resumed from the newest *committed* step: 20 if that save committed before the kill,
  # else an earlier one (the half-written saves are reported and ignored)
  assert summary["resumed_from"] is not None and summary["resumed_from"] <= 20, log
  assert summary["preempted"] and summary["step"] == 28  # saved at the next step boundary
  assert "received SIGTERM" in log
  assert summary["steps_on_disk"][-1] == 28

  rc, summary, log = train(run)
  assert rc == 0, log
  assert summary["resumed_from"] == 28 and summary["step"] == 40
  assert summary["params_sha256"] == straight["params_sha256"]
  assert summary["loss"] == straight["loss"]
  assert summary["steps_on_disk"] == [35, 40]
