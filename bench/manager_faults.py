"""What one attempt per CheckpointManager call costs a successful call, and how fast a failure
between the manager's collective calls reaches the other processes (issue 34). Real processes
(``jax.distributed`` on 127.0.0.1; ``tests/manager_faults_worker.py``: a manager with a fast
tier per process, the small state of ``tests/mp_manager_worker.py``, steps 1 local and 2
durable), deadlines 600 s.

``--src DIR``: import fnckpt (and the test helpers) from ``DIR`` instead of this checkout (an
older tree, for before/after figures). Prints, per call (``manager.restore()``,
``latest_step()``), the median and p90 wall time on process 0 over ``--calls`` calls (after 3
warm-up rounds), and with ``--failures`` the slowest delay from process 1's failure (``internal``:
inside ``restore()``, between the manager's collective calls) to another process raising.
``python bench/manager_faults.py [--processes 2] [--calls 40] [--src DIR] [--failures]``.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--processes", type=int, default=2)
  ap.add_argument("--calls", type=int, default=40)
  ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  ap.add_argument("--failures", action="store_true")
  args = ap.parse_args()
  src = os.path.abspath(args.src)
  sys.path.insert(0, os.path.join(src, "tests"))
  import helpers_proc as hp

  assert hp.ROOT == src, (hp.ROOT, src)
  worker = os.path.join(src, "tests", "manager_faults_worker.py")
  n = args.processes
  tries = [{"op": "restore"}, {"op": "latest"}]
  if args.failures:
    tries = [{"op": "restore", "fail": {"process": 1, "how": "internal"}}, {"op": "restore"}]
  with tempfile.TemporaryDirectory() as d:
    cfg = {"mode": "tries", "root": os.path.join(d, "run"), "tries": tries,
           "repeat": args.calls + 3}
    port = hp.free_port()
    procs = [hp.start([sys.executable, worker, json.dumps(
        {**cfg, "port": port, "num_processes": n, "process_id": i})]) for i in range(n)]
    results = hp.finish(procs, 300)
  for r in results:
    assert r.returncode == 0 and r.result, r.describe()
  got = sorted((r.result for r in results), key=lambda r: r["process"])
  if args.failures:
    first = [g["tries"][0] for g in got]
    at = first[1]["failed_at"]
    delay = max(first[p]["raised_at"] - at for p in range(n) if p != 1)
    print(f"{n} processes: failure on process 1 -> others raised within {delay * 1000:.1f} ms")
    return
  for op, times in got[0]["times"].items():
    ms = sorted(x * 1000 for x in times[3:])
    print(f"{n} processes, {op}: median {statistics.median(ms):.1f} ms, "
          f"p90 {ms[int(len(ms) * 0.9)]:.1f} ms over {len(ms)} calls (fnckpt from {src})")


if __name__ == "__main__":
  main()
