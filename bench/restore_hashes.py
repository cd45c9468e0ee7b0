"""What restore's format-3 hash checks cost (docs/format.md): the bench transformer state
saved, made format 3 (``tests/v3util.upgrade`` until the format-3 writer lands), then restored
onto mesh ``a`` (as saved), mesh ``b`` (other specs) and the host, alternating checks on / off
(``_state.hooks.check_hashes``), warm page cache (the worst case for the checks' share).
Then, checks on, the time spent hashing (every ``hashes.array_digest`` call timed) against
the restore's: the checks' cost without the noise of a shared machine.

  python -m bench.restore_hashes [--mode quick|full] [--pairs 5]

Measured (--mode full --pairs 8, 1.45 GiB state, the shared 2-core CI machine, warm cache):
with stored chunks hashed too, hashing took 0.102 s of a 1.94 s restore onto mesh a (5.2%;
paired on/off ratio median 1.235, range 0.91-1.31), so restore no longer hashes stored chunks.
Packed leaves and whole pieces runs only: 0.008 s of 1.92 s onto a (0.4%, 120 MiB hashed),
0.006 s of 1.24 s onto b (0.5%), 0.014 s of 1.67 s onto the host (0.9%, 200 MiB: runs read
whole); paired ratios within noise (medians 1.02, 0.84, 0.87; ranges 0.5-2.0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from bench import runners

jax = runners.setup_jax()

import numpy as np  # noqa: E402

import fnckpt  # noqa: E402
from fnckpt import _state  # noqa: E402
from fnckpt._format import hashes as _hashes  # noqa: E402
from bench import states  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tests"))
import v3util  # noqa: E402


def _restore(path: str, target) -> float:
  t = time.perf_counter()
  jax.block_until_ready(fnckpt.restore(path, target))
  return time.perf_counter() - t


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--mode", default="quick")
  ap.add_argument("--pairs", type=int, default=5)
  args = ap.parse_args()
  leaves = states.leaves_for("transformer", args.mode)
  mesh = states.make_mesh("a")
  tree = states.build(leaves, mesh)
  path = os.path.join(tempfile.mkdtemp(), "t")
  fnckpt.save(tree, path).wait()
  m = v3util.upgrade(path)
  kinds = {k: sum(1 for l in m.leaves if l.is_array and getattr(l, k) is not None)
           for k in ("inline", "packed", "pieces", "stored")}
  print(f"state {states.state_bytes(leaves) / 2**20:.0f} MiB, leaves {kinds}")
  del tree
  targets = {"a": states.target(leaves, mesh, "a"),
             "b": states.target(leaves, states.make_mesh("b"), "b"),
             "host": None}
  for name, target in targets.items():
    _restore(path, target)   # warm
    on, off = [], []
    for i in range(args.pairs):
      for check in ((True, False) if i % 2 == 0 else (False, True)):
        _state.hooks.check_hashes = check
        (on if check else off).append(_restore(path, target))
    _state.hooks.check_hashes = True
    ratios = [a / b for a, b in zip(on, off)]
    print(f"restore onto {name}: checks on {statistics.median(on):.3f} s, off "
          f"{statistics.median(off):.3f} s (medians of {args.pairs}); paired ratio median "
          f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    print(f"  hashing inside restore onto {name}: {_hashing_share(path, target)}")


def _hashing_share(path: str, target, runs: int = 3) -> str:
  """Seconds and bytes hashed by restore's checks against the restore's seconds."""
  spent = [0.0, 0]
  plain = _hashes.array_digest

  def timed(a):
    t = time.perf_counter()
    try:
      return plain(a)
    finally:
      spent[0] += time.perf_counter() - t
      spent[1] += np.asarray(a).nbytes

  _hashes.array_digest = timed
  try:
    total = sum(_restore(path, target) for _ in range(runs))
  finally:
    _hashes.array_digest = plain
  return (f"{spent[0] / runs:.3f} s of {total / runs:.3f} s ({100 * spent[0] / total:.1f}%), "
          f"{spent[1] / runs / 2**20:.0f} MiB hashed a restore "
          f"({spent[1] / max(spent[0], 1e-9) / 1e9:.1f} GB/s)")


if __name__ == "__main__":
  main()
