"""Benchmark states: builders, shardings, restore targets (same mesh and a different one).

Three states, each defined as a flat list of leaves ``(key path, shape, dtype, spec_a, spec_b)``:

* ``transformer``: params + AdamW ``mu`` (bf16) / ``nu`` (fp32) of a decoder stack, leaves fully
  sharded, partially replicated and replicated on mesh A = (2, 4) ``('data', 'model')``;
  ``spec_b`` gives *different* PartitionSpecs for mesh B = (4, 2) (restore with resharding).
* ``small``: thousands of 4 KiB leaves (half replicated, half sharded 8 ways).
* ``mixed``: 2,000 leaves of 4 to 128 KiB (sizes cycling 4, 8, ..., 128 KiB; half replicated,
  half sharded 8 ways, each size in both halves).

Values come from an integer hash of the element index (cheap on 2 cores, not compressible to
nothing, identical for every run). :func:`fingerprint` is an exact integer checksum per leaf that
does not depend on the layout, so a restore on any mesh can be verified against the save.

Import only after ``jax.config.update('jax_num_cpu_devices', 8)`` (see ``runners.setup_jax``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_A = (2, 4)
MESH_B = (4, 2)
AXES = ("data", "model")

# (d_model, n_layers): bytes = (12 * n_layers + 4) * d_model**2 * 10  (fp32 p + bf16 mu + fp32 nu)
TRANSFORMER_SIZES = {
    "quick": (512, 8),      # ~250 MiB
    "full": (1024, 12),     # ~1.45 GiB
}
SMALL_SIZES = {
    "quick": (100, 20),     # 2000 leaves x 4 KiB
    "full": (100, 20),
}

MIXED_LEAVES = 2000
MIXED_KIB = (4, 8, 16, 32, 64, 128)       # float32 leaf sizes, cycling


@dataclasses.dataclass(frozen=True)
class Leaf:
  path: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: Any
  spec_a: P
  spec_b: P

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


def transformer_leaves(d_model: int, n_layers: int) -> list[Leaf]:
  d, v = d_model, 4 * d_model
  # name -> (shape, spec on mesh A, spec on mesh B); covers full / partial / no replication.
  layer = {
      "attn/qkv": ((d, 3 * d), P("data", "model"), P("model", "data")),    # sharded 8 -> 8
      "attn/out": ((d, d), P("model", "data"), P(None, "model")),           # 8 -> partial
      "attn/ln_scale": ((d,), P(), P("model")),                             # replicated -> sharded
      "mlp/wi": ((d, 4 * d), P(None, "model"), P("data", "model")),         # partial -> 8
      "mlp/bi": ((4 * d,), P("model"), P()),                                # partial -> replicated
      "mlp/wo": ((4 * d, d), P("model", None), P(None, "data")),           # partial -> partial
      "mlp/ln_scale": ((d,), P(), P()),                                     # replicated
  }
  params: list[tuple[tuple[str, ...], tuple[int, ...], P, P]] = [
      (("embed",), (v, d), P("model", "data"), P("data", "model")),
      (("final_ln", "scale"), (d,), P(), P()),
  ]
  for i in range(n_layers):
    for name, (shape, sa, sb) in layer.items():
      params.append((("layers", f"{i:02d}", *name.split("/")), shape, sa, sb))
  leaves = []
  for group, dtype in (("params", jnp.float32), ("mu", jnp.bfloat16), ("nu", jnp.float32)):
    prefix = ("params",) if group == "params" else ("opt_state", group)
    leaves += [Leaf(prefix + p, s, dtype, sa, sb) for p, s, sa, sb in params]
  leaves.append(Leaf(("opt_state", "count"), (), jnp.int32, P(), P()))
  leaves.append(Leaf(("step",), (), jnp.int32, P(), P()))
  return leaves


def small_leaves(n_blocks: int, per_block: int) -> list[Leaf]:
  leaves = []
  for b in range(n_blocks):
    for j in range(per_block):
      if j % 2:
        sa, sb = P(("data", "model")), P()
      else:
        sa, sb = P(), P("data")
      leaves.append(Leaf((f"block_{b:03d}", f"p{j:02d}"), (1024,), jnp.float32, sa, sb))
  return leaves


def mixed_leaves(n: int = MIXED_LEAVES, kib: tuple[int, ...] = MIXED_KIB) -> list[Leaf]:
  """``n`` float32 leaves, sizes cycling through ``kib``; replicated when ``i % 4 < 2``, else
  sharded 8 ways over both axes, so every size is in both halves (with a cycle of 6 sizes,
  ``i % 2`` would replicate only the 4, 16 and 64 KiB leaves). On mesh B: replicated ->
  ``P('data')``, sharded -> replicated (as in ``small``)."""
  leaves = []
  for i in range(n):
    if i % 4 < 2:
      sa, sb = P(), P("data")
    else:
      sa, sb = P(("data", "model")), P()
    shape = (kib[i % len(kib)] * 256,)
    leaves.append(Leaf((f"group_{i // 20:03d}", f"w{i % 20:02d}"), shape, jnp.float32, sa, sb))
  return leaves


STATES = ("transformer", "small", "mixed")


def leaves_for(name: str, mode: str) -> list[Leaf]:
  if name == "transformer":
    return transformer_leaves(*TRANSFORMER_SIZES[mode])
  if name == "small":
    return small_leaves(*SMALL_SIZES[mode])
  if name == "mixed":
    return mixed_leaves()
  raise ValueError(f"unknown state {name!r} ({', '.join(STATES)})")


def state_bytes(leaves: list[Leaf]) -> int:
  """Logical bytes (each array once, replicas not counted)."""
  return sum(l.nbytes for l in leaves)


def make_mesh(which: str) -> Mesh:
  shape = MESH_A if which == "a" else MESH_B
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, AXES)


def _nest(items: list[tuple[tuple[str, ...], Any]]) -> dict:
  out: dict = {}
  for path, value in items:
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = value
  return out


def _hash_values(seed: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
  """Deterministic pseudo-random values in [-0.05, 0.05) from a hash of the flat index."""
  if not shape:
    return seed.astype(dtype)
  idx = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for ax in reversed(range(len(shape))):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(stride)
    stride *= shape[ax]
  x = idx ^ (seed * jnp.uint32(0x9E3779B9))
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  x = x ^ (x >> 16)
  if jnp.issubdtype(dtype, jnp.integer):
    return (x >> 8).astype(dtype)
  f = (x >> 8).astype(jnp.float32) * jnp.float32(2.0**-24) - jnp.float32(0.5)
  return (f * jnp.float32(0.1)).astype(dtype)


def build(leaves: list[Leaf], mesh: Mesh) -> dict:
  """The state on ``mesh`` (specs ``spec_a``), generated directly on the devices."""
  fns: dict = {}
  items = []
  for seed, leaf in enumerate(leaves):
    sharding = NamedSharding(mesh, leaf.spec_a)
    key = (leaf.shape, jnp.dtype(leaf.dtype), sharding)
    if key not in fns:
      fns[key] = jax.jit(lambda s, shape=leaf.shape, dtype=leaf.dtype: _hash_values(s, shape, dtype),
                         out_shardings=sharding)
    items.append((leaf.path, fns[key](np.uint32(seed))))
  tree = _nest(items)
  jax.block_until_ready(tree)
  return tree


def target(leaves: list[Leaf], mesh: Mesh, which: str) -> dict:
  """ShapeDtypeStructs with shardings: ``which='a'`` the saved specs, ``'b'`` the other ones."""
  return _nest([(l.path, jax.ShapeDtypeStruct(l.shape, l.dtype, sharding=NamedSharding(
      mesh, l.spec_a if which == "a" else l.spec_b))) for l in leaves])


def at(tree: dict, leaf: Leaf) -> Any:
  """The value at ``leaf``'s key path in a tree built by :func:`build` (or :func:`target`)."""
  for k in leaf.path:
    tree = tree[k]
  return tree


