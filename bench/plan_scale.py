"""What planning a save and a restore costs each process at scale, simulated without devices.

    python bench/plan_scale.py --processes 4096 --devices-per-process 8 --json /tmp/plan.json
    python bench/plan_scale.py --processes 64 --devices-per-process 8 --tp-only-embeddings
    python bench/plan_scale.py --processes 4096 --replica-groups 2 4 8 16 32 --broadcast-only

``--replica-groups R ...``: storage bytes each process reads to restore the state onto a
(R, P * D / (8 R), 8) mesh ("replica", "data", "model"; the specs above, replicated over
"replica": R data-parallel replica groups), without broadcast (each process reads every
byte its devices hold: the job reads the state R times) and with it (``_layout.spread``'s
reader layouts: once, 1/R per process), for every process, with the time to plan one
process's reader layouts. ``--broadcast-only`` skips the save/restore planning figures.

The state is 70B-like (Llama-2-70B sizes with fused projections): d_model 8192, 80 layers,
each with ``wqkv`` (8192, 10240), ``wo`` (8192, 8192), ``w13`` (8192, 57344), ``w2``
(28672, 8192) and two norm scales (8192,); plus ``embed`` (32000, 8192), a final norm and
``lm_head`` (8192, 32000): 483 parameters. The training state is params (float32), AdamW
``mu`` (bfloat16) and ``nu`` (float32): 1,449 leaves, 690 GB. The mesh is
(P * D / 8, 8) with axes ("data", "model"): every matrix FSDP x TP (``P("data", "model")``
for wqkv, w13, lm_head; ``P("model", "data")`` for wo, w2, embed), norms replicated (``P()``).
With ``--tp-only-embeddings``, embed and lm_head are sharded over "model" only and replicated
over "data" (32 to 125 MiB shards held by P * D / 8 replicas: the replica-parallel split).
The restore goes onto a (P * D / 4, 4) mesh (TP 4 instead of 8) with the same specs.

Process ``p`` holds the devices at flat mesh positions ``p * D .. p * D + D - 1`` (as
``jax.make_mesh`` lays out hosts). For a sample of processes (the first, the last and 3
drawn with seed 0) it runs fnckpt's own planner: ``_layout.plan_write`` per leaf (the leaf
index as salt) and ``_layout.plan_read``, given ``ShardingInfo`` records (what the adapter
builds from a JAX ``NamedSharding``, here built from the simulated mesh), with the same
caches a real process has. They start empty for each process (a first save); a second pass
is the steady state of a training loop. ``bytes_max_over_mean`` is over *all* processes: bytes of
unreplicated leaves are the same on every process (each device writes its shard); the pieces
of replicated leaves are assigned by the planner's rule for every shard, and the result is
checked against the planned bytes of every sampled process. Times are the best of 3 runs (on a
shared machine), and the figure reported is the slowest sampled process.

"Before": the generic path that planning used for every leaf (``write_plan`` over the map of
every device to its shard index, with ``replica_count``), timed on a few leaves with a
synthetic full map and extrapolated to all leaves. Building the map is timed apart and
counted once per distinct (sharding, shape), since JAX caches ``devices_indices_map`` (whose
real cost is higher than this synthetic one's). The old restore plan filtered that same
global map (``addressable_devices_indices_map``): its "before" is the map builds alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from fnckpt._layout import chunks as _layout, packing as _packing, pieces as _pieces  # noqa: E402

INLINE_BYTES = 16 << 10          # fnckpt._save.options.INLINE_BYTES (imported there with jax)

# dim_axes of the specs on mesh axes ("data", "model")
DATA, MODEL, REPLICATED = ((0,), (1,)), ((1,), (0,)), ()
D_MODEL, LAYERS, FFN, QKV, VOCAB = 8192, 80, 28672, 10240, 32000
MiB = 1 << 20


def leaves(tp_only_embeddings: bool = False) -> list[tuple[str, tuple[int, ...], int, Any]]:
  """(name, shape, itemsize, dim_axes) of every leaf: params, mu, nu."""
  embed_spec, head_spec = (((1,),), ((), (1,))) if tp_only_embeddings else (MODEL, DATA)
  params = [("embed", (VOCAB, D_MODEL), embed_spec)]
  for i in range(LAYERS):
    params += [(f"l{i}.attn_norm", (D_MODEL,), REPLICATED),
               (f"l{i}.wqkv", (D_MODEL, QKV), DATA), (f"l{i}.wo", (D_MODEL, D_MODEL), MODEL),
               (f"l{i}.mlp_norm", (D_MODEL,), REPLICATED),
               (f"l{i}.w13", (D_MODEL, 2 * FFN), DATA), (f"l{i}.w2", (FFN, D_MODEL), MODEL)]
  params += [("final_norm", (D_MODEL,), REPLICATED), ("lm_head", (D_MODEL, VOCAB), head_spec)]
  return [(f"{part}/{name}", shape, itemsize, spec)
          for part, itemsize in (("params", 4), ("mu", 2), ("nu", 4))
          for name, shape, spec in params]


def info_for(mesh: tuple[int, ...], spec, process: int, per: int) -> _layout.ShardingInfo:
  """What the adapter would build in process ``process`` (devices: flat mesh positions)."""
  ids = range(process * per, (process + 1) * per)
  coords = tuple(zip(*(c.tolist() for c in np.unravel_index(list(ids), mesh))))
  return _layout.ShardingInfo(mesh, spec, tuple(ids), coords)


def classify(state, mesh) -> list[str]:
  """How save stores each leaf, by its rules: replicated on every device (so every process
  sees it whole) and small: "inline" or "pack"; a non-empty shard of at most PIECE_BYTES:
  "pieces"; else "store" (a zarr array, one object per write chunk)."""
  kinds = []
  for _, shape, itemsize, spec in state:
    info = _layout.ShardingInfo(mesh, spec)
    size = _layout.nbytes(shape, itemsize)
    whole = info.replicas == math.prod(mesh)
    shard = _layout.nbytes(_layout.shard_shape_of(info, shape), itemsize)
    kinds.append("inline" if whole and size <= INLINE_BYTES else
                 "pack" if whole and size <= _packing.PACK_LEAF_BYTES else
                 "pieces" if 0 < shard <= _pieces.PIECE_BYTES else "store")
  return kinds


def plan_save(state, mesh, process: int, per: int, procs: np.ndarray
              ) -> tuple[float, list[list[_layout.WriteUnit]], dict[str, Any]]:
  """One process's save plan, as ``fnckpt._save.plan.plan`` makes it: ``plan_write`` per stored leaf
  (salt = leaf index); the pieces layout of every process (``_pieces.build``, O(devices) per
  distinct structure) and this process's chunks of each pieced leaf (``local_writes``); every
  process's pack (``_packing.assign``). The time includes building the ShardingInfo records,
  as the adapter would once per sharding. Returns (seconds, stored units per leaf, packs)."""
  t0 = time.perf_counter()
  infos: dict[Any, _layout.ShardingInfo] = {}
  plans, pieced, items = [], [], []
  for i, ((_, shape, itemsize, spec), kind) in enumerate(zip(state, classify(state, mesh))):
    info = infos.get(spec) or infos.setdefault(spec, info_for(mesh, spec, process, per))
    plans.append([])
    if kind == "pack":
      items.append(_packing.PackItem(i, _layout.nbytes(shape, itemsize), None))
    elif kind == "pieces":
      shard = _layout.shard_shape_of(info, shape)
      dim_axes = spec + ((),) * (len(shape) - len(spec))
      pieced.append((info, shape, _pieces.PieceLeaf(
          i, 0, mesh, dim_axes, _pieces.shift_of(i, mesh, dim_axes), shard,
          _layout.nbytes(shard, itemsize))))
    elif kind == "store":
      plans[-1] = _layout.plan_write(info, shape, itemsize, salt=i)[1]
  layout = _pieces.build([procs], [p for _, _, p in pieced], len(procs) // per)
  regions = {int(p): int(layout.region[p]) for p in np.flatnonzero(layout.region)}
  packs = _packing.assign(items, len(procs) // per, extra=regions,
                          chunk_bytes=_pieces.PACK_CHUNK_BYTES if regions else
                          _packing.PACK_CHUNK_BYTES)
  for info, shape, leaf in pieced:  # what _piece_writes.Planner.parts checks and stages
    chunk, units = _layout.plan_write(info, shape, state[leaf.index][2], salt=leaf.index)
    assert chunk == leaf.chunk and len(units) == len(layout.mine(leaf.index, process)[0])
  return time.perf_counter() - t0, plans, packs.sizes


def plan_restore(state, mesh, process: int, per: int, saved_mesh=None, procs=None
                 ) -> tuple[float, int]:
  """One process's restore plan: ``plan_read`` per leaf; with ``saved_mesh``, also what
  reading pieced leaves adds: the pieces layout a reader builds when it parses the manifest,
  and, for each slice, the chunks it intersects located in their writers' packs (what
  ``_piece_reads.SliceReader.parts`` computes before any I/O)."""
  t0 = time.perf_counter()
  infos: dict[Any, _layout.ShardingInfo] = {}
  slices = 0
  pieced = {}
  if saved_mesh is not None:
    kinds = classify(state, saved_mesh)
    leaves = []
    for i, ((_, shape, itemsize, spec), kind) in enumerate(zip(state, kinds)):
      if kind == "pieces":
        shard = _layout.shard_shape_of(_layout.ShardingInfo(saved_mesh, spec), shape)
        dim_axes = spec + ((),) * (len(shape) - len(spec))
        leaves.append(_pieces.PieceLeaf(i, 0, saved_mesh, dim_axes, _pieces.shift_of(
            i, saved_mesh, dim_axes), shard, _layout.nbytes(shard, itemsize)))
    layout = _pieces.build([procs], leaves, len(procs) // per)
    pieced = {leaf.index: leaf for leaf in leaves}
  for i, (_, shape, _, spec) in enumerate(state):
    info = infos.get(spec) or infos.setdefault(spec, info_for(mesh, spec, process, per))
    plan = _layout.plan_read(info, shape)
    slices += len(plan)
    leaf = pieced.get(i)
    if leaf is not None:
      for index in plan:
        blocks = [range(a // c, -(-b // c)) for (a, b), c in zip(index, leaf.chunk)]
        cells = np.array(list(itertools.product(*blocks))).T
        layout.locate(i, np.ravel_multi_index(tuple(cells), leaf.grid))
  return time.perf_counter() - t0, slices


def _owner(mesh, spec, block: tuple[int, ...], replica: int, per: int) -> int:
  """The process holding the device with this shard block and replica number."""
  coord = [0] * len(mesh)
  for axes, b in zip(spec, block):
    for a in reversed(axes):
      coord[a], b = b % mesh[a], b // mesh[a]
  for a in reversed(_layout.ShardingInfo(mesh, spec).unused_axes):
    coord[a], replica = replica % mesh[a], replica // mesh[a]
  return int(np.ravel_multi_index(coord, mesh)) // per


def bytes_per_process(state, mesh, processes: int, per: int, packs) -> np.ndarray:
  """Bytes each process writes, for all processes, by the planner's assignment rule: its
  pack (``packs``: process -> (nbytes, chunk, inner)) and the chunks of stored leaves."""
  out = np.zeros(processes, np.int64)
  for p, (nbytes, _, _) in packs.items():
    out[p] += nbytes
  for salt, ((_, shape, itemsize, spec), kind) in enumerate(zip(state, classify(state, mesh))):
    if kind != "store":
      continue
    info = _layout.ShardingInfo(mesh, spec)
    shard = _layout.shard_shape_of(info, shape)
    if info.replicas == 1:
      out += per * _layout.nbytes(shard, itemsize)
      continue
    layout = _layout.write_layout(info, shape, itemsize)
    blocks = [n // s for n, s in zip(shape, shard)]
    for block in np.ndindex(*blocks):
      index = tuple((b * s, b * s + s) for b, s in zip(block, shard))
      cells = _layout._chunks_of(index, layout.chunk)
      if not cells:
        continue
      start = _layout._spread(salt) + _layout._cell_number(cells[0], layout.chunk, shape)
      stride = max(1, info.replicas // len(cells))
      for p, cell in enumerate(cells):
        replica = (start + p * stride) % info.replicas
        out[_owner(mesh, spec, block, replica, per)] += _layout.nbytes(
            [b - a for a, b in cell], itemsize)
  return out


def old_plan_per_leaf(state, mesh, per: int, sample: list[int]) -> tuple[float, float]:
  """Seconds of the generic O(all devices) path, for process 0: (building the map of every
  device to its shard index, planning one leaf from it), averaged over the leaves sampled."""
  build = plan = 0.0
  n = math.prod(mesh)
  for i in sample:
    _, shape, itemsize, spec = state[i]
    info = _layout.ShardingInfo(mesh, spec)
    t0 = time.perf_counter()
    shard = _layout.shard_shape_of(info, shape)
    full = {d: _layout.shard_index(info, np.unravel_index(d, mesh), shard) for d in range(n)}
    t1 = time.perf_counter()
    chunk = _layout.chunk_shape(shard, _layout.replica_count(full), itemsize)
    _layout.write_plan(full, range(per), chunk, salt=i)
    t2 = time.perf_counter()
    build, plan = build + t1 - t0, plan + t2 - t1
  return build / len(sample), plan / len(sample)


def sample_processes(processes: int, k: int = 3, seed: int = 0) -> list[int]:
  rest = list(range(1, processes - 1))
  return sorted({0, processes - 1, *random.Random(seed).sample(rest, min(k, len(rest)))})


def measure_process(state, save_mesh, restore_mesh, p: int, per: int, totals: np.ndarray,
                    procs: np.ndarray, repeats: int = 3) -> dict[str, Any]:
  """Plan a first save, a steady-state save and a restore in process ``p``; each time is the
  best of ``repeats`` (the machine may be shared)."""
  cold, warm, restore_s = [], [], []
  for _ in range(repeats):
    _layout.clear_plan_caches()  # a first save: nothing cached
    t, plans, packs = plan_save(state, save_mesh, p, per, procs)
    cold.append(t)
    warm.append(plan_save(state, save_mesh, p, per, procs)[0])  # the next saves of the loop
    _layout.clear_plan_caches()
    t, slices = plan_restore(state, restore_mesh, p, per, save_mesh, procs)
    restore_s.append(t)
  sizes = [(_layout.nbytes([b - a for a, b in u.index], itemsize),
            _layout.nbytes(shape, itemsize))
           for (_, shape, itemsize, _), units in zip(state, plans) for u in units]
  if p in packs:  # the pack's chunk files (counted small only if the whole pack is larger)
    nbytes, chunk, _ = packs[p]
    sizes += [(min(chunk, nbytes - a), nbytes) for a in range(0, nbytes, chunk)]
  assert sum(n for n, _ in sizes) == totals[p], (p, totals[p])  # the all-process figure
  return {"save_s": min(cold), "warm_s": min(warm), "restore_s": min(restore_s),
          "slices": slices, "objects": len(sizes), "min_object": min(n for n, _ in sizes),
          "small_objects": sum(1 for n, leaf in sizes if n < MiB <= leaf)}


def run(processes: int, per: int, tp_only_embeddings: bool = False,
        old_leaves: int = 6) -> dict[str, Any]:
  if processes * per % 8:
    raise SystemExit("processes x devices-per-process must be a multiple of 8")
  state = leaves(tp_only_embeddings)
  save_mesh, restore_mesh = (processes * per // 8, 8), (processes * per // 4, 4)
  sample = sample_processes(processes)
  procs = np.arange(processes * per) // per   # the process of each mesh position
  packs = plan_save(state, save_mesh, 0, per, procs)[2]
  totals = bytes_per_process(state, save_mesh, processes, per, packs)
  m = [measure_process(state, save_mesh, restore_mesh, p, per, totals, procs) for p in sample]
  worst = {k: max(r[k] for r in m) for k in m[0]}
  which = [i * len(state) // old_leaves for i in range(old_leaves)]
  build, plan = old_plan_per_leaf(state, save_mesh, per, which)
  distinct = len({(shape, spec) for _, shape, _, spec in state})
  return {
      "processes": processes, "devices_per_process": per, "leaves": len(state),
      "smallest_leaf_bytes": min(_layout.nbytes(s, i) for _, s, i, _ in state),
      "state_bytes": sum(_layout.nbytes(s, i) for _, s, i, _ in state),
      "tp_only_embeddings": tp_only_embeddings, "sampled_processes": sample,
      "storage": {k: classify(state, save_mesh).count(k)
                  for k in ("inline", "pack", "pieces", "store")},
      "save": {"mesh": list(save_mesh), "plan_s_per_process": worst["save_s"],
               "plan_s_per_process_steady": worst["warm_s"],
               "objects_per_process_max": worst["objects"],
               "min_object_bytes": min(r["min_object"] for r in m),
               "objects_under_1MiB_of_leaves_over_1MiB_max": worst["small_objects"],
               "bytes_per_process_mean": float(totals.mean()),
               "bytes_max_over_mean": float(totals.max() / totals.mean()),
               "bytes_max_over_mean_of": "all processes"},
      "restore": {"mesh": list(restore_mesh), "plan_s_per_process": worst["restore_s"],
                  "slices_per_process_max": worst["slices"]},
      "before": {"leaves_timed": len(which), "map_build_s": build,
                 "write_plan_s_per_leaf": plan, "distinct_sharding_shapes": distinct,
                 "save_plan_s_per_process_extrapolated": build * distinct + plan * len(state),
                 "restore_plan_s_per_process_extrapolated": build * distinct},
  }


def broadcast_reads(processes: int, per: int, groups: int) -> dict[str, Any]:
  """Storage bytes read per process restoring the state onto ``groups`` replica groups, with
  and without read-once broadcast (``_layout.spread``), over every process."""
  from fnckpt._layout import spread as _spread
  devices = processes * per
  if devices % (8 * groups):
    raise SystemExit(f"{devices} devices do not form {groups} groups of (data, 8)")
  mesh = (groups, devices // (8 * groups), 8)
  grid = _spread.Grid(("replica", "data", "model"), mesh,
                      (np.arange(devices) // per).reshape(mesh))
  names = ("data", "model")
  off = np.zeros(processes, np.int64)
  on = np.zeros(processes, np.int64)
  plan_s = 0.0
  for _, shape, itemsize, dim_axes in leaves():
    spec = tuple(tuple(names[a] for a in axes) for axes in dim_axes)
    t0 = time.perf_counter()
    rspec, _ = _spread.reader_spec(grid, spec, shape)
    plan_s += time.perf_counter() - t0
    off += _spread.bytes_per_process(grid, spec, shape, itemsize)
    on += _spread.bytes_per_process(grid, rspec, shape, itemsize)
  state = sum(_layout.nbytes(s, i) for _, s, i, _ in leaves())
  return {"groups": groups, "mesh": list(mesh), "state_bytes": state,
          "off_bytes_per_process_max": int(off.max()), "on_bytes_per_process_max": int(on.max()),
          "on_bytes_per_process_min": int(on.min()),
          "off_job_reads_over_state": float(off.sum() / state),
          "on_job_reads_over_state": float(on.sum() / state),
          "on_over_off_per_process": float(on.max() / off.max()),
          "reader_plan_s_per_process": plan_s}


def broadcast_summary(b: dict[str, Any]) -> str:
  return (f"R={b['groups']:>2} mesh {tuple(b['mesh'])}: per process "
          f"{b['off_bytes_per_process_max'] / MiB:,.1f} MiB -> "
          f"{b['on_bytes_per_process_max'] / MiB:,.1f} MiB "
          f"({b['on_over_off_per_process']:.4f}, 1/R = {1 / b['groups']:.4f}); job reads "
          f"{b['off_job_reads_over_state']:.3f} -> {b['on_job_reads_over_state']:.3f} x the "
          f"state; reader plan {b['reader_plan_s_per_process'] * 1e3:.0f} ms")


def summary(r: dict[str, Any]) -> str:
  s, b = r["save"], r["before"]
  return (f"{r['processes']} x {r['devices_per_process']}: {r['leaves']} leaves; plan per "
          f"process: save {s['plan_s_per_process']:.3f} s (steady "
          f"{s['plan_s_per_process_steady']:.4f} s), restore "
          f"{r['restore']['plan_s_per_process']:.3f} s, before "
          f"{b['save_plan_s_per_process_extrapolated']:.1f} s / "
          f"{b['restore_plan_s_per_process_extrapolated']:.1f} s; "
          f"{s['objects_per_process_max']} objects/process, smallest "
          f"{s['min_object_bytes']:,} B; bytes max/mean {s['bytes_max_over_mean']:.3f}")


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--processes", type=int, default=64)
  ap.add_argument("--devices-per-process", type=int, default=8)
  ap.add_argument("--json", help="write the result here")
  ap.add_argument("--tp-only-embeddings", action="store_true",
                  help="embed/lm_head replicated over 'data' (exercises replica splits)")
  ap.add_argument("--old-leaves", type=int, default=6, help="leaves timed on the old path")
  ap.add_argument("--replica-groups", type=int, nargs="*", default=[],
                  help="storage bytes read per process with R replica groups, with and "
                       "without broadcast")
  ap.add_argument("--broadcast-only", action="store_true",
                  help="only the --replica-groups figures")
  args = ap.parse_args(argv)
  r: dict[str, Any] = {}
  if not args.broadcast_only:
    r = run(args.processes, args.devices_per_process, args.tp_only_embeddings, args.old_leaves)
    print(summary(r))
  r["broadcast"] = [broadcast_reads(args.processes, args.devices_per_process, g)
                    for g in args.replica_groups]
  for b in r["broadcast"]:
    print(broadcast_summary(b))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(r, f, indent=1)


if __name__ == "__main__":
  main()
