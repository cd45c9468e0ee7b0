"""Train a small decoder-only transformer language model, checkpointing with fnckpt.

A GPT-style model in Flax nnx (token and position embeddings, causal self-attention, MLP,
RMSNorm, tied or untied output layer) learns a generated character-level corpus (sentences
of a tiny grammar and sums such as ``12+7=19.``; nothing is downloaded) with Optax AdamW.
Parameters and optimizer state are sharded FSDP x TP over a ``(data, model)`` mesh: every
weight matrix is split over ``data`` along one dimension (FSDP) and over ``model`` along
the other (tensor parallelism: attention heads and MLP units); batches go over ``data``.

The checkpoint is the whole training state: parameters, AdamW state (``mu`` in bfloat16),
the step, the dropout PRNG key and the data iterator's position (epoch, batch within the
epoch, and the numpy Generator that shuffles the epoch). Stop it any way you like and run
the same command again: it resumes from the newest checkpoint, also on another mesh or
device count, and an interrupted run's losses equal an uninterrupted run's, bit for bit.

    python examples/lm.py --size tiny --devices 8 --mesh 2,4 --steps 200 --dir /tmp/lm
    python examples/lm.py --size tiny --devices 4 --mesh 2,2 --steps 300 --dir /tmp/lm  # resumes
    python examples/lm.py --size tiny --devices 2 --mesh 1,2 --dir /tmp/lm --eval
    fnckpt ls /tmp/lm

``--eval`` builds no optimizer: it reads the newest checkpoint's description
(``fnckpt.metadata``), turns it into a restore target on this job's mesh
(``fnckpt.target_from_metadata``), restores only the parameters and reports a held-out loss.

Sizes: ``tiny`` (20 K parameters; 60 arrays, 0.2 MiB checkpointed; for tests), ``small``
(0.83 M parameters; 111 arrays, 8 MiB; the default) and ``100m`` (104 M parameters; 300 arrays,
1 GiB). Each logged step prints ``step <n> loss <float>`` (the float's ``repr``: exact); the
last line is a JSON summary. ``--preempt-at-step K`` sends SIGTERM to itself after step K
(the manager saves at the next step boundary, waits for the commit and exits 0);
``--kill-at-step K`` SIGKILLs it. On GPUs/TPUs the mesh is built from ``jax.devices()`` and
``--devices`` is ignored.

A checkpoint every step: ``--local-dir /dev/shm/lm`` saves every step (``--local-every K``:
every K-th) to a fast local tier, and every ``--save-every``-th step also to ``--dir``; a
restart resumes from the newest valid step of either tier:

    python examples/lm.py --size small --local-dir /dev/shm/lm --save-every 50 --dir /tmp/lm

The pieces (``SIZES``, ``build``, ``TextBatches``, ``make_mesh``) are importable:
``bench/train_cost.py`` drives ``build(...).train_step`` to measure what saving costs training.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import re
import signal
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import fnckpt


# --- sizes ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Size:
  vocab: int          # padded vocabulary (the corpus uses 37 characters)
  d_model: int
  layers: int
  heads: int
  d_ff: int
  seq_len: int
  batch: int
  tied: bool          # output layer = the token embedding, transposed
  corpus_chars: int
  lr: float
  dropout: float = 0.1
  warmup: int = 20
  decay_steps: int = 5000


SIZES = {
    "tiny": Size(vocab=64, d_model=32, layers=2, heads=4, d_ff=64, seq_len=32, batch=8,
                 tied=True, corpus_chars=6_000, lr=3e-3),
    "small": Size(vocab=128, d_model=128, layers=4, heads=4, d_ff=512, seq_len=64, batch=16,
                  tied=False, corpus_chars=1_000_000, lr=1e-3),
    "100m": Size(vocab=256, d_model=768, layers=12, heads=12, d_ff=4096, seq_len=64, batch=8,
                 tied=True, corpus_chars=4_000_000, lr=3e-4),
}


# --- the corpus: a tiny grammar and sums, generated from a fixed seed ------------------------

NOUNS = "cat dog bird fish fox owl bee ant horse mouse".split()
VERBS = "sees chases likes finds follows hears".split()
ADJECTIVES = "small big red quick lazy old young green".split()


def make_corpus(chars: int, seed: int = 0) -> str:
  """Deterministic text: ``the quick fox sees a red bee.`` and ``17+25=42.``, seeded."""
  rng = np.random.default_rng(seed)
  n = chars // 20 + 1  # sentences average ~25 characters
  words = [rng.choice(w, n) for w in (ADJECTIVES, NOUNS, VERBS, ADJECTIVES, NOUNS)]
  a, b = rng.integers(0, 100, (2, n))
  is_sum = rng.random(n) < 0.4
  parts = [f"{x}+{y}={x + y}. " if s else f"the {w1} {w2} {w3} a {w4} {w5}. "
           for s, x, y, w1, w2, w3, w4, w5 in zip(is_sum, a, b, *words)]
  return "".join(parts)[:chars]


ALPHABET = sorted(set("".join(["the a .+=0123456789", *NOUNS, *VERBS, *ADJECTIVES])))


def encode(text: str, vocab: int) -> np.ndarray:
  """Characters -> token ids (positions in ``ALPHABET``; ids above it pad the vocabulary)."""
  if len(ALPHABET) > vocab:
    raise ValueError(f"a vocabulary of {vocab} cannot hold {len(ALPHABET)} characters")
  lookup = np.zeros(128, np.int32)
  lookup[[ord(c) for c in ALPHABET]] = np.arange(len(ALPHABET))
  return lookup[np.frombuffer(text.encode("ascii"), np.uint8)]


# --- the data iterator, whose position is part of the checkpoint ---------------------------

class TextBatches:
  """Batches of ``batch`` windows of ``seq_len + 1`` tokens, epoch after epoch.

  Each epoch draws a random offset and a random order of the windows from a numpy
  Generator. The position is three values, and they are what gets checkpointed:
  ``epoch``, ``position`` (batches taken in this epoch) and ``rng``, the Generator as it was
  *before* this epoch's draws. A resumed iterator redraws the same order and continues.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, state: dict[str, Any]):
    self.tokens, self.seq_len, self.batch = tokens, seq_len, batch
    self.windows = (len(tokens) - 1 - seq_len) // seq_len   # room for any offset < seq_len
    self.per_epoch = self.windows // batch
    self.epoch, self.position = state["epoch"], state["position"]
    self.rng = copy.deepcopy(state["rng"])
    self._draw()

  @staticmethod
  def initial_state(seed: int) -> dict[str, Any]:
    return {"epoch": 0, "position": 0, "rng": np.random.default_rng(seed)}

  def _draw(self) -> None:
    rng = copy.deepcopy(self.rng)
    self.offset = int(rng.integers(self.seq_len))
    self.order = rng.permutation(self.windows)
    self._rng_after = rng  # where the next epoch starts

  def state(self) -> dict[str, Any]:
    """The position, to save (a copy: the iterator goes on)."""
    return {"epoch": self.epoch, "position": self.position, "rng": copy.deepcopy(self.rng)}

  def __next__(self) -> np.ndarray:
    if self.position == self.per_epoch:
      self.epoch, self.position, self.rng = self.epoch + 1, 0, self._rng_after
      self._draw()
    picked = self.order[self.position * self.batch:(self.position + 1) * self.batch]
    starts = self.offset + picked * self.seq_len
    self.position += 1
    return self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]


