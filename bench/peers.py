"""Recovery time with one wiped fast tier, 2 processes (tests/mp_manager_worker.py mode
``peers``, the state of tests/test_peers_mp.py): from the peers' replicas (step 5) against the
durable fallback when there are none (step 4). ``python bench/peers.py [--runs 3]``."""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import test_peers_mp as t  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--runs", type=int, default=3)
  args = ap.parse_args()
  for name, spec in (("peers (replicated over r)", [None, "s"]),
                     ("durable (no replicas)", ["r", "s"])):
    times = []
    with tempfile.TemporaryDirectory() as d:
      import pathlib
      cfg = t.saved(pathlib.Path(d), 2, spec)
      for _ in range(args.runs):
        out = t.run({**cfg, "phase": "recover", "wipe": [1]}, 2)
        times.append(max(r["restore_s"] for r in out))
    print(f"{name}: step {out[0]['restored']}, restore() s per run (slowest process): "
          + ", ".join(f"{x:.3f}" for x in times))


if __name__ == "__main__":
  main()
