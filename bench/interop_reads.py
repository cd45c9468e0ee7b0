"""Bytes read and peak memory of restoring one big tensor from safetensors / Orbax, sharded.

  python bench/interop_reads.py [--mib 1024] [--budgets 64,1100] [--dir tmp/bench-reads]

One float32 square tensor of ``--mib`` MiB is written once as a ``.safetensors`` file and once
by Orbax saved from one device (``PyTreeCheckpointHandler(use_ocdbt=False)``: one chunk, the
whole array). Each case runs in its own process (8 virtual CPU devices) and restores it
sharded 8 ways (on columns for safetensors, on rows for Orbax) with ``budget_bytes`` set to
each of ``--budgets`` MiB; it prints the bytes read from storage (TensorStore's
``/tensorstore/kvstore/file/bytes_read``), the peak RSS when the restore returns (the
restored arrays included: on CPU devices they are host memory) and the wall time, and checks
the result bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bytes_read() -> int:
  import tensorstore as ts
  for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
    return sum(v["value"] for v in m["values"])
  return 0


def _value(n: int):
  import numpy as np
  return (np.arange(n * n, dtype=np.float32) % 251).reshape(n, n)


def make(directory: str, n: int) -> None:
  import jax
  import orbax.checkpoint as ocp
  from safetensors.numpy import save_file
  os.makedirs(directory, exist_ok=True)
  value = _value(n)
  save_file({"w": value}, os.path.join(directory, "w.safetensors"))
  ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(
      os.path.join(directory, "orbax"), args=ocp.args.PyTreeSave({"w": jax.numpy.asarray(value)}))


def one(directory: str, n: int, kind: str, budget_mib: int) -> dict:
  """One restore in this process (run by ``main`` in a fresh one)."""
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  sys.path.insert(0, ROOT)
  import fnckpt
  mesh = jax.make_mesh((8,), ("x",))
  spec, path = ((P(None, "x"), os.path.join(directory, "w.safetensors")) if kind == "safetensors"
                else (P("x"), os.path.join(directory, "orbax")))
  target = {"w": jax.ShapeDtypeStruct((n, n), np.float32, sharding=NamedSharding(mesh, spec))}
  before, start = _bytes_read(), time.perf_counter()
  got = jax.block_until_ready(fnckpt.restore(path, target, budget_bytes=budget_mib << 20))
  seconds, used = time.perf_counter() - start, _bytes_read() - before
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # (before the check's copy)
  value = _value(n)
  ok = all(np.array_equal(np.asarray(s.data), value[s.index]) for s in got["w"].addressable_shards)
  return {"kind": kind, "budget_mib": budget_mib, "bytes_read_mib": round(used / 2**20, 1),
          "tensor_mib": round(value.nbytes / 2**20, 1), "seconds": round(seconds, 1),
          "peak_rss_mb": peak, "ok": ok}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=1024)
  ap.add_argument("--budgets", default="64,1100")
  ap.add_argument("--dir", default="tmp/bench-reads")
  ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
  args = ap.parse_args()
  n = int((args.mib * 2**20 // 4) ** 0.5)
  if args.one:
    print(json.dumps(one(args.dir, n, args.one[0], int(args.one[1]))))
    return
  if not os.path.exists(os.path.join(args.dir, "orbax")):
    make(args.dir, n)
  for kind in ("safetensors", "orbax"):
    for budget in args.budgets.split(","):
      out = subprocess.run([sys.executable, __file__, "--mib", str(args.mib), "--dir", args.dir,
                            "--one", kind, budget], capture_output=True, text=True, check=True)
      print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
  main()
