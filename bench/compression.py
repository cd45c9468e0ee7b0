"""Which compression pays for itself on real training state? (issue 11, point 3)

Reads the arrays of a committed fnckpt checkpoint of a real training run (by default: train
``examples/lm.py --size 100m`` for a few steps first), groups them as parameters (fp32), Adam
``mu`` (bf16) and Adam ``nu`` (fp32), and writes each group with raw TensorStore zarr3 under
several codec chains (always ending in ``crc32c``, as fnckpt does): none, zstd at levels 1 and
3, and blosc (lz4 or zstd, with byte or bit shuffle). For each it reports the compression
ratio (raw bytes / bytes on disk), the write speed to durable (fsynced) and the cold read
speed, best of ``--repeats``, and the CPU seconds per GB each takes (all threads: less
sensitive than speeds to other load on the machine); the rows without compression are the limit each codec is
measured against, in the same run.

    python examples/lm.py --size 100m --devices 8 --mesh 2,4 --steps 20 --save-every 20 --dir /tmp/lm100m
    python bench/compression.py --checkpoint /tmp/lm100m/20 --json /tmp/compression.json

Chunks are the arrays' first-axis halves (>= a few MiB each, like fnckpt's large arrays).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import limits  # noqa: E402

CODECS = {
    "none": [],
    "zstd-1": [{"name": "zstd", "configuration": {"level": 1}}],
    "zstd-3": [{"name": "zstd", "configuration": {"level": 3}}],
    "blosc-lz4-shuffle": [{"name": "blosc", "configuration": {
        "cname": "lz4", "clevel": 5, "shuffle": "shuffle"}}],
    "blosc-lz4-bitshuffle": [{"name": "blosc", "configuration": {
        "cname": "lz4", "clevel": 5, "shuffle": "bitshuffle"}}],
    "blosc-zstd-shuffle": [{"name": "blosc", "configuration": {
        "cname": "zstd", "clevel": 3, "shuffle": "shuffle"}}],
    "blosc-zstd-bitshuffle": [{"name": "blosc", "configuration": {
        "cname": "zstd", "clevel": 3, "shuffle": "bitshuffle"}}],
}


def group_of(path: str) -> str:
  if ".mu" in path or "'mu'" in path or "/mu" in path:
    return "adam mu"
  if ".nu" in path or "'nu'" in path or "/nu" in path:
    return "adam nu"
  return "params"


def load_groups(checkpoint: str, min_bytes: int) -> dict[str, list[tuple[str, np.ndarray]]]:
  import jax
  import jax.numpy as jnp
  import fnckpt
  tree = fnckpt.restore(checkpoint)
  groups: dict[str, list[tuple[str, np.ndarray]]] = {}
  for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(x, np.ndarray) and x.nbytes >= min_bytes and jnp.issubdtype(x.dtype, jnp.floating):
      name = jax.tree_util.keystr(kp)
      groups.setdefault(group_of(name), []).append((name, x))
  return groups


def _spec(path: str, x: np.ndarray | None, codecs: list) -> dict:
  spec: dict = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"}}
  if x is not None:
    b = {"name": "bytes"}
    if x.dtype.itemsize > 1:
      b["configuration"] = {"endian": "little"}
    chunk = list(x.shape)
    chunk[0] = max(1, -(-x.shape[0] // 2))
    spec["metadata"] = {
        "shape": list(x.shape), "data_type": str(x.dtype),
        "codecs": [b, *codecs, {"name": "crc32c"}],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}}}
    spec["create"] = True
  return spec


def measure(arrays: list[tuple[str, np.ndarray]], codecs: list, root: str,
            repeats: int) -> dict[str, float]:
  import tensorstore as ts
  nbytes = sum(x.nbytes for _, x in arrays)
  best_w, best_r, disk = float("inf"), float("inf"), 0
  cpu_w, cpu_r = float("inf"), float("inf")
  for _ in range(repeats):
    shutil.rmtree(root, ignore_errors=True)
    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    t, c = time.perf_counter(), time.process_time()
    stores = [ts.open(_spec(f"{root}/{i}", x, codecs), context=ctx).result()
              for i, (_, x) in enumerate(arrays)]
    for f in [s.write(x) for s, (_, x) in zip(stores, arrays)]:
      f.result()
    limits.fsync_dirs(root)
    best_w = min(best_w, time.perf_counter() - t)
    cpu_w = min(cpu_w, time.process_time() - c)
    disk = limits.dir_stats(root)["bytes"]
    limits.evict(root)
    t, c = time.perf_counter(), time.process_time()
    stores = [ts.open(_spec(f"{root}/{i}", None, codecs), context=ctx).result()
              for i in range(len(arrays))]
    got = [f.result() for f in [s.read() for s in stores]]
    best_r = min(best_r, time.perf_counter() - t)
    cpu_r = min(cpu_r, time.process_time() - c)
    if not all(np.array_equal(g.view(np.uint8), x.view(np.uint8))
               for g, (_, x) in zip(got, arrays)):
      raise AssertionError("a codec changed the data")
  shutil.rmtree(root, ignore_errors=True)
  return {"bytes": nbytes, "ratio": nbytes / disk, "write_gbps": nbytes / best_w / 1e9,
          "read_gbps": nbytes / best_r / 1e9, "write_cpu_s_per_gb": cpu_w / nbytes * 1e9,
          "read_cpu_s_per_gb": cpu_r / nbytes * 1e9}


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--checkpoint", required=True)
  p.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--min-bytes", type=int, default=1 << 20)
  p.add_argument("--json", default=None)
  p.add_argument("--groups", default=None, help="comma-separated subset of: params,adam mu,adam nu")
  args = p.parse_args(argv)
  scratch = args.dir or tempfile.mkdtemp(prefix="fnckpt-compression-")
  groups = load_groups(args.checkpoint, args.min_bytes)
  if args.groups:
    groups = {g: a for g, a in groups.items() if g in args.groups.split(",")}
  rows = []
  print("| group | dtype | MiB | codec | ratio | write GB/s | cold read GB/s | write CPU s/GB "
        "| read CPU s/GB |")
  print("|---|---|---|---|---|---|---|---|---|")
  for group, arrays in sorted(groups.items()):
    for name, codecs in CODECS.items():
      m = measure(arrays, codecs, os.path.join(scratch, "c"), args.repeats)
      row = {"group": group, "dtype": str(arrays[0][1].dtype), "codec": name, **m}
      rows.append(row)
      print(f"| {group} | {row['dtype']} | {m['bytes'] / 2**20:,.0f} | {name} | "
            f"{m['ratio']:.3f} | {m['write_gbps']:.2f} | {m['read_gbps']:.2f} | "
            f"{m['write_cpu_s_per_gb']:.2f} | {m['read_cpu_s_per_gb']:.2f} |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"checkpoint": args.checkpoint, "rows": rows,
                 "machine": limits.machine(scratch)}, f, indent=1)
  shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
  main()
