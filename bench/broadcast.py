"""Read once and broadcast (``fnckpt.restore(..., broadcast=)``) with real processes on this
machine: restore time and bytes each process reads from the checkpoint's files, at 2, 4 and 8
processes, with and without broadcast, warm (page cache) and cold (evicted first).

    python bench/broadcast.py                       # 2, 4, 8 processes, 64 MiB, ~2 minutes
    python bench/broadcast.py --processes 2 4 --mib 128 --json /tmp/bcast.json

One device per process; the mesh is (2, P/2) with axes ("r", "s"): the state is sharded over
"s" (FSDP inside a replica group) and replicated over "r" (2 data-parallel replica groups; at 2
processes each group is one process holding the whole state). Saved once by this process
(zarr arrays of 16 MiB leaves). Each figure is one measured restore after a warm-up restore
(which compiles the reshard and connects Gloo) in the same processes; bytes are
``/proc/self/io`` ``rchar`` (file reads; Gloo's socket receives are not counted) and, cold,
``read_bytes`` (what the disk delivered); peak RSS is the process's high-water mark above its
RSS before the restore (the heap trimmed first), less the restored state it holds: the
restore's transient host and (on CPU) device memory. Children run ``tests/bcast_worker.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
for p in (REPO, TESTS):
  if p not in sys.path:
    sys.path.insert(0, p)

import helpers_proc as hp  # noqa: E402
import mp_worker  # noqa: E402

MiB = 1 << 20
LEAF = [4096, 1024]   # 16 MiB float32 (stored inner chunks (512, 512): shards of whole chunks)


def group(config: dict, n: int, timeout: float = 600) -> list[dict]:
  port = hp.free_port()
  procs = [hp.start([sys.executable, os.path.join(TESTS, "bcast_worker.py"), json.dumps(
      {**config, "port": port, "num_processes": n, "process_id": i})]) for i in range(n)]
  out = hp.finish(procs, timeout)
  for r in out:
    if r.returncode != 0 or not r.result:
      raise RuntimeError(r.describe())
  return [r.result for r in out]


def run(processes: list[int], mib: int, root: str) -> list[dict]:
  import fnckpt
  leaves = {f"w{i}": {"shape": LEAF, "spec": ["s"]} for i in range(mib // 16)}
  path = os.path.join(root, "ckpt")
  fnckpt.save({k: mp_worker.expected(k, l["shape"]) for k, l in leaves.items()} | {"step": 7},
              path).wait()
  rows = []
  for n in processes:
    for cold in (False, True):
      t0 = time.monotonic()
      results = group({"mode": "restore", "devices": 1, "mesh": [[2, n // 2], ["r", "s"]],
                       "leaves": leaves, "target": {}, "path": path, "evict": cold,
                       "runs": [False, True, False, True]}, n)
      for k, broadcast in enumerate([False, True, False, True]):
        runs = [r["runs"][k] for r in results]
        rows.append({"processes": n, "cold": cold, "broadcast": broadcast, "repeat": k // 2,
                     "state_mib": mib,
                     "restore_s": max(x["elapsed_s"] for x in runs),
                     "rchar_mib_per_process": [round(x["io"]["rchar"] / MiB, 2) for x in runs],
                     "read_bytes_mib_per_process": [round(x["io"]["read_bytes"] / MiB, 2)
                                                    for x in runs],
                     "rchar_mib_total": round(sum(x["io"]["rchar"] for x in runs) / MiB, 2),
                     "sent_mib_per_process": round(max(x["io"]["wchar"] for x in runs) / MiB, 2),
                     "peak_rss_above_state_mib": round(max(
                         x["peak_rss"] - x["local_state_bytes"] for x in runs) / MiB, 1),
                     "waves": runs[0]["waves"]})
      print(f"  {n} processes, {'cold' if cold else 'warm'}: {time.monotonic() - t0:.0f} s",
            file=sys.stderr)
  return rows


def table(rows: list[dict]) -> str:
  out = ["| processes | cache | broadcast | restore s (best of 2) | MiB read / process (rchar) "
         "| MiB read, job | MiB from disk / process | MiB sent / process "
         "| peak RSS above the state, MiB |",
         "|---|---|---|---|---|---|---|---|---|"]
  key = lambda r: (r["processes"], r["cold"], r["broadcast"])
  seen = {}
  for r in rows:
    seen.setdefault(key(r), []).append(r)
  for k, rs in seen.items():
    best = min(rs, key=lambda r: r["restore_s"])
    out.append(f"| {k[0]} | {'cold' if k[1] else 'warm'} | {k[2]} | {best['restore_s']:.3f} | "
               f"{max(best['rchar_mib_per_process']):.1f} | {best['rchar_mib_total']:.1f} | "
               f"{max(best['read_bytes_mib_per_process']):.1f} | "
               f"{best['sent_mib_per_process']:.1f} | {best['peak_rss_above_state_mib']:.0f} |")
  return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8])
  ap.add_argument("--mib", type=int, default=64, help="state size (multiple of 16)")
  ap.add_argument("--json", help="write the rows here")
  args = ap.parse_args(argv)
  root = tempfile.mkdtemp(prefix="bcast-", dir=os.path.join(REPO, "tmp") if os.path.isdir(
      os.path.join(REPO, "tmp")) else None)
  try:
    rows = run(args.processes, args.mib, root)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(table(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