# --- the model -----------------------------------------------------------------------------

class Attention(nnx.Module):
  def __init__(self, size: Size, rngs: nnx.Rngs):
    d = size.d_model
    self.heads = size.heads
    self.q, self.k, self.v, self.o = (nnx.Linear(d, d, use_bias=False, rngs=rngs)
                                      for _ in range(4))

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
    y = jax.nn.dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                     is_causal=True)
    return self.o(y.reshape(b, t, d))


class MLP(nnx.Module):
  def __init__(self, size: Size, rngs: nnx.Rngs):
    self.up = nnx.Linear(size.d_model, size.d_ff, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(size.d_ff, size.d_model, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); dropout on both."""

  def __init__(self, size: Size, rngs: nnx.Rngs):
    self.norm1 = nnx.RMSNorm(size.d_model, rngs=rngs)
    self.attn = Attention(size, rngs)
    self.norm2 = nnx.RMSNorm(size.d_model, rngs=rngs)
    self.mlp = MLP(size, rngs)
    self.drop = nnx.Dropout(size.dropout)

  def __call__(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
    keys = (None, None) if key is None else jax.random.split(key)
    x = x + self.drop(self.attn(self.norm1(x)), deterministic=key is None, rngs=keys[0])
    return x + self.drop(self.mlp(self.norm2(x)), deterministic=key is None, rngs=keys[1])


class LM(nnx.Module):
  def __init__(self, size: Size, rngs: nnx.Rngs):
    self.embed = nnx.Embed(size.vocab, size.d_model, rngs=rngs)
    self.pos = nnx.Embed(size.seq_len, size.d_model, rngs=rngs)
    self.blocks = nnx.List([Block(size, rngs) for _ in range(size.layers)])
    self.norm = nnx.RMSNorm(size.d_model, rngs=rngs)
    self.unembed = (None if size.tied else
                    nnx.Linear(size.d_model, size.vocab, use_bias=False, rngs=rngs))

  def __call__(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Logits for the next token at every position; ``key`` turns dropout on."""
    x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
    for i, block in enumerate(self.blocks):
      x = block(x, None if key is None else jax.random.fold_in(key, i))
    x = self.norm(x)
    return self.embed.attend(x) if self.unembed is None else self.unembed(x)


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# --- sharding: FSDP over 'data' x tensor parallelism over 'model' ---------------------------

# (regex on the key path, PartitionSpec); first match wins, anything else is replicated (norm
# scales, the step count, the PRNG key). The same rules serve the parameters and their AdamW
# moments, whose key paths end the same way.
SHARDING_RULES = (
    (r"\['embed'\]\['embedding'\]$", P("model", "data")),   # (vocab, d)
    (r"\['pos'\]\['embedding'\]$", P(None, "data")),        # (seq, d)
    (r"\['(q|k|v)'\]\['kernel'\]$", P("data", "model")),    # (d, heads * head_dim)
    (r"\['o'\]\['kernel'\]$", P("model", "data")),
    (r"\['up'\]\['kernel'\]$", P("data", "model")),         # (d, d_ff)
    (r"\['down'\]\['kernel'\]$", P("model", "data")),
    (r"\['unembed'\]\['kernel'\]$", P("data", "model")),    # (d, vocab)
)


def spec_for(keypath: str) -> P:
  """The PartitionSpec of the leaf at ``keypath`` (as ``jax.tree_util.keystr`` prints it)."""
  return next((spec for pattern, spec in SHARDING_RULES if re.search(pattern, keypath)), P())


def make_mesh(shape: tuple[int, int] | None, axis_types: str = "auto") -> Mesh:
  """A ('data', 'model') mesh over this job's devices (default: all on 'data'), with Auto axes
  (XLA propagates shardings) or Explicit ones (shardings are part of the types: ``jax.typeof``;
  what ``jax.make_mesh`` gives by default)."""
  devices = jax.devices()
  shape = shape or (len(devices), 1)
  if shape[0] * shape[1] != len(devices):
    raise SystemExit(f"--mesh {shape[0]},{shape[1]} needs {shape[0] * shape[1]} devices; this "
                     f"job has {len(devices)} ({devices[0].platform}).")
  kind = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
  return jax.make_mesh(shape, ("data", "model"), devices=devices,
                       axis_types=(kind[axis_types],) * 2)


# --- everything a training job needs, built for one size and one mesh ----------------------

@dataclasses.dataclass
class Run:
  size: Size
  mesh: Mesh
  init: Callable[[], dict[str, Any]]        # a fresh state: arrays on the mesh + step + data
  target: dict[str, Any]                    # what a checkpoint is restored into, on this mesh
  train_step: Callable                      # (arrays, tokens) -> (arrays, loss); donates arrays
  batches: Callable[[dict[str, Any]], TextBatches]
  tokens_sharding: NamedSharding


def build(size: Size, mesh: Mesh, seed: int = 0) -> Run:
  """The model, optimizer, shardings, jitted train step and data for ``size`` on ``mesh``."""
  graphdef = nnx.split(nnx.eval_shape(lambda: LM(size, nnx.Rngs(0))))[0]
  schedule = optax.warmup_cosine_decay_schedule(0.0, size.lr, size.warmup, size.decay_steps,
                                                end_value=size.lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, weight_decay=0.1, mu_dtype=jnp.bfloat16))

  def init_arrays() -> dict[str, Any]:
    params = nnx.to_pure_dict(nnx.split(LM(size, nnx.Rngs(seed)))[1])  # plain nested dicts
    return {"params": params, "opt_state": tx.init(params), "key": jax.random.key(seed + 1)}

  abstract = jax.eval_shape(init_arrays)
  shardings = jax.tree_util.tree_map_with_path(
      lambda path, _: NamedSharding(mesh, spec_for(jax.tree_util.keystr(path))), abstract)
  tokens = encode(make_corpus(size.corpus_chars), size.vocab)

  if jax.sharding.AxisType.Explicit in mesh.axis_types:  # shardings are part of the types
    init_on_mesh = jax.jit(lambda: jax.tree.map(jax.sharding.reshard, init_arrays(), shardings))
  else:
    init_on_mesh = jax.jit(init_arrays, out_shardings=shardings)

  def init() -> dict[str, Any]:
    return {**init_on_mesh(), "step": 0, "data": TextBatches.initial_state(seed + 2)}

  # What to restore into: shapes, dtypes and the shardings of *this* job's mesh (any mesh);
  # on Explicit axes jax.eval_shape gives shardings over an abstract mesh (no devices), which
  # restore places on this job's devices.
  target = {**jax.eval_shape(init_on_mesh), "step": 0, "data": TextBatches.initial_state(0)}

  def train_step(arrays: dict[str, Any], batch: jax.Array):
    key, dropout_key = jax.random.split(arrays["key"])

    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(batch[:, :-1], dropout_key)
      return next_token_loss(logits, batch[:, 1:])

    loss, grads = jax.value_and_grad(loss_fn)(arrays["params"])
    updates, opt_state = tx.update(grads, arrays["opt_state"], arrays["params"])
    params = optax.apply_updates(arrays["params"], updates)
    return {"params": params, "opt_state": opt_state, "key": key}, loss

  if jax.sharding.AxisType.Explicit in mesh.axis_types:  # the model's ops as on Auto axes
    train_step = jax.sharding.auto_axes(
        train_step, out_sharding=(shardings, NamedSharding(mesh, P())))
  train_step = jax.jit(train_step, out_shardings=(shardings, NamedSharding(mesh, P())),
                       donate_argnums=0)
  return Run(size, mesh, init, target, train_step,
             lambda state: TextBatches(tokens, size.seq_len, size.batch, state),
             NamedSharding(mesh, P("data", None)))


