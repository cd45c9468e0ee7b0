"""fnckpt against raw TensorStore, paired: the same state saved and restored by both, rounds
interleaved in one process (the order alternating), so that the disk's drift over minutes
(on a virtual disk, the same write varies by 2x) hits both alike. ``run.py`` measures raw
TensorStore in its own worker at another time and takes its best of 3 against fnckpt's median
of 5; this script gives the like-for-like ratio.

    python bench/vs_tensorstore.py                      # transformer state (1.45 GiB), 6 rounds
    python bench/vs_tensorstore.py --state mixed --rounds 8 --json out.json

Per round, each timed from host/device state to durable (save) or to arrays (restore), every
read after evicting the files from the page cache:

* ``fnckpt save``: ``fnckpt.save(tree, path).wait()`` (default options);
* ``raw write (whole)``: ``bench/limits.py``'s raw TensorStore write: one plain zarr3 array per
  leaf (``bytes`` + ``crc32c``, chunk = saved shard), each array written whole, concurrently;
* ``raw write (per chunk)``: the same arrays, each chunk in its own transaction (what fnckpt
  does), source data referenced, not copied;
* ``fnckpt restore``: ``fnckpt.restore`` onto the saved mesh;
* ``raw read``: every raw array read whole into numpy (host memory: no device placement);
* ``raw read + place``: that, then ``jax.device_put`` of each leaf with its target sharding
  (the whole job of a restore).

Prints each figure's values and median, and the median of the per-round ratios
(raw / fnckpt: above 1 means fnckpt took less time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import runners  # noqa: E402

jax = runners.setup_jax()

import numpy as np  # noqa: E402
import tensorstore as ts  # noqa: E402

import fnckpt  # noqa: E402
from bench import limits, states  # noqa: E402


def raw_write_per_chunk(root: str, arrays: list) -> None:
  """Each chunk of each array in its own transaction, all concurrently; then fsync the dirs."""
  ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
  opens = [ts.open(limits._zarr3_spec(os.path.join(root, n), x, c), context=ctx)
           for n, x, c in arrays]
  commits = []
  for fut, (_, x, c) in zip(opens, arrays):
    store = fut.result()
    for cell in np.ndindex(*[-(-n // k) for n, k in zip(x.shape, c)]):
      box = tuple(slice(i * k, min((i + 1) * k, n)) for i, k, n in zip(cell, c, x.shape))
      txn = ts.Transaction()
      store.with_transaction(txn)[box].write(
          x[box], can_reference_source_data_indefinitely=True).result()
      commits.append(txn.commit_async())
  for c in commits:
    c.result()
  limits.fsync_dirs(root)


def _timed(fn) -> tuple[float, object]:
  t = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return time.perf_counter() - t, out


def run(state: str, rounds: int, root: str) -> dict[str, list[float]]:
  leaves = states.leaves_for(state, "full")
  mesh = states.make_mesh("a")
  tree = states.build(leaves, mesh)
  jax.block_until_ready(tree)
  arrays = states.raw_arrays(leaves, tree, mesh)
  target = states.target(leaves, mesh, "a")
  shardings = [states.at(target, leaf).sharding for leaf in leaves]
  shutil.rmtree(root, ignore_errors=True)
  os.makedirs(root)
  fnckpt.save(tree, os.path.join(root, "warmup")).wait()   # first-call costs out of the way
  shutil.rmtree(os.path.join(root, "warmup"))
  times: dict[str, list[float]] = {}
  for r in range(rounds):
    ck, raw, raw2 = (os.path.join(root, f"{name}{r}") for name in ("fnckpt", "raw", "rawc"))
    saves = [("fnckpt save", lambda: fnckpt.save(tree, ck).wait()),
             ("raw write (whole)", lambda: limits._ts_write(ts, raw, arrays)),
             ("raw write (per chunk)", lambda: raw_write_per_chunk(raw2, arrays))]
    reads = [("fnckpt restore", ck, lambda: fnckpt.restore(ck, target)),
             ("raw read", raw, lambda: limits._ts_read(ts, raw, arrays)),
             ("raw read + place", raw, lambda: jax.device_put(
                 limits._ts_read(ts, raw, arrays), shardings))]
    order = 1 if r % 2 == 0 else -1
    for name, fn in saves[::order]:
      times.setdefault(name, []).append(_timed(fn)[0])
    for name, path, fn in reads[::order]:
      limits.evict(path)
      dt, out = _timed(fn)
      del out
      times.setdefault(name, []).append(dt)
    for path in (ck, raw, raw2):
      shutil.rmtree(path)
  return times


def report(times: dict[str, list[float]]) -> list[str]:
  lines = ["| figure | median s | runs (s) |", "| --- | ---: | --- |"]
  for name, v in times.items():
    lines.append(f"| {name} | {statistics.median(v):.2f} | {' '.join(f'{x:.2f}' for x in v)} |")
  lines += ["", "| raw / fnckpt, per round (median) | |", "| --- | ---: |"]
  for raw, ours in (("raw write (whole)", "fnckpt save"), ("raw write (per chunk)", "fnckpt save"),
                    ("raw read", "fnckpt restore"), ("raw read + place", "fnckpt restore")):
    ratios = [a / b for a, b in zip(times[raw], times[ours])]
    lines.append(f"| {raw} / {ours} | {statistics.median(ratios):.2f} |")
  return lines


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--state", default="transformer", choices=["transformer", "mixed", "small"])
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--dir", default=os.path.join(REPO, "tmp", "vs_tensorstore"))
  p.add_argument("--json", help="write the raw times here")
  a = p.parse_args(argv)
  times = run(a.state, a.rounds, a.dir)
  print(f"# fnckpt vs raw TensorStore, paired: state {a.state}, {a.rounds} rounds\n")
  print("\n".join(report(times)))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"state": a.state, "rounds": a.rounds, "times": times}, f, indent=1)
  shutil.rmtree(a.dir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
