"""How fast a collective restore's failure on one process reaches the others (issue 34), and
what the agreement step costs a successful restore. Real processes (``jax.distributed`` on
127.0.0.1, Gloo; ``tests/faults_worker.py``), the state of ``tests/test_faults_mp.py``,
``restore(broadcast=True)`` at the default 600 s deadline, heartbeat 10 s.

For each failure kind on process 1 (a wrong target shape, the manifest read, a read, an
assembly, the process killed at its reads): the delay from the failure on process 1 to the
moment each other process raised (``time.time()`` on one machine), the slowest of them; the
try after it must succeed. For successful restores: how long barrier 0 (the agreement) took on
each process; the fastest process's figure is the exchange itself (the others also wait for the
slowest to finish planning). ``python bench/faults.py [--processes 2 4] [--runs 5]``.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import helpers_proc as hp  # noqa: E402
import test_faults_mp as t  # noqa: E402

KINDS = ["shape", "manifest", "read", "assemble"]


def launch(cfg: dict, n: int, timeout: float = 120) -> list:
  port = hp.free_port()
  procs = [hp.start([sys.executable, t.WORKER, json.dumps(
      {**cfg, "port": port, "num_processes": n, "process_id": i})]) for i in range(n)]
  return hp.finish(procs, timeout)


def failures(cfg: dict, n: int, runs: int) -> dict[str, list[float]]:
  tries = [{"op": "restore"}]
  for _ in range(runs):
    for how in KINDS:
      tries += [{"op": "restore", "fail": {"process": 1, "how": how}}, {"op": "restore"}]
  got = t.group({**cfg, "tries": tries}, n, timeout=300)
  out: dict[str, list[float]] = {k: [] for k in KINDS}
  for i, tr in enumerate(tries):
    if "fail" in tr:
      at = got[1][i]["failed_at"]
      out[tr["fail"]["how"]].append(max(got[p][i]["raised_at"] - at for p in range(n) if p != 1))
      assert all("ok" in got[p][i + 1] for p in range(n)), (i, got)
  return out


def killed(cfg: dict, n: int) -> str:
  """Process 1 exits at its reads; how the others ended, and when."""
  res = launch({**cfg, "tries": [{"op": "restore"}, {"op": "restore",
                                                     "fail": {"process": 1, "how": "kill"}}]}, n)
  at = float(next(line.split()[1] for line in res[1].stdout.splitlines()
                  if line.startswith("KILLED_AT")))
  parts = []
  for p, r in enumerate(res):
    if p == 1:
      continue
    tr = r.result["tries"][1] if r.result else None
    if tr and "error" in tr:
      parts.append(f"p{p}: {tr['error']} after {tr['raised_at'] - at:.1f}s")
    else:
      parts.append(f"p{p}: ended by JAX (exit {r.returncode})")
  return "; ".join(parts)


def agreement(cfg: dict, n: int, runs: int) -> tuple[list[float], list[float]]:
  """Per successful restore (after a warm-up): the agreement on the fastest process, and the
  whole restore on the slowest."""
  got = t.group({**cfg, "tries": [{"op": "restore"}] * (runs + 1)}, n)
  tries = range(1, runs + 1)
  return ([min(got[p][i]["agree_s"][0] for p in range(n)) for i in tries],
          [max(got[p][i]["elapsed_s"] for p in range(n)) for i in tries])


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--processes", type=int, nargs="+", default=[2, 4])
  ap.add_argument("--runs", type=int, default=5)
  args = ap.parse_args()
  print("| processes | failure on process 1 | others raised after, s (median; max) |")
  print("|---|---|---|")
  rows = []
  for n in args.processes:
    with tempfile.TemporaryDirectory() as d:
      cfg = t.saved(pathlib.Path(d), n)
      for how, delays in failures(cfg, n, args.runs).items():
        print(f"| {n} | {how} | {statistics.median(delays):.3f}; {max(delays):.3f} |")
      print(f"| {n} | killed at its reads | {killed(cfg, n)} |")
      rows.append((n, agreement(cfg, n, args.runs * 4)))
  for n, (took, whole) in rows:
    print(f"agreement (barrier 0), {n} processes, fastest process per restore: median "
          f"{1000 * statistics.median(took):.2f} ms, max {1000 * max(took):.2f} ms; the whole "
          f"restore (slowest process): median {1000 * statistics.median(whole):.1f} ms "
          f"({len(took)} restores)")


if __name__ == "__main__":
  main()
