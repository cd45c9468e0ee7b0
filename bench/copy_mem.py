"""Memory and time of copying a base's chunks into a leaf written whole (save(base=)).

    python bench/copy_mem.py                         # 1 GiB fp32, budget_bytes=64 MiB
    python bench/copy_mem.py --mib 256 --budget-mib 16 --dir /mnt/nvme/tmp

One fp32 array sharded over 8 virtual CPU devices (8 chunks). A full save that records hashes
(as an ``incremental=True`` manager's full saves do), then ``save(base=)`` of the same array
with one element changed: its chunk differs, so the array is written whole and the 7 other
chunks are copied from the base as stored. Each save runs in a fresh process; reported: the
time until it returned and until committed, and its peak RSS above the process's RSS just
before the save (sampled every 10 ms with psutil), with the save's own stats.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(mode: str, directory: str, mib: int, budget_mib: int) -> None:
  sys.path.insert(0, REPO)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import psutil
  from jax.sharding import NamedSharding, PartitionSpec as P
  import fnckpt

  sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))

  def make() -> jax.Array:  # made on the devices: no host copy to free during the save
    a = jax.numpy.arange(mib << 18, dtype=jax.numpy.float32)
    return a.at[5].set(-1.0) if mode == "incr" else a  # one chunk of eight differs

  x = jax.jit(make, out_shardings=sharding)().block_until_ready()
  proc = psutil.Process()
  before = proc.memory_info().rss
  peak, stop = [before], threading.Event()

  def sample() -> None:
    while not stop.is_set():
      peak[0] = max(peak[0], proc.memory_info().rss)
      time.sleep(0.01)

  threading.Thread(target=sample, daemon=True).start()
  t0 = time.perf_counter()
  if mode == "base":
    handle = fnckpt.save({"x": x}, f"{directory}/1", budget_bytes=budget_mib << 20)
  else:
    handle = fnckpt.save({"x": x}, f"{directory}/2", base=f"{directory}/1",
                         budget_bytes=budget_mib << 20)
  blocked = time.perf_counter() - t0
  st = handle.wait()
  total = time.perf_counter() - t0
  stop.set()
  print(f"{mode}: blocked {blocked:.2f} s, committed after {total:.1f} s, peak extra RSS "
        f"{(peak[0] - before) / 2**20:.0f} MiB; written {st.bytes_written / 2**20:.0f} MiB, "
        f"reused {st.bytes_reused / 2**20:.0f} MiB, chunks written {st.chunks_written}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--mib", type=int, default=1024, help="array size (MiB, a multiple of 8)")
  p.add_argument("--budget-mib", type=int, default=64, help="budget_bytes of both saves")
  p.add_argument("--dir", default=None, help="where to write (a temporary directory in it)")
  p.add_argument("--child", nargs=2, metavar=("MODE", "DIR"), help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    child(args.child[0], args.child[1], args.mib, args.budget_mib)
    return
  with tempfile.TemporaryDirectory(dir=args.dir) as d:
    for mode in ("base", "incr"):
      subprocess.run([sys.executable, os.path.abspath(__file__), "--mib", str(args.mib),
                      "--budget-mib", str(args.budget_mib), "--child", mode, d], check=True)


if __name__ == "__main__":
  main()
