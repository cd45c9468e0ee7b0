"""Overlapping incremental saves: a manager saving 8 steps without waiting (the loop when a
write outlasts a step), incremental=True against a plain manager.

    python bench/overlap.py                      # 128 MiB frozen, 3 rounds
    python bench/overlap.py --mib 64 --rounds 2 --dir /mnt/nvme/tmp

State: a frozen float32 matrix sharded over 8 virtual CPU devices (stored) plus a 1 MiB adapter
(packed) that changes at every step. Per round, each manager kind (rotated): the caller's
``blocking_s`` per save (median and max over the 8 saves), the wall time of the loop until
everything is committed, and the bytes on disk of the run. Reported: medians over rounds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def du(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path)
             for n in names)


def one(root: str, incremental: bool, frozen, steps: int) -> dict:
  import numpy as np
  import fnckpt
  mgr = fnckpt.CheckpointManager(root, incremental=incremental)
  t0 = time.perf_counter()
  handles = [mgr.save(s, {"frozen": frozen, "adapter": np.full((1 << 18,), s, np.float32),
                          "step": s}) for s in range(steps)]
  mgr.wait()
  wall = time.perf_counter() - t0
  mgr.close()
  blocking = [h.stats.blocking_s for h in handles]
  return {"block_med": statistics.median(blocking), "block_max": max(blocking),
          "wall": wall, "disk": du(root)}


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--dir", default=None)
  args = ap.parse_args()
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  rows = args.mib * (1 << 20) // 4 // 4096
  frozen = jax.device_put(np.arange(rows * 4096, dtype=np.float32).reshape(rows, 4096),
                          NamedSharding(mesh, P("x", "y")))
  out: dict[str, list[dict]] = {"plain": [], "incremental": []}
  for r in range(args.rounds + 1):   # (round 0: warm-up, not counted)
    kinds = list(out) if r % 2 else list(out)[::-1]
    for kind in kinds:
      d = tempfile.mkdtemp(dir=args.dir)
      try:
        got = one(os.path.join(d, "run"), kind == "incremental", frozen, args.steps)
      finally:
        shutil.rmtree(d, ignore_errors=True)
      if r:
        out[kind].append(got)
  print(f"frozen {args.mib} MiB + 1 MiB adapter, {args.steps} saves without waiting, "
        f"medians of {args.rounds} rounds:")
  for kind, rows_ in out.items():
    med = {k: statistics.median(x[k] for x in rows_) for k in rows_[0]}
    print(f"  {kind:12s} blocking median {med['block_med'] * 1e3:7.1f} ms, max "
          f"{med['block_max'] * 1e3:7.1f} ms; all committed after {med['wall']:.2f} s; "
          f"disk {med['disk'] / 2**20:.1f} MiB")


if __name__ == "__main__":
  main()
