"""Export throughput and peak memory of fnckpt.export_safetensors (and export_orbax) on a
state larger than the read window.

    python bench/export.py                        # 1 GiB state, 64 MiB window, 3 runs per mode
    python bench/export.py --gib 0.25 --runs 1 --dir /mnt/nvme/tmp
    python bench/export.py --gib 0.5 --runs 1 --modes single,orbax   # 64 MiB leaves

The state is bench/blocking.py's: 8 float32 arrays of 128 MiB sharded over a (2, 4) mesh in
four ways, saved once. Each run is a fresh process (so RSS is its own) that exports the whole
checkpoint after evicting it from the page cache (a cold read) and resetting the kernel's peak
RSS counter (``/proc/self/clear_refs``), and reports:

- ``MB/s``: tensor bytes exported / wall time of the export (fsync included);
- ``peak RSS over baseline``: VmHWM after the export minus VmRSS just before it;
- ``CPU seconds``: user + system time of the process during the export (less sensitive than
  wall time to other work on the machine);
- ``window peak``: the most bytes the export's reads held at once (``peak_read_bytes``; each
  read charged twice its size).

Modes: one ``.safetensors`` file; a directory of 256 MB shards; one file cast to bfloat16;
``orbax``: ``export_orbax`` (an Orbax PyTree checkpoint, zstd-compressed zarr in OCDBT; not
in the default modes).
For contrast, ``restore + save_file`` does what a user would write without export: restore
the checkpoint to host numpy arrays, then ``safetensors.numpy.save_file`` (fsynced). Machine
limits measured in the same run: disk write + fsync, cold read (bench/limits.py).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

MiB = 1 << 20

# Runs in a fresh interpreter: argv = checkpoint, out, mode, window bytes.
WORKER = r"""
import json, os, resource, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, sys.argv[5])
import numpy as np, fnckpt
from bench import limits

def status(field):
  return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) << 10

ckpt, out, mode, window = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
fnckpt.metadata(ckpt)  # imports and first-use costs outside the measurement
limits.evict(ckpt)
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
if mode == "restore+save_file":
  from safetensors.numpy import save_file
  tree = fnckpt.restore(ckpt, budget_bytes=window)
  save_file({k: v for k, v in tree.items()}, out)
  fd = os.open(out, os.O_RDONLY); os.fsync(fd); os.close(fd)
  nbytes, peak = sum(v.nbytes for v in tree.values()), None
else:
  if mode == "orbax":
    r = fnckpt.export_orbax(ckpt, out, budget_bytes=window)
  else:
    kw = {"single": {}, "shards": {"max_shard_size": "256MB"}, "bf16": {"dtype": "bfloat16"}}
    r = fnckpt.export_safetensors(ckpt, out, budget_bytes=window, **kw[mode])
  nbytes, peak = r.bytes, r.peak_read_bytes
seconds = time.perf_counter() - t
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime
print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "bytes": nbytes, "rss_over_base": status("VmHWM") - base,
                  "window_peak": peak}))
"""


def run_one(ckpt: str, out: str, mode: str, window: int) -> dict:
  r = subprocess.run([sys.executable, "-c", WORKER, ckpt, out, mode, str(window), REPO],
                     capture_output=True, text=True, check=False)
  if r.returncode != 0:
    raise RuntimeError(f"{mode} failed:\n{r.stderr}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def save_state(path: str, gib: float) -> int:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import fnckpt
  from bench.blocking import make_state
  state = make_state(int(gib * (1 << 30)))
  fnckpt.save(state, path).wait()
  return sum(x.nbytes for x in state.values())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gib", type=float, default=1.0)
  ap.add_argument("--window-mib", type=int, default=64)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--dir", default=os.path.join(REPO, "tmp", "bench"))
  ap.add_argument("--modes", default="single,shards,bf16,restore+save_file")
  ap.add_argument("--json", help="also write the raw results here")
  args = ap.parse_args(argv)
  os.makedirs(args.dir, exist_ok=True)
  root = tempfile.mkdtemp(prefix="export-", dir=args.dir)
  try:
    from bench import limits
    disk = limits.disk_gbps(root, 512 * MiB, repeats=2)
    ckpt = os.path.join(root, "ckpt")
    state_bytes = save_state(ckpt, args.gib)
    window = args.window_mib * MiB
    print(f"state {state_bytes / MiB:.0f} MiB, read window {args.window_mib} MiB, "
          f"{args.runs} run(s) per mode; disk write+fsync {disk['disk_write_gbps']:.2f} GB/s, "
          f"cold read {disk['disk_read_cold_gbps']:.2f} GB/s\n")
    print(f"load average at start: {os.getloadavg()[0]:.1f}\n")
    print("| mode | MB/s (median) | seconds | CPU seconds | peak RSS over baseline | "
          "window peak |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    results = {"disk": disk, "state_bytes": state_bytes, "window": window, "modes": {}}
    for mode in args.modes.split(","):
      runs = []
      for i in range(args.runs if mode != "restore+save_file" else 1):
        out = os.path.join(root, f"out-{i}" + ("" if mode in ("shards", "orbax") else
                                               ".safetensors"))
        runs.append(run_one(ckpt, out, mode, window))
        shutil.rmtree(out, ignore_errors=True) if os.path.isdir(out) else os.unlink(out)
      results["modes"][mode] = runs
      secs = statistics.median(r["seconds"] for r in runs)
      cpu = statistics.median(r["cpu_seconds"] for r in runs)
      rss = max(r["rss_over_base"] for r in runs)
      peak = runs[0]["window_peak"]
      print(f"| {mode} | {runs[0]['bytes'] / secs / 1e6:.0f} | {secs:.2f} | {cpu:.2f} | "
            f"{rss / MiB:.0f} MiB (max) | {'-' if peak is None else f'{peak / MiB:.0f} MiB'} |")
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")
    if args.json:
      with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
