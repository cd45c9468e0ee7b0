"""What hashing costs a save: the hash function timed on the bytes a save of the bench's
transformer state (quick size) stores, beside that save.

    python bench/hashing.py                          # 9 rounds, a temp dir
    python bench/hashing.py --pairs 15 --dir /mnt/nvme/tmp --out bench/results/x.md

Every save records XXH3-128 content hashes of what it stores (format 3); there is no switch
that turns them off (a save without them would record hashes that incremental saves trust).
So the cost is measured honestly from outside: per round, one ``fnckpt.save`` as shipped
(time to committed, ``SaveStats.total_s``; CPU seconds of the whole process from the call to
the end of ``wait()``, ``getrusage``: every thread, user + sys; blocked, ``SaveStats
.blocking_s``), then ``fnckpt._format.hashes.array_digest`` of every array leaf's bytes, one
after another on this thread (wall and CPU): the hashing work the save does, without its
threads overlapping it with writes. Reported: medians, and the median of the per-round ratios
hash / save (time and CPU), with a bootstrap 90% interval (2000 resamples, seed 0). One
warm-up round first.
(Before format 3, the arms were ``start(hashes=False)`` and ``start(hashes=True)``: SHA-256;
``bench/results/2026-11-25-hashing-before.md``.)
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from bench import states  # noqa: E402
import fnckpt  # noqa: E402
from fnckpt._format import hashes  # noqa: E402

SAVE_OPTIONS: dict = {}   # (--pack-bytes)


def cpu_s() -> float:
  """CPU seconds of this process so far (all threads, user + sys)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def measure_save(tree: dict, path: str) -> dict:
  """One save to ``path`` (deleted afterwards): committed s, CPU s, blocked s."""
  c0, t0 = cpu_s(), time.perf_counter()
  stats = fnckpt.save(tree, path, **SAVE_OPTIONS).wait()
  wall, cpu = time.perf_counter() - t0, cpu_s() - c0
  shutil.rmtree(path)
  total = getattr(stats, "total_s", None)
  return {"committed": total if total else wall, "cpu": cpu, "blocked": stats.blocking_s}


def measure_hash(arrays: list[np.ndarray]) -> dict:
  """The content hash of every array, one after another: wall s and CPU s."""
  c0, t0 = cpu_s(), time.perf_counter()
  for a in arrays:
    hashes.array_digest(a)
  return {"committed": time.perf_counter() - t0, "cpu": cpu_s() - c0, "blocked": 0.0}


def run_pairs(tree: dict, root: str, pairs: int) -> list[dict[str, dict]]:
  """A warm-up round, then ``pairs`` rounds: per round, {"save": ..., "hash": ...}."""
  arrays = [np.ascontiguousarray(np.asarray(x)) for x in jax.tree.leaves(tree)
            if isinstance(x, (jax.Array, np.ndarray))]   # host bytes made before timing
  measure_save(tree, os.path.join(root, "warmup"))
  measure_hash(arrays)
  return [{"save": measure_save(tree, os.path.join(root, str(r))), "hash": measure_hash(arrays)}
          for r in range(pairs)]


def bootstrap_median(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
  """5th and 95th percentiles of the median over ``n`` resamples of ``x`` (with replacement)."""
  rng = np.random.default_rng(seed)
  meds = np.median(x[rng.integers(0, len(x), (n, len(x)))], axis=1)
  return float(np.percentile(meds, 5)), float(np.percentile(meds, 95))


def report(rounds: list[dict[str, dict]]) -> list[str]:
  """The markdown tables: per arm medians, then paired ratios to the first arm."""
  names = ["save", "hash"]
  lines = ["| what | s to committed (hash: wall) | CPU s | blocked s |",
           "| --- | --- | --- | --- |"]
  for n in names:
    med = {k: np.median([r[n][k] for r in rounds]) for k in ("committed", "cpu", "blocked")}
    lines.append(f"| {n} | {med['committed']:.3f} | {med['cpu']:.3f} | {med['blocked']:.4f} |")
  lines += ["", f"| ratio (paired, {len(rounds)} rounds) | median | 90% bootstrap interval |",
            "| --- | --- | --- |"]
  base = "save"
  for n in ["hash"]:
    for k, label in (("committed", "time to committed"), ("cpu", "CPU s")):
      x = np.array([r[n][k] / r[base][k] for r in rounds])
      lo, hi = bootstrap_median(x)
      lines.append(f"| {n}/{base} {label} | {np.median(x):.3f} | {lo:.3f} - {hi:.3f} |")
  lines += ["", "Every round (save: committed s / CPU s / blocked s; hash: wall s / CPU s):", ""]
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
  p.add_argument("--pairs", type=int, default=9, help="rounds (one save and one hash pass each)")
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
  head = ["# Hashing's cost: the hash function on a save's bytes, beside the save", "",
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
