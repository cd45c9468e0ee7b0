"""Two tiers: a fast local tier (tmpfs) in front of durable storage (a local S3 server).

    python bench/tiers.py                 # ~250 MiB state, 3 runs per figure
    python bench/tiers.py --mode full     # ~1.45 GiB (bench/states.py's transformer state)

Per run, with ``CheckpointManager``:

* **durable only**: ``CheckpointManager(s3_dir)``; one ``save``: the time it blocks the caller
  and the time until committed on S3;
* **two tiers**: ``CheckpointManager(s3_dir, local_directory=tmpfs_dir)`` (every step local and
  durable); one ``save``: the time it blocks the caller, until committed locally
  (``handle.wait()``), and until the background copy has committed it on S3
  (``manager.wait()``);
* **recovery**: a new manager ``restore()`` onto the same mesh, from the fast tier (tmpfs
  holds the step), and from S3 (the local tier is empty: a replaced host), with the S3
  server's files dropped from the page cache first. Every restore is verified against the
  saved values (exact checksum per leaf).

The S3 server is tests/servers.py's SeaweedFS on 127.0.0.1, sharing the machine's cores with
the client. Runs of the two save setups alternate; figures are medians. Prints a markdown
table; exits 1 if any restore returned wrong values.
"""

from __future__ import annotations

import argparse
import os
import shutil
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


def _save_once(fnckpt, state, durable: str, local: str | None, options: dict) -> dict:
  mgr = fnckpt.CheckpointManager(durable, local_directory=local, storage_options=options)
  t = time.perf_counter()
  handle = mgr.save(0, state)
  out = {"blocked": time.perf_counter() - t}
  handle.wait()
  out["committed"] = time.perf_counter() - t
  mgr.wait()
  out["durable"] = time.perf_counter() - t
  mgr.close()
  return out


def _recover(fnckpt, jax, durable: str, local: str, options: dict, target, evict) -> tuple:
  evict()
  mgr = fnckpt.CheckpointManager(durable, local_directory=local, storage_options=options)
  t = time.perf_counter()
  out = mgr.restore(target=target)
  jax.block_until_ready(out)
  return time.perf_counter() - t, out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--mode", choices=("quick", "full"), default="quick")
  ap.add_argument("--fast", default="/dev/shm", help="where the fast tier goes (tmpfs)")
  a = ap.parse_args(argv)

  from bench.runners import setup_jax
  jax = setup_jax()
  import fnckpt
  import servers
  from bench import limits, states
  from fnckpt._io import paths as _paths

  leaves = states.leaves_for("transformer", a.mode)
  nbytes = states.state_bytes(leaves)
  mesh = states.make_mesh("a")
  state = states.build(leaves, mesh)
  expected = states.fingerprint(state)
  target = states.target(leaves, mesh, "a")
  fast_root = tempfile.mkdtemp(prefix="fnckpt-bench-tiers-", dir=a.fast)
  res: dict[str, list[float]] = {}
  wrong: list[str] = []
  try:
    with servers.s3_server() as s3:
      os.environ.update(s3.env)
      s3_data = os.path.join(os.path.dirname(s3.log_path), "data")
      opts = dict(s3.storage_options)
      warm = {"w": jax.numpy.ones((1024, 1024))}  # first-call costs out of the way
      _save_once(fnckpt, warm, f"{s3.url}bench/warm", os.path.join(fast_root, "warm"), opts)
      for local in (os.path.join(fast_root, "warm"), os.path.join(fast_root, "empty")):
        _recover(fnckpt, jax, f"{s3.url}bench/warm", local, opts, None, lambda: None)
      for r in range(a.runs):
        tag = uuid.uuid4().hex[:8]
        durable_only, tiered = f"{s3.url}bench/d-{tag}", f"{s3.url}bench/t-{tag}"
        fast = os.path.join(fast_root, tag)
        setups = [("durable", durable_only, None), ("tiers", tiered, fast)]
        for name, durable, local in (setups if r % 2 == 0 else setups[::-1]):
          for k, v in _save_once(fnckpt, state, durable, local, opts).items():
            res.setdefault(f"{name}_{k}", []).append(v)
        recoveries = [("from_fast", fast), ("from_s3", os.path.join(fast_root, "empty"))]
        for name, local in (recoveries if r % 2 == 0 else recoveries[::-1]):
          took, out = _recover(fnckpt, jax, tiered, local, opts, target,
                               lambda: limits.evict(s3_data))
          res.setdefault(name, []).append(took)
          if states.fingerprint(out) != expected:
            wrong.append(f"run {r} {name}")
          del out
        for url in (durable_only, tiered):
          _paths.delete_prefix(url, opts)
        shutil.rmtree(fast, ignore_errors=True)
        print(f"run {r}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in res.items()),
              file=sys.stderr)
  finally:
    shutil.rmtree(fast_root, ignore_errors=True)

  m = {k: statistics.median(v) for k, v in res.items()}
  print(f"\nfnckpt {fnckpt.__version__}, state {nbytes / MiB:.0f} MiB ({len(leaves)} arrays, "
        f"transformer/{a.mode}) on 8 virtual CPU devices, {os.cpu_count()} cores; fast tier "
        f"tmpfs ({a.fast}), durable tier SeaweedFS S3 on 127.0.0.1; medians of {a.runs} runs; "
        f"command: python bench/tiers.py"
        + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip() + "\n")
  print("| | straight to S3 | two tiers (tmpfs + S3) |")
  print("| --- | ---: | ---: |")
  print(f"| caller blocked by save | {m['durable_blocked']:.3f} s | {m['tiers_blocked']:.3f} s |")
  print(f"| save -> committed on the fast tier | - | {m['tiers_committed']:.2f} s |")
  print(f"| save -> committed on S3 | {m['durable_durable']:.2f} s | "
        f"{m['tiers_durable']:.2f} s |")
  print(f"| recovery (new manager, restore) | {m['from_s3']:.2f} s (S3) | "
        f"{m['from_fast']:.2f} s (tmpfs) |")
  print(f"\nrecovery from the fast tier: {m['from_s3'] / m['from_fast']:.1f}x faster than "
        f"from S3")
  if wrong:
    print(f"\nWRONG VALUES restored: {', '.join(wrong)}")
    return 1
  print("\nEvery restore verified against the saved values (exact checksum per leaf).")
  return 0


if __name__ == "__main__":
  sys.exit(main())
