"""fnckpt save / restore throughput: a local S3 server (SeaweedFS) against local files.

    python bench/s3.py               # ~256 MiB state, 3 runs per figure (about a minute)
    python bench/s3.py --runs 5 --mode full --dir /mnt/nvme/tmp

The state is bench/states.py's ``transformer`` state (``quick``: ~250 MiB of fp32/bf16 leaves,
fully sharded, partly replicated and replicated on a (2, 4) mesh of 8 virtual CPU devices). Per
backend and run: one save (time until ``save`` returns, and until committed), then restores onto
the same mesh and onto a (4, 2) mesh with other PartitionSpecs, each verified against the saved
values by an exact checksum. Before every restore the page cache is dropped for the checkpoint's
files and for the S3 server's data directory, so both backends read from the disk. Runs of the
two backends alternate, so drift on a shared machine hits both; figures are medians.

The server is tests/servers.py's SeaweedFS (``weed mini``: master, volume, filer and S3 gateway
in one process) on 127.0.0.1, sharing the machine's cores with the client, so the S3 figures
include the server's own CPU work (HTTP, SigV4 checks, its filer and volume writes).
Prints a markdown table; exits 1 if any restore returned wrong values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (REPO, os.path.join(REPO, "tests")):
  if p not in sys.path:
    sys.path.insert(0, p)

MiB = 2**20


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--mode", choices=("quick", "full"), default="quick",
                  help="state size: quick ~250 MiB, full ~1.4 GiB (bench/states.py)")
  ap.add_argument("--dir", default=None, help="where the local-files checkpoints go")
  ap.add_argument("--concurrency", type=int, default=None,
                  help="S3 requests in flight (storage option; default TensorStore's 32)")
  a = ap.parse_args(argv)

  from bench.runners import setup_jax
  jax = setup_jax()
  import fnckpt
  import servers
  from bench import limits, states
  from fnckpt._io import paths as _paths

  leaves = states.leaves_for("transformer", a.mode)
  nbytes = states.state_bytes(leaves)
  mesh_a, mesh_b = states.make_mesh("a"), states.make_mesh("b")
  state = states.build(leaves, mesh_a)
  expected = states.fingerprint(state)
  targets = {"a": states.target(leaves, mesh_a, "a"), "b": states.target(leaves, mesh_b, "b")}

  local_root = tempfile.mkdtemp(prefix="fnckpt-bench-s3-", dir=a.dir)
  results: dict[str, dict[str, list[float]]] = {}
  objects: dict[str, int] = {}
  wrong: list[str] = []
  with servers.s3_server() as s3:
    os.environ.update(s3.env)
    s3_data = os.path.join(os.path.dirname(s3.log_path), "data")
    options = dict(s3.storage_options)
    if a.concurrency:
      options["concurrency"] = a.concurrency
    backends = {
        "local files": (lambda name: os.path.join(local_root, name), None),
        "S3 (SeaweedFS)": (lambda name: f"{s3.url}bench/{name}", options),
    }
    # First-call costs (drivers, thread pools, the server's first volume) out of the way.
    warm = {"w": jax.numpy.ones((1024, 1024))}
    for make, opts in backends.values():
      url = make(f"warmup-{uuid.uuid4().hex[:8]}")
      fnckpt.save(warm, url, storage_options=opts).wait()
      fnckpt.restore(url, storage_options=opts)

    for r in range(a.runs):
      order = list(backends) if r % 2 == 0 else list(backends)[::-1]
      for name in order:
        make, opts = backends[name]
        res = results.setdefault(name, {})
        url = make(f"run{r}")
        t = time.perf_counter()
        handle = fnckpt.save(state, url, storage_options=opts)
        blocked = time.perf_counter() - t
        handle.wait()
        total = time.perf_counter() - t
        res.setdefault("blocked", []).append(blocked)
        res.setdefault("save", []).append(total)
        objects[name] = len(_paths.list_keys(url, opts))
        for which in ("a", "b"):
          limits.evict(local_root)
          limits.evict(s3_data)
          t = time.perf_counter()
          out = fnckpt.restore(url, targets[which], storage_options=opts)
          jax.block_until_ready(out)
          res.setdefault(f"restore_{which}", []).append(time.perf_counter() - t)
          if states.fingerprint(out) != expected:
            wrong.append(f"{name} run {r} mesh {which}")
          del out
        _paths.delete_prefix(url, opts)
        print(f"run {r} {name}: save {total:.2f}s (blocked {blocked:.2f}s), restore "
              f"{res['restore_a'][-1]:.2f}s / resharded {res['restore_b'][-1]:.2f}s",
              file=sys.stderr)

  med = {n: {k: statistics.median(v) for k, v in res.items()} for n, res in results.items()}
  rate = lambda s: f"{nbytes / s / MiB:.0f}"
  print(f"\nfnckpt {fnckpt.__version__}, state {nbytes / MiB:.0f} MiB ({len(leaves)} arrays, "
        f"transformer/{a.mode}) on 8 virtual CPU devices, {os.cpu_count()} cores; medians of "
        f"{a.runs} runs; command: python bench/s3.py"
        + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip() + "\n")
  print("| backend | save returns (s) | save committed (s) | save MiB/s | restore (s) | "
        "restore MiB/s | restore resharded (s) | resharded MiB/s | objects |")
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for name, m in med.items():
    print(f"| {name} | {m['blocked']:.2f} | {m['save']:.2f} | {rate(m['save'])} | "
          f"{m['restore_a']:.2f} | {rate(m['restore_a'])} | {m['restore_b']:.2f} | "
          f"{rate(m['restore_b'])} | {objects[name]} |")
  if len(med) == 2:
    local, s3m = med["local files"], med["S3 (SeaweedFS)"]
    print(f"\nS3 / local time ratio: save {s3m['save'] / local['save']:.2f}x, restore "
          f"{s3m['restore_a'] / local['restore_a']:.2f}x, resharded restore "
          f"{s3m['restore_b'] / local['restore_b']:.2f}x")
  if wrong:
    print(f"\nWRONG VALUES restored: {', '.join(wrong)}")
    return 1
  print("\nEvery restore verified against the saved values (exact checksum per leaf).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
