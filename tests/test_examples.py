"""The examples run on CPU as documented (subprocesses with simulated devices)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def run(script, *args):
  r = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)],
                     capture_output=True, text=True, env=ENV, timeout=300)
  return r.returncode, r.stdout, r.stderr


def test_reshard_example():
  rc, out, err = run("reshard.py", "--devices", "8")
  assert rc == 0, out + err
  assert "from a {'data': 2, 'model': 4} mesh of 8 cpu device(s)" in out
  spec = jax.sharding.PartitionSpec(None, "x")  # P(None, 'x'); PartitionSpec(...) before JAX 0.10
  assert f"restored onto 4 devices, 1-D mesh: w as {spec} (4 shard(s))" in out
  assert out.count("values match") == 3
  assert out.strip().endswith("OK: every layout restored the same values")


def test_train_example_resumes_on_a_different_mesh(tmp_path):
  common = ["--dir", tmp_path / "run", "--save-every", "10", "--keep", "2"]
  rc, out, err = run("train.py", *common, "--steps", "20", "--devices", "8", "--mesh", "2,4")
  assert rc == 0, out + err
  assert "mesh {'data': 2, 'model': 4} on 8 cpu device(s)" in out
  assert "starting fresh" in out and "step    20  loss" in out
  first = json.loads(out.splitlines()[-1])
  assert first["step"] == 20 and first["steps_on_disk"] == [10, 20]

  # a job with fewer devices and another mesh picks up where the first one stopped
  rc, out, err = run("train.py", *common, "--steps", "30", "--devices", "4", "--mesh", "4,1")
  assert rc == 0, out + err
  assert "resumed from step 20" in out
  second = json.loads(out.splitlines()[-1])
  assert second["resumed_from"] == 20 and second["step"] == 30
  assert second["steps_on_disk"] == [20, 30]

  rc, out, err = run("train.py", *common, "--steps", "8", "--mesh", "3,1", "--devices", "4")
  assert rc != 0 and "--mesh 3,1 needs 3 devices; this job has 4" in err
