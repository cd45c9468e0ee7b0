"""Paired cold restores of one checkpoint by two (or more) fnckpt trees: fresh processes, one
restore each (as ``bench/run.py``'s workers time them: the checkpoint evicted from the page
cache, ``jax.block_until_ready`` included), the trees alternating and their order reversed
every round, so that a shared machine's drift hits them alike. Prints each tree's medians:
wall time, CPU time of the process, CPU time of the calling thread.

  mkdir /tmp/before && git archive <rev> | tar -x -C /tmp/before   # a tree to compare against
  python bench/restore_pairs.py --ckpt DIR --state mixed --mesh b --rounds 10 /tmp/before .

Each tree's own ``bench`` package is used in its processes (the script's directory is not on
their path).

``--ckpt``: a checkpoint of ``--state`` saved on mesh ``a`` (``bench/run.py --keep`` leaves
them under ``<dir>/<state>/fnckpt/run<k>/<step>``). ``--one``: the worker (one restore, JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
  del sys.path[0]   # (run as a script: bench/ on the path shadows modules jax imports, as
                    # ``compression``, whose bench namesake puts this checkout on the path)


def one(ckpt: str, state: str, mesh: str) -> dict:
  """One cold restore in this process: seconds of wall, process CPU, calling thread CPU."""
  from bench import runners
  jax = runners.setup_jax()
  from bench import limits, states
  import fnckpt
  leaves = states.leaves_for(state, "quick")
  target = states.target(leaves, states.make_mesh(mesh), mesh)
  limits.evict(ckpt)
  c0, th0, t0 = runners._cpu_s(), time.thread_time(), time.perf_counter()
  jax.block_until_ready(fnckpt.restore(ckpt, target))
  return {"s": time.perf_counter() - t0, "cpu": runners._cpu_s() - c0,
          "main": time.thread_time() - th0, "fnckpt": os.path.dirname(fnckpt.__file__)}


def run(tree: str, args: argparse.Namespace) -> dict:
  """:func:`one` in a fresh process importing fnckpt and bench from ``tree`` (ahead of the
  caller's ``PYTHONPATH``, kept for anything else it holds)."""
  paths = [os.path.abspath(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(
      os.pathsep) if p]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
  out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", "--ckpt",
                        args.ckpt, "--state", args.state, "--mesh", args.mesh],
                       capture_output=True, text=True, env=env, cwd=os.path.abspath(tree))
  if out.returncode:
    raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("trees", nargs="*", help="fnckpt trees (directories holding fnckpt/)")
  ap.add_argument("--ckpt", required=True)
  ap.add_argument("--state", default="mixed")
  ap.add_argument("--mesh", default="b", choices=("a", "b"))
  ap.add_argument("--rounds", type=int, default=10)
  ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.one:
    print(json.dumps(one(args.ckpt, args.state, args.mesh)))
    return
  got: dict[str, list[dict]] = {t: [] for t in args.trees}
  for r in range(args.rounds):
    for t in (args.trees if r % 2 == 0 else args.trees[::-1]):
      got[t].append(run(t, args))
  for t, xs in got.items():
    med = {k: statistics.median(x[k] for x in xs) for k in ("s", "cpu", "main")}
    walls = ", ".join(f"{x['s']:.3f}" for x in xs)
    print(f"{t} ({xs[0]['fnckpt']}): wall {med['s']:.3f} s, CPU {med['cpu']:.3f} s, calling thread "
          f"{med['main']:.3f} s (medians of {len(xs)}; walls {walls})")


if __name__ == "__main__":
  main()
