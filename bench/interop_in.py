"""Restoring other libraries' checkpoints: fnckpt.restore beside the library's own loader.

  python bench/interop_in.py [--mib 256] [--runs 3] [--dir tmp/bench-interop]

One process, 8 virtual CPU devices. A state of ``--mib`` MiB (fp32 and bf16 matrices, sharded
on a (2, 4) mesh) is saved once by Orbax (``StandardCheckpointer``: OCDBT, zarr v2, zstd) and
once as one ``.safetensors`` file (the ``safetensors`` library, numpy API). Each restore starts
with a cold page cache (files fsynced and evicted with ``posix_fadvise(DONTNEED)``) and is
checked bitwise. Figures are medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fnckpt  # noqa: E402


def evict(path: str) -> None:
  for root, _, files in os.walk(path):
    for f in files:
      fd = os.open(os.path.join(root, f), os.O_RDONLY)
      try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def make_state(mib: int) -> dict[str, list[dict[str, np.ndarray]]]:
  n = max(1, mib // 24)               # per layer: 16 MiB fp32 + 8 MiB bf16
  rng = np.random.default_rng(0)
  return {"layers": [{"w": rng.standard_normal((2048, 2048), np.float32),
                      "m": rng.standard_normal((2048, 2048), np.float32).astype(jnp.bfloat16)}
                     for _ in range(n)]}


def timed(fn, runs: int, path: str):
  """Median wall and CPU seconds of ``fn`` (cold page cache each time) and its last result."""
  times, cpu, result = [], [], None
  for _ in range(runs):
    evict(path)
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    jax.block_until_ready(result)
    times.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
  return statistics.median(times), statistics.median(cpu), result


def check(got, want) -> None:
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.asarray(g).tobytes() == w.tobytes()


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mib", type=int, default=256)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--dir", default="tmp/bench-interop")
  args = ap.parse_args()
  import orbax.checkpoint as ocp
  from safetensors.numpy import load_file, save_file

  root = os.path.abspath(args.dir)
  os.makedirs(root, exist_ok=True)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  other = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[::-1])
  host = make_state(args.mib)
  flat = {f"layers.{i}.{k}": v for i, layer in enumerate(host["layers"]) for k, v in layer.items()}
  nbytes = sum(v.nbytes for v in flat.values())
  saved = jax.device_put(host, NamedSharding(mesh, P("data", "model")))
  tree = lambda s: jax.tree.map(  # noqa: E731
      lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), host)
  same_t = tree(NamedSharding(mesh, P("data", "model")))
  other_t = tree(NamedSharding(other, P("model", "data")))
  rows_t = tree(NamedSharding(mesh, P(("data", "model"))))
  rows_s = NamedSharding(mesh, P(("data", "model")))

  opath = os.path.join(root, f"orbax-{time.time_ns()}")
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(opath, saved)
  ckpt.wait_until_finished()
  spath = os.path.join(root, f"model-{time.time_ns()}.safetensors")
  save_file(flat, spath)

  rows = []

  def row(name, fn, path, want=host):  # noqa: ANN001
    t, cpu, got = timed(fn, args.runs, path)
    check(got, want)
    rows.append((name, t, nbytes / t / 1e9, cpu))

  row("Orbax restore by Orbax, same mesh",
      lambda: ckpt.restore(opath, same_t), opath)
  row("Orbax restore by fnckpt, same mesh",
      lambda: fnckpt.restore(opath, same_t), opath)
  row("Orbax restore by fnckpt, other mesh",
      lambda: fnckpt.restore(opath, other_t), opath)
  row("safetensors load_file + device_put, rows sharded",
      lambda: {k: jax.device_put(v, rows_s) for k, v in load_file(spath).items()}, spath,
      want=flat)
  row("safetensors by fnckpt, rows sharded",
      lambda: fnckpt.restore(spath, rows_t), spath)
  row("safetensors by fnckpt, (2,4) mesh (rows x columns)",
      lambda: fnckpt.restore(spath, same_t), spath)
  print(f"state: {nbytes / 2**20:.0f} MiB in {len(flat)} arrays; medians of {args.runs}, cold "
        f"page cache; jax {jax.__version__}, orbax-checkpoint {ocp.__version__}")
  print(f"load average {os.getloadavg()[0]:.1f} (the machine's cores: {os.cpu_count()})")
  print("| restore | wall s | GB/s | CPU s |\n| --- | ---: | ---: | ---: |")
  for name, t, gbs, cpu in rows:
    print(f"| {name} | {t:.2f} | {gbs:.2f} | {cpu:.2f} |")
  ckpt.close()
  import shutil
  shutil.rmtree(opath, ignore_errors=True)
  os.remove(spath)


if __name__ == "__main__":
  main()
