"""How long fnckpt.save() blocks the caller, against the whole save, for a 1 GiB state.

    python bench/blocking.py                    # 1 GiB on 8 virtual CPU devices, 5 runs
    python bench/blocking.py --gib 0.25 --runs 3 --dir /mnt/nvme/tmp

The state: 8 float32 arrays of 128 MiB, sharded over a (2, 4) mesh in four different ways
(both axes, rows, columns, the other order), so every device holds 1/8 of it and every
array is written as 8 chunks. Each run saves to a fresh directory (deleted afterwards):

- ``blocking``: wall time of the ``save()`` call (what a training loop waits for);
- ``total``: from the call until ``wait()`` returns (committed: data, manifest, marker,
  fsync'd by TensorStore's file driver);
- ``memcpy``: one copy of the same bytes with numpy, the floor for a device-to-host copy on
  CPU, measured in the same run.

One line per run, then the medians. fnckpt only (bench/run.py compares with Orbax).
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
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fnckpt  # noqa: E402

MiB = 1 << 20


def make_state(total_bytes: int) -> dict[str, jax.Array]:
  mesh = jax.make_mesh((2, 4), ("x", "y"))
  P = jax.sharding.PartitionSpec
  specs = [P("x", "y"), P(("x", "y")), P(None, ("x", "y")), P("y", "x")]
  n = 8
  rows = max(8, int(total_bytes // n // 4 // 4096) // 8 * 8)
  state = {}
  for i in range(n):
    s = jax.sharding.NamedSharding(mesh, specs[i % len(specs)])
    f = jax.jit(lambda k, i=i: jnp.arange(rows * 4096, dtype=jnp.float32).reshape(rows, 4096)
                + k, out_shardings=s)
    state[f"layer{i}"] = f(float(i))
  jax.block_until_ready(state)
  return state


def memcpy_s(state) -> float:
  """One numpy copy of every shard (what staging must at least do on CPU)."""
  shards = [np.asarray(s.data) for a in state.values() for s in a.addressable_shards]
  t0 = time.perf_counter()
  copies = [np.array(x, copy=True) for x in shards]
  dt = time.perf_counter() - t0
  del copies
  return dt


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
  ap.add_argument("--runs", type=int, default=5)
  ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  args = ap.parse_args(argv)

  state = make_state(int(args.gib * (1 << 30)))
  nbytes = sum(a.nbytes for a in state.values())
  root = tempfile.mkdtemp(prefix="fnckpt-blocking-", dir=args.dir)
  print(f"state: {nbytes / MiB:.0f} MiB in {len(state)} arrays on {jax.device_count()} CPU "
        f"devices; writing under {root}; jax {jax.__version__}, {os.cpu_count()} cores")
  # warm-up: TensorStore thread pools, file driver, first-call costs
  fnckpt.save({"w": state["layer0"]}, os.path.join(root, "warmup")).wait()
  rows = []
  try:
    for i in range(args.runs):
      path = os.path.join(root, f"run{i}")
      copy = memcpy_s(state)
      t0 = time.perf_counter()
      h = fnckpt.save(state, path)
      blocking = time.perf_counter() - t0
      stats = h.wait()
      total = time.perf_counter() - t0
      assert stats.bytes_written == nbytes, (stats.bytes_written, nbytes)
      rows.append((blocking, total, copy))
      print(f"run {i + 1}: blocking {blocking:.3f} s  total {total:.3f} s  "
            f"({100 * blocking / total:.0f}% of total)  memcpy {copy:.3f} s  "
            f"[stats: blocking {stats.blocking_s:.3f} write {stats.write_s:.3f} "
            f"commit {stats.commit_s:.3f} peak staged {stats.peak_staged_bytes / MiB:.0f} MiB]",
            flush=True)
      shutil.rmtree(path)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  med = [statistics.median(c) for c in zip(*rows)]
  print(f"median over {len(rows)} runs: blocking {med[0]:.3f} s, total {med[1]:.3f} s "
        f"(blocking = {100 * med[0] / med[1]:.0f}% of total; {med[0] / med[2]:.1f}x one memcpy "
        f"of {med[2]:.3f} s); {nbytes / MiB / med[0]:.0f} MiB/s blocked, "
        f"{nbytes / MiB / med[1]:.0f} MiB/s committed")
  return 0


if __name__ == "__main__":
  sys.exit(main())
