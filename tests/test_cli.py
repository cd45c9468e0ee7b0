"""The ``fnckpt`` command, run as a subprocess the way users run it. Its environment names a
JAX platform that does not exist, so any attempt to start a JAX backend would fail: the CLI
must need no devices."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt import _save

ENV = {**os.environ, "JAX_PLATFORMS": "no_such_platform"}


def cli(*args, console_script=False):
  cmd = ([shutil.which("fnckpt")] if console_script else [sys.executable, "-m", "fnckpt"])
  r = subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=ENV,
                     timeout=120)
  return r.returncode, r.stdout, r.stderr


def train_state(step):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  w = jnp.arange(64 * 96, dtype=jnp.float32).reshape(64, 96) + step
  return {
      "params": {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
                 "b": jnp.full((4,), 0.5, jnp.bfloat16)},
      "step": step,
      "key": jax.random.key(step),
      "data": np.random.default_rng(step),
  }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A run directory: committed steps 10 and 20 (with metrics) and an interrupted step 30."""
  root = tmp_path_factory.mktemp("cli") / "run"
  with fnckpt.CheckpointManager(str(root)) as mgr:
    mgr.save(10, train_state(10), metrics={"loss": 0.75})
    mgr.save(20, train_state(20), metrics={"loss": 0.25})
  original = _save._phase

  def crash(name):
    if name == "committing":
      raise RuntimeError("simulated crash")
  _save._phase = crash
  try:
    with pytest.raises(fnckpt.CheckpointError):
      fnckpt.save(train_state(30), str(root / "30")).wait()
  finally:
    _save._phase = original
  return root


def test_ls(run):
  rc, out, err = cli("ls", run)
  assert rc == 0, err
  lines = out.splitlines()
  assert lines[0].split() == ["STEP", "STATUS", "DATA", "LEAVES", "FILES", "COMMITTED",
                              "METRICS"]
  row10, row20, row30 = lines[1].split(), lines[2].split(), lines[3].split()
  assert row10[:2] == ["10", "committed"] and "loss=0.75" in lines[1]
  assert row20[:2] == ["20", "committed"] and "loss=0.25" in lines[2]
  assert row10[2:4] == ["24.0", "KiB"] and row10[4] == "5"  # 64*96*4 + 8 + 8 bytes; 5 leaves
  assert row30[:2] == ["30", "UNCOMMITTED"]
  assert "2 committed, 1 uncommitted; latest: 20" in out
  rc, out, err = cli("ls", run.parent / "nothing-here")
  assert rc == 1 and "No checkpoints under" in err


def test_inspect_console_script(run):
  rc, out, err = cli("inspect", run / "20", console_script=True)
  assert rc == 0, err
  assert '"metrics": {"loss": 0.25}' in out
  rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("[")}
  w = rows["['params']['w']"]
  assert "float32" in w and "(64, 96)" in w and "24.0 KiB" in w
  assert "P('data', 'model') mesh(data=2,model=4)" in w and "chunks (32, 24)" in w
  assert "bfloat16" in rows["['params']['b']"] and "inline [0.5, 0.5, 0.5, 0.5]" in rows[
      "['params']['b']"]
  assert "(threefry2x32)" in rows["['key']"] and "inline" in rows["['key']"]
  assert rows["['step']"].split()[-1] == "20"
  assert "numpy Generator (PCG64)" in rows["['data']"]
  assert "5 leaves (3 arrays, 1 stored in their own files)" in out


def test_inspect_uncommitted_and_missing(run):
  rc, out, err = cli("inspect", run / "30")
  assert rc == 2 and "interrupted save" in err
  rc, out, err = cli("inspect", run / "404")
  assert rc == 2 and "No checkpoint at" in err
  rc, out, err = cli("inspect")
  assert rc == 2 and "usage:" in err


def test_verify_ok_then_corrupt_then_missing(run, tmp_path):
  ckpt = tmp_path / "20"
  shutil.copytree(run / "20", ckpt)
  rc, out, err = cli("verify", ckpt)
  assert rc == 0, out + err
  assert out.strip() == f"OK {ckpt}"
  assert "100.0% 8/8 chunks 24.0 KiB/24.0 KiB" in err  # the progress bar, on stderr

  chunks = sorted(p for p in (ckpt / "d").rglob("c/*/*") if p.is_file())
  assert len(chunks) == 8
  data = bytearray(chunks[5].read_bytes())
  data[3] ^= 0x40  # one flipped bit in the data of one chunk
  chunks[5].write_bytes(bytes(data))
  rc, out, err = cli("verify", "-q", ckpt)
  assert rc == 1
  assert "DAMAGED ['params']['w']" in out and "checksum mismatch" in out
  assert f"FAILED {ckpt}: 1 problem(s)." in out
  assert err == ""  # --quiet: no progress bar

  chunks[2].unlink()
  rc, out, err = cli("verify", "-q", ckpt)
  assert rc == 1
  damaged = [l for l in out.splitlines() if l.startswith("DAMAGED")]
  assert len(damaged) == 1 and "['params']['w']" in damaged[0]
  assert "missing data" in damaged[0] and "(and 1 more damaged chunk(s))" in damaged[0]


def test_verify_run_directory_and_uncommitted(run):
  rc, out, err = cli("verify", "-q", run)
  assert rc == 0, out
  assert "uncommitted steps [30]" in out and "2 of 2 checkpoints OK." in out
  rc, out, err = cli("verify", "-q", run / "30")
  assert rc == 1 and "interrupted save" in out


def test_diff(run, tmp_path):
  rc, out, err = cli("diff", run / "10", run / "20")
  assert rc == 0 and "same trees" in out, out + err
  rc, out, err = cli("diff", "--values", run / "10", run / "20")
  assert rc == 1
  assert "! ['params']['w']: values differ (6144 of 6144 elements differ)" in out
  assert "! ['step']: values differ (10 -> 20)" in out
  assert "['params']['b']" not in out  # equal values are not listed

  other = tmp_path / "other"
  state = train_state(10)
  w = np.array(state["params"]["w"])
  w[3, 7] = -1.0
  state["params"]["w"] = jax.device_put(w, state["params"]["w"].sharding)
  del state["params"]["b"]
  state["params"]["extra"] = np.zeros((2, 2), np.int8)
  state["key"] = jnp.zeros((3,), jnp.uint32)
  fnckpt.save(state, str(other), metadata={"step": 10, "metrics": {"loss": 0.75}}).wait()
  rc, out, err = cli("diff", "--values", run / "10", other)
  assert rc == 1
  lines = out.splitlines()
  assert lines[:2] == [f"--- {run / '10'}", f"+++ {other}"]
  assert "- ['params']['b']: array bfloat16[4]" in lines
  assert "+ ['params']['extra']: array int8[2, 2]" in lines
  assert "~ ['key']: key uint32[2] -> array uint32[3]" in lines
  assert "! ['params']['w']: values differ (1 of 6144 elements differ)" in lines
  assert len(lines) == 6, out


def test_in_process_single_checkpoint_and_missing_zarr_json(run, tmp_path, capsys):
  from fnckpt.cli import main
  assert main(["ls", str(run / "20")]) == 0
  out = capsys.readouterr().out
  assert "is a single checkpoint" in out and out.splitlines()[2].split()[:2] == [".", "committed"]

  ckpt = tmp_path / "20"
  shutil.copytree(run / "20", ckpt)
  (next((ckpt / "d").rglob("zarr.json"))).unlink()
  assert main(["verify", "-q", str(ckpt)]) == 1
  out = capsys.readouterr().out
  assert "DAMAGED ['params']['w']" in out and "cannot open its array" in out
