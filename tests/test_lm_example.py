"""examples/lm.py at size tiny, run as subprocesses (simulated CPU devices): an interrupted run's
loss curve equals an uninterrupted one's bitwise; a run resumes on another mesh and device
count with the saved values and keeps training; --eval restores the parameters through
fnckpt.metadata -> target_from_metadata; the default size is as large as documented.
Then target_from_metadata itself, in this process (8 CPU devices, see conftest.py)."""

import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fnckpt
from fnckpt._restore.target import target_from_metadata  # exported as fnckpt.target_from_metadata
from tree_utils import assert_trees_all_equal

LM = Path(__file__).resolve().parent.parent / "examples" / "lm.py"
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
TINY = ["--size", "tiny", "--save-every", "8", "--keep", "3", "--log-every", "1"]
ON_8 = ["--devices", "8", "--mesh", "2,4"]
STEPS = 28


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """Runs of one mesh share compiled programs (each compiles in ~10 s on 2 busy cores)."""
  ENV["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax-cache"))
  yield
  del ENV["JAX_COMPILATION_CACHE_DIR"]


def lm(directory, *args):
  """Run the example; (returncode, losses {step: repr string}, JSON summary or None, log)."""
  r = subprocess.run([sys.executable, str(LM), "--dir", str(directory), *map(str, args)],
                     capture_output=True, text=True, env=ENV, timeout=300)
  losses = {int(s): v for s, v in re.findall(r"^step +(\d+) loss (\S+)$", r.stdout, re.M)}
  lines = r.stdout.strip().splitlines()
  summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
  return r.returncode, losses, summary, r.stdout + r.stderr


def digest(params) -> str:
  """What lm.params_digest computes, over host values."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    h.update(jax.tree_util.keystr(path).encode())
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
  """An uninterrupted run: 28 steps on a 2x4 mesh, saved at 8, 16, 24 and 28."""
  directory = tmp_path_factory.mktemp("lm") / "straight"
  rc, losses, summary, log = lm(directory, *TINY, *ON_8, "--steps", STEPS)
  assert rc == 0, log
  assert "starting fresh" in log and summary["resumed_from"] is None
  assert sorted(losses) == list(range(1, STEPS + 1)), log
  assert summary["steps_on_disk"] == [16, 24, 28]
  return directory, losses, summary


@pytest.mark.slow
def test_preempted_run_has_the_loss_curve_of_an_uninterrupted_one(straight, tmp_path):
  _, straight_losses, straight_summary = straight
  run = tmp_path / "interrupted"
  rc, first, summary, log = lm(run, *TINY, *ON_8, "--steps", STEPS, "--preempt-at-step", 10)
  assert rc == 0, log
  assert summary["preempted"] and summary["step"] == 11, log  # saved at the next boundary
  assert summary["steps_on_disk"] == [8, 11]

  rc, second, summary, log = lm(run, *TINY, *ON_8, "--steps", STEPS)
  assert rc == 0, log
  assert "resumed from step 11" in log and "saved on mesh {'data': 2, 'model': 4}" in log
  assert sorted(second) == list(range(12, STEPS + 1))  # crosses an epoch of the data (23 batches)
  assert {**first, **second} == straight_losses  # every loss, bit for bit (repr strings)
  assert summary["params_sha256"] == straight_summary["params_sha256"]


@pytest.mark.slow
def test_explicit_axes_resume_bitwise(tmp_path):
  """--axis-types explicit: the restore target is jax.eval_shape's, on an abstract mesh."""
  explicit = (*TINY, *ON_8, "--steps", STEPS, "--axis-types", "explicit")
  rc, straight_losses, straight_summary, log = lm(tmp_path / "straight", *explicit)
  assert rc == 0 and sorted(straight_losses) == list(range(1, STEPS + 1)), log
  run = tmp_path / "explicit"
  rc, first, summary, log = lm(run, *explicit, "--preempt-at-step", 10)
  assert rc == 0, log
  assert summary["preempted"] and summary["step"] == 11, log
  rc, second, summary, log = lm(run, *explicit)
  assert rc == 0, log
  assert "resumed from step 11" in log
  assert sorted(second) == list(range(12, STEPS + 1))
  assert {**first, **second} == straight_losses  # every loss, bit for bit
  assert summary["params_sha256"] == straight_summary["params_sha256"]