def raw_arrays(leaves: list[Leaf], tree: dict, mesh: Mesh) -> list:
  """``[(name, host numpy array, chunk = its shard on the saved mesh)]``: the state as raw
  TensorStore writes it (``limits.tensorstore_rw``)."""
  return [(".".join(l.path), np.asarray(jax.device_get(at(tree, l))),
           tuple(NamedSharding(mesh, l.spec_a).shard_shape(l.shape))) for l in leaves]


_PRIMES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)


def _shard_checksum(data: np.ndarray, index: tuple) -> np.ndarray:
  """(sum of bits, coordinate-weighted sum of bits) mod 2**64 of one shard, global coordinates."""
  bits = data.view(np.dtype(f"u{data.dtype.itemsize}")) if data.dtype.itemsize in (1, 2, 4, 8) \
      else data.astype(np.uint64)
  bits = bits.astype(np.uint64)
  w = np.ones(data.shape, np.uint64)
  for ax, (sl, n) in enumerate(zip(index, data.shape)):
    start = sl.start or 0
    coord = np.arange(start, start + n, dtype=np.uint64) + np.uint64(1)
    shape = [1] * data.ndim
    shape[ax] = n
    w = w + coord.reshape(shape) * np.uint64(_PRIMES[ax % 4])
  with np.errstate(over="ignore"):
    return np.array([bits.sum(dtype=np.uint64), (bits * w).sum(dtype=np.uint64)], np.uint64)


def fingerprint(tree: dict) -> dict[str, list[int]]:
  """Exact, layout-independent checksum per leaf, computed per shard on the host.

  (No jitted reductions: XLA:CPU collectives across 8 virtual devices on 2 cores can deadlock.)
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  out = {}
  for path, x in flat:
    total = np.zeros(2, np.uint64)
    for shard in x.addressable_shards:
      if shard.replica_id == 0:
        with np.errstate(over="ignore"):
          total = total + _shard_checksum(np.asarray(shard.data), shard.index)
    out[jax.tree_util.keystr(path)] = [int(v) for v in total]
  return out