# --- helpers for the loop --------------------------------------------------------------------

def saved_mesh(meta: fnckpt.CheckpointMetadata) -> dict[str, int] | None:
  """The mesh a checkpoint was saved on, from its metadata (no array data read)."""
  arrays = [m for m in jax.tree.leaves(meta.tree) if isinstance(m, fnckpt.ArrayMetadata)]
  named = next((m.sharding for m in arrays if m.sharding and m.sharding.type == "named"), None)
  return dict(zip(named.axes, named.sizes)) if named else None


def params_digest(params: Any) -> str:
  """SHA-256 over every parameter's key path and bytes (the same on any mesh)."""
  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    digest.update(jax.tree_util.keystr(path).encode())
    digest.update(np.asarray(leaf).tobytes())
  return digest.hexdigest()


def checkpoint_size(meta: fnckpt.CheckpointMetadata) -> dict[str, int]:
  arrays = [m for m in jax.tree.leaves(meta.tree) if isinstance(m, fnckpt.ArrayMetadata)]
  return {"arrays": len(arrays), "bytes": sum(m.nbytes for m in arrays)}


def evaluate_newest(directory: str, size: Size, mesh: Mesh) -> dict[str, Any]:
  """Restore only the parameters of the newest checkpoint onto ``mesh`` (no optimizer built:
  the target comes from the checkpoint's metadata) and compute a held-out loss."""
  manager = fnckpt.CheckpointManager(directory)
  step = manager.latest_step()
  if step is None:
    raise SystemExit(f"--eval: no checkpoint in {directory}")
  path = manager.path(step)
  meta = fnckpt.metadata(path)
  target = fnckpt.target_from_metadata(meta, lambda keypath, _: spec_for(keypath), mesh=mesh)
  params = fnckpt.restore(path, {"params": target["params"]}, partial=True)["params"]
  graphdef = nnx.split(nnx.eval_shape(lambda: LM(size, nnx.Rngs(0))))[0]
  held_out = encode(make_corpus(20 * size.batch * (size.seq_len + 1), seed=1), size.vocab)
  batches = TextBatches(held_out, size.seq_len, size.batch, TextBatches.initial_state(0))
  loss_of = jax.jit(lambda p, b: next_token_loss(nnx.merge(graphdef, p)(b[:, :-1]), b[:, 1:]))
  tokens_sharding = NamedSharding(mesh, P("data", None))
  losses = [float(loss_of(params, jax.device_put(next(batches), tokens_sharding)))
            for _ in range(batches.per_epoch)]
  return {"eval_step": step, "saved_on": saved_mesh(meta), "eval_loss": float(np.mean(losses)),
          "params_sha256": params_digest(params)}


