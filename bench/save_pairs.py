"""Paired saves of one state by two (or more) fnckpt trees: fresh processes, each saving the
bench state ``--saves`` times (after one warm-up save) to fresh paths, the trees alternating
and their order reversed every round, so that a shared machine's drift hits them alike.
Prints each tree's medians over every save of every round: time blocked (``SaveStats
.blocking_s``), time to committed (``total_s``) and CPU of the process per save.

  mkdir /tmp/before && git archive <rev> | tar -x -C /tmp/before   # a tree to compare against
  python bench/save_pairs.py --state transformer --rounds 6 /tmp/before .

Each tree's own ``bench`` package is used in its processes (see ``bench/restore_pairs.py``).
``--one``: the worker (JSON lines of one process's saves).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
  del sys.path[0]  # (run as a script: bench/ on the path shadows modules jax imports)


def one(state: str, saves: int, root: str) -> list[dict]:
  """``saves`` saves of ``state`` on mesh a in this process, after a warm-up save."""
  from bench import runners

  runners.setup_jax()
  import fnckpt
  from bench import states

  leaves = states.leaves_for(state, "quick")
  tree = states.build(leaves, states.make_mesh("a"))
  fnckpt.save(tree, f"{root}/warmup").wait()
  out = []
  for k in range(saves):
    c0 = runners._cpu_s()
    stats = fnckpt.save(tree, f"{root}/{k}").wait()
    out.append({"blocked": stats.blocking_s, "committed": stats.total_s,
                "cpu": runners._cpu_s() - c0, "fnckpt": os.path.dirname(fnckpt.__file__)})
    shutil.rmtree(f"{root}/{k}")
  return out


def run(tree: str, args: argparse.Namespace) -> list[dict]:
  """:func:`one` in a fresh process importing fnckpt and bench from ``tree``."""
  env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
  with tempfile.TemporaryDirectory(prefix="fnckpt-save-pairs-", dir=args.dir) as root:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", "--state",
                          args.state, "--saves", str(args.saves), "--dir", root],
                         capture_output=True, text=True, env=env, cwd=os.path.abspath(tree))
  if out.returncode:
    raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("trees", nargs="*", help="fnckpt trees (directories holding fnckpt/)")
  ap.add_argument("--state", default="transformer")
  ap.add_argument("--rounds", type=int, default=6)
  ap.add_argument("--saves", type=int, default=5, help="saves per process (after a warm-up)")
  ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.one:
    print(json.dumps(one(args.state, args.saves, args.dir)))
    return
  got: dict[str, list[dict]] = {t: [] for t in args.trees}
  print(f"{time.strftime('%Y-%m-%d %H:%M')}; load average {os.getloadavg()}")
  for r in range(args.rounds):
    for t in args.trees if r % 2 == 0 else args.trees[::-1]:
      got[t] += run(t, args)
  for t, xs in got.items():
    med = {k: statistics.median(x[k] for x in xs) for k in ("blocked", "committed", "cpu")}
    print(f"{t} ({xs[0]['fnckpt']}): blocked {med['blocked'] * 1e3:.1f} ms, committed "
          f"{med['committed']:.3f} s, CPU {med['cpu']:.3f} s a save (medians of {len(xs)})")


if __name__ == "__main__":
  main()
