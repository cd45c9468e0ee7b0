"""What hashing costs a plain save: paired saves of the bench's transformer state (quick size).

    python bench/hashing.py                          # 9 pairs, a temp dir
    python bench/hashing.py --pairs 15 --dir /mnt/nvme/tmp --out bench/results/x.md

Arms (:data:`ARMS`: name -> callable ``(tree, path) -> SaveHandle``; the first is the
baseline, every other arm is compared with it; add an arm with one line):

- ``none``: ``fnckpt.save`` with hashing replaced by a no-op (``_state.hooks.hashing =
  False``, a private bench-only hook: the checkpoint records zeros; never for real saves).
- ``xxh3``: ``fnckpt.save`` as shipped: the XXH3-128 of every stored chunk, packed leaf and
  pieces run recorded (format 3; every save).
(Before format 3, the arms were ``start(hashes=False)`` and ``start(hashes=True)``: SHA-256;
``bench/results/2026-11-25-hashing-before.md``.)

One warm-up save per arm, then ``--pairs`` rounds, each saving once per arm, in ABBA order
(the arms' order reversed every other round), each to a fresh path deleted after it is
measured. Per save: time to committed (``SaveStats.total_s``), CPU seconds of the whole
process from the call to the end of ``wait()`` (``getrusage``: every thread, user + sys),
and the time the caller was blocked (``SaveStats.blocking_s``). Reported: per arm medians,
and per other arm the median of its paired ratios to the baseline (same round) for time and
CPU, with a bootstrap 90% interval (2000 resamples of the rounds, seed 0).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from bench import states  # noqa: E402
import fnckpt  # noqa: E402
from fnckpt import _state  # noqa: E402


class _Waited:
  """A save whose hook setting stays in force until ``wait()`` returns (the background
  writer hashes after ``save`` returned)."""

  def __init__(self, tree, path, hashing: bool):
    _state.hooks.hashing = hashing
    self.handle = fnckpt.save(tree, path, **SAVE_OPTIONS)

  def wait(self):
    try:
      return self.handle.wait()
    finally:
      _state.hooks.hashing = True


def _save_with(hashing: bool) -> Callable:
  return lambda tree, path: _Waited(tree, path, hashing)


SAVE_OPTIONS: dict = {}   # (--pack-bytes)

ARMS: dict[str, Callable] = {
    "none": _save_with(False),   # hashing a no-op (the baseline)
    "xxh3": _save_with(True),    # as shipped
}


def cpu_s() -> float:
  """CPU seconds of this process so far (all threads, user + sys)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def measure(arm: Callable, tree: dict, path: str) -> dict:
  """One save to ``path`` (deleted afterwards): committed s, CPU s, blocked s."""
  c0, t0 = cpu_s(), time.perf_counter()
  stats = arm(tree, path).wait()
  wall, cpu = time.perf_counter() - t0, cpu_s() - c0
  shutil.rmtree(path)
  total = getattr(stats, "total_s", None)
  return {"committed": total if total else wall, "cpu": cpu, "blocked": stats.blocking_s}


def run_pairs(tree: dict, root: str, pairs: int) -> list[dict[str, dict]]:
  """A warm-up save per arm, then ``pairs`` rounds in ABBA order: per round, arm -> figures."""
  names = list(ARMS)
  for name in names:
    measure(ARMS[name], tree, os.path.join(root, f"warmup-{name}"))
  rounds = []
  for r in range(pairs):
    order = names if r % 2 == 0 else names[::-1]
    rounds.append({n: measure(ARMS[n], tree, os.path.join(root, f"{r}-{n}")) for n in order})
  return rounds


def bootstrap_median(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
  """5th and 95th percentiles of the median over ``n`` resamples of ``x`` (with replacement)."""
  rng = np.random.default_rng(seed)
  meds = np.median(x[rng.integers(0, len(x), (n, len(x)))], axis=1)
  return float(np.percentile(meds, 5)), float(np.percentile(meds, 95))


def report(rounds: list[dict[str, dict]]) -> list[str]:
  """The markdown tables: per arm medians, then paired ratios to the first arm."""
  names = list(ARMS)
  lines = ["| arm | committed s (median) | CPU s (median) | blocked s (median) |",
           "| --- | --- | --- | --- |"]
  for n in names:
    med = {k: np.median([r[n][k] for r in rounds]) for k in ("committed", "cpu", "blocked")}
    lines.append(f"| {n} | {med['committed']:.3f} | {med['cpu']:.3f} | {med['blocked']:.4f} |")
  lines += ["", f"| ratio (paired, {len(rounds)} rounds) | median | 90% bootstrap interval |",
            "| --- | --- | --- |"]
  base = names[0]
  for n in names[1:]:
    for k, label in (("committed", "time to committed"), ("cpu", "CPU s")):
      x = np.array([r[n][k] / r[base][k] for r in rounds])
      lo, hi = bootstrap_median(x)
      lines.append(f"| {n}/{base} {label} | {np.median(x):.3f} | {lo:.3f} - {hi:.3f} |")
  lines += ["", "Every save (round: arm committed s / CPU s / blocked s):", ""]
  for i, r in enumerate(rounds):
    lines.append(f"- {i}: " + "; ".join(
        f"{n} {v['committed']:.3f} / {v['cpu']:.3f} / {v['blocked']:.4f}" for n, v in r.items()))
  return lines


def git_commit() -> str:
  """The fnckpt checkout's commit (``+dirty`` if it has uncommitted changes)."""
  def git(*a):
    return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True).stdout.strip()
  return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain") else "")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--pairs", type=int, default=9, help="rounds (one save per arm each)")
  p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
  p.add_argument("--out", default=None, help="also write the markdown report here")
  p.add_argument("--state", default="transformer", choices=states.STATES)
  p.add_argument("--pack-bytes", type=int, default=None,
                 help="save(pack_bytes=...): 0 stores every leaf as a zarr array (chunks "
                 "hashed on the hashing threads instead of pack spans)")
  args = p.parse_args()
  if args.pack_bytes is not None:
    SAVE_OPTIONS["pack_bytes"] = args.pack_bytes
  leaves = states.leaves_for(args.state, "quick")
  tree = states.build(leaves, states.make_mesh("a"))
  root = tempfile.mkdtemp(prefix="fnckpt-hashing-", dir=args.dir)
  head = [f"# Hashing a plain save: {' vs '.join(ARMS)} (paired, ABBA)", "",
          f"`python bench/hashing.py --pairs {args.pairs} --state {args.state}"
          + (f" --pack-bytes {args.pack_bytes}" if args.pack_bytes is not None else "")
          + f"`; fnckpt {git_commit()}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S')}; {os.cpu_count()} cores, 8 virtual CPU devices; "
          f"{args.state} state (quick), {states.state_bytes(leaves) / 2**20:.0f} MiB, "
          f"{len(leaves)} leaves; load average before {os.getloadavg()}", ""]
  try:
    rounds = run_pairs(tree, root, args.pairs)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  text = "\n".join(head + report(rounds) + ["", f"Load average after: {os.getloadavg()}", ""])
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)


if __name__ == "__main__":
  main()