# --- the training job ------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--dir", default="/tmp/fnckpt-lm", help="checkpoint directory (any fnckpt "
                 "location: a path, gs://..., s3://...)")
  p.add_argument("--size", choices=sorted(SIZES), default="small")
  p.add_argument("--steps", type=int, default=300, help="train until this step (saved too)")
  p.add_argument("--save-every", type=int, default=50, help="checkpoint interval (steps)")
  p.add_argument("--keep", type=int, default=3, help="keep the newest K checkpoints")
  p.add_argument("--local-dir", default=None, help="a fast local tier (e.g. /dev/shm/lm): "
                 "every --local-every-th step is saved there, every --save-every-th also to "
                 "--dir (the durable tier)")
  p.add_argument("--local-every", type=int, default=1, help="with --local-dir: save to the "
                 "fast tier every K steps (default: every step)")
  p.add_argument("--devices", type=int, default=None,
                 help="number of simulated CPU devices (ignored on GPU/TPU)")
  p.add_argument("--mesh", default=None, help="mesh shape 'DATA,MODEL' (default: all devices "
                 "on the data axis)")
  p.add_argument("--axis-types", choices=("auto", "explicit"), default="auto",
                 help="the mesh's axis types (explicit: shardings in the types, as "
                 "jax.make_mesh gives by default)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
  p.add_argument("--eval", action="store_true", help="evaluate the newest checkpoint's "
                 "parameters on this mesh; no training")
  p.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL self after step K")
  p.add_argument("--preempt-at-step", type=int, default=None, help="SIGTERM self after step K")
  return p.parse_args(argv)


def resume_or_start(manager: fnckpt.CheckpointManager, run: Run,
                    local_dir: str | None = None) -> tuple[dict, int | None]:
  """The newest checkpoint (of either tier) restored onto this job's mesh, or a fresh
  state."""
  t0 = time.perf_counter()
  state, restored = manager.restore_or_init(run.init, target=run.target)
  if restored is None:
    print(f"no checkpoint in {manager.directory}: starting fresh", flush=True)
  else:
    path = manager.path(restored)
    try:
      meta = fnckpt.metadata(path)  # reads only the manifest
    except fnckpt.CheckpointError:  # a step only the fast tier holds
      path = f"{local_dir}/{restored}"
      meta = fnckpt.metadata(path)
    print(f"resumed from step {restored} ({path}), saved on mesh "
          f"{saved_mesh(meta)}, in {time.perf_counter() - t0:.2f}s", flush=True)
  return state, restored


def train(args: argparse.Namespace, run: Run) -> dict[str, Any]:
  """Train until ``args.steps``, saving every ``args.save_every`` steps, on SIGTERM and at
  the end; return the summary."""
  t0 = time.perf_counter()
  tier = {} if args.local_dir is None else {  # a fast tier in front of --dir
      "local_directory": args.local_dir, "local_save_interval_steps": args.local_every}
  manager = fnckpt.CheckpointManager(args.dir, max_to_keep=args.keep,
                                     save_interval_steps=args.save_every,
                                     handle_preemption=True,  # SIGTERM: save, then stop
                                     **tier)
  state, restored = resume_or_start(manager, run, args.local_dir)
  batches = run.batches(state["data"])
  arrays = {k: state[k] for k in ("params", "opt_state", "key")}
  step, loss, preempted, last_saved = state["step"], float("nan"), False, restored
  while step < args.steps:
    tokens = jax.device_put(next(batches), run.tokens_sharding)
    arrays, loss = run.train_step(arrays, tokens)
    step += 1  # the checkpoint's step = number of steps done
    if step % args.log_every == 0 or step == args.steps:
      print(f"step {step:6d} loss {float(loss)!r}", flush=True)
    if manager.should_save(step):  # on the interval, or the first step after a SIGTERM
      manager.save(step, {**arrays, "step": step, "data": batches.state()},
                   metrics={"loss": loss})
      last_saved = step
    if manager.reached_preemption(step):  # that save has committed
      print(f"preempted: step {step} is committed; run the same command to resume", flush=True)
      preempted = True
      break
    if args.kill_at_step == step:
      print(f"--kill-at-step {step}: SIGKILL now (its save may be half written)", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    if args.preempt_at_step == step:
      print(f"--preempt-at-step {step}: sending SIGTERM to self", flush=True)
      os.kill(os.getpid(), signal.SIGTERM)
  local_only = args.local_dir is not None and step % args.save_every != 0  # (not in --dir)
  if not preempted and (last_saved != step or local_only):  # the last step, durable too
    manager.save(step, {**arrays, "step": step, "data": batches.state()},
                 metrics={"loss": loss}, force=True)
  manager.close()  # waits until every save is committed
  return {"step": step, "preempted": preempted, "resumed_from": restored, "loss": float(loss),
          "params_sha256": params_digest(arrays["params"]), "steps_on_disk": manager.all_steps(),
          "checkpoint": checkpoint_size(fnckpt.metadata(manager.path(manager.latest_step()))),
          "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.devices:  # before JAX starts its CPU backend; only CPU devices are simulated
    jax.config.update("jax_num_cpu_devices", args.devices)
  mesh = make_mesh(tuple(int(n) for n in args.mesh.split(",")) if args.mesh else None,
                   args.axis_types)
  devices = jax.devices()
  print(f"mesh {dict(mesh.shape)} on {len(devices)} {devices[0].platform} device(s), "
        f"size {args.size}", flush=True)
  # Explicit axes: the mesh in context, as jax.sharding.reshard and jitted steps on it need
  with jax.set_mesh(mesh) if args.axis_types == "explicit" else contextlib.nullcontext():
    if args.eval:
      summary = evaluate_newest(args.dir, SIZES[args.size], mesh)
    else:
      summary = train(args, build(SIZES[args.size], mesh, args.seed))
  print(json.dumps(summary), flush=True)  # the last line: a JSON summary
  return 0


if __name__ == "__main__":
  sys.exit(main())