@pytest.mark.slow
def test_resumes_on_another_mesh_and_device_count(straight, tmp_path):
  directory, straight_losses, straight_summary = straight
  run = tmp_path / "moved"
  shutil.copytree(directory, run)
  with fnckpt.CheckpointManager(str(run)) as manager:
    manager.delete(28)  # resume from 24, so that steps 25-28 can be compared
  saved = fnckpt.restore(str(run / "24"))  # host values, as saved

  # --eval: parameters only, through fnckpt.metadata -> target_from_metadata, on 2 devices
  rc, _, evaluated, log = lm(run, "--size", "tiny", "--devices", 2, "--mesh", "1,2", "--eval")
  assert rc == 0, log
  assert evaluated["eval_step"] == 24 and evaluated["saved_on"] == {"data": 2, "model": 4}
  assert evaluated["params_sha256"] == digest(saved["params"])  # restored bitwise
  assert np.isfinite(evaluated["eval_loss"])

  # the whole state onto 4 devices as (2, 2), and training goes on from it
  rc, losses, summary, log = lm(run, *TINY, "--devices", 4, "--mesh", "2,2", "--steps", STEPS)
  assert rc == 0, log
  assert "mesh {'data': 2, 'model': 2} on 4 cpu device(s)" in log
  assert "resumed from step 24" in log and summary["resumed_from"] == 24
  assert sorted(losses) == list(range(25, STEPS + 1))
  # another mesh sums in another order: equal up to rounding, not bitwise (a wrong data
  # position, optimizer state or PRNG key would be off by far more)
  expected = [float(straight_losses[s]) for s in range(25, STEPS + 1)]
  np.testing.assert_allclose([float(losses[s]) for s in range(25, STEPS + 1)], expected,
                             rtol=1e-4)
  assert summary["steps_on_disk"] == [16, 24, 28]
  moved = fnckpt.restore(str(run / "28"))
  assert moved["step"] == 28 and digest(moved["params"]) != digest(saved["params"])


def test_default_size_is_a_real_checkpoint(tmp_path):
  """`small` (the default): at least 20 arrays and 5 MiB (step 0: initialised, saved, no step)."""
  rc, _, summary, log = lm(tmp_path / "small", "--devices", 2, "--mesh", "1,2", "--steps", 0)
  assert rc == 0, log
  assert "size small" in log and summary["steps_on_disk"] == [0]
  assert summary["checkpoint"]["arrays"] >= 20
  assert summary["checkpoint"]["bytes"] >= 5 << 20
  meta = fnckpt.metadata(str(tmp_path / "small" / "0"))
  assert meta.tree["data"]["epoch"] == 0 and meta.tree["step"] == 0
  assert meta.tree["key"].impl is not None  # the dropout key is a typed PRNG key


def test_another_device_count_than_the_mesh_is_refused(tmp_path):
  rc, _, _, log = lm(tmp_path, "--size", "tiny", "--devices", 4, "--mesh", "3,1")
  assert rc != 0 and "--mesh 3,1 needs 3 devices; this job has 4" in log


# --- target_from_metadata ------------------------------------------------------------------

Opt = collections.namedtuple("Opt", "count mu")


@pytest.fixture
def saved(tmp_path):
  """A checkpoint of every kind of leaf, saved on a (2, 4) mesh."""
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  tree = {"w": put(np.arange(512.0, dtype=np.float32).reshape(64, 8), "data", "model"),
          "b": put(np.arange(4, dtype=np.int32), "model"),
          "keys": put(jax.random.split(jax.random.key(0), 8), "data"),
          "key": jax.random.key(1, impl="rbg"),
          "opt": Opt(7, {"w": put(np.ones((64, 8), jax.numpy.bfloat16), ("data", "model"))}),
          "host": np.arange(6.0, dtype=np.float32).reshape(2, 3), "name": "run",
          "none": None, "empty": {}, "rng": np.random.default_rng(3)}
  path = str(tmp_path / "ckpt")
  fnckpt.save(tree, path).wait()
  return path


