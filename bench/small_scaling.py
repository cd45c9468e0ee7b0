"""Small-leaf scaling: save and restore time against the number of leaves, fnckpt beside Orbax.

    python bench/small_scaling.py --leaves 250 500 1000 2000 4000 --runs 2 \\
        --json bench/results/<date>-small-scaling.json

The ``small`` state of ``bench/states.py`` (4 KiB float32 leaves, half replicated, half sharded
8 ways over a (2, 4) mesh of 8 virtual CPU devices) at each leaf count. All in one process
(``run.py`` uses a fresh process per measurement): each library first saves and restores the
smallest state once, untimed, so the figures are a training loop's steady state. Per round and
leaf count, the libraries alternate (the order flips every round); each saves once (time the
caller is blocked, time to committed) and restores onto the saved mesh after the checkpoint is
evicted from the page cache. Round 1's restores are checked against the saved values. Orbax
is used as in ``run.py`` (``CheckpointManager``, default options). Prints a markdown table of
medians; ``--json`` writes every time, the command, the machine and the versions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import runners  # noqa: E402

jax = runners.setup_jax()

from bench import limits, states  # noqa: E402
from bench.run import versions  # noqa: E402

LIBS = ("fnckpt", "orbax")
PER_BLOCK = 10   # leaves per block (key paths block_<b>/p<j>; run.py's small state has 20)


def _save(lib: str, tree: dict, root: str) -> tuple[float, float]:
  """One save into ``root``: (seconds the caller was blocked, seconds to committed)."""
  gc.collect()   # (as run.py's workers: no collection of earlier garbage inside the timing)
  t0 = time.perf_counter()
  if lib == "orbax":
    mngr = runners.orbax_manager(root)
    wait, _ = runners.orbax_save(mngr, 0, tree)
  else:
    wait, _ = runners.fnckpt_save(tree, runners.ckpt_path(lib, root, 0))
  blocked = time.perf_counter() - t0
  wait()
  committed = time.perf_counter() - t0
  if lib == "orbax":
    mngr.close()
  return blocked, committed


def _restore(lib: str, root: str, target: dict) -> tuple[float, dict]:
  """A cold restore of step 0 under ``root``: (seconds, the restored tree)."""
  path = runners.ckpt_path(lib, root, 0)
  limits.evict(path)
  gc.collect()
  t0 = time.perf_counter()
  if lib == "orbax":
    out = runners.orbax_restore(root, 0, target)
  else:
    out = runners.fnckpt_restore(path, target)
  jax.block_until_ready(out)
  return time.perf_counter() - t0, out


def _state(n: int) -> tuple[dict, dict, dict[str, list[int]]]:
  """The small state of ``n`` leaves: (tree, restore target on the saved mesh, checksums)."""
  leaves = states.small_leaves(n // PER_BLOCK, PER_BLOCK)
  mesh = states.make_mesh("a")
  tree = states.build(leaves, mesh)
  return tree, states.target(leaves, mesh, "a"), states.fingerprint(tree)


def _one(lib: str, n: int, state: tuple, root: str, check: bool) -> dict[str, float]:
  tree, target, want = state
  shutil.rmtree(root, ignore_errors=True)
  blocked, committed = _save(lib, tree, root)
  restore_s, out = _restore(lib, root, target)
  if check and states.fingerprint(out) != want:
    raise SystemExit(f"{lib} restored other values than it saved ({n} leaves)")
  shutil.rmtree(root, ignore_errors=True)
  return {"save_block_s": blocked, "save_commit_s": committed, "restore_s": restore_s}


def run(counts: list[int], runs: int, root: str, log: Callable[[str], None]) -> dict:
  """``{lib: {count: {figure: [seconds per run]}}}``."""
  built = {n: _state(n) for n in counts}
  for lib in LIBS:   # first-call costs out of the way
    _one(lib, counts[0], built[counts[0]], os.path.join(root, "warmup"), check=False)
  times: dict[str, dict[str, dict[str, list[float]]]] = {lib: {} for lib in LIBS}
  for r in range(runs):
    for n in counts:
      for lib in (LIBS if r % 2 == 0 else LIBS[::-1]):
        got = _one(lib, n, built[n], os.path.join(root, lib), check=r == 0)
        for k, v in got.items():
          times[lib].setdefault(str(n), {}).setdefault(k, []).append(v)
        log(f"run {r + 1} {lib} {n} leaves: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()))
  return times


def table(times: dict) -> list[str]:
  """Markdown: medians per leaf count, fnckpt / Orbax."""
  figs = ("save_block_s", "save_commit_s", "restore_s")
  lines = ["| leaves | " + " | ".join(f"{f} fnckpt / orbax" for f in figs) + " |",
           "| ---: |" + " ---: |" * len(figs)]
  for n in times["fnckpt"]:
    cells = [" / ".join(f"{statistics.median(times[lib][n][f]):.3f}" for lib in LIBS)
             for f in figs]
    lines.append(f"| {n} | " + " | ".join(cells) + " |")
  return lines


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--leaves", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000])
  p.add_argument("--runs", type=int, default=2)
  p.add_argument("--dir", default=os.path.join(REPO, "tmp", "small_scaling"))
  p.add_argument("--json", help="write every time, the command and the machine here")
  a = p.parse_args(argv)
  if any(n % PER_BLOCK or n <= 0 for n in a.leaves):
    raise SystemExit(f"--leaves: positive multiples of {PER_BLOCK}")
  os.makedirs(a.dir, exist_ok=True)
  head: dict[str, Any] = {
      "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d-%H%M%S"),
      "command": shlex.join(["python", "bench/small_scaling.py", *argv]),
      "machine": limits.machine(a.dir), "versions": versions(), "state": "small",
      "leaf_bytes": 4096, "runs": a.runs, "load": [os.getloadavg()[0]]}
  t0 = time.perf_counter()
  times = run(sorted(a.leaves), a.runs, a.dir, lambda s: print(s, file=sys.stderr, flush=True))
  head.update(wall_s=time.perf_counter() - t0, times=times)
  head["load"].append(os.getloadavg()[0])
  print("\n".join(table(times)))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(head, f, indent=1)
  shutil.rmtree(a.dir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
