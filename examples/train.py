"""Train a small Flax (nnx) + Optax model on synthetic data, checkpointing with fnckpt.

Run it, interrupt it any way you like (Ctrl-C, ``kill``, ``kill -9``, a preempted VM), and run
the same command again: it resumes from the newest committed checkpoint and ends with exactly
the parameters an uninterrupted run ends with (bitwise), because the whole training state is
checkpointed: parameters, optimizer state, step, PRNG key and the data position (the numpy
Generator that makes the batches).

    python examples/train.py --dir /tmp/fnckpt-run --steps 300 --devices 8 --mesh 2,4
    fnckpt ls /tmp/fnckpt-run

Flags for tests: ``--kill-at-step K`` SIGKILLs the process right after step K (its save may
be half written), ``--preempt-at-step K`` sends it SIGTERM (it then saves at the next step
boundary, waits for the commit and exits 0). The last line printed is a JSON summary.

The mesh is built from ``jax.devices()``, so the same script runs on GPUs/TPUs: there
``--devices`` (the number of simulated CPU devices) is ignored. Batches are sharded over the
``data`` axis, the hidden layer over the ``model`` axis (NamedSharding).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

D_IN, HIDDEN, D_OUT, BATCH = 16, 64, 1, 32


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--dir", default="/tmp/fnckpt-train", help="checkpoint directory (any fnckpt "
                 "location: a path, gs://..., s3://...)")
  p.add_argument("--steps", type=int, default=300, help="train until this many steps are done")
  p.add_argument("--save-every", type=int, default=25, help="checkpoint interval (steps)")
  p.add_argument("--keep", type=int, default=3, help="keep the newest K checkpoints")
  p.add_argument("--devices", type=int, default=None,
                 help="number of simulated CPU devices (jax_num_cpu_devices)")
  p.add_argument("--mesh", default=None, help="mesh shape 'DATA,MODEL' (default: all devices "
                 "on the data axis)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL self after step K")
  p.add_argument("--preempt-at-step", type=int, default=None, help="SIGTERM self after step K")
  p.add_argument("--quiet", action="store_true", help="print only the summary")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  if args.devices:  # must happen before JAX starts its CPU backend
    jax.config.update("jax_num_cpu_devices", args.devices)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  import fnckpt

  say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))

  # --- the mesh: from whatever devices this job has -----------------------------------------
  devices = jax.devices()
  if args.mesh:
    shape = tuple(int(n) for n in args.mesh.split(","))
  else:
    shape = (len(devices), 1)
  if len(shape) != 2 or shape[0] * shape[1] != len(devices):
    sys.exit(f"--mesh {args.mesh} needs {shape[0] * shape[1]} devices; this job has "
             f"{len(devices)} ({devices[0].platform}).")
  mesh = jax.make_mesh(shape, ("data", "model"), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)  # XLA propagates shardings
  say(f"mesh {dict(mesh.shape)} on {len(devices)} {devices[0].platform} device(s)")

  # --- the model, the optimizer and how their arrays are sharded ------------------------------
  class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.l1 = nnx.Linear(D_IN, HIDDEN, rngs=rngs)
      self.l2 = nnx.Linear(HIDDEN, D_OUT, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  graphdef, _ = nnx.split(nnx.eval_shape(lambda: MLP(nnx.Rngs(0))), nnx.Param)
  tx = optax.adam(args.lr)

  def spec(path, leaf) -> P:
    """Hidden units over 'model' (for params and the matching Adam moments alike)."""
    del leaf
    name = jax.tree_util.keystr(path)
    if "['l1']['kernel']" in name:
      return P(None, "model")
    if "['l1']['bias']" in name:
      return P("model")
    if "['l2']['kernel']" in name:
      return P("model", None)
    return P()

  def init_arrays():
    _, params = nnx.split(MLP(nnx.Rngs(args.seed)), nnx.Param)
    return {"params": params, "opt_state": tx.init(params),
            "key": jax.random.key(args.seed + 1)}

  abstract = jax.eval_shape(init_arrays)
  shardings = jax.tree_util.tree_map_with_path(
      lambda path, leaf: NamedSharding(mesh, spec(path, leaf)), abstract)
  batch_sharding = NamedSharding(mesh, P("data", None))

  def fresh_state():
    arrays = jax.jit(init_arrays, out_shardings=shardings)()
    return {**arrays, "step": 0, "data": np.random.default_rng(args.seed + 2)}

  # What to restore into: shapes, dtypes and the shardings of *this* job's mesh.
  target = {**jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                           abstract, shardings),
            "step": 0, "data": np.random.default_rng()}

  teacher = np.random.default_rng(12345).normal(size=(D_IN, D_OUT)).astype(np.float32)

  def next_batch(rng: np.random.Generator):
    """Synthetic regression data; the Generator's state is the data position."""
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = np.tanh(x @ teacher) + 0.05 * rng.normal(size=(BATCH, D_OUT)).astype(np.float32)
    return (jax.device_put(x, batch_sharding), jax.device_put(y, batch_sharding))

  def train_step(arrays, x, y):
    key, noise_key = jax.random.split(arrays["key"])
    x = x + 0.01 * jax.random.normal(noise_key, x.shape)  # input noise: uses the PRNG key

    def loss_fn(params):
      return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(arrays["params"])
    updates, opt_state = tx.update(grads, arrays["opt_state"], arrays["params"])
    params = optax.apply_updates(arrays["params"], updates)
    return {"params": params, "opt_state": opt_state, "key": key}, loss

  train_step = jax.jit(train_step, out_shardings=(shardings, NamedSharding(mesh, P())),
                       donate_argnums=0)

  # --- checkpointing: resume if a checkpoint exists, save every N steps and on SIGTERM -------
  t0 = time.perf_counter()
  manager = fnckpt.CheckpointManager(args.dir, max_to_keep=args.keep,
                                     save_interval_steps=args.save_every,
                                     handle_preemption=True)
  state, restored = manager.restore_or_init(fresh_state, target=target)
  if restored is None:
    say(f"no checkpoint in {manager.directory}: starting fresh")
  else:
    say(f"resumed from step {restored} ({manager.path(restored)}) in "
        f"{time.perf_counter() - t0:.2f}s")

  loss = float("nan")
  preempted = False
  last_saved = restored
  for step in range(state["step"], args.steps):
    x, y = next_batch(state["data"])
    arrays, loss = train_step({k: state[k] for k in ("params", "opt_state", "key")}, x, y)
    state = {**arrays, "step": step + 1, "data": state["data"]}
    done = step + 1  # the checkpoint's step = number of steps done
    if manager.should_save(done):
      manager.save(done, state, metrics={"loss": loss})
      last_saved = done
      say(f"step {done:5d}  loss {float(loss):.5f}  saving")
    elif done % 10 == 0:
      say(f"step {done:5d}  loss {float(loss):.5f}")
    if manager.reached_preemption(done):
      say(f"preempted: step {done} is committed; run the same command to resume")
      preempted = True
      break
    if args.kill_at_step == done:
      say(f"--kill-at-step {done}: SIGKILL now (the save above may be half written)")
      os.kill(os.getpid(), signal.SIGKILL)
    if args.preempt_at_step == done:
      say(f"--preempt-at-step {done}: sending SIGTERM to self")
      os.kill(os.getpid(), signal.SIGTERM)

  if not preempted and last_saved != state["step"]:
    manager.save(state["step"], state, metrics={"loss": loss}, force=True)
    say(f"step {state['step']:5d}  final save")
  manager.close()  # waits until every save is committed

  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(state["params"])[0]:
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(np.asarray(leaf).tobytes())
  print(json.dumps({"step": state["step"], "preempted": preempted, "resumed_from": restored,
                    "loss": float(loss), "params_sha256": digest.hexdigest(),
                    "steps_on_disk": manager.all_steps(),
                    "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