def test_target_keeps_the_saved_specs_on_another_mesh(saved):
  mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
  target = target_from_metadata(saved, mesh)  # a path: read with fnckpt.metadata
  assert target["w"] == jax.ShapeDtypeStruct((64, 8), np.float32,
                                             sharding=NamedSharding(mesh, P("data", "model")))
  assert target["opt"]["mu"]["w"].sharding.spec == P(("data", "model"))
  assert target["keys"].shape == (8,) and target["keys"].sharding.spec == P("data")
  assert jax.dtypes.issubdtype(target["key"].dtype, jax.dtypes.prng_key)
  assert str(target["key"].dtype) == "key<rbg>" and target["key"].shape == ()
  assert target["host"].sharding.spec == P()  # saved from numpy: replicated
  assert target["opt"]["count"] == 7 and target["name"] == "run" and target["none"] is None
  restored = fnckpt.restore(saved, target)
  assert_trees_all_equal(restored, fnckpt.restore(saved))  # every value, as saved
  for path, leaf in jax.tree_util.tree_leaves_with_path(target):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      got = restored
      for k in path:
        got = got[k.key]
      assert got.sharding == leaf.sharding, jax.tree_util.keystr(path)


def test_target_from_a_rule_or_one_sharding(saved):
  meta = fnckpt.metadata(saved)
  mesh = jax.make_mesh((8,), ("x",))
  seen = []

  def rule(keypath, array):
    seen.append(keypath)
    return P("x") if array.key_shape[:1] == (8,) or array.shape[:1] == (64,) else P()

  target = target_from_metadata(meta, rule, mesh=mesh)
  assert sorted(seen) == sorted(["['b']", "['host']", "['key']", "['keys']",
                                 "['opt']['mu']['w']", "['w']"])
  assert target["w"].sharding == NamedSharding(mesh, P("x"))
  assert target["keys"].sharding == NamedSharding(mesh, P("x"))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[3])
  restored = fnckpt.restore(saved, target_from_metadata(meta, one))
  assert restored["keys"].sharding == one and restored["w"].sharding == one
  assert_trees_all_equal(restored, fnckpt.restore(saved))


@pytest.mark.parametrize("sharding, mesh, error, match", [
    ("mesh x", None, ValueError, r"\['b'\] was saved as " + re.escape(str(P("model"))) +
     r" over mesh axes \('data', 'model'\); this mesh has axes \('x',\), not \['model'\]. "
     r"Pass a rule"),
    ("mesh 1x8", None, ValueError, r"\['b'\] of shape \(4,\) cannot be placed"),
    (lambda keypath, array: P(), None, TypeError, r"a PartitionSpec needs a mesh: pass mesh="),
    (lambda keypath, array: "data", "mesh x", TypeError, r"returned 'data' for \['b'\]"),
    ("one device", "mesh x", TypeError, r"mesh= goes with a rule"),
    ("mesh x", "mesh x", TypeError, r"pass the mesh once"),
    ("data", None, TypeError, r"got str"),
])
def test_target_errors_say_which_leaf_and_what_to_do(saved, sharding, mesh, error, match):
  given = {"mesh x": jax.make_mesh((8,), ("x",)),
           "mesh 1x8": jax.make_mesh((1, 8), ("data", "model")),
           "one device": jax.sharding.SingleDeviceSharding(jax.devices()[0])}
  with pytest.raises(error, match=match):
    target_from_metadata(fnckpt.metadata(saved), given.get(sharding, sharding),
                         mesh=given.get(mesh, mesh))


def test_a_checkpoint_every_step_into_a_local_tier(straight, tmp_path):
  """--local-dir: every step saved to the fast tier, every 8th (and the last) also durable;
  killed just after the save of step 13 is called, the run resumes from local step 13 (or 12,
  if 13 had not committed; not durable 8) and ends with the uninterrupted run's losses and
  parameters."""
  _, straight_losses, straight_summary = straight
  durable, local = tmp_path / "durable", tmp_path / "fast"
  args = [*TINY, *ON_8, "--local-dir", local]
  rc, first, _, log = lm(durable, *args, "--steps", STEPS, "--kill-at-step", 13)
  assert rc == -9, log
  rc, second, summary, log = lm(durable, *args, "--steps", STEPS)
  assert rc == 0, log
  resumed = int(re.search(r"resumed from step (\d+) \(.*/fast/", log).group(1))
  assert resumed in (12, 13), log
  assert {**first, **second} == straight_losses
  assert summary["params_sha256"] == straight_summary["params_sha256"]
  committed = lambda d: sorted(int(p.name) for p in d.iterdir() if (p / "COMMIT").exists())
  assert committed(durable) == [16, 24, 28]  # --keep 3
  assert committed(local) == [27, 28]  # the fast tier keeps its newest 2 (every step saved)
